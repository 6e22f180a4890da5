// Internal to plugins/kernels: dtype helpers, warp reductions, the workspace
// layout, and the host-side launch functions each .cu file provides.
// No TensorRT types here (STYLE principle 10).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#include <utility>

#include "qsa_launch.h"
#include "qsa_math.h"  // the element math (cold decode, sub-page bounds), shared with the CPU node

// A block's dynamic shared memory. Under g++ (plugins/emulation) `extern` and
// `static` cannot combine, so the emulator hands out the block's buffer instead.
#ifdef QSA_EMULATION
#define QSA_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(::qsa_emu::dynamic_shared())
#else
#define QSA_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

namespace qsa {

// Every kernel launch goes through here: `<<<>>>` under nvcc, the CPU
// emulator's launcher under g++ (plugins/emulation/cuda_emu.h), so both run
// the same kernel source. Returns the launch's error (cudaGetLastError).
template <typename... KArgs, typename... Args>
inline cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                 cudaStream_t stream, Args&&... args) {
#ifdef QSA_EMULATION
    (void)stream;
    return ::qsa_emu::launch(kernel, grid, block, smem, std::forward<Args>(args)...);
#else
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return cudaGetLastError();
#endif
}

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// The cold tier's format as a kernel template argument: the kernels compile the
// cold read out (kNoCold: it costs registers, see ptxas -v) or in for one format.
constexpr int kNoCold = -1;
constexpr int kColdInt8 = QSA_COLD_FORMAT_INT8;
constexpr int kColdInt4 = QSA_COLD_FORMAT_INT4;

// One scale tensor of the cold tier, [Pcold, Hkv, T, C * pairs] with T in {1, ps}: float32
// (INT8) or float16 (INT4; V holds pairs = 2: C scales, then C mins). A broadcast token axis
// gets stride 0 and channel dd reads column dd >> ch_shift (C == D: 0; C == 1: a shift past
// any head dim; channel groups of D / C = 2^k: k), its min C columns later, so one formula
// serves every granularity and no thread branches on it.
struct ScaleView {
    const void* base;
    int32_t head_stride;  // T * C * pairs elements per (cold page, KV head)
    int32_t tok_stride;   // C * pairs, or 0 when one scale covers all tokens
    int32_t ch_shift;
    int32_t min_offset;   // C (INT4 V: the mins follow the scales), else 0

    template <int CF>
    __device__ __forceinline__ float load(size_t i) const {
        if constexpr (CF == kColdInt4) return __half2float(static_cast<const __half*>(base)[i]);
        else return static_cast<const float*>(base)[i];
    }
    __device__ __forceinline__ size_t index(size_t page_head, int tok, int dd) const {
        return page_head * head_stride + size_t(tok) * tok_stride + size_t(dd >> ch_shift);
    }
    // Scale of channel dd in row `tok` of (cold page, KV head) `page_head`, as float.
    template <int CF>
    __device__ __forceinline__ float at(size_t page_head, int tok, int dd) const {
        return load<CF>(index(page_head, tok, dd));
    }
    // INT4 V: the group's min (float16), as float.
    template <int CF>
    __device__ __forceinline__ float min_at(size_t page_head, int tok, int dd) const {
        return load<CF>(index(page_head, tok, dd) + min_offset);
    }
};

static_assert(QSA_MAX_HEAD_DIM < (1 << 9), "ScaleView's broadcast shift must exceed every channel index");

// log2 of D / C when it is a power of two (C == D: 0), 9 for C == 1, -1 otherwise (refused).
__host__ __device__ inline int32_t scale_ch_shift(int32_t channels, int32_t head_dim) {
    if (channels == 1) return 9;
    if (channels < 1 || head_dim % channels) return -1;
    const int32_t g = head_dim / channels;
    if (g & (g - 1)) return -1;
    int32_t k = 0;
    while ((1 << k) < g) ++k;
    return k;
}

