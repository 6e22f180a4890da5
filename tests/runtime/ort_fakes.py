"""A stand-in ``onnxruntime`` (session + IOBinding) and ``torch.cuda`` for OrtBackend tests on CPU.

The fake IOBinding records every bind (name, device type, pointer, shape) and the
fake session computes a toy model from the bytes at the bound addresses, whatever
the device type says: K/V from (token, position, layer), logits from the row's
cached keys read through the page table (cold pages, physical ids >= P,
dequantized from the bound INT8 pools, as the op). So a pool that was not bound,
bound stale, or not written on the "device" shows up as wrong logits. Device
tensors are torch CPU tensors (``fake_torch``: ``torch.device`` is the CPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import types

import numpy as np
import torch

from tinyserve_trt.ops import schema
from tinyserve_trt.ops.cold_codec import ColdCodec
from tinyserve_trt.runtime.backends.device_pages import COLD_ROLES, HOT_ROLES

LAYERS, HEADS, DIM, PAGE_SIZE, VOCAB = 2, 2, 4, 4, 16  # DIM even: INT4 packs channel pairs
COLD_TIER = dict(k_granularity="channel", v_granularity="token")
STEP_INPUTS = {"input_ids": "tensor(int32)", "position_ids": "tensor(int32)", "page_table": "tensor(int32)",
               "past_lens": "tensor(int32)", "token_budget": "tensor(int32)", "logits_index": "tensor(int64)"}
NP = {"tensor(int32)": np.int32, "tensor(int64)": np.int64, "tensor(float)": np.float32,
      "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


def _io(name, type_):
    return types.SimpleNamespace(name=name, type=type_, shape=None)


def layer_names(i: int) -> dict:
    return {r: f"{r}.{i}" for r in (*HOT_ROLES, *COLD_ROLES, "new_key", "new_value", "selected_pages")}


class FakeOrtValue:
    def __init__(self, array):
        self.array = array

    @classmethod
    def ortvalue_from_numpy(cls, array):
        return cls(array)


class FakeIOBinding:
    """Records binds: ``inputs``/``outputs`` name -> dict(device, ptr, shape, dtype), ``log``."""

    def __init__(self):
        self.inputs, self.outputs, self.log, self._keep = {}, {}, [], {}

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        self.log.append(("bind_input", name, device_type))
        self.inputs[name] = dict(device=device_type, device_id=device_id, ptr=buffer_ptr, shape=tuple(shape),
                                 dtype=np.dtype(element_type))

    def bind_cpu_input(self, name, array):
        self.log.append(("bind_cpu_input", name, "cpu"))
        self._keep[name] = array
        self.inputs[name] = dict(device="cpu", ptr=array.ctypes.data, shape=array.shape, dtype=array.dtype)

    def bind_ortvalue_input(self, name, value):
        self.log.append(("bind_ortvalue_input", name, "cpu"))
        a = value.array
        self.inputs[name] = dict(device="cpu", ptr=a.ctypes.data, shape=a.shape, dtype=a.dtype)

    def bind_output(self, name, device_type="cpu", device_id=0, element_type=None, shape=None, buffer_ptr=None):
        self.log.append(("bind_output", name, device_type))
        self.outputs[name] = dict(device=device_type, ptr=buffer_ptr, shape=shape,
                                  dtype=None if element_type is None else np.dtype(element_type))

    def clear_binding_outputs(self):
        self.outputs = {}

    def copy_outputs_to_cpu(self):
        return [o["array"] for o in self.outputs.values()]


class FakeSession:
    def __init__(self, model, so, providers, cold):
        """``cold``: False, or the package's cold format (True = int8): the cold inputs' types
        are ``schema.COLD_DTYPES`` of it, as an exported model declares them."""
        self.model, self.providers, self.runs = model, providers, 0
        self._inputs = [_io(n, t) for n, t in STEP_INPUTS.items()]
        self._outputs = [_io("logits", "tensor(float)")]
        cold_types = dict(zip(COLD_ROLES, schema.COLD_DTYPES["int8" if cold is True else cold or "int8"]))
        onnx_type = {"int8": "tensor(int8)", "uint8": "tensor(uint8)", "float32": "tensor(float)",
                     "float16": "tensor(float16)"}
        for i in range(LAYERS):
            roles = HOT_ROLES + (COLD_ROLES if cold else ())
            self._inputs += [_io(f"{r}.{i}", onnx_type[cold_types[r]] if r in cold_types else "tensor(float)")
                             for r in roles]
            self._outputs += [_io(f"new_key.{i}", "tensor(float)"), _io(f"new_value.{i}", "tensor(float)"),
                              _io(f"selected_pages.{i}", "tensor(bool)")]
        self.binding = None
        self.last_context = None

    def get_inputs(self):
        return self._inputs

    def get_outputs(self):
        return self._outputs

    def io_binding(self):
        self.binding = FakeIOBinding()
        return self.binding

    def _view(self, spec):
        size = int(np.prod(spec["shape"])) * spec["dtype"].itemsize
        return np.frombuffer((ctypes.c_char * size).from_address(spec["ptr"]), spec["dtype"]).reshape(spec["shape"])

    def run_with_iobinding(self, binding):
        self.runs += 1
        x = {name: self._view(spec) for name, spec in binding.inputs.items()}
        ids, pos, table, past = x["input_ids"], x["position_ids"], x["page_table"], x["past_lens"]
        last = x["logits_index"]
        b_rows, width = ids.shape
        out = {"logits": np.zeros((b_rows, 1, VOCAB), np.float32)}
        context = np.zeros(b_rows)
        for layer in range(LAYERS):
            grid = 0.5 * np.arange(HEADS)[:, None, None] + 0.125 * np.arange(DIM)
            key = ((ids + 0.25 * pos + layer)[:, None, :, None] + grid).astype(np.float32)
            out[f"new_key.{layer}"], out[f"new_value.{layer}"] = key, -key
            pages = -(-past // PAGE_SIZE)
            out[f"selected_pages.{layer}"] = np.broadcast_to(
                np.arange(table.shape[1]) < pages[:, None, None], (b_rows, HEADS, table.shape[1]))
            cache = x[f"key_cache.{layer}"]
            if f"key_cache_int8.{layer}" in x:  # physical ids >= P are cold: dequantized, as the op
                pool = x[f"key_cache_int8.{layer}"]
                codec = ColdCodec("int4" if pool.dtype == np.uint8 else "int8")  # the format is the pool's dtype
                P = cache.shape[0]  # INT4 keys read their page's bounds (by physical id)
                codes = x.get(f"key_sub_bounds.{layer}")  # two-level: INT4 keys on the sub-page codes
                cold = codec.dequantize_keys(pool, x[f"key_scale.{layer}"], x[f"key_min.{layer}"][P:],
                                             x[f"key_max.{layer}"][P:], sub_codes=None if codes is None else codes[P:])
                cache = np.concatenate([cache, cold])
            for b in range(b_rows):
                slots = np.arange(past[b])
                context[b] += cache[table[b, slots // PAGE_SIZE], 0, slots % PAGE_SIZE, 0].sum()
        self.last_context = context
        rows = np.arange(b_rows)
        phase = ids[rows, last] + 0.1 * pos[rows, last] + 1e-3 * context
        out["logits"][...] = np.cos(0.37 * np.arange(VOCAB) * (1 + phase[:, None]))[:, None, :]
        for name, spec in binding.outputs.items():
            if spec["ptr"] is None:  # bound to "cpu" without a buffer: ORT allocates
                spec["array"] = np.ascontiguousarray(out[name])
                continue
            assert tuple(spec["shape"]) == out[name].shape, (name, spec["shape"], out[name].shape)
            self._view(spec)[...] = out[name]


def fake_ort(available=("CPUExecutionProvider",), device="CPU", fail_on=()):
    """A stand-in ``onnxruntime`` module; ``sessions`` lists every InferenceSession made
    (``fail_on``: EP names whose session creation raises, as ORT #27873 does)."""
    mod = types.ModuleType("onnxruntime")
    mod.__version__ = "0.0-fake"
    mod.sessions, mod.attempts = [], []
    mod.cold = False
    mod.get_available_providers = lambda: list(available)
    mod.get_device = lambda: device
    mod.SessionOptions = lambda: types.SimpleNamespace()
    mod.OrtValue = FakeOrtValue

    def session(model, so, providers):
        mod.attempts.append((model, providers))
        first = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
        if first in fail_on:
            raise RuntimeError("Could not find an implementation for QueryAwareSparseAttention(1) node\nmore")
        s = FakeSession(model, so, providers, mod.cold)
        mod.sessions.append(s)
        return s

    mod.InferenceSession = session
    return mod


class _Stream:
    cuda_stream = 7

    def synchronize(self):
        pass


def fake_torch() -> types.ModuleType:
    """Real torch, except that devices are the CPU and ``torch.cuda`` reports a GPU."""
    fake = types.ModuleType("torch")
    fake.__getattr__ = lambda name: getattr(torch, name)
    fake.device = lambda *args, **kwargs: torch.device("cpu")
    fake.cuda = types.SimpleNamespace(is_available=lambda: True, current_stream=lambda device=None: _Stream(),
                                      stream=lambda s: contextlib.nullcontext(), synchronize=lambda: None)
    return fake


def fake_package(path, cold_tier=None):
    model = path / "model.onnx"
    if not model.exists():
        model.write_bytes(b"fake")
    return types.SimpleNamespace(
        path=path, model_path=model, ort_model_path=lambda version: model, dtype="float32",
        layers=[layer_names(i) for i in range(LAYERS)], logits="logits", cold_tier=cold_tier,
        num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=PAGE_SIZE, vocab_size=VOCAB,
        manifest={}, max_context=256, inputs={r: r for r in STEP_INPUTS},
        spec=types.SimpleNamespace(ort_optimized=None, validation=None))  # no model.ort.onnx
