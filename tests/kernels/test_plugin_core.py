"""The TensorRT plugin's logic, executed without TensorRT's headers (CPU, g++; CI runs this).

``plugin_harness/core_harness.cpp`` drives the plugin's TensorRT-free core
(``plugins/tensorrt/QsaPluginCore.h`` and ``QsaPluginFields.h``: field parsing and validation,
output types, the output-shape formula, the format rule, configure, workspace, shapes -> launch
dims, enqueue over the launch structs, serialized fields) through the call sequence TensorRT makes
of the IPluginV3 class, which is a thin adapter over that core: fields -> types and shapes (over
symbolic dims and over numbers) -> formats -> configure -> workspace -> clone -> enqueue on the
CPU-emulated kernels -> serialize -> recreate -> the same output. Randomized cases are held to the
numpy reference; a mutated copy of the field parsing or the output-shape formula must fail them.
The adapter itself is driven by ``test_plugin_harness.py``, which needs ``$TENSORRT_INCLUDE_DIR``.
"""

from __future__ import annotations

import re

import pytest

from .plugin_harness import cases as pc


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return pc.build_core_harness(tmp_path_factory.mktemp("core_harness"))


@pytest.fixture(scope="module")
def cases():
    return pc.all_cases()


def test_cases_cover_the_interface(cases):
    pc.check_cover(cases)


def test_core_through_the_call_sequence_equals_reference(harness, cases, tmp_path):
    for c in cases:
        pc.check_case(harness, c, tmp_path / f"case{c['seed']}", ipluginv3=False)


@pytest.mark.parametrize("line", pc.BAD_FIELDS)
def test_bad_fields_are_refused(harness, line, tmp_path):
    """parseFields refuses a field the schema does not allow, with a reason (the creator logs it)."""
    r = pc.run_with_field(harness, line, tmp_path)
    assert r.returncode != 0 and re.search(r"parseFields \(build\) refused the fields: \S", r.stderr), r.stderr


@pytest.mark.parametrize("mutation", sorted(pc.MUTATIONS))
def test_a_mutated_core_fails_the_cases(mutation, cases, tmp_path):
    exe = pc.build_core_harness(tmp_path, pc.mutated_sources(mutation, tmp_path))
    failure = pc.first_failure(exe, cases, tmp_path, ipluginv3=False)
    assert failure is not None, f"the {mutation} mutant passed every case: the core harness does not check it"
    print(f"{mutation}: {failure}")


def test_the_core_includes_no_tensorrt_header():
    """What CI compiles above is all of the plugin's logic but the adapter: no NvInfer header in it,
    and the adapter decides nothing the core does not (it holds no QSA_IN_* position)."""
    for name in pc.CORE_SOURCES + pc.CORE_HEADERS:
        text = (pc.PLUGIN_SRC / name).read_text()
        assert not re.search(r"#\s*include\s*[<\"]NvInfer", text), f"{name} includes a TensorRT header"
        assert "nvinfer1" not in re.sub(r"//[^\n]*", "", text), f"{name} names TensorRT's namespace"
    adapter = re.sub(r"//[^\n]*", "", (pc.PLUGIN_SRC / "QueryAwareSparseAttentionPlugin.cpp").read_text())
    assert set(re.findall(r"QSA_IN_\w+", adapter)) <= {"QSA_IN_QUERY"}, "input roles belong in QsaPluginCore"


def test_no_tensorrt_declarations_in_the_repository():
    """TensorRT's headers (or a copy of their declarations) are never committed: the IPluginV3
    harness compiles against $TENSORRT_INCLUDE_DIR only."""
    skip = {".git", "build", "node_modules", ".venv"}
    for path in pc.ROOT.rglob("*"):
        if skip & set(path.relative_to(pc.ROOT).parts) or not path.is_file():
            continue
        assert not path.name.startswith("NvInfer"), f"{path.relative_to(pc.ROOT)}: a TensorRT header"
        if path.suffix in (".h", ".hpp", ".cuh", ".cpp", ".cu"):
            text = path.read_text(errors="replace")
            assert not re.search(r"\bnamespace\s+nvinfer1\s*\{", text), \
                f"{path.relative_to(pc.ROOT)} declares TensorRT's namespace"
