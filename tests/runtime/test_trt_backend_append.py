"""TrtBackend's K/V append: the stream-ordered ``library.append_kv`` binding, no harness.

On CPU against the stand-ins of ``trt_fakes`` (the fake append applies the numpy
reference at the addresses the backend passes, and sets the kernel's error flag for a
page id outside the pool, as ``qsa_append_kv`` does).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.runtime.trt_fakes import REQUESTS, _appended, fake_backend, greedy  # noqa: E402,F401
from tinyserve_trt.cuda.library import KernelError  # noqa: E402
from tinyserve_trt.runtime.backends import trt as trt_backend  # noqa: E402


def test_backend_imports_nothing_from_the_dev_harness():
    tree = ast.parse(Path(trt_backend.__file__).read_text())
    modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m.startswith("tinyserve_dev")]


def test_appends_go_through_the_library_binding(fake_backend):
    backend, pool = fake_backend(cuda_graphs=False)
    greedy(backend, pool, REQUESTS)
    assert _appended and int(backend._appender.flags[0]) == 0


def test_bad_page_id_flagged_by_the_append_fails_the_step(fake_backend, monkeypatch):
    backend, pool = fake_backend(cuda_graphs=False)
    real = backend.pool.physical_table

    def corrupt(table):
        out = real(table).copy()
        out[:, 0] = 10_000  # no such page
        return out

    monkeypatch.setattr(backend.pool, "physical_table", corrupt)
    with pytest.raises(KernelError, match="page id outside the pools"):
        greedy(backend, pool, REQUESTS)
