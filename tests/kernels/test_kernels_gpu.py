"""The CUDA kernels against the numpy reference (fresh random inputs each run).

Marked ``gpu``; they skip with the reason when torch, a CUDA device or nvcc is
missing. Outputs are poisoned before every launch (harness.py). Selections are
compared by the reference's scores (a float32 near-tie may keep a different,
equally scored page); outputs are compared with the schema's tolerance against
the reference's attention over the pages the kernel actually kept, and against
``sparse_attention_ref`` itself whenever the kept pages are the same.
Mixed hot + INT8 cold cases (``ops.cases.make_mixed_case``) are also compared
with the reference on the dequantized all-hot cache (``dequantized_float32_case``).
"""

import numpy as np
import pytest

from tinyserve_dev.kernels.references import append_kv_ref, attention_with_selection_ref, selection_score_gap
from tinyserve_trt.ops import schema, sparse_attention_ref
from tinyserve_dev.cases import CaseSpec, dequantized_float32_case, make_case, make_mixed_case

pytestmark = pytest.mark.gpu

LENS = (0, 5, 64, 130, 300)  # empty, partial first page, exact pages, partial last page, longer


def _assert_close(got, want, dtype, what):
    tol = schema.TOLERANCES[dtype]
    assert not np.isnan(got).any(), f"{what}: NaN left in the output (a row was never written)"
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), err_msg=what, **tol)


def _run_and_check(case, attrs, dtype, **kw):
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    out, sel = sparse_attention_gpu(**case, attrs=attrs, **kw)
    ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    S = case["query"].shape[2]
    if S == 1 and attrs.policy not in ("dense",):
        gap = selection_score_gap(case, sel, ref_sel, attrs)
        assert gap <= 1e-4 * max(1.0, np.abs(case["query"]).max()), f"kept pages score worse by {gap}"
    else:
        np.testing.assert_array_equal(sel, ref_sel)
    _assert_close(out, attention_with_selection_ref(case, sel, attrs), dtype, "output vs kept pages")
    if np.array_equal(sel, ref_sel):
        _assert_close(out, ref_out.astype(np.float64), dtype, "output vs sparse_attention_ref")
    return out, sel


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("policy,group_reduce", [("query_aware", "max"), ("query_aware", "sum"),
                                                 ("window", "max"), ("dense", "max")])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])  # GQA group 1 and 4
def test_decode_matches_reference(cuda_lib, rng, dtype, policy, group_reduce, heads):
    H, Hkv = heads
    spec = CaseSpec(LENS, H, Hkv, 64, 16, 1, dtype, budget=64)
    case = make_case(spec, rng)
    case["token_budget"] = np.array([64, 0, 32, 48, 96], dtype=np.int32)  # mixed, incl. dense (0)
    _run_and_check(case, schema.OpAttributes(policy=policy, group_reduce=group_reduce), dtype)


@pytest.mark.parametrize("head_dim", [16, 80, 128, 256])
def test_decode_head_dims(cuda_lib, rng, head_dim):
    case = make_case(CaseSpec((37, 200), 4, 2, head_dim, 16, 1, "float32", budget=80), rng)
    _run_and_check(case, schema.OpAttributes(sink_pages=2, recent_pages=2), "float32")


@pytest.mark.parametrize("head_dim", [20, 36])  # fp16 rows that are not whole 16-byte vectors: element loads
def test_decode_head_dims_partial_vectors(cuda_lib, rng, head_dim):
    case = make_case(CaseSpec((37, 200), 4, 2, head_dim, 16, 1, "float16", budget=80), rng)
    _run_and_check(case, schema.OpAttributes(sink_pages=2, recent_pages=2), "float16")


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_decode_split_counts(cuda_lib, rng, num_splits):
    case = make_case(CaseSpec((300, 17), 8, 2, 64, 8, 1, "float16", budget=120), rng)
    _run_and_check(case, schema.OpAttributes(), "float16", num_splits=num_splits)


