"""The ORT graph's post-passes on one onnx-ir model give main's proto passes' graph, node for node.

``ort_graph.prepared_graph`` used to run each post-pass on an ``onnx.ModelProto``
(inlining, shared shapes, per-step merge, rotate_half, skip-norm, rotary, the
native decode switch); it now converts once to an ``onnx_ir.Model``, runs them
as onnx-ir passes and serializes once (``ort_passes.py``). The oracle is main's
code at ``OLD_COMMIT`` itself: ``git archive`` of that commit's package into this
test's tmp, run in a subprocess on the same exported packages; its graphs are
written there, never committed. Compared: the (domain, op_type) multiset of every
graph, subgraphs included; the fused node counts; the ORT logits on random tokens
(prefill + decode, dense and selecting) to 1e-5. Without the git history (a source
tarball) the oracle part skips; the fused counts below, read off main's proto
passes at ``OLD_COMMIT`` on these fixtures, still run.
The native plans' structure differs by design since node version 3 (one native node per layer,
no ``If(S == 1)`` switch, the layer's head split and rotary inside it): there only their logits
are compared. Two later changes are applied to
both sides or counted: the opset raise before the
passes is today's ``ort_opset.py`` on both (it keeps the source's value_info), and the
Identity copies that only name graph outputs, which ``DropOutputIdentities`` removes
after main's passes, are subtracted from the old graph's counts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from tinyserve_trt.contracts.manifest import MANIFEST_FILE, MODEL_FILE
from tinyserve_trt.cpu import native as cpu_native
from tinyserve_trt.export.config import ExportConfig
from tinyserve_trt.export.ort_graph import prepared_graph
from tinyserve_trt.export.ort_opset import ORT_OPSET
from tinyserve_trt.export.pipeline import export_model

ort = pytest.importorskip("onnxruntime")
OLD_COMMIT = "d895d21"  # main before the port: every post-pass on onnx.ModelProto
REPO = Path(__file__).resolve().parents[2]
CONFIG = ExportConfig(page_size=8, sub_page_size=4, dense_layers=1, validate=False)  # dense + two-level layer
# (contrib fusions, opset, native decode): the plans the exporter tries (ort_validation.py)
PLANS = [(True, ORT_OPSET, True), (True, ORT_OPSET, False), (False, ORT_OPSET, False), (True, None, False),
         (False, None, True)]
FUSED = {("com.microsoft", "SkipSimplifiedLayerNormalization"), ("com.microsoft", "RotaryEmbedding"),
         (cpu_native.DOMAIN, cpu_native.OP_TYPE)}
# fused node counts of main's proto passes at OLD_COMMIT on these fixtures (2 layers), plan PLANS[0]; the
# tiny fixtures' norms do not fuse there (synthetic graphs below do: test_skip_norm.py's)
OLD_FUSED = {"llama": {"SkipSimplifiedLayerNormalization": 0, "RotaryEmbedding": 4, cpu_native.OP_TYPE: 2},
             "qwen2": {"SkipSimplifiedLayerNormalization": 0, "RotaryEmbedding": 4, cpu_native.OP_TYPE: 2},
             "gpt2": {"SkipSimplifiedLayerNormalization": 0, "RotaryEmbedding": 0, cpu_native.OP_TYPE: 2}}

OLD_SCRIPT = """
import json, sys, onnx
sys.path.insert(0, sys.argv[1])
import tinyserve_trt.export.ort_graph as g
assert g.__file__.startswith(sys.argv[1]), g.__file__
for source, out, (contrib, opset, native) in json.loads(sys.argv[2]):
    onnx.save_model(g.prepared_graph(onnx.load(source, load_external_data=False), contrib, opset, native), out)
