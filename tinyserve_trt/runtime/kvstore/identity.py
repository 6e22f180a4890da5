"""StoreIdentity: the package and pool format a stored page belongs to.

A page's K/V are a function of the model (its weights and rewrite: the package
manifest, which carries the source model's sha256 and every export choice), of the
tokens (the chained page hash) and of the pool's format (page size, dtype, sub-page
bounds). The identity's 16-byte :attr:`digest` is written in every entry header and
names the store's directory, so a store never serves another package's pages.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from tinyserve_trt.runtime.config import KV_DTYPES

FORMAT = "hot-v1"  # pages stored as the pool's hot K/V (pool dtype), min/max, sub-page codes, valid counts


@dataclass(frozen=True)
class StoreIdentity:
    """package: hex digest of the package (its manifest and model file sizes); the rest is
    the pool geometry an entry's payload is laid out in."""

    package: str
    num_layers: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    dtype: str
    sub_page_size: int = 0
    format: str = FORMAT

    def __post_init__(self):
        if not isinstance(self.package, str) or not self.package:
            raise ValueError(f"package must be a non-empty digest string, got {self.package!r}")
        for name in ("num_layers", "num_kv_heads", "page_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.sub_page_size, int) or self.sub_page_size < 0 or (
                self.sub_page_size and self.page_size % self.sub_page_size):
            raise ValueError(f"sub_page_size must be 0 or divide page_size, got {self.sub_page_size!r}")

    @property
    def digest(self) -> bytes:
        """16 bytes naming this identity (entry headers, the store directory)."""
        text = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=16).digest()

    @classmethod
    def of_package(cls, package, *, dtype: str | None = None, sub_page_size: int | None = None) -> StoreIdentity:
        """The identity of ``package`` (a ``ModelPackage``) served over a pool of ``dtype``
        (default the package's). Hashes the manifest (source sha256, export settings, validation)
        and the model files' sizes - not the weights themselves (hundreds of MB at every start)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(package.manifest, sort_keys=True, default=str).encode())
        for name in ("model.onnx", "model.onnx.data"):
            path = package.path / name
            h.update(f"{name}:{path.stat().st_size if path.is_file() else -1};".encode())
        return cls(package=h.hexdigest(), num_layers=package.num_layers, num_kv_heads=package.num_kv_heads,
                   page_size=package.page_size, head_dim=package.head_dim, dtype=dtype or package.dtype,
                   sub_page_size=package.sub_page_size if sub_page_size is None else sub_page_size)
