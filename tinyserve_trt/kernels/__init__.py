"""GPU kernels of QueryAwareSparseAttention: ctypes bindings and a harness.

Imports nothing heavy at package import: ``library`` loads the compiled
``libqsa_kernels.so`` (built by ``python plugins/build.py``) only when called,
and ``harness`` imports torch inside its functions.
"""
