"""The C++ side reads the op definition from a header generated from schema.py (STYLE principle 7)."""

import dataclasses
import re

from tinyserve_dev import schema_header
from tinyserve_trt.ops import schema

from .conftest import ROOT


def test_generated_header_is_up_to_date():
    # the schema header (the kernels, the plugin and the CPU node include this one copy), the launch structs
    for path, text in schema_header.generated().items():
        assert path.read_text() == text, \
            f"{path.relative_to(ROOT)} is stale: run `python -m tinyserve_dev.schema_header`"
    assert schema_header.main(["--check"]) == 0


def test_moving_an_input_or_changing_a_default_changes_the_header(monkeypatch):
    """The schema is the one place to edit: the header every C++ consumer includes follows it."""
    before = schema_header.render()
    inputs = list(schema.INPUTS)
    sub = inputs.pop(schema.INPUT_NAMES.index("key_sub_bounds"))
    inputs.insert(schema.NUM_REQUIRED_INPUTS, sub)  # version 1 of the CPU node's order
    monkeypatch.setattr(schema, "INPUTS", tuple(inputs))
    monkeypatch.setattr(schema, "INPUT_NAMES", tuple(t.name for t in inputs))
    moved = schema_header.render()
    assert "#define QSA_IN_KEY_SUB_BOUNDS 10\n" in moved and "#define QSA_IN_KEY_CACHE_INT8 11\n" in moved
    assert "#define QSA_FIRST_COLD_INPUT 11\n" in moved
    assert '"token_budget", "key_sub_bounds", "key_cache_int8"' in moved
    monkeypatch.undo()
    attrs = [dataclasses.replace(a, default=3) if a.name == "sink_pages" else a for a in schema.ATTRIBUTES]
    monkeypatch.setattr(schema, "ATTRIBUTES", tuple(attrs))
    changed = schema_header.render()
    assert "#define QSA_ATTR_SINK_PAGES_DEFAULT 3\n" in changed and changed != before
    monkeypatch.undo()
    assert schema_header.render() == before


def _code(paths) -> str:
    return "\n".join(re.sub(r"//[^\n]*", "", p.read_text()) for p in paths)  # comments may name things


def test_cpu_node_reads_positions_names_and_defaults_from_the_header():
    """No C++ of the CPU node spells an input position, attribute name or default itself."""
    csrc = ROOT / "tinyserve_trt" / "cpu" / "csrc"
    src = _code(p for p in sorted(csrc.iterdir()) if p.suffix in (".h", ".cpp")
                and p.name != "qsa_append.cpp")  # the append kernel has its own (non-op) inputs
    assert not re.findall(r"\bin\[\d+\]", src), "an input indexed by a number: use QSA_IN_*"
    for a in schema.ATTRIBUTES:
        assert f'"{a.name}"' not in src, f"{a.name!r} hard-coded in the CPU node; use QSA_ATTR_*_NAME"
        assert f"QSA_ATTR_{a.name.upper()}_NAME" in src, f"the CPU node does not read attribute {a.name!r}"
    for t in schema.INPUTS:
        assert f'"{t.name}"' not in src, f"input name {t.name!r} hard-coded; use QSA_INPUT_NAMES"
    assert "QSA_INPUT_NAMES" in src and "QSA_ATTR_SINK_PAGES_DEFAULT" in src


def test_header_lists_every_attribute_in_schema_order():
    text = schema_header.render()
    listed = re.findall(r'X\(\w+, "(\w+)", (\d)\)', text)
    kinds = {"int": "0", "float": "1", "string": "2"}
    assert listed == [(a.name, kinds[a.type]) for a in schema.ATTRIBUTES]


def test_plugin_fields_come_from_the_header_only():
    """The plugin spells no attribute name itself: every field name is a QSA_ATTR_*_NAME macro."""
    src = "\n".join(p.read_text() for p in sorted((ROOT / "plugins" / "tensorrt").glob("*.cpp")))
    src = re.sub(r"//[^\n]*", "", src)  # comments may name the op
    for a in schema.ATTRIBUTES:
        assert f'"{a.name}"' not in src, f"{a.name!r} hard-coded in the plugin; use QSA_ATTR_*_NAME"
        assert f"QSA_ATTR_{a.name.upper()}_NAME" in src, f"plugin does not handle attribute {a.name!r}"
    assert "QSA_FOR_EACH_ATTRIBUTE(" in src  # creator's getFieldNames is generated from the schema
    for literal in ("QueryAwareSparseAttention", '"tinyserve"'):
        assert literal not in src.replace("QueryAwareSparseAttentionPlugin", "")


