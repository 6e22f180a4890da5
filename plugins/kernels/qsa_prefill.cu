// Prefill attention (S > 1): exact causal attention of the new tokens over
// every cached token of the sequence and the new tokens up to their own
// position, tiled so the paged cache is read once per query tile.
//
// CPU reference: tinyserve_trt/ops/reference.py::sparse_attention_ref with
// S > 1 (all valid pages; causal over the new tokens); tests/kernels compare
// with it, including a 1K+ token prefill.
//
// Shape of the work: grid (ceil(S / BQ), Hkv * gchunks, B). A block owns a
// query tile of kRows rows = BQ positions x ng query heads of one GQA group
// (row r: head g0 + r % ng, position s0 + r / ng), so one K/V tile serves the
// whole group and BQ positions. It walks the keys (cached ones through the
// page table, then the new ones) in tiles of kKeys rows held in shared memory
// as fp32 (cold INT8/INT4 rows dequantized on load), and per tile:
//   scores (thread per (row, key) pair) -> online-softmax row update (thread
//   per row) -> accumulator update (thread per (row, channel)).
// No shuffles and four barriers per key tile; the accumulators live in shared
// memory, so any head dim up to QSA_MAX_HEAD_DIM fits without register spills.
// Plain loads only: the CPU emulation runs exactly this code.
//
// Bytes moved per (sequence, KV head): ceil(S / BQ) * (past + S) * 2 * D *
// sizeof(T) of K/V (was S * (past + S) * 2 * D: once per position), + the
// queries and outputs once.
#include "qsa_common.cuh"

namespace qsa {
namespace {

constexpr int kThreads = 128;
constexpr int kRows = 16;  // query rows (position x head) per block
constexpr int kKeys = 16;  // keys per shared-memory tile

size_t prefill_smem(int D) {
    // q, acc: [kRows, D]; k, v: [kKeys, D]; scores [kRows, kKeys]; m, l, corr [kRows]
    return (size_t(2) * kRows * D + size_t(2) * kKeys * D + kRows * kKeys + 3 * kRows) * sizeof(float);
}

template <typename T, int CF>
__global__ void __launch_bounds__(kThreads) prefill_tiled_kernel(QsaForwardParams p, int gchunks) {
    QSA_DYNAMIC_SHARED(float, smem);
    const QsaDims& d = p.dims;
    const int D = d.head_dim, ps = d.page_size, NP = d.table_width, Hkv = d.num_kv_heads, S = d.new_tokens;
    const int h = blockIdx.y / gchunks, gc = blockIdx.y % gchunks, b = blockIdx.z;
    const int G = d.num_heads / Hkv, g0 = gc * QSA_MAX_GROUP_PER_BLOCK;
    const int ng = min(QSA_MAX_GROUP_PER_BLOCK, G - g0);
    const int bq = kRows / min(QSA_MAX_GROUP_PER_BLOCK, G);  // positions per tile, as the launcher sized the grid
    const int s0 = blockIdx.x * bq;
    const int tid = threadIdx.x;
    float* q_s = smem;                    // [kRows, D], pre-scaled
    float* acc = q_s + kRows * D;         // [kRows, D]
    float* k_s = acc + kRows * D;         // [kKeys, D]
    float* v_s = k_s + kKeys * D;         // [kKeys, D]
    float* sc = v_s + kKeys * D;          // [kRows, kKeys]
    float* m_s = sc + kRows * kKeys;      // [kRows]
    float* l_s = m_s + kRows;             // [kRows]
    float* corr = l_s + kRows;            // [kRows]

    const float scale = p.attrs.scale > 0.f ? p.attrs.scale : rsqrtf(float(D));
    const size_t hq0 = size_t(b) * d.num_heads + size_t(h) * G + g0;
    const T* q = static_cast<const T*>(p.query);
    // row r is valid when its position exists: r / ng < bq and s0 + r / ng < S
    auto row_pos = [&](int r) { return r / ng < bq ? s0 + r / ng : S; };
    for (int i = tid; i < kRows * D; i += kThreads) {
        const int r = i / D, dd = i % D, s = row_pos(r);
        q_s[i] = s < S ? to_f(q[((hq0 + r % ng) * S + s) * D + dd]) * scale : 0.f;
        acc[i] = 0.f;
    }
    if (tid < kRows) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.f;
    }

    const int past = max(p.past_lens[b], 0);
    const int cached = min(past, NP * ps);
    if (tid == 0 && blockIdx.x == 0 && past > cached) raise_flag(p.error_flags, QSA_FLAG_TOO_MANY_PAGES);
    const int s_last = min(S, s0 + bq) - 1;
    const int total = cached + s_last + 1;  // keys any row of this tile may see
    const T* kn = static_cast<const T*>(p.key) + (size_t(b) * Hkv + h) * S * D;
    const T* vn = static_cast<const T*>(p.value) + (size_t(b) * Hkv + h) * S * D;
    const ScaleView ksv = scale_view(p.key_scale, p.cold.key_scale_tokens, p.cold.key_scale_channels, D);
    const ScaleView vsv = value_scale_view<CF == kNoCold ? kColdInt8 : CF>(p, D);
    __shared__ int key_ok[kKeys];

