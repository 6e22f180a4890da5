/* The op's page scoring and selection rule, once for every C++ target (issue #32): the Quest
 * bound of a page or sub-page, the GQA group's combination of its heads' scores, the order in
 * which candidates are kept (ties, NaN), and the rule that decides how many pages or sub-pages
 * are kept - the budget arithmetic, the sink and recent pages, two-level's candidates - as
 * ops/policies.py (QueryAware, reduce_group, select_pages) and ops/two_level.py define them
 * (ops/reference.py, the numpy oracle, calls those).
 *
 * __host__ __device__-clean like qsa_math.h (included from it for the element primitives): the
 * CUDA kernels (qsa_topk.cuh, qsa_select.cu, qsa_select_two_level.cu), their CPU emulation and
 * the CPU node (tinyserve_trt/cpu/csrc: qsa_vector.h, qsa_decode_math.h, built with -I to this
 * directory) call these functions; only the parallel structure differs per target - warps,
 * radix select and block scans on the GPU, SIMD lanes and nth_element on the CPU. */
#ifndef TINYSERVE_QSA_SELECT_MATH_H
#define TINYSERVE_QSA_SELECT_MATH_H

#include <math.h>
#include <stdint.h>

#include "qsa_math.h"

namespace qsa_math {

/* ---- scoring: policies.QueryAware ----
 * One channel's term of the page score sum_d max(q_d * lo_d, q_d * hi_d), for lo <= hi, is
 * relu(q) * hi + min(q, 0) * lo (the ONNX function's two-MatMul form): a step splits each query
 * once into query_pos / query_neg and accumulates two fused multiply-adds per channel. Equal to
 * the reference's form for finite bounds; an infinite bound scores NaN (0 * inf), as in the ONNX
 * function. A NaN query element stays NaN in both halves, so its page scores NaN as in numpy. */
template <typename F> QSA_HD F query_pos(F q) { return q < F{} ? F{} : q; }
template <typename F> QSA_HD F query_neg(F q) { return q > F{} ? F{} : q; }
template <typename F> QSA_HD F bound_madd(F acc, F qpos, F qneg, F lo, F hi) {
    return madd(qneg, lo, madd(qpos, hi, acc));
}

/* A sub-page's bound in level form (the CPU node's register-blocked path; the ONNX function's
 * sub_page_score_onnx): with lo = kmin + lc * step and hi = kmax - hc * step (sub_lo / sub_hi) the
 * bound is the page's own bound over (kmin, kmax) plus sum_d lc * wlo + hc * whi, where
 * wlo = min(q, 0) * step and whi = -(relu(q) * step). Equal to the decoded form up to float32
 * rounding of the sums. */
template <typename F> QSA_HD F level_weight_lo(F qneg, F step) { return mul_rn(qneg, step); }
template <typename F> QSA_HD F level_weight_hi(F qpos, F step) { return -mul_rn(qpos, step); }

/* max that propagates NaN, as numpy's maximum does (fmaxf and std::max drop it). */
template <typename F> QSA_HD F max_nan(F a, F b) { return ((a != a) | (b != b)) ? a + b : (a > b ? a : b); }

/* policies.reduce_group: a GQA group's per-head scores into one per KV head, head by head
 * (first: the group's first head). group_reduce "sum" adds, "max" takes the NaN-propagating max. */
template <typename F> QSA_HD F group_combine(F acc, F x, bool first, bool sum) {
    return first ? x : sum ? acc + x : max_nan(acc, x);
}

/* ---- the keep order: numpy's stable argsort of -score ----
 * order_key: larger score, larger key; -0 and +0 equal; NaN below -inf (numpy sorts NaN last).
 * rank_key: the order key, then the lower index on a tie; the kept candidates are those with the
 * k largest rank keys (the GPU's radix select + ordered scan computes the same set). */
QSA_HD uint32_t order_key(float f) {
    uint32_t u;
#ifdef __CUDA_ARCH__
    u = __float_as_uint(f);
#else
    __builtin_memcpy(&u, &f, sizeof u);
#endif
    /* on the bits alone (integer selects, no float compare: a CPU loop of keys vectorizes) */
    const uint32_t mag = u & 0x7FFFFFFFu;
    const uint32_t key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return mag > 0x7F800000u ? 0u : (mag == 0u ? 0x80000000u : key);
}
QSA_HD uint64_t rank_key(float score, uint32_t index) {
    return (uint64_t(order_key(score)) << 32) | uint64_t(0xFFFFFFFFu - index);
}
QSA_HD uint32_t rank_index(uint64_t key) { return 0xFFFFFFFFu - uint32_t(key); }

/* ---- the rule: policies.select_pages ----
 * A sequence's n pages: forced are the first sink_pages and the last recent_pages, the ranges
 * [0, n_sink) and [recent_start, n). keep = max(budget // ps, #forced) pages are kept in all; a
 * budget <= 0, or keep >= n, keeps every page (all; keep then means nothing, so // may truncate). Otherwise the kept non-forced pages are the
 * kept_free() best-scored of [n_sink, recent_start). */
struct PageRule {
    int64_t n, n_sink, recent_start, keep;
    bool all;
    QSA_HD bool forced(int64_t i) const { return i < n_sink || i >= recent_start; }
    QSA_HD int64_t num_forced() const { return n_sink + (n - recent_start); }
    QSA_HD int64_t num_free() const { return recent_start - n_sink; }
    QSA_HD int64_t kept_free() const { return all ? num_free() : keep - num_forced(); }
};

QSA_HD PageRule page_rule(int64_t n, int64_t budget, int64_t page_size, int64_t sink_pages, int64_t recent_pages) {
    PageRule r;
    r.n = n;
    r.n_sink = sink_pages < n ? sink_pages : n;
    r.recent_start = n - recent_pages > r.n_sink ? n - recent_pages : r.n_sink;
    const int64_t by_budget = budget / page_size, forced = r.num_forced();
    r.keep = by_budget > forced ? by_budget : forced;
    r.all = budget <= 0 || r.keep >= n;
    return r;
}

/* ---- the rule: two_level.select_sub_pages (sub_page_size sp, r = ps / sp sub-pages a page) ----
 * Sub-pages [0, written) hold tokens (written = ceil(past / sp)); the forced pages' written
 * sub-pages are forced. keep = max(budget // sp, #forced) sub-pages in all; a budget <= 0, or
 * keep >= written, keeps every written sub-page (all). Level 1 picks the candidate pages:
 * page_rule with max(candidate_pages * ps, budget) tokens, candidate_pages =
 * max(floor(f32(share) * f32(n)), budget // ps) (two_level.candidate_pages). Level 2 keeps the
 * forced sub-pages and the kept_free(c) best of the c candidate sub-pages (written, not forced). */
struct SubPageRule {
    PageRule pages;  // level 1: the forced pages and the candidates
    int64_t r, written, forced, keep;
    bool all;
    QSA_HD int64_t kept_free(int64_t candidate_units) const {
        return keep - forced < candidate_units ? keep - forced : candidate_units;
    }
};

QSA_HD int64_t candidate_pages(int64_t n, int64_t budget, int64_t page_size, float candidate_share) {
    const int64_t share = int64_t(floorf(mul_rn(candidate_share, float(n)))), by_budget = budget / page_size;
    return share > by_budget ? share : by_budget;
}

QSA_HD SubPageRule sub_page_rule(int64_t n, int64_t past, int64_t budget, int64_t page_size, int64_t sub_page_size,
                                 float candidate_share, int64_t sink_pages, int64_t recent_pages) {
    SubPageRule s;
    s.r = page_size / sub_page_size;
    const int64_t ceil_written = (past + sub_page_size - 1) / sub_page_size;
    s.written = ceil_written < n * s.r ? ceil_written : n * s.r;
    const int64_t cand_tokens = candidate_pages(n, budget, page_size, candidate_share) * page_size;
    s.pages = page_rule(n, cand_tokens > budget ? cand_tokens : budget, page_size, sink_pages, recent_pages);
    const int64_t sink_units = s.pages.n_sink * s.r, recent_units = s.pages.recent_start * s.r;
    s.forced = (sink_units < s.written ? sink_units : s.written) +
               (s.written > recent_units ? s.written - recent_units : 0);
    const int64_t by_budget = budget / sub_page_size;
    s.keep = by_budget > s.forced ? by_budget : s.forced;
    s.all = budget <= 0 || s.keep >= s.written;
    return s;
}

}  // namespace qsa_math

#endif /* TINYSERVE_QSA_SELECT_MATH_H */
