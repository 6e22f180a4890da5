"""Which layers keep dense attention: the one definition every reader of the setting uses.

``dense_layers`` (ExportConfig, the manifest, calibration, the evaluation harness) is either an
int ``n`` - the leading ``n`` layers, as Quest keeps 2 - or a list of layer indices. A list is
what a model whose selection loss sits in a few middle layers needs: on Qwen2.5-Coder-0.5B at 8K
(benchmarks/results/selection_probe.md, "Layer sensitivity") seven of 24 layers cost more than
all the others together, and none of them is among the first two.
"""

from __future__ import annotations

from collections.abc import Sequence


def dense_layer_indices(value, num_layers: int | None = None) -> tuple[int, ...]:
    """The sorted layer indices ``value`` names (an int: that many leading layers, capped at
    ``num_layers``; a sequence: those indices). ValueError, one line, for a negative count, a
    non-int, a repeated index or (given ``num_layers``) an index past the model's layers."""
    if isinstance(value, bool) or not isinstance(value, (int, Sequence)) or isinstance(value, str):
        raise ValueError(f"dense_layers must be a count or a list of layer indices, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"dense_layers must be >= 0, got {value}")
        return tuple(range(value if num_layers is None else min(value, num_layers)))
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ValueError(f"dense_layers indices must be ints >= 0, got {list(value)!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"dense_layers repeats a layer: {list(value)!r}")
    if num_layers is not None and any(i >= num_layers for i in value):
        raise ValueError(f"dense_layers {sorted(i for i in value if i >= num_layers)} out of range: "
                         f"the model has {num_layers} layers (0..{num_layers - 1})")
    return tuple(sorted(value))


def parse_dense_layers(text: str) -> int | tuple[int, ...]:
    """A CLI value: ``N`` (the leading N layers) or comma-separated indices (``0,1,9,11``)."""
    try:
        if "," not in text:
            n = int(text)
            dense_layer_indices(n)  # a negative count fails here
            return n
        return dense_layer_indices([int(t) for t in text.split(",") if t.strip()])
    except ValueError as e:
        raise ValueError(f"--dense-layers: a count or comma-separated layer indices, got {text!r}"
                         + (f" ({e})" if "dense_layers" in str(e) else "")) from None


def describe(value, num_layers: int) -> str:
    """The export summary's line: ``2 (the leading 2)`` or ``7: 0,1,3,9,11,16,21``."""
    idx = dense_layer_indices(value, num_layers)
    if isinstance(value, int):
        return f"{len(idx)} (the leading {len(idx)})" if idx else "none"
    return f"{len(idx)}: {','.join(map(str, idx))}"


def manifest_value(value, num_layers: int) -> int | list[int]:
    """What ``tinyserve.json`` stores: a count stays a count (capped at the model's layers: the form
    every package before lists had), indices are a sorted list."""
    idx = dense_layer_indices(value, num_layers)
    return len(idx) if isinstance(value, int) else list(idx)
