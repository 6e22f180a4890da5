// CPU emulation of the CUDA subset plugins/kernels uses, so g++ builds the
// real kernel sources into a host library that tests run (plugins/README.md).
//
// Model: a launch runs its blocks one after another; every CUDA thread of a
// block is a host thread from a pool reused across blocks and launches.
// __shared__ is `static` (one copy, valid because blocks never overlap),
// __syncthreads is a block-wide barrier, full-warp shuffles go through a
// per-warp exchange buffer between two warp barriers, shared atomics are
// std::atomic_ref. A thread that returns drops out of its barriers, as an
// exited CUDA thread stops counting at __syncthreads. Launches check the
// limits a GPU enforces (threads per block, grid extents, dynamic shared
// memory over 48 KB without cudaFuncSetAttribute) and fail with the error a
// GPU returns instead of running. Streams are ignored: a launch has finished
// when it returns. Nothing here is fast; it is for correctness only.
#pragma once
#ifdef __CUDACC__
#error "cuda_emu.h is the g++ stand-in for CUDA; nvcc uses the real headers"
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#define QSA_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
    unsigned x, y, z;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDeviceFunction = 98,
} cudaError_t;
typedef struct CUstream_st* cudaStream_t;
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97, cudaDevAttrMultiProcessorCount = 16 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

constexpr int warpSize = 32;

namespace qsa_emu {

// Where the calling host thread is in the current launch.
struct ThreadPos {
    uint3 thread{0, 0, 0}, block{0, 0, 0};
    dim3 block_dim, grid_dim;
    unsigned shfl_parity = 0;  // which slot set the next shuffle uses; 0 at each block's start
};
extern thread_local ThreadPos tpos;

void sync_block();                               // __syncthreads
void sync_warp();                                // the barrier of the caller's warp
uint64_t* warp_slots(int parity);                // 32 exchange slots of the caller's warp (two sets)
int warp_lanes();                                // threads in the caller's warp (32 but for a partial last warp)
void* dynamic_shared();                          // this block's dynamic shared memory
void set_last_error(cudaError_t e);
size_t max_dynamic_smem(const void* kernel);     // 48 KB unless raised by cudaFuncSetAttribute

// Runs body(linear thread id) for every thread of every block; checks limits first.
cudaError_t run_grid(const void* kernel, dim3 grid, dim3 block, size_t smem, const std::function<void()>& body);

template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
    // Each CUDA thread gets its own copy of the arguments, as each gets its own parameter space.
    std::tuple<std::decay_t<KArgs>...> packed(std::forward<Args>(args)...);
    const cudaError_t e = run_grid(reinterpret_cast<const void*>(kernel), grid, block, smem, [&] {
        auto copy = packed;
        std::apply(kernel, copy);
    });
    set_last_error(e);
    return e;
}

template <typename T>
T shfl_xor(T v, int lane_mask) {
    static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
    // Two slot sets used alternately: a lane writing shuffle k + 2 has passed the barrier
    // of shuffle k + 1, which every lane reaches only after reading shuffle k, so one
    // barrier per shuffle suffices (the warp's lanes shuffle in lockstep, as on a GPU).
    const unsigned parity = tpos.shfl_parity ^= 1u;
    const int lane = int(tpos.thread.x) & 31;  // kernels here use 1-D blocks
    uint64_t* slots = warp_slots(int(parity));
    memcpy(&slots[lane], &v, sizeof(T));
    sync_warp();
    const int src = lane ^ lane_mask;
    T r = v;
    if (src < warp_lanes()) memcpy(&r, &slots[src], sizeof(T));
    return r;
}

}  // namespace qsa_emu

#define threadIdx (::qsa_emu::tpos.thread)
#define blockIdx (::qsa_emu::tpos.block)
#define blockDim (::qsa_emu::tpos.block_dim)
#define gridDim (::qsa_emu::tpos.grid_dim)

inline void __syncthreads() { qsa_emu::sync_block(); }
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    (void)width;
    (void)mask;  // only full-warp masks are used; partial masks would need per-mask barriers
    return qsa_emu::shfl_xor(v, lane_mask);
}
template <typename T>
inline T atomicAdd(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v);
}
template <typename T>
inline T atomicOr(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_or(v);
}
template <typename T>
inline T atomicMax(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}

inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
// Single-rounded float32 arithmetic, never contracted into an FMA: the library is
// built with -ffp-contract=off (plugins/build.py), and on the host each is one IEEE op.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

// CUDA's device min/max: one overload set for mixed integer/float arguments.
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
    return b < a ? b : a;
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
    return a < b ? b : a;
}

// ---- runtime API subset ----
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaFuncSetAttributeImpl(const void* func, cudaFuncAttribute attr, int value);
template <typename F>
inline cudaError_t cudaFuncSetAttribute(F* func, cudaFuncAttribute attr, int value) {
    return cudaFuncSetAttributeImpl(reinterpret_cast<const void*>(func), attr, value);
}
const char* cudaGetErrorString(cudaError_t e);
