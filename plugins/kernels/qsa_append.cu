// Append the new tokens' K/V to their pages and refresh the touched pages'
// key_min/key_max: the write side of the cache that QueryAwareSparseAttention
// itself never modifies.
//
// CPU reference: tinyserve_dev/kernels/references.py::append_kv_ref (slot =
// past_len + i in logical page slot // ps; metadata = ops.reference.page_min_max
// over the page's valid keys).
//
// One block per (sequence, KV head), threads over D. Thread d writes column d
// of every new row and then reads column d of the touched pages back, so its
// own program order makes the reads see the writes: no barrier, one launch.
// Min/max are recomputed from the page's valid rows instead of merged with the
// old metadata, because a freshly allocated page holds stale metadata.
//
// Bytes moved: 2 * S * D * sizeof(T) written, plus touched_pages * ps * D *
// sizeof(T) re-read and 2 * touched_pages * D * sizeof(T) metadata written.
#include "qsa_common.cuh"

namespace qsa {
namespace {

template <typename T>
__global__ void append_kernel(QsaAppendParams p) {
    const QsaDims& d = p.dims;
    const int h = blockIdx.x, b = blockIdx.y;
    const int D = d.head_dim, ps = d.page_size, NP = d.table_width, Hkv = d.num_kv_heads, S = d.new_tokens;
    const int past = max(p.past_lens[b], 0);
    const T* kn = static_cast<const T*>(p.key) + (size_t(b) * Hkv + h) * S * D;
    const T* vn = static_cast<const T*>(p.value) + (size_t(b) * Hkv + h) * S * D;
    T* kc = static_cast<T*>(p.key_cache);
    T* vc = static_cast<T*>(p.value_cache);
    if (threadIdx.x == 0 && past + S > NP * ps) raise_flag(p.error_flags, QSA_FLAG_TOO_MANY_PAGES);
    for (int i = 0; i < S; ++i) {
        const int slot = past + i, lp = slot / ps;
        if (lp >= NP) break;
        const int page = p.page_table[size_t(b) * NP + lp];
        if (page < 0 || page >= d.num_pages) {
            if (threadIdx.x == 0) raise_flag(p.error_flags, QSA_FLAG_BAD_PAGE_ID);
            continue;
        }
        const size_t row = ((size_t(page) * Hkv + h) * ps + slot % ps) * D;
        for (int dd = threadIdx.x; dd < D; dd += blockDim.x) {
            kc[row + dd] = kn[size_t(i) * D + dd];
            vc[row + dd] = vn[size_t(i) * D + dd];
        }
    }
    const int end = past + S;
    for (int lp = past / ps; lp * ps < end && lp < NP; ++lp) {
        const int page = p.page_table[size_t(b) * NP + lp];
        if (page < 0 || page >= d.num_pages) continue;
        const int valid = min(ps, end - lp * ps);
        const size_t base = (size_t(page) * Hkv + h) * ps * D;
        for (int dd = threadIdx.x; dd < D; dd += blockDim.x) {
            float lo = INFINITY, hi = -INFINITY;
            for (int r = 0; r < valid; ++r) {
                const float x = to_f(kc[base + size_t(r) * D + dd]);
                lo = fminf(lo, x);
                hi = fmaxf(hi, x);
            }
            const size_t meta = (size_t(page) * Hkv + h) * D + dd;
            static_cast<T*>(p.key_min)[meta] = from_f<T>(lo);  // exact: lo is one of the T values
            static_cast<T*>(p.key_max)[meta] = from_f<T>(hi);
        }
    }
}

}  // namespace

cudaError_t launch_append(const QsaAppendParams& p, cudaStream_t stream) {
    const dim3 grid(p.dims.num_kv_heads, p.dims.batch);
    const int threads = p.dims.head_dim < 128 ? 64 : 128;
    if (p.dtype == QSA_DTYPE_FLOAT16) return launch_kernel(append_kernel<__half>, grid, threads, 0, stream, p);
    return launch_kernel(append_kernel<float>, grid, threads, 0, stream, p);
}

}  // namespace qsa
