"""Calibration of mixed-precision KV pages (issue #6), in two phases.

observe (``observe.py``): run prompts through a :class:`~.source.ObservationSource`
(the model), record per layer / KV head K and V ranges and which pages the
op's selection attends, then evaluate the cold tier on held-out prompts ->
write a :class:`~tinyserve_trt.contracts.calibration.CalibrationArtifact`
(JSON + ``.npz``).
apply (``contracts/calibration.py``, shared with export and the runtime): the
runtime loads the artifact and builds its ``TierConfig`` / ``HotnessConfig``
from it; it never observes.

Pure numpy here; torch/transformers are imported by the ``hf`` source's factory, the
runtime and onnxruntime by the ``engine`` source's (``engine_source.py``).
"""

from tinyserve_trt.contracts.calibration import CalibrationArtifact

__all__ = ["CalibrationArtifact"]
