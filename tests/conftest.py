"""Session-scoped tiny model packages (random LLaMA / Qwen2 / GPT-2), built once per run.

Needs torch + transformers to build; tests that use them skip without.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

ARCHS = ("llama", "qwen2", "gpt2")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_packages(tiny_root):
    """arch -> (source model.onnx, package dir, manifest), built lazily and cached."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_models import build_package

    cache = {}

    def get(arch: str):
        if arch not in cache:
            src, pkg = build_package(arch, tiny_root)
            cache[arch] = (src, pkg, json.loads((pkg / "tinyserve.json").read_text()))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def llama(tiny_packages):
    return tiny_packages("llama")


@pytest.fixture(scope="session")
def llama_cold(llama, tiny_root):
    """(source, package with an INT8 cold tier, manifest) of the same tiny LLaMA as ``llama``."""
    from tests.tiny_models import build_cold_package

    src, _, manifest = llama
    root = tiny_root / "llama-cold"
    root.mkdir(exist_ok=True)
    pkg = build_cold_package(src, manifest, root)
    return src, pkg, json.loads((pkg / "tinyserve.json").read_text())


@pytest.fixture
def rng(request):
    """Fresh random inputs each run; the seed is printed on failure so a case can be replayed."""
    seed = np.random.SeedSequence().entropy % (1 << 32)
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
