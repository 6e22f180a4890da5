"""The C++ side reads the op definition from a header generated from schema.py (STYLE principle 7)."""

import re

from tinyserve_dev import schema_header
from tinyserve_trt.ops import schema

from .conftest import ROOT


def test_generated_header_is_up_to_date():
    assert schema_header.HEADER_PATH.read_text() == schema_header.render(), \
        "plugins/generated/qsa_schema.h is stale: run `python -m tinyserve_dev.schema_header`"


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


def test_policy_enum_values_match_schema_order():
    text = schema_header.render()
    for i, name in enumerate(schema.POLICIES):
        assert f"#define QSA_POLICY_{name.upper()} {i}" in text
    for i, name in enumerate(schema.GROUP_REDUCTIONS):
        assert f"#define QSA_GROUP_REDUCE_{name.upper()} {i}" in text
