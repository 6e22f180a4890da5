"""ctypes bindings to the CUDA kernels of QueryAwareSparseAttention.

Imports nothing heavy at package import: ``library`` loads the compiled
``libqsa_kernels.so`` (built by ``python plugins/build.py``) only when called.
The test harness and numpy references live in ``tinyserve_dev.kernels``.
"""
