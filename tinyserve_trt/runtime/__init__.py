"""Serving runtime: sequences, the paged KV pool and prefix cache, the scheduler, sampling.

Everything here is pure Python + numpy; backends (ort, trt) import their heavy
dependencies inside their factories.
"""
