"""A model's weights stay on disk from load to package (issue #30).

protobuf cannot serialize a message over 2 GB, and a loaded copy of every weight per
stage is what made exports take 16x their weights in memory. So the exporter's protos
never hold the large weights: an initializer over ``EXTERNAL_OVER`` bytes is an external
reference (``location`` / ``offset`` / ``length``) into files of one folder - the source's
folder until the package's ``model.onnx.data`` is written, that folder after. ORT sessions
built from such a proto read them through ``session_options(weights_dir)``; the checker gets
:func:`check_copy`, which keeps every type and shape but no data.

Every layout exporters write reads the same way: one ``.data`` file (``onnx.save`` with
``all_tensors_to_one_file``, optimum), a file per tensor (torch's legacy exporter over
2 GB), weights inline in a small model. :func:`check_external_data` refuses, in one line,
a missing or truncated data file and a location outside the model's folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx

from .errors import InputError

EXTERNAL_OVER = 1024  # bytes; smaller initializers stay inline in the graph (as ORT does)
ALIGN = 4096  # offsets in model.onnx.data: page-aligned, so ORT can map them
COPY_CHUNK = 1 << 24
FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def external_info(t: onnx.TensorProto) -> dict | None:
    """``{location, offset, length}`` of an external tensor, None for an inline one."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in t.external_data}
    return dict(location=info.get("location", ""), offset=int(info.get("offset", 0) or 0),
                length=int(info["length"]) if info.get("length") else None)


def _inside(base: Path, location: str, tensor: str) -> Path:
    if not location or os.path.isabs(location) or ".." in Path(location).parts:
        raise InputError(f"initializer {tensor}: external data location {location!r} is not a file beside the model")
    return base / location


def check_external_data(proto: onnx.ModelProto, base_dir: Path, what: str) -> None:
    """One-line ``InputError`` for a missing, truncated or out-of-folder external data file."""
    sizes: dict[str, int] = {}
    for t in proto.graph.initializer:
        info = external_info(t)
        if info is None:
            continue
        path = _inside(Path(base_dir), info["location"], t.name)
        if info["location"] not in sizes:
            if not path.is_file():
                raise InputError(f"{what}: external data file missing ({info['location']}, initializer {t.name})")
            sizes[info["location"]] = path.stat().st_size
        length = info["length"] if info["length"] is not None else _nbytes(t)
        if info["offset"] + length > sizes[info["location"]]:
            raise InputError(f"{what}: external data file {info['location']} is truncated ({sizes[info['location']]} "
                             f"bytes; initializer {t.name} needs {info['offset'] + length})")


def _nbytes(t: onnx.TensorProto) -> int:
    n = int(np.prod(t.dims, dtype=np.int64))
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (n + 1) // 2
    return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def tensor_bytes(t: onnx.TensorProto) -> int:
    """Bytes of an initializer's data, wherever it is (no data is read)."""
    info = external_info(t)
    if info is not None:
        return info["length"] if info["length"] is not None else _nbytes(t)
    return len(t.raw_data) if t.HasField("raw_data") else _nbytes(t)


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise InputError(f"{path.name}: truncated (initializer data ends at byte {offset + len(data)})")
    return data


def inline_small(proto: onnx.ModelProto, base_dir: Path, max_bytes: int = EXTERNAL_OVER) -> None:
    """Read external initializers of at most ``max_bytes`` into the proto (shape constants, norms
    of a torch export that wrote every tensor to its own file), so graph passes can read them."""
    for t in proto.graph.initializer:
        info = external_info(t)
        if info is None or tensor_bytes(t) > max_bytes:
            continue
        data = _read(_inside(Path(base_dir), info["location"], t.name), info["offset"], tensor_bytes(t))
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
        t.raw_data = data


def read_array(t: onnx.TensorProto, base_dir: Path) -> np.ndarray:
    """An initializer's value, from its external file when it has one."""
    info = external_info(t)
    if info is None:
        return onnx.numpy_helper.to_array(t)
    data = _read(_inside(Path(base_dir), info["location"], t.name), info["offset"], tensor_bytes(t))
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    return np.frombuffer(data, dtype=dtype).reshape(tuple(t.dims)).copy()


