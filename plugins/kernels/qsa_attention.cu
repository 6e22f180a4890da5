// Attention over paged K/V: split-K flash-decoding for decode steps, and a
// simple exact causal kernel for prefill.
//
// CPU reference: tinyserve_trt/ops/reference.py::sparse_attention_ref (the
// loop under "for g in range(G)"): softmax over the kept cached tokens, then
// the new tokens up to and including the query's own position.
//
// Shape of the work:
// * One block serves one KV head and up to QSA_MAX_GROUP_PER_BLOCK of its query
//   heads, so each K/V row loaded from HBM is used by the whole GQA group.
// * A warp owns one token at a time: lanes hold D/32 elements of K and V, the
//   q.k dot product is a warp all-reduce, and each warp keeps its own online-
//   softmax state (m, l, acc); the block merges its warps at the end.
// * Decode: blockIdx.x is a split of the sequence's kept pages (split-K); each
//   split writes (m, l, unnormalised acc) to the workspace and combine_kernel
//   merges them, so a batch-1 step still fills the GPU. Split 0 also attends the
//   new token (its K/V are inputs, not yet in the cache).
// * Prefill: blockIdx.x is the query position s; the block walks every cached
//   token then new tokens 0..s and writes the normalised output directly.
//
// * Cold pages (id >= P, INT8 tier): the row is read as int8 and multiplied by
//   its float32 scale on load (load_cached_row); everything after the load -
//   dot product, online softmax, accumulation - is the hot path's fp32 code.
//
// Bytes moved (decode): kept_tokens * 2 * D * sizeof(T) of K/V per (sequence,
// KV head) for hot pages; for cold ones kept_tokens * 2 * D bytes of int8 plus
// their float32 scales (K per channel: 4 * D per page; V per token: 4 per row),
// + the partials (B * H * splits * (D + 2) * 4, written and read once).
#include "qsa_common.cuh"

namespace qsa {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxG = QSA_MAX_GROUP_PER_BLOCK;

// Lane `lane` loads elements lane + 32 e of a D-wide row into fp32 registers.
template <typename T, int EPT>
__device__ __forceinline__ void load_row(const T* __restrict__ x, float (&r)[EPT], int D, int lane) {
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
        const int dd = lane + 32 * e;
        r[e] = dd < D ? to_f(x[dd]) : 0.f;
    }
}

template <int EPT, int MAXG>
struct WarpState {
    float q[MAXG][EPT];  // pre-multiplied by the softmax scale
    float m[MAXG], l[MAXG], acc[MAXG][EPT];

    __device__ void init() {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            m[g] = -INFINITY;
            l[g] = 0.f;
#pragma unroll
            for (int e = 0; e < EPT; ++e) acc[g][e] = 0.f;
        }
    }

    template <typename T>
    __device__ void attend(const T* __restrict__ k, const T* __restrict__ v, int D, int ng, int lane) {
        float kr[EPT], vr[EPT];
        load_row<T, EPT>(k, kr, D, lane);
        load_row<T, EPT>(v, vr, D, lane);
        update(kr, vr, ng);
    }

    // One K/V row, already in fp32 registers (lane holds elements lane + 32 e).
    __device__ void update(const float (&kr)[EPT], const float (&vr)[EPT], int ng) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g < ng) {
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < EPT; ++e) s += q[g][e] * kr[e];
                s = warp_sum(s);
                const float m_new = fmaxf(m[g], s);
                const float corr = expf(m[g] - m_new);  // m = -inf the first time: 0
                const float pr = expf(s - m_new);
                l[g] = l[g] * corr + pr;
#pragma unroll
                for (int e = 0; e < EPT; ++e) acc[g][e] = acc[g][e] * corr + pr * vr[e];
                m[g] = m_new;
            }
        }
    }
};

// Merge the warps' states of one block. On return, for g < ng and d < D:
// out_m[g], out_l[g] and out_acc[g * D + d] (unnormalised) in shared memory.
template <int EPT, int MAXG>
__device__ void merge_warps(const WarpState<EPT, MAXG>& st, int D, int ng, float* out_m, float* out_l,
                            float* out_acc) {
    __shared__ float sm_m[kWarps][MAXG], sm_l[kWarps][MAXG];
    __shared__ float sm_acc[kWarps][MAXG][EPT * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (lane == 0) {
            sm_m[warp][g] = st.m[g];
            sm_l[warp][g] = st.l[g];
        }
#pragma unroll
        for (int e = 0; e < EPT; ++e) sm_acc[warp][g][lane + 32 * e] = st.acc[g][e];
    }
    __syncthreads();
    for (int g = threadIdx.x; g < ng; g += blockDim.x) {
        float M = -INFINITY;
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][g]);
        float L = 0.f;
        if (M != -INFINITY)
            for (int w = 0; w < kWarps; ++w) L += sm_l[w][g] * expf(sm_m[w][g] - M);
        out_m[g] = M;
        out_l[g] = L;
    }
    for (int i = threadIdx.x; i < ng * D; i += blockDim.x) {
        const int g = i / D, dd = i % D;
        float M = -INFINITY;
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][g]);
        float a = 0.f;
        if (M != -INFINITY)
            for (int w = 0; w < kWarps; ++w) a += sm_acc[w][g][dd] * expf(sm_m[w][g] - M);
        out_acc[g * D + dd] = a;
    }
    __syncthreads();
}