// `columns`: the tensor's last dim (QsaColdDims); `pairs` 2 for INT4 V (scales + mins).
__host__ __device__ inline ScaleView scale_view(const void* scale, int32_t tokens, int32_t columns,
                                                int32_t head_dim, int32_t pairs = 1) {
    const int32_t channels = columns / pairs;
    return ScaleView{scale, tokens * columns, tokens > 1 ? columns : 0, scale_ch_shift(channels, head_dim),
                     pairs == 2 ? channels : 0};
}

// Quantized value of channel dd of cold row `row` (= cold page * Hkv + KV head) * ps + token,
// as float: INT8 is the int8 itself; INT4 is the nibble q in [0, 15], channel dd < D/2 in the low
// nibble of byte dd and dd >= D/2 in the high nibble of byte dd - D/2 (ops/cold_codec.py::pack_int4).
template <int CF>
__device__ __forceinline__ float cold_value(const void* pool, size_t row, int D, int dd) {
    if constexpr (CF == kColdInt4) {
        return qsa_math::int4_level(static_cast<const uint8_t*>(pool) + row * size_t(D >> 1), D, dd);
    } else {
        return float(static_cast<const int8_t*>(pool)[row * D + dd]);
    }
}

// The scale view of the cold values: INT4 V holds scales and mins (pairs 2).
template <int CF>
__host__ __device__ inline ScaleView value_scale_view(const QsaForwardParams& p, int32_t head_dim) {
    return scale_view(p.value_scale, p.cold.value_scale_tokens, p.cold.value_scale_channels, head_dim,
                      CF == kColdInt4 ? 2 : 1);
}

// Cold value of channel dd, row `row` (as cold_value). INT8: q * scale. INT4 (format 3,
// asymmetric): q * scale + min, single-rounded float32 (no FMA contraction: the reference's order).
template <int CF>
__device__ __forceinline__ float cold_v(const QsaForwardParams& p, const ScaleView& vsv, size_t page_head,
                                        size_t row, int off, int D, int dd) {
    const float q = cold_value<CF>(p.value_cache_int8, row, D, dd);
    if constexpr (CF == kColdInt4) {
        return qsa_math::int4_value(q, vsv.at<CF>(page_head, off, dd), vsv.min_at<CF>(page_head, off, dd));
    } else {
        return qsa_math::int8_value(q, vsv.at<CF>(page_head, off, dd));
    }
}

// Cold key of channel dd, row `row` (as cold_value), of physical page `page` and KV head h, as
// float. INT8: q * scale. INT4 (format 3): the nibble q in [0, 15] between lo and hi,
// min(lo + q * step, hi) with step = (hi - lo) * f32(1/15), single-rounded float32 ops (no FMA
// contraction), so the key stays inside them (the selection's bounds). lo/hi: the page's
// key_min/key_max, or - two-level (0 < sub_page_size < ps) - the token's sub-page bounds its
// key_sub_bounds code decodes to (ops/fine_bounds.py::decode: kmin + (code & 15) * pstep,
// kmax - (code >> 4) * pstep, pstep = (kmax - kmin) * f32(1/15)).
template <typename T, int CF>
__device__ __forceinline__ float cold_key(const QsaForwardParams& p, const ScaleView& ksv, int page, int h,
                                          size_t page_head, size_t row, int off, int D, int dd) {
    if constexpr (CF == kColdInt4) {
        const size_t m = (size_t(page) * p.dims.num_kv_heads + h) * D + dd;
        float lo = to_f(static_cast<const T*>(p.key_min)[m]);
        float hi = to_f(static_cast<const T*>(p.key_max)[m]);
        const int sp = p.attrs.sub_page_size, ps = p.dims.page_size;
        if (sp > 0 && sp < ps && p.key_sub_bounds != nullptr) {
            const int r = ps / sp;
            const uint8_t code = static_cast<const uint8_t*>(
                p.key_sub_bounds)[((size_t(page) * p.dims.num_kv_heads + h) * r + off / sp) * D + dd];
            qsa_math::sub_bounds(lo, hi, code, &lo, &hi);
        }
        return qsa_math::int4_key(cold_value<CF>(p.key_cache_int8, row, D, dd), lo, qsa_math::level_step(lo, hi), hi);
    } else {
        return qsa_math::int8_value(cold_value<CF>(p.key_cache_int8, row, D, dd), ksv.at<CF>(page_head, off, dd));
    }
}