def external_files(proto: onnx.ModelProto) -> list[str]:
    """Locations of the external data files, in first-use order."""
    out: dict[str, None] = {}
    for t in proto.graph.initializer:
        info = external_info(t)
        if info is not None:
            out.setdefault(info["location"])
    return list(out)


def bf16_to_f32(data: bytes) -> bytes:
    """Little-endian bfloat16 bytes as float32 bytes (exact: bf16 is float32's top half)."""
    return (np.frombuffer(data, "<u2").astype("<u4") << 16).tobytes()


def write_data(proto: onnx.ModelProto, base_dir: Path, dst: Path, threshold: int = EXTERNAL_OVER,
               upcast_bf16: bool = False, on_bytes=None) -> int:
    """Stream every initializer over ``threshold`` bytes - external (read from ``base_dir``) or
    inline - into the one file ``dst`` (page-aligned offsets) and point the proto at it; returns
    the bytes written. Holds one chunk at a time, never the weights. ``upcast_bf16``: bfloat16
    initializers are written as float32 (``bf16.py``). ``on_bytes(n)``: called as source bytes are copied."""
    written = 0
    with open(dst, "wb") as out:
        for t in proto.graph.initializer:
            info = external_info(t)
            size = tensor_bytes(t)
            if info is None and size <= threshold:
                continue
            widen = bf16_to_f32 if upcast_bf16 and t.data_type == onnx.TensorProto.BFLOAT16 else bytes
            pad = -out.tell() % ALIGN
            out.write(b"\0" * pad)
            offset = out.tell()
            if info is None:
                data = t.raw_data if t.HasField("raw_data") else onnx.numpy_helper.to_array(t).tobytes()
                out.write(widen(data))
                if on_bytes:
                    on_bytes(len(data))
                t.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
                    t.ClearField(field)
            else:
                src = _inside(Path(base_dir), info["location"], t.name)
                with open(src, "rb") as f:
                    f.seek(info["offset"])
                    left = size
                    while left:
                        block = f.read(min(COPY_CHUNK, left))  # even: whole bf16 values
                        if not block:
                            raise InputError(f"{info['location']}: truncated while copying initializer {t.name}")
                        out.write(widen(block))
                        left -= len(block)
                        if on_bytes:
                            on_bytes(len(block))
            if widen is not bytes:
                t.data_type, size = onnx.TensorProto.FLOAT, 2 * size
            written += size
            del t.external_data[:]
            t.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", dst.name), ("offset", str(offset)), ("length", str(size))):
                t.external_data.add(key=key, value=value)
    return written


def compacted(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A fresh copy of ``proto`` once :func:`write_data` has moved its inline weights out: the
    cleared bytes stay allocated as long as the old message lives (protobuf's arena frees only
    with the message), so the caller drops every reference to the old one (Qwen2.5-0.5B fp16:
    the packed QKV / gate-up projections, 0.45 GiB, held through validation)."""
    return onnx.load_model_from_string(proto.SerializeToString())


def check_copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` for ``onnx.checker``: each external initializer becomes a graph input of its type
    and shape (the checker would look for the data files relative to the working directory)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    kept, inputs = [], {i.name for i in copy.graph.input}
    for t in copy.graph.initializer:
        if external_info(t) is None:
            kept.append(t)
        elif t.name not in inputs:
            copy.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    return copy


def session_options(so, weights_dir: Path | None):
    """``so`` reading a proto's external weights from ``weights_dir`` (None: they are inline), with
    no CPU memory arena: what a run frees goes back to the system, so a half-precision model whose
    MatMuls run through float32 casts (the CPU EP has no fp16 GEMM) holds one cast at a time, not
    an arena grown to all of them (measured on Qwen2.5-0.5B fp16: 2.4 GiB peak vs 3.9 GiB)."""
    so.enable_cpu_mem_arena = False
    if weights_dir is not None:
        so.add_session_config_entry(FOLDER_KEY, str(Path(weights_dir).resolve()))
    return so


__all__ = ["EXTERNAL_OVER", "check_copy", "compacted", "check_external_data", "external_files", "external_info", "inline_small",
           "read_array", "session_options", "tensor_bytes", "write_data"]