template <typename T, int EPT>
__device__ void load_queries(WarpState<EPT, kMaxG>& st, const T* q_rows, size_t row_stride, int D, int ng,
                             float scale, int lane) {
#pragma unroll
    for (int g = 0; g < kMaxG; ++g)
#pragma unroll
        for (int e = 0; e < EPT; ++e) {
            const int dd = lane + 32 * e;
            st.q[g][e] = (g < ng && dd < D) ? to_f(q_rows[g * row_stride + dd]) * scale : 0.f;
        }
}

// Row `off` of physical page `page`, KV head h, as fp32 K and V in the lane
// layout of WarpState. Returns false for an id in no tier (skipped, see
// qsa_launch.h). COLD = the call has an INT8 tier: a page is wholly hot or
// wholly cold, so the tier is one warp-uniform branch per row (every lane
// takes the same side), never a per-element select. Cold rows are int8 * scale
// in fp32 (ops/reference.py::page_keys_values). Without a cold tier the kernels
// are instantiated with COLD = false and compile to the hot-only code: the cold
// branch costs ~10-25 registers per thread (ptxas -v, sm_90), which hot-only
// calls should not pay.
template <typename T, int EPT, bool COLD>
__device__ __forceinline__ bool load_cached_row(const QsaForwardParams& p, int page, int h, int off, int lane,
                                                float (&kr)[EPT], float (&vr)[EPT]) {
    const QsaDims& d = p.dims;
    const int D = d.head_dim, ps = d.page_size, Hkv = d.num_kv_heads;
    if (page >= 0 && page < d.num_pages) {
        const size_t base = ((size_t(page) * Hkv + h) * ps + off) * D;
        load_row<T, EPT>(static_cast<const T*>(p.key_cache) + base, kr, D, lane);
        load_row<T, EPT>(static_cast<const T*>(p.value_cache) + base, vr, D, lane);
        return true;
    }
    if constexpr (!COLD) return false;
    const int c = page - d.num_pages;
    if (p.key_cache_int8 == nullptr || page < 0 || c >= p.cold.num_pages) return false;
    const size_t page_head = size_t(c) * Hkv + h;
    const size_t base = (page_head * ps + off) * D;
    const int8_t* k = static_cast<const int8_t*>(p.key_cache_int8) + base;
    const int8_t* v = static_cast<const int8_t*>(p.value_cache_int8) + base;
    const ScaleView ksv = scale_view(p.key_scale, p.cold.key_scale_tokens, p.cold.key_scale_channels);
    const ScaleView vsv = scale_view(p.value_scale, p.cold.value_scale_tokens, p.cold.value_scale_channels);
    const float* ks = ksv.row(page_head, off);
    const float* vs = vsv.row(page_head, off);
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
        const int dd = lane + 32 * e;
        kr[e] = dd < D ? float(k[dd]) * ks[dd * ksv.ch_stride] : 0.f;
        vr[e] = dd < D ? float(v[dd]) * vs[dd * vsv.ch_stride] : 0.f;
    }
    return true;
}

__device__ __forceinline__ float resolved_scale(const QsaForwardParams& p) {
    return p.attrs.scale > 0.f ? p.attrs.scale : rsqrtf(float(p.dims.head_dim));
}

