"""The native decode op (tinyserve.cpu::QueryAwareSparseAttentionDecode) in ONNX Runtime equals the
numpy reference: outputs within schema.TOLERANCES, selected_pages exactly; bad input fails with
our one-line message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyserve_dev.cases import CaseSpec, make_case, make_mixed_case
from tinyserve_trt.cpu import native
from tinyserve_trt.cpu.node import input_names, make_decode_model
from tinyserve_trt.ops import schema, sparse_attention_ref

ort = pytest.importorskip("onnxruntime")
_REASON = native.available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"native CPU op unavailable: {_REASON}")

_SESSIONS: dict = {}


def run_native(case: dict, attrs: schema.OpAttributes, with_selected: bool = True, lib=None):
    """Run the node over ``case``; ``lib`` another build of the library (default: this machine's)."""
    cold = case.get("key_cache_int8") is not None
    key = (attrs, with_selected, lib, cold)
    if key not in _SESSIONS:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        if lib is None:
            native.register(so)
        else:
            so.register_custom_ops_library(str(lib))
        model = make_decode_model(attrs, with_selected, cold_pages=cold)
        _SESSIONS[key] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return _SESSIONS[key].run(None, {n: case[n] for n in input_names(attrs.two_level, cold) if n})


def check_case(case: dict, attrs: schema.OpAttributes, lib=None, tol: dict | None = None):
    out, sel = run_native(case, attrs, lib=lib)
    ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    np.testing.assert_allclose(out, ref_out, **(tol or schema.TOLERANCES["float32"]))
    assert sel.dtype == bool and sel.shape == ref_sel.shape
    np.testing.assert_array_equal(sel, ref_sel)


def ragged_lens(rng, ps: int, batch: int = 5, max_pages: int = 12) -> tuple[int, ...]:
    """A partial last page, a page-aligned one, an empty cache and random others."""
    fixed = [3 * ps + int(rng.integers(1, ps)), 4 * ps, 0]
    return tuple(fixed + [int(x) for x in rng.integers(1, ps * max_pages, batch - len(fixed))])


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("group_reduce", schema.GROUP_REDUCTIONS)
@pytest.mark.parametrize("sink,recent", [(0, 1), (1, 1), (2, 2)])
def test_single_level_matches_reference(rng, heads, kv_heads, group_reduce, sink, recent):
    ps = 16
    lens = ragged_lens(rng, ps)
    for budget_pages in (1, 2, 5, 12, 0):  # one page .. every page; 0 = dense
        case = make_case(CaseSpec(lens, heads, kv_heads, 32, ps, budget=budget_pages * ps), rng)
        check_case(case, schema.OpAttributes(group_reduce=group_reduce, sink_pages=sink, recent_pages=recent))


@pytest.mark.parametrize("share", [0.5, 0.25])
@pytest.mark.parametrize("group_reduce", schema.GROUP_REDUCTIONS)
@pytest.mark.parametrize("sink,recent", [(0, 1), (1, 2), (2, 1)])
def test_two_level_matches_reference(rng, share, group_reduce, sink, recent):
    ps, sp = 16, 4
    lens = ragged_lens(rng, ps)
    attrs = schema.OpAttributes(sub_page_size=sp, candidate_share=share, group_reduce=group_reduce,
                                sink_pages=sink, recent_pages=recent)
    for budget in (sp, ps, 3 * ps + sp, 10 * ps, 0):
        check_case(make_case(CaseSpec(lens, 6, 2, 32, ps, budget=budget, sub_page_size=sp), rng), attrs)


def test_dense_policy_and_larger_head_dim(rng):
    """Policy dense attends every cached token whatever the budget; D = 64 at ps 32 (SmolLM2 shapes)."""
    case = make_case(CaseSpec(ragged_lens(rng, 32), 9, 3, 64, 32, budget=32), rng)
    check_case(case, schema.OpAttributes(policy="dense"))
    check_case(case, schema.OpAttributes())
    check_case(case, schema.OpAttributes(scale=0.3))  # an explicit softmax scale
    sel = run_native(case, schema.OpAttributes(policy="dense"))[1]
    pages = [-(-int(n) // 32) for n in case["past_lens"]]
    assert [int(s) for s in sel[:, 0].sum(-1)] == pages


def test_two_level_at_smollm2_shapes(rng):
    """The default deployment: H 9, Hkv 3, D 64, ps 32, sp 4, a few thousand tokens."""
    case = make_case(CaseSpec((3000, 1337), 9, 3, 64, 32, budget=512, sub_page_size=4), rng)
    for share in (0.5, 0.25):
        check_case(case, schema.OpAttributes(sub_page_size=4, candidate_share=share))


# Logits 12x float32's usual size carry 12x its rounding into each exp's argument: over 60 seeds the
# kernel's worst error was 1.33x the float32 tolerance (1e-5; CI's seed 2449288782 hit 1.35e-5); a wrong
# exponent or polynomial is off by 1e-3 or more
PEAKED_TOL = {"rtol": 4e-5, "atol": 4e-5}


@pytest.mark.parametrize("sp", [0, 4])
@pytest.mark.parametrize("seed", [None, 2449288782])  # None: the rng fixture's fresh seed
def test_peaked_softmax_over_the_whole_exp_range(rng, sp, seed):
    """Queries scaled so each head's logits minus their max reach about -200: every exp the
    softmax takes (the kernel's vectorized one, 8 lanes at a time, and its scalar tail) from 1 down
    past float32's smallest normal, where it must give 0. The output is then a few rows' mix, so
    a wrong exponent or polynomial moves it far outside the tolerance."""
    rng = rng if seed is None else np.random.default_rng(seed)
    for past in (7, 300, 2000):
        case = make_case(CaseSpec((past, 45), 9, 3, 64, 16, budget=256, sub_page_size=sp), rng)
        case["query"] = case["query"] * np.float32(12.0)
        check_case(case, schema.OpAttributes(sub_page_size=sp), tol=PEAKED_TOL)
        if not sp:
            check_case(case, schema.OpAttributes(policy="dense"), tol=PEAKED_TOL)


@pytest.mark.parametrize("head_dim", [4, 20])
def test_head_dim_not_a_multiple_of_the_vector_width(rng, head_dim):
    for sp in (0, 4):
        case = make_case(CaseSpec(ragged_lens(rng, 16), 6, 2, head_dim, 16, budget=40, sub_page_size=sp), rng)
        check_case(case, schema.OpAttributes(sub_page_size=sp))


@pytest.mark.parametrize("sp", [0, 4])
def test_batch_one(rng, sp):
    for heads, kv_heads in ((6, 2), (9, 3), (4, 1)):
        for past in (1, 16, 300, 977):
            case = make_case(CaseSpec((past,), heads, kv_heads, 32, 16, budget=64, sub_page_size=sp), rng)
            check_case(case, schema.OpAttributes(sub_page_size=sp))


def batch_one_cases(rng, sp: int) -> None:
    for heads, kv_heads in ((6, 2), (9, 3), (4, 1)):
        for past in (1, 16, 300, 977):
            case = make_case(CaseSpec((past,), heads, kv_heads, 32, 16, budget=64, sub_page_size=sp), rng)
            check_case(case, schema.OpAttributes(sub_page_size=sp))


def _child(code: str, env: dict[str, str]) -> str:
    """``code`` in a Python process of its own (the library reads its environment once), from the
    repository root, with ``env`` for the library's variables; its stdout."""
    root = Path(__file__).resolve().parents[2]
    base = {k: v for k, v in os.environ.items() if not k.startswith("TINYSERVE_NATIVE_")}
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**base, **env})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.parametrize("pool", ["ort", "own"])
@pytest.mark.parametrize("sp", [0, 4])
def test_batch_one_splits_the_attention(rng, sp, pool):
    """Batch 1 has fewer (sequence, KV head) tasks than 2 per pool thread: each one's kept rows are
    split into chunks attended apart and merged (with 2+ cores; serial otherwise, same result), on
    the session's intra-op pool (the default) and on the library's own (TINYSERVE_NATIVE_POOL=own,
    in a process of its own: the library reads it once)."""
    if pool == "ort":
        return batch_one_cases(rng, sp)
    seed = int(rng.integers(1 << 31))
    _child("import numpy as np; from tests.cpu.test_native_op import batch_one_cases; "
           f"batch_one_cases(np.random.default_rng({seed}), {sp})", {"TINYSERVE_NATIVE_POOL": "own"})


def test_the_environment_is_read_once():
    """TINYSERVE_NATIVE_POOL / _THREADS are read at the first call, never again: every call used to
    getenv(), which races with a Python thread's os.environ write (glibc's setenv frees the array a
    concurrent getenv reads). Set after the first call, "own" starts no pool (2 threads: one worker)."""
    out = _child("""
import os
import numpy as np
from tests.cpu.test_native_op import run_native
from tinyserve_dev.cases import CaseSpec, make_case
from tinyserve_trt.ops import schema
case = make_case(CaseSpec((977,), 6, 2, 32, 16, budget=64), np.random.default_rng(0))
attrs = schema.OpAttributes()
first = run_native(case, attrs)[0]
before = len(os.listdir("/proc/self/task"))
os.environ["TINYSERVE_NATIVE_POOL"] = "own"
again = run_native(case, attrs)[0]
assert np.array_equal(first, again)
print(len(os.listdir("/proc/self/task")) - before)
""", {"TINYSERVE_NATIVE_THREADS": "2"})
    assert out.split() == ["0"], out


COLD_LAYOUTS = [("int8", "channel", "token", 0), ("int8", "token", "channel", 0), ("int8", "head", "head", 0),
                ("int4", "channel", "token", 16), ("int4", "channel", "head", 0), ("int4", "channel", "channel", 0)]


def cold_case(rng, lens, spec_kw, layout, cold_fraction=0.5):
    fmt, kg, vg, group = layout
    return make_mixed_case(CaseSpec(lens, **spec_kw), rng, cold_fraction, kg, vg, fmt, group)


@pytest.mark.parametrize("layout", COLD_LAYOUTS, ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("sp", [0, 4])
def test_cold_pages_match_reference(rng, layout, sp):
    """Hot and cold (INT8 or INT4, each scale layout) pages in one pool: the kept cold rows are
    dequantized as ops/cold_codec.py does (INT4 keys on the sub-page bounds when two-level)."""
    attrs = schema.OpAttributes(sub_page_size=sp, cold_format=layout[0])
    lens = ragged_lens(rng, 16)
    for budget in (16, 3 * 16 + 4, 10 * 16, 0):
        kw = dict(num_heads=6, num_kv_heads=2, head_dim=32, page_size=16, budget=budget, sub_page_size=sp)
        check_case(cold_case(rng, lens, kw, layout), attrs)
    for cold_fraction in (0.1, 0.9):  # mostly hot, mostly cold; batch 1 splits its attention
        kw = dict(num_heads=9, num_kv_heads=3, head_dim=64, page_size=32, budget=256, sub_page_size=sp)
        check_case(cold_case(rng, (1500,), kw, layout, cold_fraction), attrs)


def test_cold_input_errors_are_one_line(rng):
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, budget=8)
    case = cold_case(rng, (40, 30), kw, ("int8", "channel", "token", 0))
    attrs = schema.OpAttributes()
    bad = dict(case, value_scale=np.ones(case["value_scale"].shape[:-1] + (3,), np.float32))
    _error(bad, attrs, r"value_scale has shape \[\d+,2,8,3\], expected \[\d+,2,ps\|1,C\] with C dividing 16")
    short = dict(case, key_cache_int8=np.ascontiguousarray(case["key_cache_int8"][:, :, :4]))
    _error(short, attrs, r"key_cache_int8 has shape \[\d+,2,4,16\], expected \[\d+,2,8,16\]")


def test_cold_pools_of_another_format_are_one_line(rng):
    """INT8 pools fed to a node whose cold_format says int4 (the graph's types say int8)."""
    from onnx import helper

    kw = dict(num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, budget=8)
    case = cold_case(rng, (40, 30), kw, ("int8", "channel", "token", 0))
    model = make_decode_model(schema.OpAttributes(), cold_pages=True)
    (attr,) = [a for a in model.graph.node[0].attribute if a.name == "cold_format"]
    attr.CopyFrom(helper.make_attribute("cold_format", "int4"))
    so = ort.SessionOptions()
    native.register(so)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match=r"key_cache_int8 has element type 3, cold_format int4 stores 2$"):
        sess.run(None, {n: case[n] for n in input_names(False, True) if n})


