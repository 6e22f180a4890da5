"""The export's default selection (issue #31): per query head on every backend (ONNX Runtime and
TensorRT: the CUDA kernels select per query head too), every page's sub-pages, and a budget of 1/8 of
the context with a floor of 1024 - printed by the summary, written to the manifest, refused with one
line when bad."""

from __future__ import annotations


import pytest

from tinyserve_trt.contracts.budget import DecodeBudget
from tinyserve_trt.export import cli
from tinyserve_trt.export import config as export_config
from tinyserve_trt.export.config import ExportConfig


def test_defaults():
    d = ExportConfig()
    assert d.resolved_group_reduce == "head" and d.candidate_share == 1.0
    assert d.decode_budget == DecodeBudget(1024, 0.125)
    sparse, dense = d.layer_attributes(5, 0.1), d.layer_attributes(0, 0.1)  # two dense layers lead
    assert sparse.group_reduce == "head" and sparse.function_overload() == "query_aware_head_two_level"
    assert dense.policy == "dense" and dense.group_reduce == "max"  # no per-head tasks for a dense layer
    trt = ExportConfig(backend="trt")
    assert export_config.DEFAULT_GROUP_REDUCE == "head"
    assert trt.resolved_group_reduce == "head" and trt.layer_attributes(5, 0.1).group_reduce == "head"
    assert trt.layer_attributes(0, 0.1).group_reduce == "max"  # dense layers: no selection to share
    assert ExportConfig(backend="trt", group_reduce="max").layer_attributes(5, 0.1).group_reduce == "max"
    assert ExportConfig(group_reduce="sum").layer_attributes(5, 0.1).group_reduce == "sum"
    args = cli.parser().parse_args(["m.onnx"])
    assert cli._config(args) == ExportConfig()
    args = cli.parser().parse_args(["m.onnx", "--group-reduce", "max", "--budget-share", "0", "--token-budget", "512"])
    assert cli._config(args).decode_budget == DecodeBudget(512, 0.0) and cli._config(args).group_reduce == "max"


@pytest.mark.parametrize("kw,match", [(dict(group_reduce="mean"), "group_reduce must be one of"),
                                      (dict(budget_share=1.5), "budget_share"),
                                      (dict(token_budget=-1), "token_budget")])
def test_bad_settings_are_one_line(kw, match, capsys):
    with pytest.raises(ValueError, match=match) as e:
        ExportConfig(**kw)
    assert "\n" not in str(e.value)


def test_cli_takes_head_for_trt():
    """The CUDA kernels run group_reduce head (issue #31): a TensorRT package takes the default."""
    args = cli.parser().parse_args(["m.onnx", "--backend", "trt"])
    assert cli._config(args).resolved_group_reduce == "head"
    args = cli.parser().parse_args(["m.onnx", "--backend", "trt", "--group-reduce", "head"])
    assert cli._config(args) == ExportConfig(backend="trt", group_reduce="head")
    assert "default head for every backend" in " ".join(cli.parser().format_help().split())


def test_summary_prints_the_selection_and_budget():
    from tinyserve_trt.export import report as report_mod

    want = "query_aware per query head, two-level: every page's 4-token sub-pages"
    assert report_mod._selection(ExportConfig()) == want
    assert report_mod._selection(ExportConfig(backend="trt", candidate_share=0.5)) == (
        "query_aware per query head, two-level: the top 50% of pages' 4-token sub-pages")
    assert report_mod._selection(ExportConfig(backend="trt", group_reduce="max")) == (
        "query_aware per KV head (group max), two-level: every page's 4-token sub-pages")
    assert ExportConfig().decode_budget.describe() == "0.125 of the context, at least 1024 tokens"

