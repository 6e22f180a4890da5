"""Randomized cases for the plugin harnesses, how they are built and run, and what a run must equal.

Two C++ drivers run the same case files (``case_file.h``) through the call sequence TensorRT makes
of an IPluginV3 plugin (fields -> output types and shapes -> formats -> configure -> workspace ->
clone -> enqueue on the CPU-emulated kernels -> serialized fields -> recreate -> enqueue again,
byte-identical):

- ``core_harness.cpp`` drives the plugin's TensorRT-free core (``plugins/tensorrt/QsaPluginCore.h``,
  ``QsaPluginFields.h``) and compiles with no TensorRT header (CI: ``test_plugin_core.py``);
- ``harness.cpp`` drives the IPluginV3 class itself, the thin adapter over that core, and compiles
  only against TensorRT's own headers in ``$TENSORRT_INCLUDE_DIR`` (``test_plugin_harness.py``).

Each run is held to the numpy reference; :data:`MUTATIONS` are one-line changes of the plugin's
sources that both must catch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyserve_dev.cases import CaseSpec, make_case, make_mixed_case
from tinyserve_dev.kernels.references import (
    attention_with_selection_ref,
    selection_score_gap,
)
from tinyserve_trt.cuda.library import CUDA_GROUP_REDUCTIONS
from tinyserve_trt.ops import schema, sparse_attention_ref

ROOT = Path(__file__).resolve().parents[3]
HARNESS = Path(__file__).resolve().parent
PLUGIN_SRC = ROOT / "plugins" / "tensorrt"
# The plugin's TensorRT-free sources (no NvInfer header); the rest of plugins/tensorrt is the adapter.
CORE_SOURCES = ("QsaPluginCore.cpp", "QsaPluginFields.cpp")
CORE_HEADERS = ("QsaPluginCore.h", "QsaPluginFields.h")
EMULATED = ROOT / "build" / "plugins" / "emulated"
NUM_CASES = 24
DTYPES = {"float32": "f32", "float16": "f16", "int32": "i32", "int8": "i8", "uint8": "u8"}
# Schema dims a TensorRT profile leaves dynamic (symbolic in getOutputShapes); the rest are constants.
DYNAMIC_DIMS = {"B", "S", "P", "Ptot", "Pcold", "NP"}


def _cxx():
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        pytest.skip("no g++ (or $CXX) to build the plugin harness")
    return cxx


def trt_include() -> Path | None:
    """TensorRT's own headers: ``$TENSORRT_INCLUDE_DIR`` when it holds ``NvInfer.h``, else None."""
    inc = os.environ.get("TENSORRT_INCLUDE_DIR")
    if inc and (Path(inc) / "NvInfer.h").is_file():
        return Path(inc)
    return None


def _build(out: Path, name: str, sources: list[Path], includes: list[Path], system: Path | None = None) -> Path:
    """g++ build of a harness, linked to the emulated kernels (built first when stale); ``system``:
    TensorRT's include directory, whose own warnings are not ours to fail on."""
    cxx = _cxx()
    subprocess.run([sys.executable, str(ROOT / "plugins" / "build.py"), "--emulate", "--if-stale",
                    "--out", str(EMULATED)], check=True, capture_output=True)
    exe = out / name
    subprocess.run([cxx, "-std=c++20", "-O1", "-Wall", "-Wextra", "-Werror", "-Wno-deprecated-declarations",
                    *(f"-I{d}" for d in includes), *(["-isystem", str(system)] if system else []), *map(str, sources),
                    f"-L{EMULATED}", "-lqsa_kernels", f"-Wl,-rpath,{EMULATED}", "-pthread", "-o", str(exe)],
                   check=True)
    return exe


def build_core_harness(out: Path, plugin_src: Path = PLUGIN_SRC) -> Path:
    """The core harness + the plugin's TensorRT-free sources; no TensorRT include path at all."""
    return _build(out, "core_harness", [HARNESS / "core_harness.cpp", *(plugin_src / f for f in CORE_SOURCES)],
                  [ROOT / "plugins" / "kernels", plugin_src, HARNESS])


