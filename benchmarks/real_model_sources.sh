#!/usr/bin/env bash
# Issue #30's real-model must-shows, one documented command (heavy: ~15 min, ~12 GB disk, run alone):
#   bash benchmarks/real_model_sources.sh [WORKDIR]
# Qwen2.5-Coder-0.5B-Instruct (installed by scripts/setup_qwen.sh, nothing downloaded here) exported
# four ways - from its GGUF, from its saved HF folder, from its fp32 ONNX export (2.4 GB, torch legacy,
# a file per tensor) and from an fp16 ONNX export - then each package's dense greedy ids against HF
# torch's. Writes benchmarks/results/export.md and benchmarks/results/real_model_parity.md.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/real_model_sources}
mkdir -p "$W"
GGUF=$(python3 -m tinyserve_dev.models.qwen_gguf)
python3 - "$GGUF" "$W" <<'PY'
import sys, warnings
from pathlib import Path
from tinyserve_trt.export.hf.convert import load_model
from tinyserve_trt.export.hf.smollm2 import save_tokenizer
from tinyserve_trt.export.hf.torch_export import export_causal_lm
gguf, w = Path(sys.argv[1]), Path(sys.argv[2])
hf, f16 = w / "qwen-hf", w / "qwen-fp16-onnx"
model, tok = load_model(gguf)
model.hf_quantizer = None  # dequantized fp32 now; transformers still refuses to save or cast a GGUF load
for holder in (model, model.config):
    if hasattr(holder, "quantization_config"):
        delattr(holder, "quantization_config")
if not (hf / "config.json").is_file():
    model.save_pretrained(str(hf))
    save_tokenizer(tok, hf)
if not (f16 / "model.onnx").is_file():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoModelForCausalLM  # the saved folder: a plain (not GGUF-marked) model
        half = AutoModelForCausalLM.from_pretrained(str(hf), dtype="float16").eval()
        export_causal_lm(half, f16 / "model.onnx", "legacy_sdpa")
    save_tokenizer(tok, f16)
    model.config.to_json_file(str(f16 / "config.json"))
PY
ONNX=$(python3 -c "
from pathlib import Path; import sys
from tinyserve_trt.export.hf.convert import ensure_onnx
print(ensure_onnx(Path('$GGUF')))")
python3 benchmarks/bench_export.py --workdir "$W/pkgs" \
  --source "qwen-gguf=$GGUF" --source "qwen-hf-folder=$W/qwen-hf" \
  --source "qwen-fp32-onnx=$ONNX" --source "qwen-fp16-onnx=$W/qwen-fp16-onnx/model.onnx" || true  # a failed row is in the table
pkgs=(); for p in "$W"/pkgs/*; do [ -f "$p/tinyserve.json" ] && pkgs+=(--package "$p"); done
python3 benchmarks/real_model_parity.py --source "$GGUF" "${pkgs[@]}"
