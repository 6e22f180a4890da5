// The emulator's runtime (see cuda_emu.h): a pool of host threads that play
// the CUDA threads of one block at a time, the block/warp barriers they meet
// at, and the runtime-API stubs the kernels' launchers call.
#include <barrier>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "cuda_emu.h"

namespace qsa_emu {

thread_local ThreadPos tpos;

namespace {

constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr size_t kDefaultDynamicSmem = 48 * 1024;
constexpr size_t kOptinDynamicSmem = 227 * 1024;  // an H100/H200's opt-in limit
constexpr int kEmulatedSms = 4;  // few SMs: auto split-K picks few splits, so few blocks to play

// State of the block being played; rebuilt before each block.
struct Block {
    std::optional<std::barrier<>> block_barrier;
    std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
    std::vector<uint64_t> slots;  // 2 x 32 per warp
    std::vector<int> lanes;       // threads per warp
    std::vector<unsigned char> smem;
};

class Pool {
public:
    // Plays every block of the grid; body() is one CUDA thread's run of the kernel.
    void run(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
        const unsigned nthreads = block.x * block.y * block.z;
        grow(nthreads);
        body_ = &body;
        grid_ = grid;
        block_dim_ = block;
        const unsigned nwarps = (nthreads + 31) / 32;
        blk_.smem.assign(smem, 0);
        blk_.slots.assign(size_t(nwarps) * 64, 0);
        blk_.lanes.assign(nwarps, 0);
        for (unsigned w = 0; w < nwarps; ++w) blk_.lanes[w] = int(std::min(32u, nthreads - 32 * w));
        for (unsigned z = 0; z < grid.z; ++z)
            for (unsigned y = 0; y < grid.y; ++y)
                for (unsigned x = 0; x < grid.x; ++x) {
                    blk_.block_barrier.emplace(nthreads);
                    blk_.warp_barriers.clear();
                    for (unsigned w = 0; w < nwarps; ++w)
                        blk_.warp_barriers.push_back(std::make_unique<std::barrier<>>(blk_.lanes[w]));
                    block_idx_ = uint3{x, y, z};
                    remaining_.store(int(nthreads));
                    // One word says both "a new block" and how many threads play it, so a
                    // worker that wakes late can neither miss nor replay a block.
                    generation_.store(((generation_.load() >> 11) + 1) << 11 | nthreads);
                    generation_.notify_all();
                    for (int left = remaining_.load(); left != 0; left = remaining_.load()) remaining_.wait(left);
                }
        body_ = nullptr;
    }

    Block& block() { return blk_; }

private:
    void grow(unsigned n) {
        while (workers_ < n) {
            const unsigned id = workers_++;
            // The generation it was created under, not the one it sees when it starts:
            // the block it was created for may already be published by then.
            const uint64_t seen = generation_.load();
            std::thread([this, id, seen] { work(id, seen); }).detach();  // lives as long as the process
        }
    }

    void work(unsigned id, uint64_t seen) {
        for (;;) {
            generation_.wait(seen);
            seen = generation_.load();
            if (id >= (seen & 2047u)) continue;
            const dim3 bd = block_dim_;
            tpos.block_dim = bd;
            tpos.grid_dim = grid_;
            tpos.block = block_idx_;
            tpos.shfl_parity = 0;
            tpos.thread = uint3{id % bd.x, (id / bd.x) % bd.y, id / (bd.x * bd.y)};
            (*body_)();
            // An exited thread no longer counts at later barriers of this block.
            blk_.warp_barriers[id / 32]->arrive_and_drop();
            blk_.block_barrier->arrive_and_drop();
            if (remaining_.fetch_sub(1) == 1) remaining_.notify_one();
        }
    }