// grid (splits, Hkv * gchunks, B). Writes the split's partial state.
template <typename T, int EPT, bool COLD>
__global__ void __launch_bounds__(kWarps * 32)
    decode_split_kernel(QsaForwardParams p, Workspace ws, int splits, int gchunks) {
    __shared__ float s_m[kMaxG], s_l[kMaxG], s_acc[kMaxG * EPT * 32];
    const QsaDims& d = p.dims;
    const int split = blockIdx.x, h = blockIdx.y / gchunks, gc = blockIdx.y % gchunks, b = blockIdx.z;
    const int D = d.head_dim, ps = d.page_size, NP = d.table_width, Hkv = d.num_kv_heads;
    const int G = d.num_heads / Hkv, g0 = gc * kMaxG, ng = min(kMaxG, G - g0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int bh = b * Hkv + h;

    WarpState<EPT, kMaxG> st;
    st.init();
    const T* q = static_cast<const T*>(p.query) + (size_t(b) * d.num_heads + size_t(h) * G + g0) * D;  // S == 1
    load_queries<T, EPT>(st, q, D, D, ng, resolved_scale(p), lane);

    const int past = max(p.past_lens[b], 0);
    const int cnt = ws.kept_cnt[bh];
    const int chunk = (cnt + splits - 1) / splits;
    const int p0 = split * chunk, p1 = min(cnt, p0 + chunk);
    const int ntok = max(p1 - p0, 0) * ps;
    for (int t = warp; t < ntok; t += kWarps) {
        const int off = t % ps;
        const int lp = ws.kept_idx[size_t(bh) * NP + p0 + t / ps];
        if (lp * ps + off >= past) continue;  // slot tail of the partial last page
        float kr[EPT], vr[EPT];
        if (load_cached_row<T, EPT, COLD>(p, p.page_table[size_t(b) * NP + lp], h, off, lane, kr, vr))
            st.update(kr, vr, ng);
    }
    if (split == 0 && warp == kWarps - 1) {  // the new token, not yet in the cache
        const size_t base = size_t(bh) * D;  // [B, Hkv, S == 1, D]
        st.attend(static_cast<const T*>(p.key) + base, static_cast<const T*>(p.value) + base, D, ng, lane);
    }

    merge_warps<EPT, kMaxG>(st, D, ng, s_m, s_l, s_acc);
    const size_t hq0 = size_t(b) * d.num_heads + size_t(h) * G + g0;
    for (int i = threadIdx.x; i < ng * D; i += blockDim.x) {
        const int g = i / D, dd = i % D;
        const size_t slot = (hq0 + g) * ws.splits_cap + split;
        ws.part_acc[slot * D + dd] = s_acc[i];
        if (dd == 0) {
            ws.part_m[slot] = s_m[g];
            ws.part_l[slot] = s_l[g];
        }
    }
}

// grid (H, B): merge the splits of one query head into output[b, hq, 0, :].
template <typename T>
__global__ void combine_kernel(QsaForwardParams p, Workspace ws, int splits) {
    const int hq = blockIdx.x, b = blockIdx.y, D = p.dims.head_dim;
    const size_t row = size_t(b) * p.dims.num_heads + hq;
    const float* m = ws.part_m + row * ws.splits_cap;
    const float* l = ws.part_l + row * ws.splits_cap;
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, m[s]);
    float L = 0.f;
    for (int s = 0; s < splits; ++s) L += m[s] == -INFINITY ? 0.f : l[s] * expf(m[s] - M);
    const float inv = 1.f / L;  // L > 0: split 0 always holds the new token
    T* out = static_cast<T*>(p.output) + row * D;
    for (int dd = threadIdx.x; dd < D; dd += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < splits; ++s)
            if (m[s] != -INFINITY) a += ws.part_acc[(row * ws.splits_cap + s) * D + dd] * expf(m[s] - M);
        out[dd] = from_f<T>(a * inv);
    }
}

