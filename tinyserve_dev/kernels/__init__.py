"""Kernel test tools: ``harness`` drives the compiled kernels through
``tinyserve_trt.cuda.library`` on numpy/torch buffers; ``references`` are the
slow numpy twins every kernel is checked against."""
