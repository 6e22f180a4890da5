// Block-wide pieces the two selection kernels share (qsa_select.cu: whole pages;
// qsa_select_two_level.cu: candidate pages, then their sub-pages): the page-id
// check, the Quest page score over a warp, and the radix top-K threshold. The score's
// term, the group combination, the keep order and the keep/drop rule are
// qsa_select_math.h's (shared with the CPU node); this file is their parallel form.
// Internal to plugins/kernels; one block of kSelectThreads per (sequence, selection unit):
// a KV head, or with group_reduce head a query head (qsa_common.cuh::select_unit).
#pragma once

#include <cub/block/block_scan.cuh>

#include "qsa_common.cuh"
#include "qsa_select_math.h"

namespace qsa {

constexpr int kSelectThreads = 256;
constexpr int kMaxEptMeta = QSA_MAX_HEAD_DIM / 32;  // channels per lane when a warp covers D
using SelectScan = cub::BlockScan<int, kSelectThreads>;

// qsa_math::order_key: NaN below -inf (numpy's argsort(-score) puts NaN last), so a
// NaN-scored page is kept only after every other one (lowest index first).
using qsa_math::order_key;

// The selected_pages row of one (sequence, KV head): bytes, or int32 for TensorRT. merge (per-head
// selection): the row is the union of the group's units, which clear_selected_kernel zeroed before
// them, so a unit stores only its 1s - never a 0 over a page another head of the group kept.
struct SelOut {
    void* base;
    size_t row;
    bool wide;
    bool merge;
    __device__ void put(int i, bool v) const {
        if (!base || (merge && !v)) return;
        if (wide)
            static_cast<int32_t*>(base)[row + i] = v;
        else
            static_cast<uint8_t*>(base)[row + i] = v;
    }
};

// One block per sequence (the h == 0 one) flags its bad page ids and a full page table
// (the numpy reference raises on both).
__device__ __forceinline__ void check_page_ids(const QsaForwardParams& p, int b, int past, int n) {
    const QsaDims& d = p.dims;
    const int NP = d.table_width, ps = d.page_size;
    if (threadIdx.x == 0 && (past + ps - 1) / ps > NP) raise_flag(p.error_flags, QSA_FLAG_TOO_MANY_PAGES);
    const int64_t id_end = int64_t(d.num_pages) + (p.key_cache_int8 ? p.cold.num_pages : 0);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int page = p.page_table[size_t(b) * NP + i];
        if (page < 0 || page >= id_end) raise_flag(p.error_flags, QSA_FLAG_BAD_PAGE_ID);
    }
}

// One (sequence, selection unit) of a decode step's selection, as both kernels start it: its
// written pages n, the unit (KV head, query heads, row), its kept-list row and its KV head's
// selected_pages row (the rule that decides what is kept: qsa_math::page_rule / sub_page_rule).
// The unit == 0 block also checks the page ids.
struct SelectRow {
    int past, n;
    SelectUnit unit;
    int32_t* kept;
    SelOut sel;
};

__device__ __forceinline__ SelectRow select_row(const QsaForwardParams& p, const Workspace& ws, int b, int unit) {
    const QsaDims& d = p.dims;
    const int NP = d.table_width, ps = d.page_size;
    SelectRow row;
    row.past = max(p.past_lens[b], 0);
    row.n = min((row.past + ps - 1) / ps, NP);
    row.unit = select_unit(p, b, unit);
    row.kept = ws.kept_idx + row.unit.row * ws.kept_width;
    row.sel = SelOut{p.selected_pages, (size_t(b) * d.num_kv_heads + row.unit.kv_head) * NP,
                     p.selected_pages_elem_size == 4, per_head_select(p)};
    if (unit == 0) check_page_ids(p, b, row.past, row.n);
    return row;
}

// The unit's queries (its group's G, or its one query head) into q_s [nq, D] as fp32 (decode:
// S == 1); ends with a barrier, so every thread may read q_s after it.
template <typename T>
__device__ __forceinline__ void load_unit_query(const QsaForwardParams& p, float* q_s, int b, const SelectUnit& u) {
    const QsaDims& d = p.dims;
    const int D = d.head_dim;
    const T* q = static_cast<const T*>(p.query) + (size_t(b) * d.num_heads + size_t(u.q_head)) * D;
    for (int i = threadIdx.x; i < u.nq * D; i += blockDim.x) q_s[i] = to_f(q[i]);
    __syncthreads();
}