// grid (S, Hkv * gchunks, B): exact causal attention of query position s over
// every cached token and new tokens 0..s. Reads the cache once per (s, KV head).
template <typename T, int EPT, bool COLD>
__global__ void __launch_bounds__(kWarps * 32) prefill_kernel(QsaForwardParams p, int gchunks) {
    __shared__ float s_m[kMaxG], s_l[kMaxG], s_acc[kMaxG * EPT * 32];
    const QsaDims& d = p.dims;
    const int s = blockIdx.x, h = blockIdx.y / gchunks, gc = blockIdx.y % gchunks, b = blockIdx.z;
    const int D = d.head_dim, ps = d.page_size, NP = d.table_width, Hkv = d.num_kv_heads, S = d.new_tokens;
    const int G = d.num_heads / Hkv, g0 = gc * kMaxG, ng = min(kMaxG, G - g0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    WarpState<EPT, kMaxG> st;
    st.init();
    const size_t hq0 = size_t(b) * d.num_heads + size_t(h) * G + g0;
    const T* q = static_cast<const T*>(p.query) + (hq0 * S + s) * D;  // rows g are S * D apart
    load_queries<T, EPT>(st, q, size_t(S) * D, D, ng, resolved_scale(p), lane);

    const T* kn = static_cast<const T*>(p.key) + (size_t(b) * Hkv + h) * S * D;
    const T* vn = static_cast<const T*>(p.value) + (size_t(b) * Hkv + h) * S * D;
    const int past = max(p.past_lens[b], 0);
    const int cached = min(past, NP * ps);
    if (threadIdx.x == 0 && past > cached) raise_flag(p.error_flags, QSA_FLAG_TOO_MANY_PAGES);
    const int total = cached + s + 1;
    for (int t = warp; t < total; t += kWarps) {
        if (t < cached) {
            float kr[EPT], vr[EPT];
            if (load_cached_row<T, EPT, COLD>(p, p.page_table[size_t(b) * NP + t / ps], h, t % ps, lane, kr, vr))
                st.update(kr, vr, ng);
            else if (lane == 0)
                raise_flag(p.error_flags, QSA_FLAG_BAD_PAGE_ID);
        } else {
            const size_t base = size_t(t - cached) * D;
            st.attend(kn + base, vn + base, D, ng, lane);
        }
    }
    merge_warps<EPT, kMaxG>(st, D, ng, s_m, s_l, s_acc);
    T* out = static_cast<T*>(p.output);
    for (int i = threadIdx.x; i < ng * D; i += blockDim.x) {
        const int g = i / D, dd = i % D;
        out[((hq0 + g) * S + s) * D + dd] = from_f<T>(s_acc[i] / s_l[g]);
    }
}

template <typename T, int EPT>
cudaError_t launch_decode_t(const QsaForwardParams& p, const Workspace& ws, int32_t splits, cudaStream_t stream) {
    const QsaDims& d = p.dims;
    const int G = d.num_heads / d.num_kv_heads, gchunks = (G + kMaxG - 1) / kMaxG;
    const dim3 grid(splits, d.num_kv_heads * gchunks, d.batch);
    const cudaError_t e =
        p.key_cache_int8 != nullptr
            ? launch_kernel(decode_split_kernel<T, EPT, true>, grid, kWarps * 32, 0, stream, p, ws, splits, gchunks)
            : launch_kernel(decode_split_kernel<T, EPT, false>, grid, kWarps * 32, 0, stream, p, ws, splits, gchunks);
    if (e != cudaSuccess) return e;
    return launch_kernel(combine_kernel<T>, dim3(d.num_heads, d.batch), 128, 0, stream, p, ws, splits);
}

template <typename T, int EPT>
cudaError_t launch_prefill_t(const QsaForwardParams& p, cudaStream_t stream) {
    const QsaDims& d = p.dims;
    const int G = d.num_heads / d.num_kv_heads, gchunks = (G + kMaxG - 1) / kMaxG;
    const dim3 grid(d.new_tokens, d.num_kv_heads * gchunks, d.batch);
    if (p.key_cache_int8 != nullptr)
        return launch_kernel(prefill_kernel<T, EPT, true>, grid, kWarps * 32, 0, stream, p, gchunks);
    return launch_kernel(prefill_kernel<T, EPT, false>, grid, kWarps * 32, 0, stream, p, gchunks);
}

// Elements per lane: the smallest of 1, 2, 4, 8 that covers D (D <= 256).
template <typename T, template <typename, int> class Fn, typename... Args>
cudaError_t dispatch_ept(int D, Args&&... args) {
    if (D <= 32) return Fn<T, 1>::run(args...);
    if (D <= 64) return Fn<T, 2>::run(args...);
    if (D <= 128) return Fn<T, 4>::run(args...);
    return Fn<T, 8>::run(args...);
}

template <typename T, int EPT>
struct DecodeFn {
    static cudaError_t run(const QsaForwardParams& p, const Workspace& ws, int32_t splits, cudaStream_t s) {
        return launch_decode_t<T, EPT>(p, ws, splits, s);
    }
};
template <typename T, int EPT>
struct PrefillFn {
    static cudaError_t run(const QsaForwardParams& p, cudaStream_t s) { return launch_prefill_t<T, EPT>(p, s); }
};

}  // namespace

cudaError_t launch_decode(const QsaForwardParams& p, const Workspace& ws, int32_t splits, cudaStream_t stream) {
    if (p.dtype == QSA_DTYPE_FLOAT16) return dispatch_ept<__half, DecodeFn>(p.dims.head_dim, p, ws, splits, stream);
    return dispatch_ept<float, DecodeFn>(p.dims.head_dim, p, ws, splits, stream);
}

cudaError_t launch_prefill(const QsaForwardParams& p, cudaStream_t stream) {
    if (p.dtype == QSA_DTYPE_FLOAT16) return dispatch_ept<__half, PrefillFn>(p.dims.head_dim, p, stream);
    return dispatch_ept<float, PrefillFn>(p.dims.head_dim, p, stream);
}

}  // namespace qsa
