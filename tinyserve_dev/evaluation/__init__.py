"""Quality evaluation of the op's page selection on real models (torch).

``decode_attention`` evaluates decode-mode sparse attention for every
position of a text at once, exactly as the op's decode step would at each
position; ``harness`` plugs it into a Hugging Face decoder; ``recall``
measures attention-mass recall; ``perplexity``, ``passkey`` and ``texts``
serve ``benchmarks/quality.py`` and ``benchmarks/passkey.py``.
torch and transformers are imported by these submodules only, so
``import tinyserve_dev.evaluation`` stays light.
"""
