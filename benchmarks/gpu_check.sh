#!/usr/bin/env bash
# One prepared GPU check (H200 or any CUDA GPU with torch): build, unit tests,
# validate over the serving grid, time, write benchmarks/results/gpu_h200.md.
# Needs: nvcc (PATH or $CUDACXX), python with numpy + torch (CUDA). No TensorRT, no network.
# Each step fails loudly: set -e stops at the first failing one and says which.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() { echo; echo "===== $* ====="; }
trap 'echo "gpu_check.sh: FAILED at step: ${CURRENT_STEP:-?}" >&2' ERR

CURRENT_STEP="environment"; step "$CURRENT_STEP"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
python -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'"

CURRENT_STEP="build (sm of this GPU only, to save time)"; step "$CURRENT_STEP"
ARCH=$(python -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}{m}')")
time python plugins/build.py --arch "$ARCH"

CURRENT_STEP="kernel unit tests vs numpy reference"; step "$CURRENT_STEP"
timeout 240 python -m pytest tests/kernels tests/runtime/test_device_pages.py -q -x -m gpu -p no:cacheprovider

CURRENT_STEP="validate grid + time vs torch SDPA"; step "$CURRENT_STEP"
timeout 330 python benchmarks/gpu_check.py --out benchmarks/results/gpu_h200.md "$@"

CURRENT_STEP="report"; step "$CURRENT_STEP"
cat benchmarks/results/gpu_h200.md