// One 16-byte load (both pointers 16-byte aligned). memcpy under the emulation,
// where a uint4 view of float/__half data would break C++ aliasing rules.
__device__ __forceinline__ void load16(void* dst, const void* src) {
#ifdef QSA_EMULATION
    memcpy(dst, src, 16);
#else
    *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#endif
}

// Report a bad page id / full page table to the host (qsa_launch.h error_flags).
__device__ __forceinline__ void raise_flag(int32_t* flags, int32_t bit) {
    if (flags) atomicOr(flags, bit);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Two-level selection (attribute sub_page_size not 0 and not ps): decode keeps
// sub-pages of sp tokens instead of whole pages. sub_page_size == ps is single-level.
__host__ __device__ inline bool two_level(const QsaAttrs& a, int32_t page_size) {
    return a.sub_page_size > 0 && a.sub_page_size != page_size;
}

// Tokens per entry of the kept list: a sub-page (two-level) or a page.
__host__ __device__ inline int32_t kept_unit_tokens(const QsaForwardParams& p) {
    return two_level(p.attrs, p.dims.page_size) ? p.attrs.sub_page_size : p.dims.page_size;
}

// group_reduce "head" on a decode step whose selection reads the query (policy query_aware): each
// query head of a GQA group selects alone and attends its own units. Window and dense selections do
// not read the query, so every head of a group would select the same units: those stay shared (one
// selection per KV head, its K/V read once for the group), which is the same result.
__host__ __device__ inline bool per_head_select(const QsaForwardParams& p) {
    return p.dims.new_tokens == 1 && p.attrs.group_reduce == QSA_GROUP_REDUCE_HEAD &&
           p.attrs.policy == QSA_POLICY_QUERY_AWARE;
}

// Selection units per sequence, U: one per query head (per_head_select: U = H), else one per KV head
// (U = Hkv). The kept list has a row per (sequence, unit); the select kernels run a block per unit.
__host__ __device__ inline int32_t select_units(const QsaForwardParams& p) {
    return per_head_select(p) ? p.dims.num_heads : p.dims.num_kv_heads;
}

// One selection unit: the KV head whose pages it scores, the query heads [q_head, q_head + nq) whose
// queries it scores (its group's G, reduced by group_reduce, or - per head - its own one), and its row
// b * U + unit of the kept list (and of the workspace's score rows).
struct SelectUnit {
    int32_t kv_head, q_head, nq;
    size_t row;
};

__host__ __device__ inline SelectUnit select_unit(const QsaForwardParams& p, int32_t b, int32_t unit) {
    const int32_t G = p.dims.num_heads / p.dims.num_kv_heads;
    if (per_head_select(p)) return SelectUnit{unit / G, unit, 1, size_t(b) * p.dims.num_heads + unit};
    return SelectUnit{unit, unit * G, G, size_t(b) * p.dims.num_kv_heads + unit};
}

// Scratch carved out of the caller's workspace; the same function sizes it
// (base == nullptr) and lays it out, so qsa_workspace_size cannot drift from
// what the kernels index. A kept-list entry u is logical page u / r, sub-page
// u % r (r = ps / unit tokens; r = 1 single-level). The selection rows are sized
// for B * H units (U <= H: per query head or per KV head), so the size depends on
// the dims alone and a plugin sizes it once, whatever group_reduce is.
struct Workspace {
    int32_t* kept_idx;  // [B, U, kept_width] kept units a decode step attends, ascending (room: B * H rows)
    int32_t* kept_cnt;  // [B, U]
    float* scores;      // [B, U, NP] page scores when they do not fit in shared memory
    float* fine;        // [B, U, NP * r] two-level: candidate sub-page scores (compact); null if r <= 1
    int32_t* cand;      // [B, U, NP] two-level: candidate logical pages, ascending; null if r <= 1
    float* part_m;      // [B, H, splits_cap] running max of each split (log-sum-exp state)
    float* part_l;      // [B, H, splits_cap] softmax denominator of each split
    float* part_acc;    // [B, H, splits_cap, D] unnormalised output of each split
    int32_t kept_width; // NP * max(1, r): room for every sub-page of a full table
    int32_t splits_cap;
    size_t bytes;
};

inline size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

inline int32_t splits_cap(const QsaDims& d) {
    int32_t np = d.table_width > 0 ? d.table_width : 1;
    return np < QSA_MAX_SPLITS ? np : QSA_MAX_SPLITS;
}

inline Workspace layout_workspace(const QsaDims& d, void* base) {
    Workspace w{};
    w.splits_cap = splits_cap(d);
    const int32_t r = d.sub_pages > 1 ? d.sub_pages : 1;
    w.kept_width = d.table_width * r;
    const size_t bh = size_t(d.batch) * d.num_heads;
    const size_t units = bh;  // selection rows: B * U with U <= H (select_units)
    const size_t np = size_t(d.table_width);
    size_t off = 0;
    char* p = static_cast<char*>(base);
    auto take = [&](size_t bytes) -> void* {
        void* r = p ? p + off : nullptr;
        off += align_up(bytes);
        return r;
    };
    w.kept_idx = static_cast<int32_t*>(take(units * size_t(w.kept_width) * sizeof(int32_t)));
    w.kept_cnt = static_cast<int32_t*>(take(units * sizeof(int32_t)));
    w.scores = static_cast<float*>(take(units * np * sizeof(float)));
    if (r > 1) {
        w.fine = static_cast<float*>(take(units * size_t(w.kept_width) * sizeof(float)));
        w.cand = static_cast<int32_t*>(take(units * np * sizeof(int32_t)));
    }
    w.part_m = static_cast<float*>(take(bh * w.splits_cap * sizeof(float)));
    w.part_l = static_cast<float*>(take(bh * w.splits_cap * sizeof(float)));
    w.part_acc = static_cast<float*>(take(bh * w.splits_cap * size_t(d.head_dim) * sizeof(float)));
    w.bytes = off;
    return w;
}

// Host launchers, one per kernel file. Each returns the launch's cudaError_t.
cudaError_t launch_select(const QsaForwardParams& p, const Workspace& ws, bool all_pages, cudaStream_t stream);
cudaError_t launch_select_two_level(const QsaForwardParams& p, const Workspace& ws, cudaStream_t stream);
cudaError_t launch_decode(const QsaForwardParams& p, const Workspace& ws, int32_t splits, cudaStream_t stream);
cudaError_t launch_prefill(const QsaForwardParams& p, cudaStream_t stream);
cudaError_t launch_append(const QsaAppendParams& p, cudaStream_t stream);

// Shared memory the select kernel needs: its unit's queries (the group's G, or one
// per head), plus the page scores when they fit (the fused path); 0 scores bytes means
// they go to the workspace. 40 KB of dynamic shared memory leaves room for the kernel's
// static part (scan storage, histogram) under the 48 KB default without opt-in attributes.
constexpr size_t kSelectSmemLimit = 40 * 1024;
inline size_t select_query_smem(const QsaForwardParams& p) {
    return size_t(select_unit(p, 0, 0).nq) * p.dims.head_dim * sizeof(float);
}
inline bool select_scores_in_smem(const QsaForwardParams& p) {
    return select_query_smem(p) + size_t(p.dims.table_width) * sizeof(float) <= kSelectSmemLimit;
}

}  // namespace qsa
