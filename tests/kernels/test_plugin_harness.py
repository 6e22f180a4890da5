"""The TensorRT plugin's IPluginV3 class, executed without a TensorRT library (CPU, g++).

``plugin_harness/harness.cpp`` drives ``QueryAwareSparseAttentionPlugin`` - the adapter between
TensorRT's interfaces and the TensorRT-free core that ``test_plugin_core.py`` tests in CI - through
the call sequence TensorRT uses (``getCreators`` -> creator fields -> output types and symbolic
shapes through an IExprBuilder -> format negotiation -> configure -> workspace -> clone -> enqueue
on the CPU-emulated kernels -> serialized fields -> recreate -> enqueue again, byte-identical).

It compiles only against TensorRT's own headers: set ``$TENSORRT_INCLUDE_DIR`` to a directory
holding ``NvInfer.h`` (an install's include/, or include/ of the public NVIDIA/TensorRT repository;
never committed here). Without it every test here skips. Randomized cases are held to the numpy
reference; a mutated copy of the field parsing or the output-shape formula must fail them.
"""

from __future__ import annotations

import pytest

from .plugin_harness import cases as pc

SKIP = "set TENSORRT_INCLUDE_DIR to TensorRT's include/ (NvInfer.h) to build the IPluginV3 harness"


@pytest.fixture(scope="module")
def include():
    inc = pc.trt_include()
    if inc is None:
        pytest.skip(SKIP)
    return inc


@pytest.fixture(scope="module")
def harness(include, tmp_path_factory):
    return pc.build_harness(tmp_path_factory.mktemp("plugin_harness"), include)


@pytest.fixture(scope="module")
def cases():
    return pc.all_cases()


def test_plugin_through_ipluginv3_equals_reference(harness, cases, tmp_path):
    pc.check_cover(cases)
    for c in cases:
        pc.check_case(harness, c, tmp_path / f"case{c['seed']}", ipluginv3=True)


@pytest.mark.parametrize("line", pc.BAD_FIELDS)
def test_bad_fields_are_refused_at_creation(harness, line, tmp_path):
    """createPlugin returns null with the reason logged through TensorRT's logger: the build stops."""
    r = pc.run_with_field(harness, line, tmp_path)
    assert r.returncode != 0 and "createPlugin(kBUILD) refused the fields" in r.stderr, r.stderr
    assert "plugin log: QueryAwareSparseAttention: " in r.stderr


@pytest.mark.parametrize("mutation", sorted(pc.MUTATIONS))
def test_a_mutated_plugin_fails_the_cases(include, mutation, cases, tmp_path):
    exe = pc.build_harness(tmp_path, include, pc.mutated_sources(mutation, tmp_path))
    failure = pc.first_failure(exe, cases, tmp_path, ipluginv3=True)
    assert failure is not None, f"the {mutation} mutant passed every case: the harness does not check it"
    print(f"{mutation}: {failure}")
