"""contracts.budget.DecodeBudget: the rule, its errors, and how an engine resolves it against a package."""

import pytest

from tinyserve_trt.contracts.budget import DecodeBudget
from tinyserve_trt.runtime.config import EngineConfig


class _Package:
    token_budget, budget_share = 1024, 0.125


@pytest.mark.parametrize("context,want", [(100, 1024), (8192, 1024), (16384, 2048), (32768, 4096), (32767, 4095)])
def test_floor_and_share(context, want):
    assert DecodeBudget(1024, 0.125).at(context) == want


def test_dense_and_fixed():
    assert DecodeBudget(0, 0.5).at(10_000) == 0  # 0 = dense, whatever the share
    assert DecodeBudget(512).at(100_000) == 512
    assert DecodeBudget(1024, 0.125).describe() == "0.125 of the context, at least 1024 tokens"
    assert DecodeBudget(512).describe() == "512 tokens" and DecodeBudget(0).describe() == "dense"


@pytest.mark.parametrize("tokens,share,match", [(-1, 0.0, "token_budget"), (8, 1.5, "budget_share"),
                                                (8, -0.1, "budget_share"), (8, float("nan"), "budget_share"),
                                                (True, 0.0, "token_budget")])
def test_bad_values_are_one_line(tokens, share, match):
    with pytest.raises(ValueError, match=match) as e:
        DecodeBudget(tokens, share)
    assert "\n" not in str(e.value)


def test_engine_resolves_against_the_package():
    assert EngineConfig().decode_budget(_Package) == DecodeBudget(1024, 0.125)  # the package's rule
    assert EngineConfig(token_budget=2048).decode_budget(_Package) == DecodeBudget(2048, 0.0)  # given: fixed
    assert EngineConfig(token_budget=2048, budget_share=0.25).decode_budget(_Package) == DecodeBudget(2048, 0.25)
    assert EngineConfig(budget_share=0.0).decode_budget(_Package) == DecodeBudget(1024, 0.0)
    assert EngineConfig(dense=True).decode_budget(_Package).at(32768) == 0
    with pytest.raises(ValueError, match="budget_share"):
        EngineConfig(budget_share=2.0)
