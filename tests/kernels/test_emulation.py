"""The CPU emulator (plugins/emulation) itself: it enforces a GPU's launch limits and
its shuffles, barriers and shared atomics compute what a GPU computes."""

import ctypes

import pytest

from tinyserve_trt.cuda import library


@pytest.fixture(scope="module")
def emu(cuda_lib):
    if not library.is_emulated(cuda_lib):
        pytest.skip("the loaded kernel library is the nvcc build, not the emulated one")
    cuda_lib.qsa_emulated_probe.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.POINTER(ctypes.c_ulonglong)]
    cuda_lib.qsa_emulated_probe.restype = ctypes.c_int

    def probe(grid, threads, smem=0, optin=0):
        total = ctypes.c_ulonglong(0)
        return cuda_lib.qsa_emulated_probe(grid, threads, smem, optin, ctypes.byref(total)), total.value

    return probe


def _expected(grid, threads):
    # every warp's lanes sum to the warp's ids; plus blockIdx.x once per block
    return grid * sum(range(threads)) + sum(range(grid))


@pytest.mark.parametrize("grid,threads", [(1, 32), (3, 256), (2, 1024)])
def test_probe_computes_what_a_gpu_does(emu, grid, threads):
    assert emu(grid, threads) == (0, _expected(grid, threads))


def test_partial_last_warp(emu):
    """48 threads: warp 1 has 16 lanes; its xor-16 step reads a lane that does not exist,
    which the emulator answers with the caller's own value (doubling it) instead of hanging."""
    assert emu(2, 48) == (0, 2 * (sum(range(32)) + 2 * sum(range(32, 48))) + 1)


@pytest.mark.parametrize("threads", [0, 1025, 2048])
def test_threads_per_block_limit(emu, threads):
    assert emu(1, threads)[0] == 9  # cudaErrorInvalidConfiguration


def test_dynamic_shared_memory_needs_opt_in(emu):
    assert emu(1, 32, smem=48 * 1024)[0] == 0
    assert emu(1, 32, smem=48 * 1024 + 4)[0] == 1  # cudaErrorInvalidValue without the attribute
    assert emu(1, 32, smem=100 * 1024, optin=100 * 1024)[0] == 0
    assert emu(1, 32, smem=300 * 1024, optin=300 * 1024)[0] == 1  # beyond the device's opt-in limit
