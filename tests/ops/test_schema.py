"""The schema is the single source: consumers agree with it, bad values are refused."""

import onnx
import pytest

from tinyserve_trt.ops import registered, schema
from tinyserve_trt.ops.node import make_node, make_op_model, node_attributes


def test_policy_registry_is_the_schema_source():
    from tinyserve_trt.ops import policies

    assert schema.POLICIES == registered() and schema.attribute("policy").choices == registered()
    assert schema.TWO_LEVEL_POLICIES == policies.two_level() == ("query_aware",)
    assert schema.POLICY_IDS == policies.native_ids()


@pytest.mark.parametrize("attrs", [dict(name="query_aware"), dict(name="x", native_id=0),
                                   dict(name="x", native_kernels=("cpu",)),
                                   dict(name="x", native_id=99, native_kernels=("gpu",))])
def test_register_refuses_a_repeated_name_or_id_or_a_kernel_without_id(attrs):
    from tinyserve_trt.ops import policies

    cls = type("Bad", (policies.Window,), attrs)
    with pytest.raises(ValueError):
        policies.register(cls)
    assert "x" not in registered()


def test_node_carries_schema_and_plugin_attributes():
    node = make_node(list(schema.INPUT_NAMES[:10]), ["o"], schema.OpAttributes(policy="window", sink_pages=2))
    names = {a.name for a in node.attribute}
    assert names == {a.name for a in schema.ATTRIBUTES} | set(schema.PLUGIN_ATTRIBUTES)
    assert (node.domain, node.op_type) == (schema.DOMAIN, schema.OP_TYPE)
    assert node_attributes(node) == schema.OpAttributes(policy="window", sink_pages=2)
    assert node.overload == "window"


def test_function_signature_matches_schema():
    fn = make_op_model().functions[0]
    assert tuple(fn.input) == schema.INPUT_NAMES and tuple(fn.output) == schema.OUTPUT_NAMES
    assert {a.name for a in fn.attribute_proto} == {a.name for a in schema.ATTRIBUTES}
    assert (fn.domain, fn.name) == (schema.DOMAIN, schema.OP_TYPE)


@pytest.mark.parametrize("kwargs", [dict(policy="nope"), dict(sink_pages=-1), dict(recent_pages=0),
                                    dict(scale=-1.0), dict(group_reduce="mean"), dict(sink_pages=1.5)])
def test_bad_attributes_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        schema.OpAttributes(**kwargs)


def test_wrong_input_count_refused():
    with pytest.raises(ValueError, match="inputs"):
        make_node(["q", "k"], ["o"])


def test_one_function_per_overload():
    m = make_op_model()
    extra = make_node(list(schema.INPUT_NAMES[:10]), ["o2"], schema.OpAttributes(policy="dense"))
    m.graph.node.append(extra)
    from tinyserve_trt.ops.node import attach_functions
    attach_functions(m)
    assert sorted(f.overload for f in m.functions) == ["dense", "query_aware"]
    assert onnx.checker.check_model(m) is None


def test_bad_dtype_refused():
    with pytest.raises(ValueError, match="dtype"):
        make_op_model("int8")
