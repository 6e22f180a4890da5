#!/usr/bin/env bash
# llama.cpp as a CPU peer in benchmarks/bench_peers.py (issue #31), on the weights our packages run:
#   bash scripts/setup_llamacpp.sh          (idempotent; the first build takes ~5 min on 2 cores)
# 1. llama-cpp-python 0.3.36 compiled from its PyPI sdist (-DGGML_NATIVE=ON) into its own venv, so the
#    benchmark process never imports it (it runs llama.cpp in a child with that venv's python).
# 2. F32 GGUFs made with the sdist's own converter (vendor/llama.cpp/convert_hf_to_gguf.py) from the
#    HF folders our packages are exported from: SmolLM2-135M-Instruct from the folder `tinyserve-export
#    --demo` caches, Qwen2.5-Coder-0.5B-Instruct from $QWEN_HF (default /tmp/real_model_sources/qwen-hf,
#    written by benchmarks/real_model_sources.sh), skipped with a message when that folder is absent.
# Everything goes to $TINYSERVE_LLAMACPP_DIR (default ${TINYSERVE_CACHE:-~/.cache/tinyserve}/llamacpp):
# venv/, sdist/, src/, smollm2-135m-instruct-f32.gguf, qwen2.5-coder-0.5b-instruct-f32.gguf.
# Heavy steps run under `nice -n ${LLAMACPP_NICE:-19}`. Nothing is downloaded but the sdist (PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DIR=${TINYSERVE_LLAMACPP_DIR:-${TINYSERVE_CACHE:-$HOME/.cache/tinyserve}/llamacpp}
VENV=$DIR/venv
SDIST=$DIR/sdist/llama_cpp_python-$VERSION.tar.gz
SRC=$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp
NICE=(nice -n "${LLAMACPP_NICE:-19}")
mkdir -p "$DIR/sdist" "$DIR/src"

if [ ! -f "$SDIST" ]; then
  # --no-binary for this package only: with :all: pip builds the sdist's build requirements
  # (scikit-build-core and its own) from source to read its metadata (sat 38 min; this: ~10 s)
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DIR/sdist"
fi
if "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  echo "llama-cpp-python $VERSION: already built in $VENV"
else
  echo "building llama-cpp-python $VERSION into $VENV (~5 min on 2 cores)"
  python3 -m venv "$VENV"
  # GGML_NATIVE: this CPU's instruction set, as our native op's -march=native; no LLaVA/mtmd library
  # (multimodal, imported only on use): minutes less to build
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" "${NICE[@]}" "$VENV/bin/python" -m pip install -q "$SDIST"
  "$VENV/bin/python" -c "import llama_cpp; print('built llama-cpp-python', llama_cpp.__version__)"
fi
[ -f "$SRC/convert_hf_to_gguf.py" ] || tar -xzf "$SDIST" -C "$DIR/src"
# The converter runs on this python (it needs torch, transformers, safetensors: scripts/setup.sh) and
# imports sentencepiece before it looks for a tokenizer.model, even for BPE tokenizers.
python3 -c "import sentencepiece" 2>/dev/null || python3 -m pip install -q "sentencepiece==0.2.3"

# convert HF_DIR OUT: an F32 GGUF of HF_DIR, redone only when a file of HF_DIR is newer than OUT.
convert() {
  local hf out; hf=$(cd "$1" && pwd); out=$2
  if [ -f "$out" ] && [ -z "$(find "$hf" -type f -newer "$out" -print -quit)" ]; then
    echo "$out: up to date with $hf"
    return
  fi
  echo "converting $hf to $out (F32)"
  # the converter imports its conversion/ package and the vendored gguf-py: PYTHONPATH=gguf-py:.
  (cd "$SRC" && PYTHONPATH=gguf-py:. "${NICE[@]}" python3 convert_hf_to_gguf.py "$hf" --outtype f32 \
    --outfile "$out.tmp" > "$out.log" 2>&1) || {
    echo "conversion failed, see $out.log" >&2; rm -f "$out.tmp"; return 1; }
  mv "$out.tmp" "$out"
}

SMOL_HF=$(python3 -c "from tinyserve_trt.export.hf.smollm2 import ensure_hf; print(ensure_hf())" | tail -n 1)
convert "$SMOL_HF" "$DIR/smollm2-135m-instruct-f32.gguf"
QWEN_HF=${QWEN_HF:-/tmp/real_model_sources/qwen-hf}
if [ -f "$QWEN_HF/config.json" ]; then
  convert "$QWEN_HF" "$DIR/qwen2.5-coder-0.5b-instruct-f32.gguf"
else
  echo "Qwen2.5-Coder-0.5B skipped: no HF folder at $QWEN_HF (bash scripts/setup_qwen.sh, then" \
       "bash benchmarks/real_model_sources.sh writes it; or set QWEN_HF)"
fi
echo "llama.cpp peer ready: --llamacpp-python $VENV/bin/python --gguf $DIR/<model>-f32.gguf"
