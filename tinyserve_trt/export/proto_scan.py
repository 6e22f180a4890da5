"""Read an ONNX file without reading its weights (issue #30).

``onnx.load`` parses the whole file: a model whose weights are inline (torch's exporter writes
every model under 2 GB as one protobuf) costs the file's bytes plus the parsed message - 2x its
weights before anything has run, and ORT parsing the same file again for a session costs as
much. :func:`load_proto` walks the protobuf wire format over a memory map instead: every field
is copied except the ``raw_data`` of initializers over ``threshold`` bytes, which becomes an
external reference (``location`` = the model file itself, ``offset``, ``length``) into the file,
so the proto holds the graph and the small constants only, and ORT sessions built from it with
``weights.session_options(so, path.parent)`` read the weights in place. A model whose weights
are already external is returned as ``onnx.load(..., load_external_data=False)`` would.

Wire format (protobuf): a field is a varint key ``(number << 3) | wire_type`` then its value;
ModelProto.graph = 7, GraphProto.initializer = 5, TensorProto.raw_data = 9, all length-delimited.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import onnx

MODEL_GRAPH, GRAPH_INITIALIZER, TENSOR_RAW_DATA = 7, 5, 9
LENGTH_DELIMITED = 2


class ScanError(ValueError):
    """The bytes are not a well-formed protobuf message (truncated, a bad wire type)."""


def _varint(buf, i: int, end: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= end or shift > 63:
            raise ScanError(f"truncated varint at byte {i}")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, wire type, field start, payload start, field end) of each field in [start, end)."""
    i = start
    while i < end:
        key, j = _varint(buf, i, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, stop = _varint(buf, j, end)
        elif wire == 1:
            stop = j + 8
        elif wire == 5:
            stop = j + 4
        elif wire == LENGTH_DELIMITED:
            n, j = _varint(buf, j, end)
            stop = j + n
        else:
            raise ScanError(f"unsupported wire type {wire} at byte {i}")
        if stop > end:
            raise ScanError(f"field {number} at byte {i} runs past the end of its message ({stop} > {end})")
        yield number, wire, i, j, stop
        i = stop


def _length_delimited(number: int, payload: bytes) -> bytes:
    out, n = bytearray(), (number << 3) | LENGTH_DELIMITED
    for value in (n, len(payload)):
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out) + payload


def _initializer(buf, start: int, end: int, location: str, threshold: int) -> bytes:
    """A TensorProto's bytes with its ``raw_data`` replaced by a reference into the file."""
    kept, raw = bytearray(), None
    for number, wire, fs, ps, fe in _fields(buf, start, end):
        if number == TENSOR_RAW_DATA and wire == LENGTH_DELIMITED:
            raw = (ps, fe - ps)
        else:
            kept += buf[fs:fe]
    if raw is None or raw[1] <= threshold:
        return bytes(buf[start:end])
    t = onnx.TensorProto()
    t.ParseFromString(bytes(kept))
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(raw[0])), ("length", str(raw[1]))):
        t.external_data.add(key=key, value=value)
    return t.SerializeToString()


def _graph(buf, start: int, end: int, location: str, threshold: int) -> bytes:
    out = bytearray()
    for number, wire, fs, ps, fe in _fields(buf, start, end):
        if number == GRAPH_INITIALIZER and wire == LENGTH_DELIMITED and fe - ps > threshold:
            out += _length_delimited(GRAPH_INITIALIZER, _initializer(buf, ps, fe, location, threshold))
        else:
            out += buf[fs:fe]
    return bytes(out)


def load_proto(path: str | Path, threshold: int = 1024) -> onnx.ModelProto:
    """The model at ``path`` with every inline initializer of more than ``threshold`` bytes left
    in the file as an external reference; ScanError for bytes that are not a protobuf message,
    ``google.protobuf.message.DecodeError`` for one that is not a ModelProto."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise ScanError("empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                out = bytearray()
                for number, wire, fs, ps, fe in _fields(buf, 0, len(buf)):
                    if number == MODEL_GRAPH and wire == LENGTH_DELIMITED:
                        out += _length_delimited(MODEL_GRAPH, _graph(buf, ps, fe, path.name, threshold))
                    else:
                        out += buf[fs:fe]
            finally:
                buf.release()
    proto = onnx.ModelProto()
    proto.ParseFromString(bytes(out))
    return proto


__all__ = ["ScanError", "load_proto"]
