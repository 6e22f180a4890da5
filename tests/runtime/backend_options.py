"""What an ``Engine`` hands its backend factory, without building a backend.

Config fields the backend reads (issue #32's switches, ``trust_package_engines``) are checked
where they arrive: ``make_backend``'s keyword options. :func:`backend_options` stops the engine
there, over a one-layer stand-in package (no files read).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

PACKAGE = dict(page_size=16, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", max_context=256,
               sub_page_size=0, eos_token_ids=[2], token_budget=0, budget_share=0.0, cold_tier=None)


class _Stop(Exception):
    pass


def backend_options(monkeypatch, config) -> dict:
    """The keyword options ``Engine(package, config)`` passes to ``make_backend``."""
    from tinyserve_trt.runtime import engine as engine_mod

    seen = {}

    def capture(kind, package, pool, **options):
        seen.update(options)
        raise _Stop

    with monkeypatch.context() as m:
        m.setattr(engine_mod, "make_backend", capture)
        with pytest.raises(_Stop):
            engine_mod.Engine(SimpleNamespace(**PACKAGE), config)
    return seen