def build_harness(out: Path, include: Path, plugin_src: Path = PLUGIN_SRC) -> Path:
    """The IPluginV3 harness + every plugin source (adapter and core), against TensorRT's headers."""
    return _build(out, "plugin_harness", [HARNESS / "harness.cpp", *sorted(plugin_src.glob("*.cpp"))],
                  [HARNESS / "cuda_shim", ROOT / "plugins" / "emulation" / "include", ROOT / "plugins" / "kernels",
                   plugin_src, HARNESS], system=include)


def random_case(seed: int) -> dict:
    """One randomized case: inputs by schema name, the node's input names (schema order; "" is a
    skipped input), attributes, and how the fields are typed."""
    rng = np.random.default_rng(1000 + seed)
    H, Hkv = [(4, 2), (8, 2), (4, 4), (6, 3), (8, 1)][seed % 5]
    dtype = ("float32", "float16")[seed % 2]
    ps = (8, 16)[(seed // 2) % 2]
    two_level = seed % 3 != 0
    cold = (None, "int8", "int4")[(seed // 3) % 3]
    S = 3 if seed % 8 == 7 else 1
    B = int(rng.integers(2, 4))
    lens = tuple(int(x) for x in rng.integers(0, 220, B))
    lens = (max(lens[0], 3 * ps + 1),) + lens[1:]  # one sequence with pages to choose from
    D = (16, 32, 64)[seed % 3]
    spec = CaseSpec(lens, H, Hkv, D, ps, S, dtype, sub_page_size=4 if two_level else 0)
    if cold:
        case = make_mixed_case(spec, rng, float(rng.uniform(0.3, 0.7)), "channel", "token", cold_format=cold,
                               group_size=(0, 8)[seed % 2] if cold == "int4" else 0)
    else:
        case = make_case(spec, rng)
    case["token_budget"] = rng.integers(0, 7, B).astype(np.int32) * ps  # 0: dense
    attrs = schema.OpAttributes(
        scale=float(rng.choice([0.0, 0.2])), sink_pages=int(rng.integers(0, 3)), recent_pages=int(rng.integers(1, 3)),
        group_reduce=str(rng.choice(CUDA_GROUP_REDUCTIONS)), sub_page_size=4 if two_level else 0,
        candidate_share=float(rng.choice([0.25, 0.5, 1.0])), cold_format=cold or "int8")
    names = list(schema.node_input_names(cold_pages=bool(cold), two_level=two_level))
    if two_level and not cold and seed % 2:  # a parser that drops skipped inputs: key_sub_bounds at 10
        names = [n for n in names if n]
    return {"seed": seed, "case": case, "attrs": attrs, "names": names, "wide": bool(rng.integers(0, 2)),
            "routing": bool(rng.integers(0, 2)), "dtype": dtype, "omit_defaults": seed % 4 == 1}


def write_case(c: dict, d: Path) -> Path:
    """The harness's case file: every attribute a field (ints as int32 or int64, floats as
    float32 or float64, as ONNX parser versions differ; ``omit_defaults``: only those that differ
    from the schema's default, which the plugin must then supply), then the inputs with their dims."""
    lines = []
    for a in schema.ATTRIBUTES:
        v = getattr(c["attrs"], a.name)
        if c["omit_defaults"] and v == a.default:
            continue
        if a.type == "int":
            lines.append(f"field {a.name} {'int64' if c['wide'] else 'int32'} {int(v)}")
        elif a.type == "float":
            lines.append(f"field {a.name} {'float64' if c['wide'] else 'float32'} {float(v)!r}")
        else:
            lines.append(f"field {a.name} char {v}")
    if c["routing"]:
        lines += [f"field {k} char {v}" for k, v in schema.PLUGIN_ATTRIBUTES.items()]
    specs = {t.name: t for t in schema.INPUTS}
    for i, name in enumerate(c["names"]):
        if not name:  # a skipped cold input: no extent, the element type the cold format gives it
            skipped = schema.INPUT_NAMES[i]
            dt = schema.COLD_DTYPES[c["attrs"].cold_format][schema.COLD_INPUTS.index(skipped)]
            lines.append(f"input {DTYPES[dt]} 0 -")
            continue
        arr = np.ascontiguousarray(c["case"][name])
        dims = [f"{sym}={n}" if sym in DYNAMIC_DIMS else str(n) for sym, n in zip(specs[name].shape, arr.shape)]
        path = d / f"in{i}.bin"
        path.write_bytes(arr.tobytes())
        lines.append(f"input {DTYPES[arr.dtype.name]} {arr.ndim} {' '.join(dims)} {path}")
    path = d / "case.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_harness(exe: Path, c: dict, d: Path) -> tuple[dict, list[np.ndarray]]:
    """Runs one case; ``(report lines by key, outputs)``. AssertionError when the harness fails."""
    d.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([str(exe), str(write_case(c, d)), str(d)], check=False, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"case {c['seed']}: harness failed: {r.stderr.strip()}"
    report = {}
    for line in r.stdout.splitlines():
        key, _, rest = line.partition(" ")
        report.setdefault(key, []).append(rest.split())
    outs = []
    for i, (_, dt, nb, *rest) in enumerate(report["output"]):
        shape = tuple(int(x) for x in rest[: int(nb)])
        np_dt = {"f32": np.float32, "f16": np.float16, "i32": np.int32}[dt]
        outs.append(np.fromfile(d / f"out{i}.bin", dtype=np_dt).reshape(shape))
    return report, outs


def check_case(exe: Path, c: dict, d: Path, ipluginv3: bool) -> None:
    """The harness's run of case ``c`` equals the reference; AssertionError naming what differs.
    ``ipluginv3``: ``exe`` is harness.cpp's build, which also reports the creator and the logger."""
    report, (out, sel) = run_harness(exe, c, d)
    case, attrs, seed = c["case"], c["attrs"], c["seed"]
    if ipluginv3:
        assert report["creator"][0] == [schema.OP_TYPE, schema.PLUGIN_VERSION, schema.PLUGIN_NAMESPACE]
        assert report["field_names"][0] == [a.name for a in schema.ATTRIBUTES]
        assert report["logged_errors"][0] == ["0"]
    assert report["serialized"][0] == [a.name for a in schema.ATTRIBUTES], f"case {seed}: serialized fields"
    assert report["same_output"][0] == ["1"], f"case {seed}: the recreated plugin's output differs from the build's"
    B, H, S, D = case["query"].shape
    Hkv, NP = case["key"].shape[1], case["page_table"].shape[1]
    assert out.shape == (B, H, S, D) and out.dtype == case["query"].dtype, f"case {seed}: output {out.shape}"
    assert sel.shape == (B, Hkv, NP), f"case {seed}: selected_pages {sel.shape}, want {(B, Hkv, NP)}"
    # as expressions: the builder's symbols pass through (dynamic B, S, NP), static dims stay constants
    symbolic = [line[line.index("symbolic") + 1:] for line in report["output"]]
    assert symbolic == [["B", str(H), "S", str(D)], ["B", str(Hkv), "NP"]], f"case {seed}: {symbolic}"
    assert np.isin(sel, (0, 1)).all(), f"case {seed}: selected_pages entries never written"
    sel = sel.astype(bool)
    ref_out, ref_sel = sparse_attention_ref(**case, attrs=attrs)
    tol = schema.TOLERANCES[c["dtype"]]
    if not np.array_equal(sel, ref_sel):
        # ties and fp rounding may pick another page of (almost) equal score; two-level must match, and so
        # must per-head selection (selected_pages is the group's union: no per-head kept lists to score here)
        assert S == 1 and not attrs.two_level and attrs.group_reduce != "head", \
            f"case {seed}: selected_pages differ from the reference"
        gap = selection_score_gap(case, sel, ref_sel, attrs)
        assert gap <= 1e-4 * max(1.0, np.abs(case["query"]).max()), f"case {seed}: kept pages score worse by {gap}"
        ref_out = attention_with_selection_ref(case, sel, attrs)
    np.testing.assert_allclose(out.astype(np.float64), ref_out.astype(np.float64), err_msg=f"case {seed}", **tol)


def all_cases() -> list[dict]:
    return [random_case(i) for i in range(NUM_CASES)]


def check_cover(cases: list[dict]) -> None:
    """The randomized cases span the interface, so a run over them means something."""
    kinds = {(c["dtype"], c["attrs"].two_level, c["attrs"].cold_format if "key_cache_int8" in c["case"] else None)
             for c in cases}
    assert len(cases) >= 20 and len(kinds) == 12  # fp32/fp16 x two-level on/off x hot/int8/int4
    assert all(c["case"]["query"].shape[0] > 1 for c in cases)
    assert any(c["case"]["query"].shape[1] != c["case"]["key"].shape[1] for c in cases)  # GQA
    assert any(c["attrs"].group_reduce == "head" and c["case"]["query"].shape[2] == 1 for c in cases)  # per head
    assert any(c["case"]["query"].shape[2] > 1 for c in cases)  # prefill
    assert any(len(set(c["case"]["past_lens"].tolist())) > 1 for c in cases)  # ragged
    assert {len(c["names"]) for c in cases} == {10, 11, 14, 15}  # every input layout the plugin takes
    assert any(c["omit_defaults"] for c in cases) and any(c["wide"] for c in cases)


# Fields the schema does not allow (range, choice, type, name, or two-level with a policy that has
# no sub-page bound): the plugin must refuse to be created from them.
BAD_FIELDS = ["field sink_pages int32 -1", "field recent_pages int64 0", "field policy char nope",
              "field candidate_share float32 1.5", "field cold_format char int2", "field sub_page_size float32 4.5",
              "field no_such_field int32 1", "field policy char window"]


def run_with_field(exe: Path, line: str, d: Path) -> subprocess.CompletedProcess:
    """A two-level case (sub_page_size 4 needs policy query_aware) with ``line`` appended: a later
    field overrides the earlier one."""
    path = write_case(random_case(2), d)
    path.write_text(path.read_text() + line + "\n")
    return subprocess.run([str(exe), str(path), str(d)], check=False, capture_output=True, text=True, timeout=60)


# A copy of plugins/tensorrt with one line changed must fail the cases: (file, line, mutant).
MUTATIONS = {
    "field parsing (sink_pages read into recent_pages)":
        ("QsaPluginFields.cpp", "attrs.sink_pages = int32_t(v);", "attrs.recent_pages = int32_t(v);"),
    "output-shape formula (selected_pages [B, H, NP])":
        ("QsaPluginCore.h", "sel.d[1] = inputs[QSA_IN_KEY].d[1];", "sel.d[1] = inputs[QSA_IN_QUERY].d[1];"),
}


def mutated_sources(mutation: str, d: Path) -> Path:
    """A copy of plugins/tensorrt in ``d`` with ``mutation`` applied."""
    file, line, mutant = MUTATIONS[mutation]
    src = d / "tensorrt"
    shutil.copytree(PLUGIN_SRC, src)
    text = (src / file).read_text()
    assert text.count(line) == 1, f"{file} no longer holds {line!r}: update the mutation"
    (src / file).write_text(text.replace(line, mutant))
    return src


def first_failure(exe: Path, cases: list[dict], d: Path, ipluginv3: bool) -> str | None:
    """The first case's failure, or None when every case passes."""
    for c in cases:
        try:
            check_case(exe, c, d / f"case{c['seed']}", ipluginv3)
        except AssertionError as e:
            return str(e).splitlines()[0]
    return None