    Block blk_;
    const std::function<void()>* body_ = nullptr;
    dim3 grid_, block_dim_;
    uint3 block_idx_{0, 0, 0};
    unsigned workers_ = 0;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> remaining_{0};
};

Pool& pool() {
    static Pool* p = new Pool;  // never destroyed: its detached threads outlive static destructors
    return *p;
}

std::mutex& launch_mutex() {
    static std::mutex m;
    return m;
}

std::map<const void*, size_t>& smem_optin() {
    static std::map<const void*, size_t> m;
    return m;
}

thread_local cudaError_t last_error = cudaSuccess;

unsigned warp_of_caller() {
    const dim3 bd = tpos.block_dim;
    return (tpos.thread.x + bd.x * (tpos.thread.y + bd.y * tpos.thread.z)) / 32;
}

}  // namespace

void sync_block() { pool().block().block_barrier->arrive_and_wait(); }
void sync_warp() { pool().block().warp_barriers[warp_of_caller()]->arrive_and_wait(); }
uint64_t* warp_slots(int parity) { return pool().block().slots.data() + (size_t(warp_of_caller()) * 2 + parity) * 32; }
int warp_lanes() { return pool().block().lanes[warp_of_caller()]; }
void* dynamic_shared() { return pool().block().smem.data(); }

void set_last_error(cudaError_t e) {
    if (e != cudaSuccess) last_error = e;
}

size_t max_dynamic_smem(const void* kernel) {
    std::lock_guard<std::mutex> g(launch_mutex());
    auto it = smem_optin().find(kernel);
    return it == smem_optin().end() ? kDefaultDynamicSmem : it->second;
}

cudaError_t run_grid(const void* kernel, dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
    const unsigned long long nthreads = 1ull * block.x * block.y * block.z;
    if (nthreads == 0 || nthreads > kMaxThreadsPerBlock || block.z > 64 || grid.x == 0 || grid.y == 0 ||
        grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
        return cudaErrorInvalidConfiguration;
    if (smem > max_dynamic_smem(kernel)) return cudaErrorInvalidValue;
    std::lock_guard<std::mutex> g(launch_mutex());
    pool().run(grid, block, smem, body);
    return cudaSuccess;
}

}  // namespace qsa_emu

cudaError_t cudaGetLastError() {
    const cudaError_t e = qsa_emu::last_error;
    qsa_emu::last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError() { return qsa_emu::last_error; }
cudaError_t cudaGetDevice(int* device) {
    *device = 0;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
    switch (attr) {
        case cudaDevAttrMultiProcessorCount: *value = qsa_emu::kEmulatedSms; return cudaSuccess;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = int(qsa_emu::kOptinDynamicSmem); return cudaSuccess;
    }
    return cudaErrorInvalidValue;
}
cudaError_t cudaFuncSetAttributeImpl(const void* func, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || size_t(value) > qsa_emu::kOptinDynamicSmem)
        return cudaErrorInvalidValue;
    std::lock_guard<std::mutex> g(qsa_emu::launch_mutex());
    qsa_emu::smem_optin()[func] = size_t(value);
    return cudaSuccess;
}
const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorInvalidConfiguration: return "invalid configuration argument";
        default: return "unknown error";
    }
}

// The ctypes layer asks this to know it drives host memory (tinyserve_trt/cuda/library.py).
extern "C" int qsa_emulated(void) { return 1; }

// A self-test kernel for tests/kernels/test_emulation.py: each thread adds its
// lane-reduced id (through the shuffle path and a barrier) to *sum.
namespace {
void probe_kernel(unsigned long long* sum) {
    __shared__ unsigned long long block_total;
    if (threadIdx.x == 0) block_total = 0;
    __syncthreads();
    unsigned v = threadIdx.x;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(&block_total, (unsigned long long)v);
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(sum, block_total + blockIdx.x);
}
}  // namespace

// Launches probe_kernel<<<grid_x, threads, smem>>> after raising its dynamic shared
// memory limit to optin_bytes (0: leave the 48 KB default); returns the cudaError_t.
extern "C" int qsa_emulated_probe(unsigned grid_x, unsigned threads, size_t smem, int optin_bytes,
                                  unsigned long long* sum) {
    if (optin_bytes > 0) {
        const cudaError_t e = cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin_bytes);
        if (e != cudaSuccess) return e;
    }
    *sum = 0;
    return qsa_emu::launch(probe_kernel, dim3(grid_x), dim3(threads), smem, sum);
}
