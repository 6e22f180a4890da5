"""tinyserve.cpu::QueryAwareSparseAttentionLayer (the op plus its layer's head split, rotary and
transposes, ``csrc/qsa_layer_cpu.cpp``) equals the numpy reference run on the split, rotated
heads: output [B, S, H*D] within schema.TOLERANCES, new_key / new_value the rotated / copied rows,
selected_pages exactly - decode (selecting) and prefill; bad input fails with one line."""

from __future__ import annotations

import numpy as np
import pytest

from tinyserve_dev.cases import CaseSpec, make_case
from tinyserve_trt.cpu import native
from tinyserve_trt.cpu.node import LAYER_OUTPUTS, VERSION, layer_input_names, make_layer_node
from tinyserve_trt.ops import schema, sparse_attention_ref

from .test_native_op import cold_case, ragged_lens

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native CPU op unavailable: "
                                f"{native.available()}")


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """ORT's RotaryEmbedding (non-interleaved) on rows x [..., D] with their cos / sin [..., D/2], float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos + (-x2) * sin, x2 * cos + x1 * sin], axis=-1).astype(np.float32)


def layer_case(case: dict, rng, rotary: bool = True) -> tuple[dict, dict]:
    """(the layer node's feeds, the op's reference inputs) for ``case``: its query / key / value
    rows drawn anew as [B, S, heads*D] rows, rotated at random positions for the reference."""
    B, H, S, D = case["query"].shape
    Hkv = case["key"].shape[1]
    rows = {n: rng.standard_normal((B, S, h * D)).astype(np.float32) for n, h in (("query", H), ("key", Hkv),
                                                                                  ("value", Hkv))}
    feeds = dict(rows)
    heads = {n: rows[n].reshape(B, S, -1, D).transpose(0, 2, 1, 3) for n in rows}
    if rotary:
        R = 50
        theta = rng.uniform(0, 6.3, (R, D // 2))
        cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
        pos = rng.integers(0, R, (B, S)).astype(np.int64)
        feeds.update(rotary_positions=pos, cos_cache=cos, sin_cache=sin)
        c, s = cos[pos][:, None], sin[pos][:, None]  # [B, 1, S, D/2]
        heads["query"], heads["key"] = rotate(heads["query"], c, s), rotate(heads["key"], c, s)
    ref = dict(case, **{n: np.ascontiguousarray(v) for n, v in heads.items()})
    feeds.update({n: case[n] for n in schema.INPUT_NAMES[3:] if case.get(n) is not None})
    return feeds, ref


_SESSIONS: dict = {}


def run_layer(feeds: dict, attrs: schema.OpAttributes, rotary: bool = True, outputs=LAYER_OUTPUTS):
    from onnx import TensorProto, helper

    cold = feeds.get("key_cache_int8") is not None
    names = layer_input_names(attrs.two_level, cold, rotary)
    key = (attrs, rotary, cold, tuple(outputs))
    if key not in _SESSIONS:
        types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
                 np.dtype(np.int32): TensorProto.INT32, np.dtype(np.uint8): TensorProto.UINT8,
                 np.dtype(np.int8): TensorProto.INT8, np.dtype(np.float16): TensorProto.FLOAT16}
        node = make_layer_node(list(names), list(outputs), attrs, name="layer", cold_pages=cold)
        ins = [helper.make_tensor_value_info(n, types[feeds[n].dtype], None) for n in names if n]
        outs = [helper.make_tensor_value_info(n, TensorProto.BOOL if n == "selected_pages" else TensorProto.FLOAT,
                                              None) for n in outputs if n]
        model = helper.make_model(helper.make_graph([node], "layer", ins, outs), ir_version=10,
                                  opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(native.DOMAIN,
                                                                                                  VERSION)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        native.register(so)
        _SESSIONS[key] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return _SESSIONS[key].run(None, {n: feeds[n] for n in names if n})


def check_layer(case: dict, attrs: schema.OpAttributes, rng, rotary: bool = True):
    feeds, ref = layer_case(case, rng, rotary)
    out, sel, new_key, new_value = run_layer(feeds, attrs, rotary)
    want, want_sel = sparse_attention_ref(**ref, attrs=attrs)
    B, H, S, D = want.shape
    np.testing.assert_allclose(out, want.transpose(0, 2, 1, 3).reshape(B, S, H * D), **schema.TOLERANCES["float32"])
    np.testing.assert_array_equal(sel, want_sel)
    np.testing.assert_allclose(new_key, ref["key"], rtol=0, atol=1e-6)  # the same float32 operations
    np.testing.assert_array_equal(new_value, ref["value"])


@pytest.mark.parametrize("new_tokens", [1, 9])
@pytest.mark.parametrize("sp", [0, 4])
@pytest.mark.parametrize("group_reduce", ["head", "max"])
def test_layer_matches_reference(rng, new_tokens, sp, group_reduce):
    lens = ragged_lens(rng, 16)
    attrs = schema.OpAttributes(sub_page_size=sp, group_reduce=group_reduce)
    for budget in (16, 3 * 16 + 4, 0):
        case = make_case(CaseSpec(lens, 6, 2, 32, 16, new_tokens=new_tokens, budget=budget, sub_page_size=sp), rng)
        check_layer(case, attrs, rng)


@pytest.mark.parametrize("new_tokens", [1, 40])
def test_layer_without_rotary_and_at_qwen_shapes(rng, new_tokens):
    """GPT-2 has no rotary: the rows are only split and transposed; Qwen's 14 / 2 heads of 64."""
    case = make_case(CaseSpec((300, 33), 4, 4, 16, 16, new_tokens=new_tokens, budget=32), rng)
    check_layer(case, schema.OpAttributes(), rng, rotary=False)
    case = make_case(CaseSpec((1000,), 14, 2, 64, 32, new_tokens=new_tokens, budget=256, sub_page_size=4), rng)
    check_layer(case, schema.OpAttributes(sub_page_size=4, group_reduce="head"), rng)