def test_output_only_node(rng):
    case = make_case(CaseSpec((40, 7), 4, 2, 16, 8, budget=8), rng)
    (out,) = run_native(case, schema.OpAttributes(), with_selected=False)
    np.testing.assert_allclose(out, sparse_attention_ref(**case)[0], **schema.TOLERANCES["float32"])


def test_exact_ties_go_to_the_lower_page(rng):
    """Pages with identical metadata tie exactly: the reference's stable sort keeps the lower index."""
    case = make_case(CaseSpec((16 * 10,), 2, 1, 16, 16, budget=3 * 16), rng)
    pt = case["page_table"][0]
    case["key_max"][pt[2]] += 50.0  # six equal scores, above the others' ...
    for i in range(3, 8):
        case["key_min"][pt[i]], case["key_max"][pt[i]] = case["key_min"][pt[2]], case["key_max"][pt[2]]
    case["key_max"][pt[8]] += 100.0  # ... below one clear winner; two free slots (page 9 is recent)
    check_case(case, schema.OpAttributes(sink_pages=0))
    sel = run_native(case, schema.OpAttributes(sink_pages=0))[1]
    assert np.flatnonzero(sel[0, 0]).tolist() == [2, 8, 9]


@pytest.mark.parametrize("levels", [2, 4])
@pytest.mark.parametrize("group_reduce", ["head", "sum"])
def test_top_k_over_many_exact_ties(rng, levels, group_reduce):
    """Keys and queries on a few binary levels: every page score is exact in float32 and float64
    alike, so hundreds of pages tie exactly, and the k-th score's ties cut through them (the radix
    select's last digits and its tie rule, qsa_topk.h): the kept set is still the reference's - the
    k largest, the lower index on a tie. 4-token pages: 750 candidates per sequence."""
    case = make_case(CaseSpec((3000, 2100), 14, 2, 64, 4, budget=512), rng)
    for name in ("key_cache", "query"):
        case[name] = (1.0 + np.floor(rng.random(case[name].shape) * levels) / levels).astype(np.float32)
    from tinyserve_trt.ops.reference import page_min_max  # the new keys' metadata, as the runtime keeps it

    for b, past in enumerate((3000, 2100)):
        for i, pid in enumerate(case["page_table"][b, :-(-past // 4)]):
            for h in range(2):
                case["key_min"][pid, h], case["key_max"][pid, h] = page_min_max(case["key_cache"][pid, h],
                                                                              min(4, past - i * 4))
    for budget in (64, 512, 1500):
        case["token_budget"][:] = budget
        check_case(case, schema.OpAttributes(group_reduce=group_reduce))


@pytest.mark.parametrize("sp", [0, 4])
def test_nan_scores_rank_like_numpy(rng, sp):
    """The selection order at NaN is the reference's (qsa_select_math.h, issue #32): a NaN in one
    query head's channel makes its KV head's page scores NaN (the group's max keeps it, and the
    relu split keeps it in both halves), and pages whose bounds hold NaN rank after every finite
    one, the lower index first."""
    case = make_case(CaseSpec((16 * 12, 16 * 9), 4, 2, 16, 16, budget=5 * 16, sub_page_size=sp), rng)
    case["query"][0, 1, 0, 3] = np.nan  # sequence 0: the second query head of KV head 0
    table = case["page_table"][1]
    for lp in (2, 4, 5):  # sequence 1: NaN bounds on three pages of KV head 1
        case["key_min"][table[lp], 1, lp] = np.nan
    for group_reduce in schema.GROUP_REDUCTIONS:
        check_case(case, schema.OpAttributes(sub_page_size=sp, group_reduce=group_reduce))
    case["token_budget"][1] = 8 * 16  # sequence 1 must take NaN pages: the lower-index ones
    check_case(case, schema.OpAttributes(sub_page_size=sp))


def _error(case, attrs, match):
    with pytest.raises(Exception, match=match) as info:
        run_native(case, attrs)
    assert "\n" not in str(info.value).strip().split(native.OP_TYPE, 1)[1]


def test_page_id_out_of_range(rng):
    case = make_case(CaseSpec((20, 30), 4, 2, 16, 8, budget=8), rng)
    case["page_table"][1, 2] = case["key_cache"].shape[0]
    _error(case, schema.OpAttributes(), r"page_table\[1,2\] = \d+ is outside the page pool")
    case["page_table"][1, 2] = -1
    _error(case, schema.OpAttributes(), r"page_table\[1,2\] = -1 is outside")


def test_too_short_page_table(rng):
    case = make_case(CaseSpec((20, 30), 4, 2, 16, 8, budget=8, extra_table_cols=0), rng)
    case["past_lens"][0] = 8 * case["page_table"].shape[1] + 1
    _error(case, schema.OpAttributes(), r"sequence 0: \d+ cached tokens need \d+ pages, page table has \d+")


@pytest.mark.parametrize("policy", ["window", "oracle"])
def test_unsupported_policy_fails_at_session_creation(policy):
    from onnx import helper

    model = make_decode_model(schema.OpAttributes())
    node = model.graph.node[0]
    (attr,) = [a for a in node.attribute if a.name == "policy"]
    attr.CopyFrom(helper.make_attribute("policy", policy))
    so = ort.SessionOptions()
    native.register(so)
    with pytest.raises(Exception, match=rf"QueryAwareSparseAttentionDecode: policy '{policy}' is not supported"):
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_node_builder_refuses_what_the_kernel_cannot_run():
    from tinyserve_trt.cpu.node import make_decode_node

    with pytest.raises(ValueError, match="policy"):
        make_decode_node(list(input_names(False)), ["out"], schema.OpAttributes(policy="window"))
    with pytest.raises(ValueError, match="takes 15 inputs"):  # key_sub_bounds at its schema position
        make_decode_node(list(input_names(False)), ["out"], schema.OpAttributes(sub_page_size=4))


def test_node_inputs_sit_at_the_schema_positions():
    """Optional inputs never shift: the native node, the op node and the generated header agree on
    every position (version 1 had key_sub_bounds at 10 and the cold tier after it; version 3 runs
    prefill too, at version 2's positions, so a version-2 graph still runs)."""
    from tinyserve_trt.cpu.node import RUNS_VERSIONS, VERSION

    assert VERSION == 3 and RUNS_VERSIONS == (2, 3)
    for two_level in (False, True):
        for cold in (False, True):
            names = input_names(two_level, cold)
            assert names == schema.node_input_names(cold_pages=cold, two_level=two_level)
            for i, n in enumerate(names):
                assert n in ("", schema.INPUT_NAMES[i])
    assert input_names(True, False).index("key_sub_bounds") == schema.INPUT_NAMES.index("key_sub_bounds") == 14


def test_shape_errors_are_one_line(rng):
    case = make_case(CaseSpec((20, 30), 4, 2, 16, 16, budget=16, sub_page_size=4), rng)
    bad = dict(case, key_sub_bounds=np.ascontiguousarray(case["key_sub_bounds"][:, :, :2]))
    _error(bad, schema.OpAttributes(sub_page_size=4), r"key_sub_bounds has shape \[\d+,2,2,16\], expected \[Ps,2,4,16\]")
    odd = dict(case, query=np.ascontiguousarray(case["query"][:, :3]))
    _error(odd, schema.OpAttributes(), r"query heads 3 not a multiple of KV heads 2")
    short = dict(case, key_max=np.ascontiguousarray(case["key_max"][:, :, :8]))
    _error(short, schema.OpAttributes(), r"key_max has shape \[\d+,2,8\], expected \[\d+,2,16\]")


def test_forked_child_runs_serially(rng):
    """The pool's threads do not survive fork(): a child must still compute (serially), not hang."""
    import multiprocessing as mp

    case = make_case(CaseSpec((64,) * 4, 4, 2, 16, 16, budget=16), rng)
    expect = run_native(case, schema.OpAttributes())[0]  # the parent's pool is up now
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_run_output, (case,)).get(timeout=60)
    np.testing.assert_array_equal(got, expect)


def _run_output(case):
    return run_native(case, schema.OpAttributes())[0]


def test_float16_is_refused_at_session_creation():
    from onnx import TensorProto

    model = make_decode_model()
    for vi in [*model.graph.input[:7], model.graph.output[0]]:
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    so = ort.SessionOptions()
    native.register(so)
    with pytest.raises(Exception, match=r"tensor\(float16\).* \(query\) of operator \(QueryAwareSparseAttentionDecode\)"):
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_too_old_onnxruntime_is_refused_loudly():
    """RegisterCustomOps against a runtime without C API 16: an error status (made through API 1)
    naming the version, not a silent no-op. The runtime here is a ctypes fake."""
    import ctypes

    lib = ctypes.CDLL(str(native.library_path()))
    create_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)
    get_api_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)
    version_t = ctypes.CFUNCTYPE(ctypes.c_void_p)

    class Api(ctypes.Structure):
        _fields_ = [("CreateStatus", create_t)]

    class ApiBase(ctypes.Structure):
        _fields_ = [("GetApi", get_api_t), ("GetVersionString", version_t)]

    seen = []
    version = ctypes.create_string_buffer(b"1.15.1")
    create = create_t(lambda code, msg: seen.append((code, msg.decode())) or 1234)
    api1 = Api(create)
    asked = []
    get_api = get_api_t(lambda v: asked.append(v) or (ctypes.addressof(api1) if v == 1 else None))
    base = ApiBase(get_api, version_t(lambda: ctypes.addressof(version)))
    lib.RegisterCustomOps.restype = ctypes.c_void_p
    lib.RegisterCustomOps.argtypes = [ctypes.c_void_p, ctypes.POINTER(ApiBase)]
    assert lib.RegisterCustomOps(None, ctypes.byref(base)) == 1234
    assert asked == [16, 1]
    (code, msg), = seen
    assert code == 1 and "C API 16" in msg and "onnxruntime 1.15.1" in msg and "\n" not in msg
