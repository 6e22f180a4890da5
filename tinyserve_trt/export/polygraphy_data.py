"""Valid paged-KV feeds for comparing a package's TensorRT engine with ONNX Runtime in Polygraphy.

Random feeds do not work for the rewritten model: page tables must name
pages, ``past_lens`` must fit them and ``key_min``/``key_max`` must bound the
keys. This module fills a page pool with random K/V for a batch of
sequences of different lengths and returns decode-step feeds (one new token
per sequence) by the package's input names. Polygraphy calls ``load_data``::

    TINYSERVE_PACKAGE=pkg polygraphy run pkg/model.onnx --trt --onnxrt \\
        --plugins build/plugins/libtinyserve_trt_plugin.so \\
        --data-loader-script tinyserve_trt/export/polygraphy_data.py:load_data \\
        $(python -m tinyserve_trt.export.polygraphy_data pkg --shape-flags) --atol 2e-3 --rtol 2e-3

``--shape-flags`` prints ``--trt-min/opt/max-shapes`` equal to the feeds'
shapes (one profile). Environment knobs of ``load_data``: TINYSERVE_PACKAGE
(required), TINYSERVE_BATCH (default 2), TINYSERVE_CONTEXT (longest
sequence, default 200), TINYSERVE_BUDGET (decode token budget, default the
package's), TINYSERVE_SEED.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from tinyserve_trt.contracts.manifest import MODEL_FILE, Manifest  # absolute: Polygraphy loads this file by path
from tinyserve_trt.export.validate import PagedState

_ONNX_TYPES = {1: np.float32, 10: np.float16, 6: np.int32, 7: np.int64, 9: np.bool_}


def _input_dtypes(model_path: Path) -> dict[str, np.dtype]:
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    return {i.name: np.dtype(_ONNX_TYPES[i.type.tensor_type.elem_type]) for i in model.graph.input}


def decode_feeds(package_dir: str | Path, batch: int = 2, context: int = 200, budget: int | None = None,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """One decode step's feeds for ``batch`` sequences whose lengths spread up to ``context``."""
    package_dir = Path(package_dir)
    manifest = Manifest.load(package_dir)
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got {batch} and {context}")
    io, ps = manifest.io, manifest.page_size
    layers, hkv, d = manifest.num_layers, manifest.num_kv_heads, manifest.head_dim
    dtype = np.float16 if manifest.dtype == "float16" else np.float32
    rng = np.random.default_rng(seed)
    lengths = [max(1, context - (context * b) // (2 * batch)) for b in range(batch)]
    pages = sum(-(-(n + 1) // ps) for n in lengths) + 1
    state = PagedState(layers, hkv, d, ps, pages, dtype, rng, manifest.to_dict().get("cold_tier"))
    for b, n in enumerate(lengths):
        state.add_sequence()
        k = [rng.standard_normal((hkv, n, d)).astype(dtype) for _ in range(layers)]
        v = [rng.standard_normal((hkv, n, d)).astype(dtype) for _ in range(layers)]
        state.write(b, k, v, n)
    # the decode step writes one token: its page must be in the table already
    for b, n in enumerate(lengths):
        if n // ps >= len(state.tables[b]):
            state.tables[b].append(int(state.free.pop()))
    budget = manifest.token_budget if budget is None else budget
    by_role = state.feeds(io.layers, budget)
    feeds = {io.inputs["page_table"]: by_role.pop("page_table"),
             io.inputs["past_lens"]: by_role.pop("past_lens"),
             io.inputs["token_budget"]: by_role.pop("token_budget"), **by_role}
    vocab = manifest.vocab_size
    feeds[io.inputs["input_ids"]] = rng.integers(0, vocab, (batch, 1))
    if "position_ids" in io.inputs:
        feeds[io.inputs["position_ids"]] = np.asarray(lengths)[:, None]
    if "logits_index" in io.inputs:
        feeds[io.inputs["logits_index"]] = np.zeros(batch)
    types = _input_dtypes(package_dir / MODEL_FILE)
    return {name: np.ascontiguousarray(value, types.get(name, value.dtype)) for name, value in feeds.items()}


def load_data():
    """Polygraphy's data-loader entry: yields one feed dict (see the module docstring)."""
    package = os.environ.get("TINYSERVE_PACKAGE")
    if not package:
        raise RuntimeError("set TINYSERVE_PACKAGE to the tinyserve package directory")
    budget = os.environ.get("TINYSERVE_BUDGET")
    yield decode_feeds(package, int(os.environ.get("TINYSERVE_BATCH", 2)), int(os.environ.get("TINYSERVE_CONTEXT", 200)),
                       None if budget is None else int(budget), int(os.environ.get("TINYSERVE_SEED", 0)))


def shape_flags(feeds: dict[str, np.ndarray]) -> str:
    """``--trt-min-shapes ... --trt-opt-shapes ... --trt-max-shapes ...`` pinned to the feeds' shapes."""
    shapes = " ".join(f"{name}:[{','.join(map(str, a.shape))}]" for name, a in feeds.items())
    return " ".join(f"--trt-{k}-shapes {shapes}" for k in ("min", "opt", "max"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="print Polygraphy shape flags for the tinyserve data loader")
    ap.add_argument("package", type=Path)
    ap.add_argument("--shape-flags", action="store_true", help="print --trt-{min,opt,max}-shapes")
    ap.add_argument("--batch", type=int, default=int(os.environ.get("TINYSERVE_BATCH", 2)))
    ap.add_argument("--context", type=int, default=int(os.environ.get("TINYSERVE_CONTEXT", 200)))
    args = ap.parse_args(argv)
    try:
        feeds = decode_feeds(args.package, args.batch, args.context)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(shape_flags(feeds) if args.shape_flags else "\n".join(f"{n} {a.dtype} {a.shape}" for n, a in feeds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
