// Two-level selection for a decode step (attribute sub_page_size = sp, 0 < sp < ps):
// candidate pages by the page score, then the candidates' sub-pages by the bound
// decoded from key_sub_bounds. One block per (sequence, selection unit: a KV head, or
// with group_reduce head a query head with its own candidates and sub-pages), fused like
// qsa_select.cu (whose helpers, qsa_topk.cuh, and selected_pages union it shares).
//
// CPU reference: tinyserve_trt/ops/two_level.py (select_sub_pages,
// candidate_pages) with ops/fine_bounds.py::decode. The rule is
// qsa_math::sub_page_rule (qsa_select_math.h, shared with the CPU node; n pages,
// r = ps / sp sub-pages each, nw = ceil(past / sp) written sub-pages): the forced
// pages' written sub-pages are kept (the last page is always forced, recent_pages
// >= 1, so only forced pages hold unwritten sub-pages); a budget <= 0, or one that
// covers every written sub-page, keeps them all; else the candidate pages are the
// forced ones plus rule.pages.kept_free() best-scored others, and the kept
// sub-pages the forced ones plus the rule's kept_free(nc) best of the nc candidate
// sub-pages; ties -> lower index, NaN last (qsa_math::order_key, as numpy).
// Scores: the page's Quest bound from key_min/key_max, combined over the GQA
// group by group_reduce (per head: its own query's); a sub-page's the same bound from its decoded [lo, hi]:
//   step = (kmax - kmin) * f32(1/15); lo = kmin + (c & 15) * step; hi = kmax - (c >> 4) * step
// each a single-rounded float32 operation (__fmul_rn etc.: no FMA contraction),
// so lo/hi equal fine_bounds.decode's bit for bit.
//
// Output: the kept list in the workspace holds sub-page units u = page * r + j,
// ascending (sink pages' units, kept candidate units, recent pages' written
// units), which decode_split_kernel walks in sp-row runs; selected_pages marks a
// page when any of its sub-pages is kept (ops/reference.py).
//
// Bytes moved per (sequence, unit): the single-level step's n * 2 * D *
// sizeof(T) of key_min/key_max, plus per candidate page 2 * D * sizeof(T)
// (its bounds again, cached) and r * D bytes of codes.
#include "qsa_topk.cuh"