def test_policy_enum_values_are_the_registry_native_ids():
    """The header's policy ids are the registry's native_ids; a policy without one is not in it."""
    from tinyserve_trt.ops import policies

    text = schema_header.render()
    for name in schema.POLICIES:
        if name in schema.POLICY_IDS:
            assert f"#define QSA_POLICY_{name.upper()} {schema.POLICY_IDS[name]}\n" in text
        else:
            assert f"QSA_POLICY_{name.upper()} " not in text and f'"{name}"' not in text
    assert f"#define QSA_NUM_POLICIES {len(schema.POLICY_IDS)}\n" in text
    assert schema.POLICY_IDS == policies.native_ids()
    for i, name in enumerate(schema.GROUP_REDUCTIONS):
        assert f"#define QSA_GROUP_REDUCE_{name.upper()} {i}" in text


def _policy_cases(src: str, pattern: str) -> set[str]:
    return {m.lower() for m in re.findall(pattern, src)}


def test_native_kernels_implement_exactly_the_registry_policies():
    """qsa_api.cu's decode switch and the CPU node's policy check accept exactly the policies whose
    ``native_kernels`` name them: a registry that claims a kernel the C lacks (or the reverse) fails."""
    from tinyserve_trt.cpu import node
    from tinyserve_trt.cuda import library
    from tinyserve_trt.ops import policies

    api = _code([ROOT / "plugins" / "kernels" / "qsa_api.cu"])
    switch = api[api.index("bool decode_policy_implemented"):]
    switch = switch[:switch.index("}")]
    assert _policy_cases(switch, r"case QSA_POLICY_(\w+):") == set(policies.implemented_by("cuda"))
    cpu = _code([ROOT / "tinyserve_trt" / "cpu" / "csrc" / "qsa_ort_kernel.h"])  # both CPU ops' attribute check
    check = cpu[cpu.index("if (policy != kPolicies"):]
    check = check[:check.index(")\n")]
    assert _policy_cases(check, r"kPolicies\[QSA_POLICY_(\w+)\]") == set(policies.implemented_by("cpu"))
    assert node.POLICIES == policies.implemented_by("cpu") and library.CUDA_POLICIES == policies.implemented_by("cuda")


def test_launch_structs_are_generated_from_the_ctypes_definition():
    """qsa_launch.h types no struct itself; the ctypes mirror and the C structs share launch_abi."""
    from tinyserve_trt.cuda import launch_abi, library

    launch = _code([ROOT / "plugins" / "kernels" / "qsa_launch.h"])
    assert "typedef struct" not in re.sub(r"/\*.*?\*/", "", launch, flags=re.S)
    assert '#include "../generated/qsa_launch_structs.h"' in launch
    text = schema_header.render_launch_structs()
    for struct in launch_abi.STRUCTS:
        cls = getattr(library, struct.name)
        assert [n for n, _ in cls._fields_] == [f.name for f in struct.fields]
        assert f"typedef struct {struct.name} {{" in text


SHARED_MATH = ("qsa_math.h", "qsa_select_math.h")  # plugins/kernels: the C++ math every target includes


def _cpp_sources_but_the_math() -> dict[str, str]:
    """The CUDA kernels' and the CPU node's C++ sources (file name -> code without comments), the
    shared math headers left out."""
    sources = [p for p in (*(ROOT / "plugins" / "kernels").iterdir(),
                           *(ROOT / "tinyserve_trt" / "cpu" / "csrc").iterdir())
               if p.suffix in (".h", ".cu", ".cuh", ".cpp") and p.name not in SHARED_MATH]
    return {p.name: re.sub(r"/\*.*?\*/", "", _code([p]), flags=re.DOTALL) for p in sources}


