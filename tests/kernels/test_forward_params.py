"""Host-side packing of a ``qsa_forward`` call (library.forward_params): no compiler, no GPU.

The GPU harness packs every launch through it, so what it derives from the
input shapes - dims, and the INT8 cold tier's page count and scale extents -
is checked here on CPU against cases built by ``ops.cases``.
"""

import pytest

from tinyserve_trt.cuda import library
from tinyserve_trt.ops import quantization, schema
from tinyserve_dev.cases import CaseSpec, make_case, make_mixed_case


def _shapes(case):
    return {n: a.shape for n, a in case.items()}


def test_hot_only_case_has_no_cold_tier(rng):
    case = make_case(CaseSpec((40, 7), 8, 2, 16, 8, 1, "float16", 16), rng)
    p = library.forward_params(_shapes(case), {"query": 0x1000}, "float16", schema.OpAttributes())
    assert (p.dims.batch, p.dims.num_heads, p.dims.num_kv_heads, p.dims.new_tokens, p.dims.head_dim) == (2, 8, 2, 1, 16)
    assert (p.dims.num_pages, p.dims.page_size, p.dims.table_width) == (case["key_cache"].shape[0], 8,
                                                                        case["page_table"].shape[1])
    assert tuple(getattr(p.cold, f) for f, _ in library.QsaColdDims._fields_) == (0,) * 6
    assert p.query == 0x1000 and p.key_cache_int8 is None and p.dtype == library.DTYPES["float16"]


@pytest.mark.parametrize("k_gran", quantization.GRANULARITIES)
@pytest.mark.parametrize("v_gran", quantization.GRANULARITIES)
def test_cold_dims_follow_the_scale_shapes(rng, k_gran, v_gran):
    Hkv, ps, D = 2, 8, 16
    case = make_mixed_case(CaseSpec((40, 7), 4, Hkv, D, ps, 1, "float32", 16), rng, 0.5, k_gran, v_gran)
    cold = library.cold_dims(_shapes(case))
    assert cold.num_pages == case["key_cache_int8"].shape[0]
    _, kt, kc = quantization.scale_shape(k_gran, Hkv, ps, D)
    _, vt, vc = quantization.scale_shape(v_gran, Hkv, ps, D)
    assert (cold.key_scale_tokens, cold.key_scale_channels, cold.value_scale_tokens,
            cold.value_scale_channels) == (kt, kc, vt, vc)
    # key_min/key_max hold a row for every hot and cold id, as qsa_check requires
    assert case["key_min"].shape[0] >= case["key_cache"].shape[0] + cold.num_pages


def test_cold_dims_refuse_inconsistent_shapes(rng):
    case = make_mixed_case(CaseSpec((40, 7), 4, 2, 16, 8, 1, "float32", 16), rng, 0.5)
    shapes = _shapes(case)
    with pytest.raises(ValueError, match="needs all"):
        library.cold_dims({**shapes, "value_scale": None})
    Pc = shapes["key_cache_int8"][0]
    with pytest.raises(ValueError, match="value_cache_int8"):
        library.cold_dims({**shapes, "value_cache_int8": (Pc + 1, 2, 8, 16)})
    with pytest.raises(ValueError, match="key_scale"):
        library.cold_dims({**shapes, "key_scale": (Pc, 2, 4, 1)})  # 4 is neither 1 nor ps
    with pytest.raises(ValueError, match="value_scale"):
        library.cold_dims({**shapes, "value_scale": (Pc, 2, 8)})


@pytest.mark.parametrize("k_gran,v_gran,group", [("channel", "token", 4), ("channel", "head", 0), ("channel", "channel", 8)])
def test_int4_cold_dims(rng, k_gran, v_gran, group):
    """int4: packed pools [.., D/2], V scale columns per channel group (K: a [.., 1, 1] placeholder),
    the format id from the schema."""
    Hkv, ps, D = 2, 8, 16
    case = make_mixed_case(CaseSpec((40, 7), 4, Hkv, D, ps, 1, "float32", 16), rng, 0.5, k_gran, v_gran,
                           cold_format="int4", group_size=group)
    cold = library.cold_dims(_shapes(case), "int4")
    assert cold.format == schema.COLD_FORMATS.index("int4") == library.COLD_FORMAT_IDS["int4"]
    assert (cold.key_scale_tokens, cold.key_scale_channels) == case["key_scale"].shape[2:]
    assert (cold.value_scale_tokens, cold.value_scale_channels) == case["value_scale"].shape[2:]
    assert library.cold_dims(_shapes(make_mixed_case(CaseSpec((40, 7), 4, Hkv, D, ps, 1, "float32", 16),
                                                     rng, 0.5)), "int8").format == 0
    with pytest.raises(ValueError, match="key_cache_int8"):  # packed pools read as int8
        library.cold_dims(_shapes(case), "int8")
    # forward_params takes the format from the node's cold_format attribute unless told
    pointers = {n: 0x1000 for n in case}
    assert library.forward_params(_shapes(case), pointers, "float32",
                                  schema.OpAttributes(cold_format="int4")).cold.format == 1
    with pytest.raises(ValueError, match="key_cache_int8"):
        library.forward_params(_shapes(case), pointers, "float32", schema.OpAttributes())
    Pc = case["key_cache_int8"].shape[0]
    with pytest.raises(ValueError, match="value_scale"):  # 3 columns do not divide 16 channels
        library.cold_dims({**_shapes(case), "value_scale": (Pc, Hkv, ps, 3)}, "int4")


def test_two_level_packing(rng):
    case = make_case(CaseSpec((40, 7), 4, 2, 16, 16, 1, "float32", 16, sub_page_size=4), rng)
    attrs = schema.OpAttributes(sub_page_size=4, candidate_share=0.25)
    p = library.forward_params(_shapes(case), {"key_sub_bounds": 0x2000}, "float32", attrs)
    assert p.dims.sub_pages == 4 and p.key_sub_bounds == 0x2000
    assert (p.attrs.sub_page_size, p.attrs.candidate_share) == (4, 0.25)
    single = library.forward_params(_shapes({k: v for k, v in case.items() if k != "key_sub_bounds"}), {},
                                    "float32", schema.OpAttributes())
    assert single.dims.sub_pages == 0 and single.attrs.sub_page_size == 0


def test_two_level_packing_refuses_missing_or_wrong_bounds(rng):
    case = make_case(CaseSpec((40, 7), 4, 2, 16, 16, 1, "float32", 16, sub_page_size=4), rng)
    shapes = _shapes(case)
    with pytest.raises(ValueError, match="needs key_sub_bounds"):
        library.forward_params({**shapes, "key_sub_bounds": None}, {}, "float32",
                               schema.OpAttributes(sub_page_size=4))
    with pytest.raises(ValueError, match="needs key_sub_bounds"):  # r = 4 rows, sub_page_size 8 needs 2
        library.forward_params(shapes, {}, "float32", schema.OpAttributes(sub_page_size=8))
    with pytest.raises(ValueError, match="key_sub_bounds must be"):
        library.forward_params({**shapes, "key_sub_bounds": (shapes["key_min"][0], 2, 4, 8)}, {}, "float32",
                               schema.OpAttributes(sub_page_size=4))
