"""contracts.dense_layers: the one reading of ``dense_layers`` (a leading count or layer indices)."""

from __future__ import annotations

import pytest

from tinyserve_trt.contracts.dense_layers import dense_layer_indices, describe, manifest_value, parse_dense_layers
from tinyserve_trt.export.config import ExportConfig


def test_count_and_indices():
    assert dense_layer_indices(2) == (0, 1)
    assert dense_layer_indices(5, num_layers=3) == (0, 1, 2)  # a count is capped, as before lists
    assert dense_layer_indices([11, 3, 9], num_layers=24) == (3, 9, 11)
    assert dense_layer_indices(0) == ()


@pytest.mark.parametrize("value, message", [
    (-1, "dense_layers must be >= 0"), (True, "a count or a list"), ("0,1", "a count or a list"),
    ([1, 1], "repeats a layer"), ([0, -2], "ints >= 0"), ([1.0], "ints >= 0"),
])
def test_bad_values_are_one_line(value, message):
    with pytest.raises(ValueError, match=message):
        dense_layer_indices(value)


def test_index_past_the_model():
    with pytest.raises(ValueError, match=r"dense_layers \[24\] out of range: the model has 24 layers \(0..23\)"):
        dense_layer_indices([3, 24], num_layers=24)


def test_cli_form():
    assert parse_dense_layers("2") == 2
    assert parse_dense_layers("0,1,9,11") == (0, 1, 9, 11)
    for bad in ("x", "-1", "1,1", "1,a"):
        with pytest.raises(ValueError, match="--dense-layers: a count or comma-separated layer indices"):
            parse_dense_layers(bad)


def test_manifest_and_summary_forms():
    assert manifest_value(2, 24) == 2 and manifest_value(30, 24) == 24
    assert manifest_value((9, 3), 24) == [3, 9]
    assert describe(2, 24) == "2 (the leading 2)" and describe(0, 24) == "none"
    assert describe((0, 1, 9), 24) == "3: 0,1,9"


def test_export_config_layer_attributes():
    """A middle layer named dense is dense; a leading one not named is sparse (the count form could not)."""
    cfg = ExportConfig(dense_layers=[9, 0])
    assert cfg.dense_layers == (0, 9)  # normalised: the frozen config stays hashable and sorted
    assert [cfg.layer_attributes(i, 0.0).policy for i in (0, 1, 9, 10)] == ["dense", "query_aware", "dense",
                                                                            "query_aware"]
    assert cfg.layer_attributes(1, 0.0).sub_page_size == cfg.resolved_sub_page_size()  # sparse: two-level
    assert cfg.dense_layer_set(24) == (0, 9)
    with pytest.raises(ValueError, match="out of range"):
        cfg.dense_layer_set(8)