@pytest.mark.parametrize("heads", [(8, 1), (12, 1)])  # one group in a block; a group split over two blocks
def test_decode_large_groups(cuda_lib, rng, heads):
    case = make_case(CaseSpec((100, 260), heads[0], heads[1], 64, 16, 1, "float32", budget=64), rng)
    _run_and_check(case, schema.OpAttributes(group_reduce="sum"), "float32")


def test_decode_scores_spill_to_workspace(cuda_lib, rng):
    """Page scores of >10K pages do not fit in shared memory: the workspace path."""
    case = make_case(CaseSpec((12_000,), 2, 1, 16, 1, 1, "float32", budget=3000, spare_pages=0), rng)
    _run_and_check(case, schema.OpAttributes(sink_pages=4, recent_pages=64), "float32")


def test_decode_ties_keep_lowest_index(cuda_lib, rng):
    """Pages with identical metadata score exactly alike: the lower logical index wins, as in numpy."""
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    case = make_case(CaseSpec((160,), 2, 1, 32, 16, 1, "float32", budget=64), rng)
    table = case["page_table"][0]
    for lp in range(1, 9):  # pages 1..8 share page 1's metadata
        case["key_min"][table[lp]] = case["key_min"][table[1]]
        case["key_max"][table[lp]] = case["key_max"][table[1]]
    attrs = schema.OpAttributes()
    _, sel = sparse_attention_gpu(**case, attrs=attrs)
    _, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    np.testing.assert_array_equal(sel, ref_sel)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("new_tokens", [2, 5])
def test_prefill_matches_reference(cuda_lib, rng, dtype, new_tokens):
    case = make_case(CaseSpec(LENS, 8, 2, 64, 16, new_tokens, dtype, budget=32), rng)
    _run_and_check(case, schema.OpAttributes(), dtype)  # S > 1: every valid page, causal over new tokens