namespace qsa {
namespace {

template <typename T>
__global__ void __launch_bounds__(kSelectThreads)
    select_two_level_kernel(QsaForwardParams p, Workspace ws, int scores_in_smem) {
    __shared__ typename SelectScan::TempStorage scan_tmp;
    __shared__ RadixShared radix;
    QSA_DYNAMIC_SHARED(float, smem);

    const QsaDims& d = p.dims;
    const int b = blockIdx.y;
    const int NP = d.table_width, ps = d.page_size, D = d.head_dim, Hkv = d.num_kv_heads;
    const int sp = p.attrs.sub_page_size, r = ps / sp;
    const SelectRow row = select_row(p, ws, b, blockIdx.x);
    const SelectUnit& unit = row.unit;
    const int h = unit.kv_head;
    const size_t urow = unit.row;
    const int n = row.n;
    const qsa_math::SubPageRule rule =
        qsa_math::sub_page_rule(n, row.past, p.token_budget[b], ps, sp, p.attrs.candidate_share,
                                p.attrs.sink_pages, p.attrs.recent_pages);
    const int n_sink = int(rule.pages.n_sink), recent_start = int(rule.pages.recent_start);
    int32_t* kept = row.kept;
    const SelOut sel = row.sel;
    const int nw = int(rule.written);
    if (rule.all) {  // dense: every written sub-page
        for (int u = threadIdx.x; u < nw; u += blockDim.x) kept[u] = u;
        for (int i = threadIdx.x; i < NP; i += blockDim.x) sel.put(i, i < n);
        if (threadIdx.x == 0) ws.kept_cnt[urow] = nw;
        return;
    }
    // Not dense, so some page is not forced: n_sink <= recent_start <= n - 1 and the
    // sink and candidate pages are full (all r sub-pages written).

    // ---- level 1: page scores of the non-forced pages, candidates by radix select ----
    float* q_s = smem;  // [nq, D], float
    float* scores = scores_in_smem ? smem + unit.nq * D : ws.scores + urow * NP;
    load_unit_query<T>(p, q_s, b, unit);
    query_aware_page_scores<T>(p, q_s, scores, b, unit, n_sink, recent_start);
    __syncthreads();

    const int free_pages = recent_start - n_sink;
    const int cand_pages = int(rule.pages.kept_free());  // non-forced candidate pages
    uint32_t prefix = 0;  // with k == all, every key (>= 0) passes key >= prefix
    int krem = free_pages;
    if (cand_pages > 0 && cand_pages < free_pages)
        radix_threshold(scores, n_sink, recent_start, cand_pages, radix, prefix, krem);
    int32_t* cand = ws.cand + urow * NP;
    int eq_base = 0, out_base = 0;
    if (cand_pages > 0) {
        for (int c = n_sink; c < recent_start; c += blockDim.x) {
            const int i = c + threadIdx.x;
            const bool valid = i < recent_start;
            const uint32_t key = valid ? order_key(scores[i]) : 0u;
            const int is_eq = valid && key == prefix;
            int eq_rank, eq_total;
            SelectScan(scan_tmp).ExclusiveSum(is_eq, eq_rank, eq_total);
            __syncthreads();
            const int take = valid && (key > prefix || (is_eq && eq_base + eq_rank < krem));
            int pos, total;
            SelectScan(scan_tmp).ExclusiveSum(take, pos, total);
            __syncthreads();
            if (take) cand[out_base + pos] = i;
            eq_base += eq_total;
            out_base += total;
        }
    }
    const int nc = out_base * r;  // candidate sub-pages (out_base == cand_pages)
    // selected_pages: forced pages now, kept candidates' pages below (after the barrier)
    for (int i = threadIdx.x; i < NP; i += blockDim.x) sel.put(i, i < n_sink || (i >= recent_start && i < n));
    __syncthreads();

    // ---- level 2: sub-page scores of the candidates, one warp per candidate page ----
    float* fine = ws.fine + urow * ws.kept_width;
    {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
        const T* kmin = static_cast<const T*>(p.key_min);
        const T* kmax = static_cast<const T*>(p.key_max);
        const uint8_t* codes = static_cast<const uint8_t*>(p.key_sub_bounds);
        for (int c = warp; c < out_base; c += nwarps) {
            const int page = p.page_table[size_t(b) * NP + cand[c]];
            const bool ok = page >= 0 && page < d.num_meta_pages;
            const size_t page_head = size_t(ok ? page : 0) * Hkv + h;
            float pmin[kMaxEptMeta], pmax[kMaxEptMeta], step[kMaxEptMeta];
#pragma unroll
            for (int e = 0; e < kMaxEptMeta; ++e) {
                const int dd = lane + 32 * e;
                pmin[e] = (ok && dd < D) ? to_f(kmin[page_head * D + dd]) : 0.f;
                pmax[e] = (ok && dd < D) ? to_f(kmax[page_head * D + dd]) : 0.f;
                step[e] = qsa_math::level_step(pmin[e], pmax[e]);
            }
            for (int j = 0; j < r; ++j) {
                const uint8_t* row = codes + (page_head * r + j) * D;
                float lo[kMaxEptMeta], hi[kMaxEptMeta];
#pragma unroll
                for (int e = 0; e < kMaxEptMeta; ++e) {
                    const int dd = lane + 32 * e;
                    const uint8_t code = (ok && dd < D) ? row[dd] : uint8_t(0);
                    lo[e] = qsa_math::sub_lo(pmin[e], qsa_math::code_lo(code), step[e]);
                    hi[e] = qsa_math::sub_hi(pmax[e], qsa_math::code_hi(code), step[e]);
                }
                const float s = group_bound_score(q_s, unit.nq, D, p.attrs.group_reduce, lo, hi);
                if (lane == 0) fine[c * r + j] = ok ? s : -INFINITY;
            }
        }
    }
    __syncthreads();

    // ---- top sub-pages among the candidates; compact the kept list in unit order ----
    const int k2 = int(rule.kept_free(nc));  // >= 0: rule.keep >= rule.forced
    uint32_t prefix2 = 0;
    int krem2 = nc;
    if (k2 > 0 && k2 < nc) radix_threshold(fine, 0, nc, k2, radix, prefix2, krem2);
    const int sink_units = n_sink * r;
    for (int u = threadIdx.x; u < sink_units; u += blockDim.x) kept[u] = u;
    eq_base = 0;
    out_base = sink_units;
    if (k2 > 0) {
        for (int c = 0; c < nc; c += blockDim.x) {
            const int ci = c + threadIdx.x;
            const bool valid = ci < nc;
            const uint32_t key = valid ? order_key(fine[ci]) : 0u;
            const int is_eq = valid && key == prefix2;
            int eq_rank, eq_total;
            SelectScan(scan_tmp).ExclusiveSum(is_eq, eq_rank, eq_total);
            __syncthreads();
            const int take = valid && (key > prefix2 || (is_eq && eq_base + eq_rank < krem2));
            int pos, total;
            SelectScan(scan_tmp).ExclusiveSum(take, pos, total);
            __syncthreads();
            if (take) {
                const int lp = cand[ci / r];
                kept[out_base + pos] = lp * r + ci % r;
                sel.put(lp, true);  // benign: every writer stores true
            }
            eq_base += eq_total;
            out_base += total;
        }
    }
    const int recent_units = recent_start * r;
    for (int u = recent_units + threadIdx.x; u < nw; u += blockDim.x) kept[out_base + u - recent_units] = u;
    if (threadIdx.x == 0) ws.kept_cnt[urow] = out_base + nw - recent_units;
}

}  // namespace

cudaError_t launch_select_two_level(const QsaForwardParams& p, const Workspace& ws, cudaStream_t stream) {
    const QsaDims& d = p.dims;
    const bool in_smem = select_scores_in_smem(p);
    const size_t smem = select_query_smem(p) + (in_smem ? size_t(d.table_width) * sizeof(float) : 0);
    const dim3 grid(select_units(p), d.batch);
    if (p.dtype == QSA_DTYPE_FLOAT16)
        return launch_kernel(select_two_level_kernel<__half>, grid, kSelectThreads, smem, stream, p, ws, int(in_smem));
    return launch_kernel(select_two_level_kernel<float>, grid, kSelectThreads, smem, stream, p, ws, int(in_smem));
}

}  // namespace qsa
