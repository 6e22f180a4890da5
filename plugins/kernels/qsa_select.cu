// Page scoring + top-K page selection for a decode step, fused: one block per
// (sequence, selection unit) - a KV head whose group's scores combine by group_reduce,
// or with group_reduce head (qsa_common.cuh::per_head_select) a query head scoring with
// its own query, whose block writes its own kept-list row; selected_pages [B, Hkv, NP]
// is then the union over the group (cleared first, each unit storing its 1s).
//
// CPU reference: tinyserve_trt/ops/policies.py (score_ref, reduce_group,
// select_pages). The rule is qsa_math::page_rule (qsa_select_math.h, shared with
// the CPU node): the forced pages (the first sink_pages and last recent_pages of
// the n valid pages) plus the rule's kept_free() best-scored others, ties broken by
// the lower page index (qsa_math::order_key: numpy's stable argsort of -score);
// a budget <= 0, or one that covers every page, keeps all of them.
// The non-forced pages are the contiguous range [n_sink, recent_start).
//
// Why fused: the scores of one (sequence, unit) are consumed only by its own
// selection, so they stay in shared memory (n * 4 bytes; 2048 pages = 8 KB)
// and never round-trip through HBM; the workspace is the fallback when they
// do not fit. Top-K is a 4-pass 8-bit radix select on the float's order-
// preserving bits (O(n) per pass) followed by an ordered block scan that breaks
// ties by index and compacts the kept list, instead of a sort.
//
// Bytes moved per (sequence, unit): n pages * 2 * D * sizeof(T) of
// key_min/key_max (1/ps of the dense K+V bytes) + NP bytes of selected_pages.
// Two-level selection (sub_page_size not 0 or ps) is qsa_select_two_level.cu;
// launch_select hands a decode step to it.
#include "qsa_topk.cuh"

namespace qsa {
namespace {

template <typename T>
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(QsaForwardParams p, Workspace ws, int all_pages, int scores_in_smem) {
    __shared__ typename SelectScan::TempStorage scan_tmp;
    __shared__ RadixShared radix;
    QSA_DYNAMIC_SHARED(float, smem);

    const QsaDims& d = p.dims;
    const int b = blockIdx.y;
    const int NP = d.table_width, ps = d.page_size, D = d.head_dim;
    const SelectRow row = select_row(p, ws, b, blockIdx.x);
    const SelectUnit& unit = row.unit;
    const size_t urow = unit.row;
    const int n = row.n;
    const qsa_math::PageRule rule =
        qsa_math::page_rule(n, p.token_budget[b], ps, p.attrs.sink_pages, p.attrs.recent_pages);
    const int n_sink = int(rule.n_sink), recent_start = int(rule.recent_start);
    int32_t* kept = row.kept;
    const SelOut sel = row.sel;
    const bool dense = all_pages || p.attrs.policy == QSA_POLICY_DENSE || rule.all;
    if (dense) {
        for (int i = threadIdx.x; i < NP; i += blockDim.x) {
            if (i < n) kept[i] = i;
            sel.put(i, i < n);
        }
        if (threadIdx.x == 0) ws.kept_cnt[urow] = n;
        return;
    }

    // ---- scores of the non-forced pages, one warp per page, lanes over D ----
    float* q_s = smem;  // [nq, D], float
    float* scores = scores_in_smem ? smem + unit.nq * D : ws.scores + urow * NP;
    load_unit_query<T>(p, q_s, b, unit);
    if (p.attrs.policy == QSA_POLICY_WINDOW) {
        for (int i = n_sink + threadIdx.x; i < recent_start; i += blockDim.x) scores[i] = float(i);
    } else if (p.attrs.policy == QSA_POLICY_QUERY_AWARE) {  // sum_d max(q*min, q*max), combined over the unit
        query_aware_page_scores<T>(p, q_s, scores, b, unit, n_sink, recent_start);
    }
    __syncthreads();

    // ---- radix select: the key T of the k-th best, and how many ties at T to take ----
    const int k = int(rule.kept_free());  // 0 <= k < recent_start - n_sink
    uint32_t prefix = 0xffffffffu;
    int krem = 0;
    if (k > 0) radix_threshold(scores, n_sink, recent_start, k, radix, prefix, krem);

    // ---- ordered pass: ties at T go to the lowest indices; compact the kept list ----
    int eq_base = 0, out_base = 0;
    for (int c = 0; c < n; c += blockDim.x) {
        const int i = c + threadIdx.x;
        const bool valid = i < n;
        const bool is_forced = valid && rule.forced(i);
        const bool cand = valid && !is_forced && k > 0;
        const uint32_t key = cand ? order_key(scores[i]) : 0u;
        const int is_eq = cand && key == prefix;
        int eq_rank, eq_total;
        SelectScan(scan_tmp).ExclusiveSum(is_eq, eq_rank, eq_total);
        __syncthreads();
        const int keep = is_forced || (cand && (key > prefix || (is_eq && eq_base + eq_rank < krem)));
        int pos, total;
        SelectScan(scan_tmp).ExclusiveSum(keep, pos, total);
        __syncthreads();
        if (keep) kept[out_base + pos] = i;
        if (valid) sel.put(i, keep);
        eq_base += eq_total;
        out_base += total;
    }
    for (int i = n + threadIdx.x; i < NP; i += blockDim.x) sel.put(i, false);
    if (threadIdx.x == 0) ws.kept_cnt[urow] = out_base;
}

// Zeroes selected_pages [B, Hkv, NP] (n entries of `wide` ? 4 : 1 bytes) before a per-head
// selection ORs its units' pages into it (SelOut::merge). Grid-stride.
__global__ void clear_selected_kernel(void* sel, size_t n, int wide) {
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        if (wide)
            static_cast<int32_t*>(sel)[i] = 0;
        else
            static_cast<uint8_t*>(sel)[i] = 0;
    }
}

}  // namespace

cudaError_t launch_select(const QsaForwardParams& p, const Workspace& ws, bool all_pages, cudaStream_t stream) {
    const QsaDims& d = p.dims;
    if (!all_pages && per_head_select(p) && p.selected_pages) {  // the group's units merge: zero first
        const size_t n = size_t(d.batch) * d.num_kv_heads * d.table_width;
        const unsigned blocks = unsigned(n / 256 + 1 < 1024 ? n / 256 + 1 : 1024);
        const cudaError_t e = launch_kernel(clear_selected_kernel, dim3(blocks), 256, 0, stream, p.selected_pages, n,
                                            int(p.selected_pages_elem_size == 4));
        if (e != cudaSuccess) return e;
    }
    if (!all_pages && two_level(p.attrs, p.dims.page_size)) return launch_select_two_level(p, ws, stream);
    const bool in_smem = select_scores_in_smem(p);
    // all_pages (prefill) returns before touching shared memory: ask for none.
    const size_t smem =
        all_pages ? 0 : select_query_smem(p) + (in_smem ? size_t(d.table_width) * sizeof(float) : 0);
    const dim3 grid(select_units(p), d.batch);  // prefill (S > 1): shared units, every page
    if (p.dtype == QSA_DTYPE_FLOAT16)
        return launch_kernel(select_kernel<__half>, grid, kSelectThreads, smem, stream, p, ws, int(all_pages), int(in_smem));
    return launch_kernel(select_kernel<float>, grid, kSelectThreads, smem, stream, p, ws, int(all_pages), int(in_smem));
}

}  // namespace qsa
