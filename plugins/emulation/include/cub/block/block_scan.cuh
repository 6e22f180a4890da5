// g++ emulation stand-in for cub::BlockScan: the calls plugins/kernels makes
// (ExclusiveSum with a block aggregate), computed from a shared array.
#pragma once
#include "../../../cuda_emu.h"

namespace cub {

template <typename T, int BLOCK_THREADS>
class BlockScan {
public:
    struct TempStorage {
        T vals[BLOCK_THREADS];
    };
    explicit BlockScan(TempStorage& tmp) : tmp_(tmp) {}

    // Like CUB, the caller must __syncthreads() before reusing the storage.
    void ExclusiveSum(T input, T& output, T& block_aggregate) {
        const int tid = int(threadIdx.x);
        tmp_.vals[tid] = input;
        __syncthreads();
        T before{}, all{};
        for (int i = 0; i < BLOCK_THREADS; ++i) {
            if (i == tid) before = all;
            all += tmp_.vals[i];
        }
        output = before;
        block_aggregate = all;
    }
    void ExclusiveSum(T input, T& output) {
        T agg;
        ExclusiveSum(input, output, agg);
    }

private:
    TempStorage& tmp_;
};

}  // namespace cub
