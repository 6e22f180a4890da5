import numpy as np
import onnxruntime as ort
import pytest

from tinyserve_trt.ops import schema
from tinyserve_trt.ops.node import make_op_model

_SESSIONS = {}


def run_op(case: dict, attrs: schema.OpAttributes, dtype: str):
    """Run the op's ONNX function in ORT CPU on ``case``; sessions cached per (attrs, dtype)."""
    key = (attrs, dtype)
    if key not in _SESSIONS:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        _SESSIONS[key] = ort.InferenceSession(make_op_model(dtype, attrs).SerializeToString(), so,
                                              providers=["CPUExecutionProvider"])
    feeds = {n: case[n] for n in schema.node_input_names(two_level=attrs.two_level) if n}
    return _SESSIONS[key].run(None, feeds)