def test_layer_over_cold_pages(rng):
    kw = dict(num_heads=6, num_kv_heads=2, head_dim=32, page_size=16, budget=52, sub_page_size=4)
    for new_tokens in (1, 5):
        case = cold_case(rng, ragged_lens(rng, 16), dict(kw, new_tokens=new_tokens), ("int4", "channel", "token", 16))
        check_layer(case, schema.OpAttributes(sub_page_size=4, cold_format="int4"), rng)


def test_outputs_the_graph_does_not_read(rng):
    """Without new_key / new_value outputs (or selected_pages) the node still attends the rotated rows."""
    case = make_case(CaseSpec((100, 7), 6, 2, 32, 16, new_tokens=3, budget=16), rng)
    feeds, ref = layer_case(case, rng)
    (out,) = run_layer(feeds, schema.OpAttributes(), outputs=("output",))
    want, _ = sparse_attention_ref(**ref, attrs=schema.OpAttributes())
    np.testing.assert_allclose(out, want.transpose(0, 2, 1, 3).reshape(out.shape), **schema.TOLERANCES["float32"])


@pytest.mark.parametrize("break_it,match", [
    (lambda f: f.update(key=f["key"][:, :, :-1]), r"key has shape \[2,3,63\], expected \[2,3,64\]"),
    (lambda f: f.update(query=f["query"][:, :, :-3]), r"query rows of 189 are not whole heads of 32"),
    (lambda f: f.update(rotary_positions=f["rotary_positions"] + 50), r"rotary_positions\[0\] = \d+ is outside the 50"),
    (lambda f: f.update(cos_cache=f["cos_cache"][:, :-1]), r"cos_cache / sin_cache have shapes \[50,15\] / \[50,16\]"),
])
def test_bad_input_is_one_line(rng, break_it, match):
    case = make_case(CaseSpec((40, 30), 6, 2, 32, 16, new_tokens=3, budget=16), rng)
    feeds, _ = layer_case(case, rng)
    break_it(feeds)
    with pytest.raises(Exception, match=match) as info:
        run_layer(feeds, schema.OpAttributes())
    assert "\n" not in str(info.value).strip().split(native.LAYER_OP_TYPE, 1)[1]