// The unit's combined Quest score sum_d max(q*lo, q*hi) of one bound pair held by the
// warp (lane holds channels lane + 32 e); q_s is the unit's [G, D] queries in fp32 (G = 1
// per head: its own score). Every lane of the warp calls it and gets the same value.
__device__ __forceinline__ float group_bound_score(const float* q_s, int G, int D, int group_reduce,
                                                   const float (&lo)[kMaxEptMeta], const float (&hi)[kMaxEptMeta]) {
    const int lane = threadIdx.x & 31;
    float r = 0.f;
    for (int g = 0; g < G; ++g) {
        float t = 0.f;
#pragma unroll
        for (int e = 0; e < kMaxEptMeta; ++e) {
            const int dd = lane + 32 * e;
            if (dd < D) {
                const float qq = q_s[g * D + dd];
                t = qsa_math::bound_madd(t, qsa_math::query_pos(qq), qsa_math::query_neg(qq), lo[e], hi[e]);
            }
        }
        r = qsa_math::group_combine(r, warp_sum(t), g == 0, group_reduce == QSA_GROUP_REDUCE_SUM);
    }
    return r;
}

// Quest scores of logical pages [begin, end) into scores[i] for unit u (its KV head's bounds,
// its nq queries in q_s), one warp per page.
template <typename T>
__device__ void query_aware_page_scores(const QsaForwardParams& p, const float* q_s, float* scores, int b,
                                        const SelectUnit& u, int begin, int end) {
    const QsaDims& d = p.dims;
    const int NP = d.table_width, D = d.head_dim, h = u.kv_head;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const T* kmin = static_cast<const T*>(p.key_min);
    const T* kmax = static_cast<const T*>(p.key_max);
    for (int i = begin + warp; i < end; i += nwarps) {
        const int page = p.page_table[size_t(b) * NP + i];
        float lo[kMaxEptMeta], hi[kMaxEptMeta];
        const bool ok = page >= 0 && page < d.num_meta_pages;
        const size_t row = (size_t(ok ? page : 0) * d.num_kv_heads + h) * D;
#pragma unroll
        for (int e = 0; e < kMaxEptMeta; ++e) {
            const int dd = lane + 32 * e;
            lo[e] = (ok && dd < D) ? to_f(kmin[row + dd]) : 0.f;
            hi[e] = (ok && dd < D) ? to_f(kmax[row + dd]) : 0.f;
        }
        const float r = group_bound_score(q_s, u.nq, D, p.attrs.group_reduce, lo, hi);
        if (lane == 0) scores[i] = ok ? r : -INFINITY;
    }
}

// Shared state of one radix select.
struct RadixShared {
    uint32_t hist[256];
    uint32_t prefix;
    int krem;
};

// The order key `prefix` of the k-th best of scores[begin, end) (0 < k <= end - begin)
// and `krem`, how many of the entries whose key equals it to take (the lowest indices
// first). Kept = key > prefix, or key == prefix among the first krem of those.
// A 4-pass 8-bit radix select on the float's order-preserving bits, O(n) per pass.
// Every thread of the block calls it; it ends synchronised.
__device__ inline void radix_threshold(const float* scores, int begin, int end, int k, RadixShared& sh,
                                       uint32_t& prefix_out, int& krem_out) {
    uint32_t prefix = 0, mask = 0;
    int krem = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < 256; j += blockDim.x) sh.hist[j] = 0;
        __syncthreads();
        for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const uint32_t key = order_key(scores[i]);
            if ((key & mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int cum = 0;
            for (int bin = 255; bin >= 0; --bin) {
                const int c = int(sh.hist[bin]);
                if (cum + c >= krem) {
                    sh.prefix = prefix | (uint32_t(bin) << shift);
                    sh.krem = krem - cum;
                    break;
                }
                cum += c;
            }
        }
        __syncthreads();
        prefix = sh.prefix;
        krem = sh.krem;
        mask |= 0xffu << shift;
        __syncthreads();  // everyone has read sh.prefix/hist before the next pass rewrites them
    }
    prefix_out = prefix;
    krem_out = krem;
}

}  // namespace qsa