"""


def ops(graph: onnx.GraphProto) -> Counter:
    """(domain, op_type) -> count over ``graph`` and its subgraphs (an If's branches)."""
    out = Counter()
    for n in graph.node:
        out[(n.domain or "", n.op_type)] += 1
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                out += ops(g)
    return out


@pytest.fixture(scope="module")
def packages(export_fixture, tmp_path_factory):
    root = tmp_path_factory.mktemp("ir_passes")
    cache = {}

    def get(kind):
        if kind not in cache:
            export_model(export_fixture(kind, "legacy_eager") / MODEL_FILE, root / kind, CONFIG, quiet=True)
            cache[kind] = root / kind, json.loads((root / kind / MANIFEST_FILE).read_text())
        return cache[kind]
    return get


def _old_graphs(jobs: list[tuple[Path, tuple]], tmp: Path) -> list[onnx.ModelProto]:
    """Main's proto passes' graph of each (model file, plan) of ``jobs``, made by the code of
    ``OLD_COMMIT`` in a subprocess (skips without the git history)."""
    if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{OLD_COMMIT}^{{commit}}"],
                      capture_output=True).returncode:
        pytest.skip(f"no git history with {OLD_COMMIT} (the old passes) here")
    old = tmp / "old_code"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD_COMMIT, "tinyserve_trt"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    # the op's definition (its function bodies, which the old passes inline and re-attach) is
    # today's: the comparison is of the passes alone, not of the op as it was at OLD_COMMIT
    shutil.rmtree(old / "tinyserve_trt" / "ops")
    shutil.copytree(REPO / "tinyserve_trt" / "ops", old / "tinyserve_trt" / "ops",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # so is the opset raise before the passes (it now keeps the source's value_info, which the
    # passes read): today's ort_opset.py replaces the old one
    shutil.copy(REPO / "tinyserve_trt" / "export" / "ort_opset.py", old / "tinyserve_trt" / "export" / "ort_opset.py")
    spec = [(str(src), str(tmp / f"old{i}.onnx"), plan) for i, (src, plan) in enumerate(jobs)]
    subprocess.run([sys.executable, "-c", OLD_SCRIPT, str(old), json.dumps(spec)], check=True,
                   env=dict(os.environ, PYTHONPATH=str(old)), cwd=tmp)
    return [onnx.load(out, load_external_data=False) for _, out, _ in spec]


def output_identities(graph: onnx.GraphProto) -> int:
    """Identity nodes of ``graph`` that only copy a value made in it to a graph output (what
    ``DropOutputIdentities`` removes; main's proto passes kept them)."""
    outputs = {o.name for o in graph.output}
    made = {o for n in graph.node for o in n.output}
    read = {i for n in graph.node for i in n.input}
    return sum(n.op_type == "Identity" and n.output[0] in outputs and n.output[0] not in read
               and n.input[0] in made and n.input[0] not in outputs for n in graph.node)


def _same_structure(new: onnx.ModelProto, old: onnx.ModelProto, what) -> None:
    assert output_identities(new.graph) == 0, what
    want = ops(old.graph) - Counter({("", "Identity"): output_identities(old.graph)})
    assert ops(new.graph) == want, what
    assert {(o.domain, o.version) for o in new.opset_import} == {(o.domain, o.version) for o in old.opset_import}
    assert [i.name for i in new.graph.input] == [i.name for i in old.graph.input]
    assert [o.name for o in new.graph.output] == [o.name for o in old.graph.output]
    # the passes' inferred shapes stay analysis: no value_info the proto passes did not write (they
    # also kept entries of values their merges removed, which onnx-ir drops with the values)
    assert {v.name for v in new.graph.value_info} <= {v.name for v in old.graph.value_info}, what


def _logits(graph: onnx.ModelProto, pkg: Path, manifest: dict, seed: int) -> list[np.ndarray]:
    from tinyserve_trt.export.validate import graph_session, paged_logits, sparse_lengths

    ps = manifest["page_size"]
    session = graph_session(graph, pkg)
    return [x for budget in (0, 3 * ps) for x in paged_logits(session, manifest, budget, sparse_lengths(ps), seed=seed)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_fused_counts_are_main_proto_passes(packages, kind):
    """Main's counts for plan PLANS[0]; since the native layer node (native_layer.py) its rotaries
    and native op nodes are inside the layer nodes, so the fusions are counted without the native
    kernel (PLANS[1]) and the layer nodes with it."""
    pkg, manifest = packages(kind)
    proto = onnx.load(str(pkg / MODEL_FILE), load_external_data=False)
    counts = ops(prepared_graph(proto, *PLANS[1]).graph)
    got = {op: counts[(d, op)] for d, op in FUSED}
    assert got == dict(OLD_FUSED[kind], **{cpu_native.OP_TYPE: 0})
    native = ops(prepared_graph(proto, *PLANS[0]).graph)
    assert native[(cpu_native.DOMAIN, cpu_native.LAYER_OP_TYPE)] == OLD_FUSED[kind][cpu_native.OP_TYPE]
    assert native[("com.microsoft", "RotaryEmbedding")] == native[(cpu_native.DOMAIN, cpu_native.OP_TYPE)] == 0


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_prepared_graph_equals_main_proto_passes(packages, tmp_path, rng, kind):
    pkg, manifest = packages(kind)
    proto = onnx.load(str(pkg / MODEL_FILE), load_external_data=False)
    for plan, old in zip(PLANS, _old_graphs([(pkg / MODEL_FILE, plan) for plan in PLANS], tmp_path)):
        new = prepared_graph(proto, *plan)
        assert output_identities(old.graph) > 0  # the packages name new_key / new_value through copies
        if plan[2]:  # native node version 3 replaces each op node for every S: main switched on If(S == 1)
            assert not [n for n in new.graph.node if n.op_type == "If"], plan
            native = ops(new.graph)[(cpu_native.DOMAIN, cpu_native.OP_TYPE)]
            assert native + ops(new.graph)[(cpu_native.DOMAIN, cpu_native.LAYER_OP_TYPE)] == manifest["num_layers"]
            assert ops(new.graph)[("", "If")] == 0 < ops(old.graph)[("", "If")], plan
        else:
            _same_structure(new, old, plan)
        if plan[2] and cpu_native.available() is not None:
            continue  # the native node's session needs the kernel's library
        seed = int(rng.integers(1 << 31))  # the same random tokens for both graphs
        got, want = _logits(new, pkg, manifest, seed), _logits(old, pkg, manifest, seed)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=str(plan))


def _synthetic() -> dict[str, onnx.ModelProto]:
    """The pass tests' small graphs: each fuses or merges what the fixtures do not show (a residual
    RMSNorm, rope's scaling, rotate_half from a Shape, a merge an If branch reads)."""
    from tests.export import test_merge_nodes, test_rotary, test_rotate_half, test_skip_norm

    return {"skip_norm_17": test_skip_norm._model(17), "skip_norm_21": test_skip_norm._model(21),
            "skip_norm_bias": test_skip_norm._model(17, bias=True), "rotary": test_rotary._model(),
            "rotary_scaled": test_rotary._model(scaling=0.75), "rotate_half": test_rotate_half._model(True),
            "merge": test_merge_nodes._model()}


def _random_feeds(model: onnx.ModelProto, rng) -> dict[str, np.ndarray]:
    """Random values for ``model``'s inputs: symbolic dims 2 (batch) or 5, integers in [0, 8)."""
    feeds = {}
    for vi in model.graph.input:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 2 if d.dim_param == "B" else 5 for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        feeds[vi.name] = (rng.integers(0, 8, dims).astype(dtype) if np.issubdtype(dtype, np.integer)
                          else rng.standard_normal(dims).astype(dtype))
    return feeds


def test_synthetic_graphs_equal_main_proto_passes(tmp_path, rng):
    models = _synthetic()
    for name, model in models.items():
        onnx.save_model(model, str(tmp_path / f"{name}.onnx"))
    olds = _old_graphs([(tmp_path / f"{name}.onnx", (True, None, False)) for name in models], tmp_path)
    fused = Counter()
    for (name, model), old in zip(models.items(), olds):
        new = prepared_graph(model)
        _same_structure(new, old, name)
        fused.update({op: c for (d, op), c in ops(new.graph).items() if (d, op) in FUSED})
        feeds = _random_feeds(model, rng)
        run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
               for m in (new, old)]
        for a, b in zip(*run):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    assert fused == {"SkipSimplifiedLayerNormalization": 5, "RotaryEmbedding": 4}  # each pass ran on some
