"""Contracts that export, calibration and the runtime share - and the layering of tinyserve_trt.

``manifest``     the package manifest ``tinyserve.json`` (typed, versioned, validated) and the
                 package's file names; ``manifest_fields`` its per-field type and range checks
``ort_plan``     ``OrtGraphPlan``: how ``model.ort.onnx`` was made (opset, contrib fusions, native
                 decode node) and why - the manifest's ``ort_optimized.plan``
``package_paths`` ``PackageError`` and ``resolve_inside``: every file a package names stays inside it
``cold_tier``    ``TierConfig`` / ``HotnessConfig``: the INT8 cold tier and which pages stay hot
``budget``       ``DecodeBudget``: a decode step's token budget (a floor and a share of the context)
``calibration``  ``CalibrationArtifact``: what ``tinyserve-calibrate`` writes, the exporter
                 copies into a package and the runtime applies

Imports point down. A subpackage may import only those listed under it
(``LAYERS``; ``tests/test_imports.py`` checks every import, at module level and
inside functions, against this table and for cycles)::

    ops          the op: schema, numpy reference, ONNX function     imports nothing of ours
    contracts    this package                                       ops
    cuda         ctypes kernels, TensorRT + plugin loading           ops, cpu (its per-user build cache)
    cpu          the native CPU decode kernel (ORT custom op build)  ops
    export       ONNX rewrite, package writing, engine build         ops, contracts, cuda, cpu, calibration
    runtime      pages, scheduler, backends, LLM, server             ops, contracts, cuda, cpu
    calibration  observe -> artifact (sizes pages like the runtime)  ops, contracts, runtime

So the runtime never imports export or calibration, export never imports the
runtime, and nothing here imports ``tinyserve_dev`` (dev-only). Export imports
calibration in one place, inside a function: ``export/auto_int8.py`` measures the
INT4 package it just wrote to pick its INT8 layers (``--int8-layers auto``).
Only plain Python and numpy are imported at this package's import.
"""

LAYERS = {
    "ops": (),
    "contracts": ("ops",),
    "cuda": ("ops", "cpu"),  # the per-user native cache (cpu/native.py) holds the built plugin too
    "cpu": ("ops",),
    "export": ("ops", "contracts", "cuda", "cpu", "calibration"),
    "runtime": ("ops", "contracts", "cuda", "cpu"),
    "calibration": ("ops", "contracts", "runtime"),
}
