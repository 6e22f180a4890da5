"""Development tools of tinyserve-trt - never shipped (not in the wheel).

Used from the repository (tests and benchmarks put its root on ``sys.path``):
  evaluation/     quality of the op's page selection on real models (torch)
  models/         seeded tiny test models, exporter parity runs, graph reports
  kernels/        the ctypes kernel harness and the kernels' numpy references
  cases.py        random op cases for tests; doc_tables.py and schema_header.py
                  generate docs/op.md tables and plugins/generated/qsa_schema.h
It imports ``tinyserve_trt``; nothing in ``tinyserve_trt`` imports it.
"""