    for (int j0 = 0; j0 < total; j0 += kKeys) {
        // ---- K/V tile -> shared memory (fp32); key_ok = the row exists in a tier ----
        for (int i = tid; i < kKeys * D; i += kThreads) {
            const int kk = i / D, dd = i % D, j = j0 + kk;
            float kv = 0.f, vv = 0.f;
            bool ok = j < total;
            if (ok && j < cached) {
                const int page = p.page_table[size_t(b) * NP + j / ps], off = j % ps;
                if (page >= 0 && page < d.num_pages) {
                    const size_t at = ((size_t(page) * Hkv + h) * ps + off) * D + dd;
                    kv = to_f(static_cast<const T*>(p.key_cache)[at]);
                    vv = to_f(static_cast<const T*>(p.value_cache)[at]);
                } else if (CF != kNoCold && page >= d.num_pages && page - d.num_pages < p.cold.num_pages) {
                    constexpr int F = CF == kNoCold ? kColdInt8 : CF;  // compiled out when kNoCold
                    const size_t page_head = size_t(page - d.num_pages) * Hkv + h, row = page_head * ps + off;
                    kv = cold_key<T, F>(p, ksv, page, h, page_head, row, off, D, dd);
                    vv = cold_v<F>(p, vsv, page_head, row, off, D, dd);
                } else {
                    ok = false;
                    if (dd == 0) raise_flag(p.error_flags, QSA_FLAG_BAD_PAGE_ID);
                }
            } else if (ok) {
                kv = to_f(kn[size_t(j - cached) * D + dd]);
                vv = to_f(vn[size_t(j - cached) * D + dd]);
            }
            k_s[i] = kv;
            v_s[i] = vv;
            if (dd == 0) key_ok[kk] = ok;
        }
        __syncthreads();
        // ---- scores: one (row, key) pair per thread step; -inf where causally masked ----
        for (int i = tid; i < kRows * kKeys; i += kThreads) {
            const int r = i / kKeys, kk = i % kKeys, j = j0 + kk, s = row_pos(r);
            float x = -INFINITY;
            if (s < S && key_ok[kk] && (j < cached || j - cached <= s)) {
                x = 0.f;
                for (int dd = 0; dd < D; ++dd) x += q_s[r * D + dd] * k_s[kk * D + dd];
            }
            sc[i] = x;
        }
        __syncthreads();
        // ---- online softmax per row: new max, rescale factor, probabilities in place ----
        if (tid < kRows) {
            float mx = m_s[tid];
            for (int kk = 0; kk < kKeys; ++kk) mx = fmaxf(mx, sc[tid * kKeys + kk]);
            const float c = m_s[tid] == -INFINITY ? 0.f : expf(m_s[tid] - mx);
            float sum = 0.f;
            for (int kk = 0; kk < kKeys; ++kk) {
                const float x = sc[tid * kKeys + kk];
                const float pr = x == -INFINITY ? 0.f : expf(x - mx);
                sc[tid * kKeys + kk] = pr;
                sum += pr;
            }
            l_s[tid] = l_s[tid] * c + sum;
            m_s[tid] = mx;
            corr[tid] = c;
        }
        __syncthreads();
        // ---- accumulators: one (row, channel) per thread step ----
        for (int i = tid; i < kRows * D; i += kThreads) {
            const int r = i / D, dd = i % D;
            float a = acc[i] * corr[r];
            for (int kk = 0; kk < kKeys; ++kk) a += sc[r * kKeys + kk] * v_s[kk * D + dd];
            acc[i] = a;
        }
        __syncthreads();  // the next tile overwrites k_s, v_s, sc
    }
    T* out = static_cast<T*>(p.output);
    for (int i = tid; i < kRows * D; i += kThreads) {
        const int r = i / D, dd = i % D, s = row_pos(r);
        if (s < S) out[((hq0 + r % ng) * S + s) * D + dd] = from_f<T>(acc[i] / l_s[r]);
    }
}

template <typename T, int CF>
cudaError_t launch_t(const QsaForwardParams& p, cudaStream_t stream) {
    const QsaDims& d = p.dims;
    const int G = d.num_heads / d.num_kv_heads, gchunks = (G + QSA_MAX_GROUP_PER_BLOCK - 1) / QSA_MAX_GROUP_PER_BLOCK;
    const int ng_max = min(QSA_MAX_GROUP_PER_BLOCK, G);  // the tile height is set by the fullest chunk
    const int bq = kRows / ng_max;
    const dim3 grid((d.new_tokens + bq - 1) / bq, d.num_kv_heads * gchunks, d.batch);
    const size_t smem = prefill_smem(d.head_dim);
    if (smem > 48 * 1024) {  // large head dims: opt in (host-side attribute, no device work)
        const cudaError_t e = cudaFuncSetAttribute(prefill_tiled_kernel<T, CF>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        if (e != cudaSuccess) return e;
    }
    return launch_kernel(prefill_tiled_kernel<T, CF>, grid, kThreads, smem, stream, p, gchunks);
}

template <typename T>
cudaError_t launch_dtype(const QsaForwardParams& p, cudaStream_t stream) {
    if (p.key_cache_int8 == nullptr) return launch_t<T, kNoCold>(p, stream);
    return p.cold.format == QSA_COLD_FORMAT_INT4 ? launch_t<T, kColdInt4>(p, stream) : launch_t<T, kColdInt8>(p, stream);
}

}  // namespace

cudaError_t launch_prefill(const QsaForwardParams& p, cudaStream_t stream) {
    if (p.dtype == QSA_DTYPE_FLOAT16) return launch_dtype<__half>(p, stream);
    return launch_dtype<float>(p, stream);
}

}  // namespace qsa
