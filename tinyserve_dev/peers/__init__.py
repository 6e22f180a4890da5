"""CPU peers timed beside tinyserve in the benchmarks (issue #31), and what a step costs the machine.

  llamacpp_child.py  the llama.cpp side: a script run by the llama-cpp-python venv's python
                     (stdlib + numpy + llama_cpp only), JSON lines on stdin/stdout
  llamacpp.py        the parent side: start that child, time evals / decode steps, skip reasons
  step_bytes.py      bytes a decode step reads: weights (from the package's graph) + KV (from
                     its manifest's geometry and selection rule)
  genai_graph.py     ORT GenAI's graph run as its generator runs it, where GenAI cannot prefill
                     the batch itself (batch > 1 at long context)
  machine.py         the header facts: measured read bandwidth, load, git commit, peak RSS
  peer_table.py      the decode and prefill tables of benchmarks/bench_peers.py
The benchmark process never imports llama_cpp: it runs only in the child.
"""