def test_cold_and_bound_decode_exist_once_per_language():
    """The C++ decode of the cold format and the sub-page bounds is qsa_math.h's alone (the CUDA
    kernels, their emulation and the CPU node include that one file): no other C++ source
    extracts a nibble or spells the 1/15 level step. Python's rule: ops/cold_codec.py,
    ops/fine_bounds.py."""
    code = _cpp_sources_but_the_math()
    for name, text in code.items():
        for pattern in (r"&\s*15\b", r">>\s*4\b", r"1(\.0f?)?\s*/\s*(15|kLevels)", r"__f(mul|add|sub)_rn\([^)]*kInv"):
            assert not re.search(pattern, text), f"{name} decodes itself ({pattern!r}): call qsa_math.h"
    assert "qsa_math::" in code["qsa_common.cuh"] and "qsa_math::" in code["qsa_cold.h"]
    assert "qsa_math::" in code["qsa_select_two_level.cu"] and "qsa_math::" in code["qsa_decode_math.h"]


# A source that scores or selects by itself: the Quest term (q * lo / q * hi, the relu split),
# a NaN-propagating max (x != x), the order key's sign bit, budget arithmetic, the forced range,
# the candidate share's product.
_SCORE_OR_RULE = (r"\bq\w*(\[[^]]*\])?\s*\*\s*(lo|hi)\w*\b", r"\?\s*q\w*(\[[^]]*\])?\s*:\s*0", r"\b(\w+)\s*!=\s*\1\b",
                  r"0x80000000", r"budget\w*(\[[^]]*\])?\s*/", r"[-<]\s*[\w.]*\b(sink|recent)_pages\b",
                  r"\b(sink|recent)_pages\s*[-+]", r"candidate_share\s*\*|\*\s*[\w.]*candidate_share", r"\bfloorf?\(")


def test_page_scoring_and_the_selection_rule_exist_once():
    """The page score's term, the group combination, the keep order (ties, NaN) and the keep/drop
    rule (budget, sink and recent pages, two-level candidates) are qsa_select_math.h's alone
    (issue #32): the CUDA selection kernels and the CPU node call it, and no other C++ source
    spells any of them. Python's rule: ops/policies.py, ops/two_level.py."""
    code = _cpp_sources_but_the_math()
    code.pop("qsa_append.cpp")  # the append kernel encodes bounds (fine_bounds.encode's floor), never scores
    for name, text in code.items():
        for pattern in _SCORE_OR_RULE:
            assert not re.search(pattern, text), f"{name} scores or selects itself ({pattern!r}): call qsa_select_math.h"
    uses = {"qsa_topk.cuh": ("bound_madd", "query_pos", "group_combine", "order_key"),
            "qsa_select.cu": ("page_rule",), "qsa_select_two_level.cu": ("sub_page_rule",),
            "qsa_vector.h": ("bound_madd",),
            "qsa_decode_math.h": ("query_pos", "group_combine", "page_rule", "sub_page_rule", "level_weight_lo"),
            "qsa_topk.h": ("order_key",)}
    for name, calls in uses.items():
        for call in calls:
            assert f"qsa_math::{call}" in code[name], f"{name} does not call qsa_math::{call}"


def test_the_scoring_patterns_catch_what_the_sources_wrote_before():
    """The patterns above find the forms the kernels and the CPU node spelled before issue #32."""
    before = ["t += max_nan(qq * lo[e], qq * hi[e]);", "s_.qpos[i] = q_[i] > 0.0f ? q_[i] : 0.0f;",
              "if (f != f) return 0u;", "u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);",
              "const int keep_n = max(budget / ps, forced);", "int64_t keep_n = std::max(budget_tokens / p_.ps, n);",
              "bool forced(int64_t i) const { return i < a_.sink_pages || i >= n_ - a_.recent_pages; }",
              "row.recent_start = max(row.n - p.attrs.recent_pages, row.n_sink);",
              "float share_n = a_.candidate_share * static_cast<float>(n_);",
              "int(floorf(__fmul_rn(p.attrs.candidate_share, float(n))))"]
    for line in before:
        assert any(re.search(pattern, line) for pattern in _SCORE_OR_RULE), line
