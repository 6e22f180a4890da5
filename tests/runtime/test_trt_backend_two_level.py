"""TrtBackend on a two-level package (issue #15): each sparse layer's ``key_sub_bounds``.

On CPU, against the stand-in TensorRT engine of ``trt_fakes``: the engine's
``key_sub_bounds.{i}`` input is bound, in the plain context and in every decode-graph
context, to the address of DevicePages' uint8 codes of that layer (a dense layer has no
such input and gets none), and the codes the engine reads there each step are the ones
``ops.fine_bounds`` computes from the bound keys and min/max - refreshed after the
append (``PagePool.note_device_writes``), graphs on and off.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.runtime.trt_fakes import LAYERS, REQUESTS, fake_backend, greedy  # noqa: E402,F401

SUB = 2  # of the fakes' 4-token pages


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["plain", "graphs"])
def test_sub_bounds_are_bound_by_address_and_fresh_each_step(fake_backend, cuda_graphs):
    backend, pool = fake_backend(cuda_graphs=cuda_graphs, sub_page_size=SUB)
    assert backend.pages.sub_page_size == SUB
    steps = greedy(backend, pool, REQUESTS)
    engine = backend.engine
    assert len(engine.contexts) == (1 + len(backend._graphs) if cuda_graphs else 1)
    if cuda_graphs:
        assert len(backend._graphs) >= 2 and any(s[0] == "decode" for s in steps)
    for ctx in engine.contexts:
        assert "key_sub_bounds.0" not in ctx.addrs  # the dense layer takes none
        for layer in range(1, LAYERS):
            codes = backend.pages.layers[layer]["key_sub_bounds"]
            assert codes.dtype == torch.uint8
            assert ctx.addrs[f"key_sub_bounds.{layer}"] == codes.data_ptr()
            assert ctx.shapes[f"key_sub_bounds.{layer}"] == tuple(codes.shape)
    checked, stale = engine.sub_checks
    assert checked > 50 and stale == 0
    pool.check_integrity(check_data=True)  # every live page's codes equal the host-recomputed ones


def test_stale_codes_would_be_seen(fake_backend):
    """The fake's check can fail: codes not refreshed after the append are caught."""
    backend, pool = fake_backend(cuda_graphs=False, sub_page_size=SUB)
    backend.pages.refresh_sub_bounds = lambda pages, valid: None
    greedy(backend, pool, {"a": (list(range(1, 6)), 4)})
    assert backend.engine.sub_checks[1] > 0
