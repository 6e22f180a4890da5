"""PageBlock: one KV page of every layer, and its byte encoding as one store entry.

An entry is one contiguous block (all layers together: one large sequential read or
write instead of a small one per layer, as vLLM's offloading connector found)::

  header  64 bytes: magic b"TSKV", version u16, flags u16 (bit 0: has a parent),
          identity digest 16s, page hash 16s, payload length u64, blake2b-128 of the payload 16s
  payload tokens int64 [ps] | parent hash 16s (zeros without one) | num_valid int32 [L]
          | K [L, Hkv, ps, D] | V [L, Hkv, ps, D] | key_min [L, Hkv, D] | key_max [L, Hkv, D]
          | key_sub_bounds uint8 [L, Hkv, ps/sub, D] (two-level pools only)

K/V/min/max are in the identity's dtype. :func:`decode` checks everything a reader must
not trust (magic, version, identity, hash, length, checksum) and raises
:class:`BadEntry` with the reason; it never returns a page it could not verify.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from tinyserve_trt.runtime.kvstore.identity import StoreIdentity

MAGIC = b"TSKV"
VERSION = 1
HEADER = struct.Struct("<4sHH16s16sQ16s")  # 64 bytes
HEADER_SIZE = HEADER.size


class BadEntry(ValueError):
    """A stored entry that must not be served (truncated, corrupt, foreign, wrong version)."""


@dataclass(frozen=True, eq=False)
class PageBlock:
    """One page's content, every layer (host arrays; the store copies nothing it is given).

    tokens    [ps] int64: the page's token ids (a match re-checks them, as the pool's cache does)
    parent    the previous page's chain hash, None for a first page
    num_valid [L] int32 tokens written per layer (a stored page is full: ps)
    k, v      [L, Hkv, ps, D] pool dtype
    key_min, key_max [L, Hkv, D] pool dtype
    sub       [L, Hkv, ps/sub_page_size, D] uint8, or None for a single-level pool
    """

    tokens: np.ndarray
    parent: bytes | None
    num_valid: np.ndarray
    k: np.ndarray
    v: np.ndarray
    key_min: np.ndarray
    key_max: np.ndarray
    sub: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its entry (header included)."""
        arrays = (self.tokens, self.num_valid, self.k, self.v, self.key_min, self.key_max, self.sub)
        return HEADER_SIZE + 16 + sum(a.nbytes for a in arrays if a is not None)


def _shapes(identity: StoreIdentity) -> dict:
    L, h, ps, d = identity.num_layers, identity.num_kv_heads, identity.page_size, identity.head_dim
    dt = np.dtype(identity.dtype)
    out = {"tokens": ((ps,), np.int64), "num_valid": ((L,), np.int32), "k": ((L, h, ps, d), dt),
           "v": ((L, h, ps, d), dt), "key_min": ((L, h, d), dt), "key_max": ((L, h, d), dt)}
    if identity.sub_page_size:
        out["sub"] = ((L, h, ps // identity.sub_page_size, d), np.uint8)
    return out


def entry_size(identity: StoreIdentity) -> int:
    """Bytes of one entry of ``identity`` (header included)."""
    arrays = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in _shapes(identity).values())
    return HEADER_SIZE + 16 + arrays


def check_block(block: PageBlock, identity: StoreIdentity) -> None:
    """ValueError unless ``block``'s arrays have ``identity``'s shapes and dtypes."""
    for name, (shape, dtype) in _shapes(identity).items():
        arr = getattr(block, name)
        if arr is None or tuple(arr.shape) != shape or arr.dtype != dtype:
            got = None if arr is None else (tuple(arr.shape), str(arr.dtype))
            raise ValueError(f"page block {name} is {got}, the store holds {shape} {np.dtype(dtype).name}")
    if identity.sub_page_size == 0 and block.sub is not None:
        raise ValueError("page block has sub-page bounds; the store's pool has none")
    if block.parent is not None and len(block.parent) != 16:
        raise ValueError("parent hash must be 16 bytes")


def encode(block: PageBlock, page_hash: bytes, identity: StoreIdentity) -> bytes:
    """The entry bytes (header + payload) of ``block`` under ``page_hash``."""
    check_block(block, identity)
    parts = [np.ascontiguousarray(block.tokens).tobytes(), block.parent or bytes(16),
             np.ascontiguousarray(block.num_valid).tobytes()]
    parts += [np.ascontiguousarray(getattr(block, n)).tobytes() for n in ("k", "v", "key_min", "key_max")]
    if block.sub is not None:
        parts.append(np.ascontiguousarray(block.sub).tobytes())
    payload = b"".join(parts)
    flags = 1 if block.parent is not None else 0
    checksum = hashlib.blake2b(payload, digest_size=16).digest()
    return HEADER.pack(MAGIC, VERSION, flags, identity.digest, page_hash, len(payload), checksum) + payload


def check_header(raw: bytes, page_hash: bytes, identity: StoreIdentity, total: int | None = None) -> int:
    """The payload length an entry's header announces; BadEntry for a header that is not ours.
    ``total``: the entry's whole size when known (a file's), checked against the header."""
    if len(raw) < HEADER_SIZE:
        raise BadEntry(f"truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
    magic, version, _flags, ident, h, length, _ = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise BadEntry("not a page entry (bad magic)")
    if version != VERSION:
        raise BadEntry(f"entry format version {version}, this reader knows {VERSION}")
    if ident != identity.digest:
        raise BadEntry("entry of another package or pool format (identity differs)")
    if h != page_hash:
        raise BadEntry("entry holds another page hash than its name says")
    if length != entry_size(identity) - HEADER_SIZE:
        raise BadEntry(f"payload length {length} does not fit this pool's page ({entry_size(identity) - HEADER_SIZE})")
    if total is not None and total != HEADER_SIZE + length:
        raise BadEntry(f"truncated entry ({total} of {HEADER_SIZE + length} bytes)")
    return length


def decode(raw: bytes, page_hash: bytes, identity: StoreIdentity) -> PageBlock:
    """The verified PageBlock of entry bytes ``raw``; BadEntry (with why) otherwise."""
    length = check_header(raw, page_hash, identity, total=len(raw))
    _, _, flags, _, _, _, checksum = HEADER.unpack_from(raw)
    payload = memoryview(raw)[HEADER_SIZE:HEADER_SIZE + length]
    if hashlib.blake2b(payload, digest_size=16).digest() != checksum:
        raise BadEntry("checksum mismatch (corrupt entry)")
    out, off = {}, 0
    for name, (shape, dtype) in _shapes(identity).items():
        if name == "num_valid":  # the parent hash sits between tokens and num_valid
            parent = bytes(payload[off:off + 16])
            off += 16
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out[name] = np.frombuffer(payload[off:off + n], dtype).reshape(shape).copy()
        off += n
    return PageBlock(parent=parent if flags & 1 else None, **out)
