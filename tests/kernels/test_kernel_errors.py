"""What the kernels report instead of reading out of bounds, and how they order NaN scores.

Run on a GPU or, without one, on the CPU-emulated build of the same sources
(conftest.py ``cuda_lib``). A page id outside the pools and a sequence longer
than its page table are caller bugs; the kernels skip the bad reads and set
error flags that the harness turns into KernelError with the matching status.
"""

import numpy as np
import pytest

from tinyserve_dev.cases import CaseSpec, make_case
from tinyserve_trt.cuda.library import KernelError
from tinyserve_trt.ops import schema, sparse_attention_ref

pytestmark = pytest.mark.gpu

BAD_PAGE, TOO_MANY = 5, 6


def _forward(case, attrs=None):
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    return sparse_attention_gpu(**case, attrs=attrs or schema.OpAttributes())


@pytest.mark.parametrize("S", [1, 3])  # decode (select + split-K) and prefill
@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_bad_page_id_is_reported(cuda_lib, rng, S, bad_id):
    case = make_case(CaseSpec((40, 70), 4, 2, 16, 16, S, "float32", budget=32), rng)
    case["page_table"][1, 2] = bad_id
    with pytest.raises(KernelError) as e:
        _forward(case)
    assert e.value.status == BAD_PAGE


@pytest.mark.parametrize("S", [1, 3])
def test_too_many_pages_is_reported(cuda_lib, rng, S):
    case = make_case(CaseSpec((40, 70), 4, 2, 16, 16, S, "float32", budget=32), rng)
    NP, ps = case["page_table"].shape[1], case["key_cache"].shape[2]
    case["past_lens"][0] = NP * ps + 1
    with pytest.raises(KernelError) as e:
        _forward(case)
    assert e.value.status == TOO_MANY


def test_valid_call_reports_nothing(cuda_lib, rng):
    """The flags stay clear on a valid call (full page table, last slot used)."""
    case = make_case(CaseSpec((64, 5), 4, 2, 16, 16, 1, "float32", budget=32, spare_pages=0), rng)
    _forward(case)


@pytest.mark.parametrize("problem", ["bad_id", "too_many"])
def test_append_reports(cuda_lib, rng, problem):
    from tinyserve_dev.kernels.harness import append_kv_gpu

    case = make_case(CaseSpec((16, 30), 4, 2, 16, 16, 2, "float32", spare_pages=2), rng)
    NP, ps = case["page_table"].shape[1], case["key_cache"].shape[2]
    if problem == "bad_id":
        case["page_table"][0, 1] = case["key_cache"].shape[0]  # slot 16 of sequence 0 lands in page 1
    else:
        case["past_lens"][1] = NP * ps - 1  # 2 new tokens overflow the table
    args = [case[n] for n in ("key", "value", "key_cache", "value_cache", "key_min", "key_max", "page_table",
                              "past_lens")]
    with pytest.raises(KernelError) as e:
        append_kv_gpu(*args)
    assert e.value.status == (BAD_PAGE if problem == "bad_id" else TOO_MANY)


@pytest.mark.parametrize("group_reduce", ["max", "sum"])
def test_nan_scores_sort_last_like_numpy(cuda_lib, rng, group_reduce):
    """Pages whose metadata holds NaN score NaN; numpy's stable argsort(-score) puts them
    after every finite page, lowest index first among themselves - so does the kernel."""
    case = make_case(CaseSpec((320,), 2, 1, 16, 16, 1, "float32", budget=160), rng)
    table = case["page_table"][0]
    for lp in (3, 5, 6, 9, 12, 15):
        case["key_min"][table[lp], 0, lp % 16] = np.nan
    attrs = schema.OpAttributes(sink_pages=1, recent_pages=1, group_reduce=group_reduce)
    _, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    _, sel = _forward(case, attrs)
    np.testing.assert_array_equal(sel, ref_sel)
    # and when NaN pages must be taken to fill the budget, the lowest-index ones are
    case["token_budget"][0] = 16 * 16
    _, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    _, sel = _forward(case, attrs)
    np.testing.assert_array_equal(sel, ref_sel)
