"""The structs of the CUDA kernels' C launch interface, defined once.

``tinyserve_dev.schema_header`` renders them into ``plugins/generated/qsa_launch_structs.h``
(which ``plugins/kernels/qsa_launch.h`` includes: the kernels and the TensorRT plugin read
it) and ``cuda/library.py`` builds its ctypes mirror from the same tuples, so neither side
re-types a field; ``tests/kernels/test_launch_abi.py`` still compiles the header and
compares every offset. Pure data: importing it loads nothing.

Field types are C spellings: ``int32_t``, ``float``, a pointer (``const void*``, ...), or
the name of a struct defined before it. Named dims as in ``ops/schema.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CField:
    name: str
    ctype: str
    doc: str = ""


@dataclass(frozen=True)
class CStruct:
    name: str
    doc: str
    fields: tuple[CField, ...]


def _f(name: str, ctype: str, doc: str = "") -> CField:
    return CField(name, ctype, doc)


QSA_DIMS = CStruct("QsaDims", "Shapes of one call (the page layout every kernel reads).", (
    _f("batch", "int32_t", "B"),
    _f("num_heads", "int32_t", "H"),
    _f("num_kv_heads", "int32_t", "Hkv; H % Hkv == 0"),
    _f("new_tokens", "int32_t", "S; S == 1 is a decode step (selection applies)"),
    _f("head_dim", "int32_t", "D <= QSA_MAX_HEAD_DIM"),
    _f("num_pages", "int32_t", "P: hot pool pages"),
    _f("page_size", "int32_t", "ps"),
    _f("table_width", "int32_t", "NP"),
    _f("num_meta_pages", "int32_t", "Ptot: rows of key_min/key_max (>= P)"),
    _f("sub_pages", "int32_t", "r: sub-pages per page in key_sub_bounds; 0 without it (sizes the workspace)"),
))

QSA_ATTRS = CStruct("QsaAttrs", "The op's attributes (schema.ATTRIBUTES; enums as QSA_* indices).", (
    _f("scale", "float", "0: 1/sqrt(D)"),
    _f("policy", "int32_t", "QSA_POLICY_*"),
    _f("sink_pages", "int32_t"),
    _f("recent_pages", "int32_t"),
    _f("group_reduce", "int32_t", "QSA_GROUP_REDUCE_*"),
    _f("sub_page_size", "int32_t", "two-level sub-page tokens; 0 (or ps) = single-level"),
    _f("candidate_share", "float", "two-level: share of a sequence's pages kept as candidates, in [0, 1]"),
))

QSA_COLD_DIMS = CStruct(
    "QsaColdDims",
    "Shape of the cold tier. num_pages is 0 when the cold pointers are NULL (the rest is then not read).\n"
    "Only the forward call has one: append writes hot pages only.", (
        _f("num_pages", "int32_t", "Pcold: pages of each cold pool (>= 1 with a cold tier)"),
        _f("key_scale_tokens", "int32_t", "Tk: 1 or ps"),
        _f("key_scale_channels", "int32_t", "Ck: 1 or D (int4: 1 or D / a power of two)"),
        _f("value_scale_tokens", "int32_t", "Tv: 1 or ps"),
        _f("value_scale_channels", "int32_t", "Cv: as Ck (int4: 2C, scales then mins)"),
        _f("format", "int32_t", "QSA_COLD_FORMAT_INT8 (0) or QSA_COLD_FORMAT_INT4"),
    ))

QSA_FORWARD_PARAMS = CStruct("QsaForwardParams", "One qsa_forward call (layouts: qsa_launch.h).", (
    _f("dims", "QsaDims"),
    _f("attrs", "QsaAttrs"),
    _f("dtype", "int32_t", "QsaDtype of every float tensor"),
    _f("num_splits", "int32_t", "decode split-K partitions; 0 = choose from dims and the SM count"),
    _f("selected_pages_elem_size", "int32_t", "1 (bool/uint8) or 4 (int32)"),
    _f("cold", "QsaColdDims", "read only when the cold pointers are set"),
    _f("query", "const void*"),
    _f("key", "const void*"),
    _f("value", "const void*"),
    _f("key_cache", "const void*"),
    _f("value_cache", "const void*"),
    _f("key_min", "const void*"),
    _f("key_max", "const void*"),
    _f("page_table", "const int32_t*"),
    _f("past_lens", "const int32_t*"),
    _f("token_budget", "const int32_t*"),
    _f("key_cache_int8", "const void*", "int8 [Pcold, Hkv, ps, D] (int4: uint8 [.., D/2]); NULL = no cold tier"),
    _f("value_cache_int8", "const void*", "as key_cache_int8"),
    _f("key_scale", "const void*", "float32 [Pcold, Hkv, Tk, Ck] (int4: float16)"),
    _f("value_scale", "const void*", "float32 [Pcold, Hkv, Tv, Cv] (int4: float16)"),
    _f("key_sub_bounds", "const void*", "uint8 [Ptot, Hkv, r, D]; read by two-level decode and (INT4) cold keys"),
    _f("output", "void*"),
    _f("selected_pages", "void*", "may be NULL"),
    _f("error_flags", "int32_t*", "QSA_FLAG_* bits, or NULL"),
))

QSA_APPEND_PARAMS = CStruct(
    "QsaAppendParams",
    "Writes S new tokens' K/V into their page slots (slot = past_lens[b] + i, page = page_table[b, slot / ps])\n"
    "and recomputes key_min/key_max of every page it touched from the page's valid keys. Does not change\n"
    "past_lens.", (
        _f("dims", "QsaDims", "num_heads and num_meta_pages are not read"),
        _f("dtype", "int32_t"),
        _f("key", "const void*", "[B, Hkv, S, D]"),
        _f("value", "const void*", "[B, Hkv, S, D]"),
        _f("key_cache", "void*"),
        _f("value_cache", "void*"),
        _f("key_min", "void*"),
        _f("key_max", "void*"),
        _f("page_table", "const int32_t*"),
        _f("past_lens", "const int32_t*"),
        _f("error_flags", "int32_t*", "QSA_FLAG_* bits, or NULL"),
    ))

STRUCTS: tuple[CStruct, ...] = (QSA_DIMS, QSA_ATTRS, QSA_COLD_DIMS, QSA_FORWARD_PARAMS, QSA_APPEND_PARAMS)


def pointer_fields(struct: CStruct) -> tuple[str, ...]:
    """The struct's pointer fields in order (the buffers a call passes)."""
    return tuple(f.name for f in struct.fields if f.ctype.endswith("*"))


def render_c() -> str:
    """The structs as C (``typedef struct``), in definition order."""
    out = []
    for s in STRUCTS:
        out += [f"/* {line} */" for line in s.doc.splitlines()]
        out.append(f"typedef struct {s.name} {{")
        for f in s.fields:
            decl = f"    {f.ctype} {f.name};"
            out.append(f"{decl} /* {f.doc} */" if f.doc else decl)
        out += [f"}} {s.name};", ""]
    return "\n".join(out)