@pytest.mark.parametrize("head_dim,heads", [(256, (2, 1)), (64, (12, 1))])
def test_prefill_head_dims_and_groups(cuda_lib, rng, head_dim, heads):
    """D = 256 fp32 needs 66 KB of shared memory (the opt-in path); a group of 12 is two
    chunks (8 + 4 heads) whose query tiles share one grid."""
    case = make_case(CaseSpec((37, 130), heads[0], heads[1], head_dim, 16, 5, "float32", budget=32), rng)
    _run_and_check(case, schema.OpAttributes(), "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_append_kv_matches_reference(cuda_lib, rng, dtype):
    from tinyserve_dev.kernels.harness import append_kv_gpu

    ps, S = 16, 3
    case = make_case(CaseSpec((0, 15, 16, 40), 4, 2, 32, ps, S, dtype, spare_pages=4), rng)
    # give every sequence room for its new tokens: fresh pool pages in its next table columns
    pages_of = [-(-int(past) // ps) for past in case["past_lens"]]
    used = {int(p) for b, n in enumerate(pages_of) for p in case["page_table"][b, :n]}
    free = [p for p in range(case["key_cache"].shape[0]) if p not in used]
    for b, past in enumerate(case["past_lens"]):
        for lp in range(pages_of[b], -(-(int(past) + S) // ps)):
            case["page_table"][b, lp] = free.pop()
    args = [case[n] for n in ("key", "value", "key_cache", "value_cache", "key_min", "key_max", "page_table",
                              "past_lens")]
    got = append_kv_gpu(*args)
    want = append_kv_ref(*args)
    for name, g, w in zip(("key_cache", "value_cache", "key_min", "key_max"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)


# (K, V) quantization granularities: KIVI's choice, one scale per page, and the transpose of KIVI.
COLD_GRANULARITIES = [("channel", "token"), ("head", "head"), ("token", "channel")]


def _assert_mixed(case):
    """The test is only meaningful if the sequences read both tiers."""
    P, ps = case["key_cache"].shape[0], case["key_cache"].shape[2]
    ids = np.concatenate([case["page_table"][b, : -(-int(n) // ps)] for b, n in enumerate(case["past_lens"])])
    assert (ids < P).any() and (ids >= P).any(), "case does not mix hot and cold pages"


def _run_mixed_and_check(case, attrs, dtype, **kw):
    """Kernel on hot + INT8 pages vs the reference (which dequantizes cold pages itself), then vs
    the reference on the dequantized all-hot cache over the pages the kernel kept."""
    _assert_mixed(case)
    out, sel = _run_and_check(case, attrs, dtype, **kw)
    hot = dequantized_float32_case(case)
    _assert_close(out, attention_with_selection_ref(hot, sel, attrs), dtype, "output vs dequantized all-hot cache")
    return out, sel


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("granularity", COLD_GRANULARITIES)
def test_mixed_decode_matches_reference(cuda_lib, rng, dtype, granularity):
    case = make_mixed_case(CaseSpec(LENS, 8, 2, 64, 16, 1, dtype, budget=64), rng, float(rng.uniform(0.3, 0.7)),
                           *granularity)
    case["token_budget"] = np.array([64, 0, 32, 48, 96], dtype=np.int32)  # mixed, incl. dense (0)
    _run_mixed_and_check(case, schema.OpAttributes(), dtype)


@pytest.mark.parametrize("head_dim", [80, 128])  # lanes past D masked; several elements per lane
def test_mixed_decode_head_dims_and_splits(cuda_lib, rng, head_dim):
    case = make_mixed_case(CaseSpec((37, 200, 130), 8, 2, head_dim, 16, 1, "float32", budget=80), rng, 0.5)
    _run_mixed_and_check(case, schema.OpAttributes(sink_pages=2, group_reduce="sum"), "float32", num_splits=3)


def test_mixed_equals_kernel_on_dequantized_cache(cuda_lib, rng):
    """float32: dequantizing on load must give what the hot path gives on the dequantized pools."""
    from tinyserve_dev.kernels.harness import sparse_attention_gpu

    case = make_mixed_case(CaseSpec((130, 300, 64), 8, 2, 64, 16, 1, "float32", budget=64), rng, 0.5)
    _assert_mixed(case)
    out, sel = sparse_attention_gpu(**case)
    hot_out, hot_sel = sparse_attention_gpu(**dequantized_float32_case(case))
    np.testing.assert_array_equal(sel, hot_sel)
    _assert_close(out, hot_out, "float32", "mixed vs all-hot kernel")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_mixed_prefill_matches_reference(cuda_lib, rng, dtype):
    case = make_mixed_case(CaseSpec(LENS, 8, 2, 64, 16, 4, dtype, budget=32), rng, 0.6)
    _run_mixed_and_check(case, schema.OpAttributes(), dtype)


@pytest.mark.parametrize("cold_fraction", [0.0, 1.0])  # clipped to a single page in the smaller tier
def test_single_cold_or_single_hot_page(cuda_lib, rng, cold_fraction):
    case = make_mixed_case(CaseSpec((40, 20), 4, 2, 16, 8, 1, "float32", 16, spare_pages=0), rng, cold_fraction)
    assert min(case["key_cache"].shape[0], case["key_cache_int8"].shape[0]) == 1
    _run_mixed_and_check(case, schema.OpAttributes(), "float32")


def test_unsupported_reports_status(cuda_lib, rng):
    from tinyserve_dev.kernels.harness import sparse_attention_gpu
    from tinyserve_trt.cuda.library import KernelError

    case = make_case(CaseSpec((40,), 2, 1, 16, 16, 1, "float32", budget=16), rng)
    with pytest.raises(KernelError, match="unsupported"):
        sparse_attention_gpu(**case, attrs=schema.OpAttributes(policy="oracle"))


@pytest.mark.parametrize("dtype,past", [("float32", 300), ("float16", 37)])
def test_long_prefill_matches_reference(cuda_lib, rng, dtype, past):
    """1K+ new tokens: ~65 query tiles, each walking the cached pages then the causal new
    block in key tiles. Small heads keep it to seconds in the CPU emulation."""
    case = make_case(CaseSpec((past,), 2, 1, 32, 16, 1030, dtype, budget=64), rng)
    _run_and_check(case, schema.OpAttributes(), dtype)
