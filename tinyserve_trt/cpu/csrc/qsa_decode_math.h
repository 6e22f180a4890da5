// The selection of one decode-step task of QueryAwareSparseAttention on CPU (HeadStep: page
// scores, the rule's kept pages and sub-pages), free of ONNX Runtime types; qsa_decode_step.h
// runs the step's tasks (qsa_decode_cpu.cpp validates shapes and page ids before calling run()).
// Float32 throughout; the numpy reference (ops/reference.py) computes in float64 and the
// tests hold this to schema.TOLERANCES["float32"].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qsa_cold.h"
#include "qsa_problem.h"
#include "qsa_topk.h"
#include "qsa_vector.h"

namespace qsa {

// The K and V rows one task attends: pointers into the hot pools, or into `cold`, which holds the
// kept cold rows dequantized (K rows, then V rows). With per-query-head selections each query head
// has its own list: head g's (g0 + g) rows are [head_start[g], head_start[g + 1]); else head_start
// is empty and every row is every head's.
struct Rows {
  std::vector<const float*> k, v;
  std::vector<int64_t> head_start;
  std::vector<float> cold;
};

struct Scratch {  // per thread, reused across calls
  std::vector<float> qpos, qneg, coarse, fine, lo, hi, step, logits, part;
  std::vector<int64_t> cand;
  std::vector<uint64_t> unit_heads;  // per unit, the query heads that keep it
  Rows rows;
  ColdScratch cold;
  std::vector<char> keep, page_keep;
  TopkScratch topk;
};

// One task (a sequence's KV head and its group's query heads, or one query head: Task): the
// selection of its query heads, then the rows they attend.
class HeadStep {
 public:
  HeadStep(const Problem& p, const Attrs& a, Scratch& s, const Task& t)
      : p_(p), a_(a), s_(s), b_(t.b), h_(t.h), gn_(t.gn), past_(p.past[t.b]), n_((past_ + p.ps - 1) / p.ps),
        pages_(p.table + t.b * p.NP), q_(p.q + (t.b * p.H + t.h * p.G + t.g0) * p.D) {}

  // Fills keep() [n * r] per unit (a page, or a sub-page when two-level): the units the task's
  // query heads attend (one selection for all of them).
  void select() {
    const int64_t units = n_ * p_.r, written = (past_ + p_.sp - 1) / p_.sp, budget = p_.budget[b_];
    s_.keep.assign(units, 0);
    std::fill(s_.keep.begin(), s_.keep.begin() + written, 1);
    if (a_.dense) return;
    if (p_.r == 1) {
      const qsa_math::PageRule rule = qsa_math::page_rule(n_, budget, p_.ps, a_.sink_pages, a_.recent_pages);
      if (rule.all) return;
      split_query();
      keep_pages(rule, s_.keep.data());
      return;
    }
    const qsa_math::SubPageRule rule = qsa_math::sub_page_rule(n_, past_, budget, p_.ps, p_.sp, a_.candidate_share,
                                                               a_.sink_pages, a_.recent_pages);
    if (rule.all) return;
    split_query();
    s_.page_keep.resize(n_);
    keep_pages(rule.pages, s_.page_keep.data());
    fine_scores(rule.pages, written);
    for (int64_t u = 0; u < units; ++u) s_.keep[u] = u < written && rule.pages.forced(u / p_.r);
    char* keep = s_.keep.data();
    keep_best(s_.cand, s_.fine.data(), static_cast<size_t>(rule.kept_free(static_cast<int64_t>(s_.cand.size()))),
              s_.topk, [keep](int64_t u, bool kept) { keep[u] |= kept; });
  }
  // group_reduce "head" where level 1 keeps every page (candidate_share 1.0, the export default):
  // every query head's sub-page scores from one pass over each page's codes (the per-head form of
  // page_fine_scores), then each head's own best within the budget, into unit_heads [n * r] (bit g:
  // head g0 + g keeps the unit). The same scores and selections as a HeadStep per query head.
  // False where this does not apply (the caller then selects head by head).
  bool select_heads(std::vector<uint64_t>& unit_heads) {
#ifdef __AVX2__
    const int64_t D = p_.D, r = p_.r, units = n_ * r;
    if (a_.dense || r == 1 || D % kW || D / kW > kMaxChunks || r > kW || gn_ > kMaxUnionHeads) return false;
    const int64_t written = (past_ + p_.sp - 1) / p_.sp;
    const qsa_math::SubPageRule rule = qsa_math::sub_page_rule(n_, past_, p_.budget[b_], p_.ps, p_.sp,
                                                               a_.candidate_share, a_.sink_pages, a_.recent_pages);
    if (!rule.all && !rule.pages.all) return false;
    const uint64_t all = gn_ == 64 ? ~uint64_t{0} : (uint64_t{1} << gn_) - 1;
    unit_heads.assign(units, 0);
    for (int64_t u = 0; u < written; ++u)
      if (rule.all || rule.pages.forced(u / r)) unit_heads[u] = all;
    if (rule.all) return true;
    split_query();
    s_.fine.resize(gn_ * units);
    // the candidates: the written sub-pages of the pages between the sink and the recent ones
    const int64_t first = rule.pages.n_sink * r;
    const UnitRange cand{first, std::max<int64_t>(std::min(rule.pages.recent_start * r, written) - first, 0)};
    for (int64_t i = 0; i < n_; ++i) {
      if (i + kPagesAhead < n_) {  // no coarse pass has read the bounds: they sit at random pool slots
        prefetch_row(meta(p_.kmin, i + kPagesAhead), D);
        prefetch_row(meta(p_.kmax, i + kPagesAhead), D);
      }
      if (rule.pages.forced(i) || i * r >= written) continue;
      if (i + 1 < n_) {
        const char* next = reinterpret_cast<const char*>(p_.sub + (pages_[i + 1] * p_.Hkv + h_) * r * D);
        for (int64_t off = 0; off < r * D; off += 64) __builtin_prefetch(next + off);
      }
      const int64_t nsub = std::min(r, written - i * r);
      page_fine_scores(meta(p_.kmin, i), meta(p_.kmax, i), p_.sub + (pages_[i] * p_.Hkv + h_) * r * D, nsub,
                       &s_.fine[i * r], units);
    }
    const size_t k = static_cast<size_t>(rule.kept_free(cand.n));
    uint64_t* heads = unit_heads.data();
    for (int64_t g = 0; g < gn_; ++g) {
      const uint64_t bit = uint64_t{1} << g;
      keep_best(cand, &s_.fine[g * units], k, s_.topk,
                [heads, bit](int64_t u, bool kept) { heads[u] |= bit & (uint64_t{0} - kept); });
    }
    return true;
#else
    (void)unit_heads;
    return false;
#endif
  }
  const std::vector<char>& keep() const { return s_.keep; }
  int64_t units() const { return n_ * p_.r; }

 private:
  const float* meta(const float* base, int64_t page) const { return base + (pages_[page] * p_.Hkv + h_) * p_.D; }

  float reduce(float acc, float x, int64_t g) const { return qsa_math::group_combine(acc, x, g == 0, a_.reduce_sum); }

  void split_query() {
    const int64_t GD = gn_ * p_.D;
    s_.qpos.resize(GD), s_.qneg.resize(GD);
    for (int64_t i = 0; i < GD; ++i) s_.qpos[i] = qsa_math::query_pos(q_[i]), s_.qneg[i] = qsa_math::query_neg(q_[i]);
  }

  float coarse_score(int64_t page) const {
    const float *lo = meta(p_.kmin, page), *hi = meta(p_.kmax, page);
    float s = 0.0f;
    for (int64_t g = 0; g < gn_; ++g)
      s = reduce(s, bound(&s_.qpos[g * p_.D], &s_.qneg[g * p_.D], lo, hi, p_.D), g);
    return s;
  }

  // The pages `rule` keeps (qsa_math::page_rule) into keep [n]: the forced ones and the
  // rule's kept_free() best-scored others (scored only when the rule does not keep all).
  void keep_pages(const qsa_math::PageRule& rule, char* keep) {
    std::fill(keep, keep + n_, 1);
    if (rule.all) return;
    s_.cand.clear();
    s_.coarse.resize(n_);
    for (int64_t i = 0; i < n_; ++i) {
      if (i + kPagesAhead < n_) {  // the pages' bounds sit at random pool slots
        prefetch_row(meta(p_.kmin, i + kPagesAhead), p_.D);
        prefetch_row(meta(p_.kmax, i + kPagesAhead), p_.D);
      }
      keep[i] = rule.forced(i);
      if (!keep[i]) s_.cand.push_back(i), s_.coarse[i] = coarse_score(i);
    }
    keep_best(s_.cand, s_.coarse.data(), static_cast<size_t>(rule.kept_free()), s_.topk,
              [keep](int64_t u, bool kept) { keep[u] |= kept; });
  }

  // Sub-page scores of the candidate pages' written, not forced sub-pages (into s_.cand).
  void fine_scores(const qsa_math::PageRule& rule, int64_t written) {
    const int64_t D = p_.D, r = p_.r;
    s_.fine.resize(n_ * r), s_.lo.resize(D), s_.hi.resize(D), s_.step.resize(D);
    s_.cand.clear();
    int64_t ahead = 0;  // the candidate page whose codes are being prefetched
    for (int64_t i = 0; i < n_; ++i) {
      if (!s_.page_keep[i] || rule.forced(i) || i * r >= written) continue;
      for (ahead = std::max(ahead, i + 1); ahead < n_ && !s_.page_keep[ahead]; ++ahead) {
      }
      if (ahead < n_) {
        const char* next = reinterpret_cast<const char*>(p_.sub + (pages_[ahead] * p_.Hkv + h_) * r * D);
        for (int64_t off = 0; off < r * D; off += 64) __builtin_prefetch(next + off);
      }
      const float *kmin = meta(p_.kmin, i), *kmax = meta(p_.kmax, i);
      // fine_bounds.decode: each product and sum rounds once (this file builds with -ffp-contract=off)
      for (int64_t d = 0; d < D; ++d) s_.step[d] = qsa_math::level_step(kmin[d], kmax[d]);
      const uint8_t* codes = p_.sub + (pages_[i] * p_.Hkv + h_) * r * D;
      const int64_t nsub = std::min(r, written - i * r);
#ifdef __AVX2__
      if (D % kW == 0 && D / kW <= kMaxChunks && r <= kW && gn_ <= kMaxFusedGroup) {
        page_fine_scores(kmin, kmax, codes, nsub, &s_.fine[i * r]);
        for (int64_t j = 0; j < nsub; ++j) s_.cand.push_back(i * r + j);
        continue;
      }
#endif
      for (int64_t j = 0; j < nsub; ++j) {
        const uint8_t* c = codes + j * D;
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          s_.lo[d] = qsa_math::sub_lo(kmin[d], qsa_math::code_lo(c[d]), s_.step[d]);
          s_.hi[d] = qsa_math::sub_hi(kmax[d], qsa_math::code_hi(c[d]), s_.step[d]);
        }
        for (int64_t g = 0; g < gn_; ++g)
          s = reduce(s, bound(&s_.qpos[g * D], &s_.qneg[g * D], s_.lo.data(), s_.hi.data(), D), g);
        s_.fine[i * r + j] = s;
        s_.cand.push_back(i * r + j);
      }
    }
  }

#ifdef __AVX2__
  // The fine scores of one page's first `nsub` sub-pages (r <= 8) into out[0 .. nsub): with
  // lo = kmin + lo_c*step and hi = kmax - hi_c*step the bound is the head's coarse bound of the
  // page plus sum_d (min(q,0)*step*lo_c - relu(q)*step*hi_c) - the ONNX function's form
  // (policies.QueryAware.sub_page_score_onnx): no decoded lo/hi, the codes' levels feed two FMAs
  // per head, and one reduction gives a head's 8 sub-page sums. Equal to the decoded form up to
  // float32 rounding of the sums.
  // With `stride` > 0 each query head's sums instead, head g's at out[g * stride ..).
  void page_fine_scores(const float* kmin, const float* kmax, const uint8_t* codes, int64_t nsub, float* out,
                        int64_t stride = 0) {
    const int64_t D = p_.D, C = D / kW;
#ifdef __AVX512F__
    if (C % 2 == 0) return page_fine_scores16(kmin, kmax, codes, nsub, out, stride);
#endif
    vf step[kMaxChunks], lo_c[kW][kMaxChunks], hi_c[kW][kMaxChunks];
    for (int64_t c = 0; c < C; ++c) step[c] = qsa_math::level_step(vload(kmin + c * kW), vload(kmax + c * kW));
    for (int64_t j = 0; j < nsub; ++j)
      for (int64_t c = 0; c < C; ++c) {
        // one vpmovzxbd (a generic vector conversion of 8 bytes compiled to 8 scalar inserts)
        const vi ci = vi(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j * D + c * kW))));
        lo_c[j][c] = __builtin_convertvector(qsa_math::nibble_lo(ci), vf);
        hi_c[j][c] = __builtin_convertvector(qsa_math::nibble_hi(ci), vf);
      }
    vf best = {};
    for (int64_t g = 0; g < gn_; ++g) {
      const float *qp = &s_.qpos[g * D], *qn = &s_.qneg[g * D];
      vf wlo[kMaxChunks], whi[kMaxChunks];
      for (int64_t c = 0; c < C; ++c) {
        wlo[c] = qsa_math::level_weight_lo(vload(qn + c * kW), step[c]);
        whi[c] = qsa_math::level_weight_hi(vload(qp + c * kW), step[c]);
      }
      // channel-major: the 8 sub-pages' sums are 8 independent FMA chains (sub-page-major, each
      // chain waits on its own previous FMA: latency-bound, 3x slower)
      vf acc[kW] = {}, acc2[kW] = {};
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < kW; ++j)
          if (j < nsub) acc[j] = madd(wlo[c], lo_c[j][c], acc[j]), acc2[j] = madd(whi[c], hi_c[j][c], acc2[j]);
      for (int64_t j = 0; j < kW; ++j) acc[j] += acc2[j];
      put_sums(hsum8(acc) + bound(qp, qn, kmin, kmax, D), g, nsub, out, stride, best);
    }
    if (!stride) store_lanes(best, nsub, out);
  }

  // Query head g's sub-page sums: to out[g * stride ..) (stride > 0), else combined into the
  // group's `best` (written by the caller after the last head).
  void put_sums(vf sums, int64_t g, int64_t nsub, float* out, int64_t stride, vf& best) const {
    if (stride) return store_lanes(sums, nsub, out + g * stride);
    best = qsa_math::group_combine(best, sums, g == 0, a_.reduce_sum);
  }
  static void store_lanes(vf v, int64_t n, float* out) {
    float lanes[kW];
    vstore(lanes, v);
    for (int64_t j = 0; j < n; ++j) out[j] = lanes[j];
  }

#ifdef __AVX512F__
  // page_fine_scores on 16 channels a register (D a multiple of 16): half the FMAs and code
  // conversions of the 8-lane form; each sub-page's 16-lane sum folds to 8 lanes (its two halves
  // added) before the same hsum8. Same terms, another summation order (float32 rounding).
  void page_fine_scores16(const float* kmin, const float* kmax, const uint8_t* codes, int64_t nsub, float* out,
                          int64_t stride) {
    constexpr int64_t kW16 = 16, kMax16 = kMaxChunks / 2;
    const int64_t D = p_.D, C = D / kW16;
    __m512 step[kMax16], lo_c[kW][kMax16], hi_c[kW][kMax16];
    for (int64_t c = 0; c < C; ++c)
      step[c] = qsa_math::level_step(_mm512_loadu_ps(kmin + c * kW16), _mm512_loadu_ps(kmax + c * kW16));
    for (int64_t j = 0; j < nsub; ++j)
      for (int64_t c = 0; c < C; ++c) {
        const __m512i ci =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * D + c * kW16)));
        // qsa_math::nibble_lo / nibble_hi on 32-bit lanes (__m512i's own operators act on 64-bit ones)
        lo_c[j][c] = _mm512_cvtepi32_ps(_mm512_and_si512(ci, _mm512_set1_epi32(15)));
        hi_c[j][c] = _mm512_cvtepi32_ps(_mm512_srli_epi32(ci, 4));
      }
    vf best = {};
    for (int64_t g = 0; g < gn_; ++g) {
      const float *qp = &s_.qpos[g * D], *qn = &s_.qneg[g * D];
      __m512 wlo[kMax16], whi[kMax16];
      for (int64_t c = 0; c < C; ++c) {
        wlo[c] = qsa_math::level_weight_lo(_mm512_loadu_ps(qn + c * kW16), step[c]);
        whi[c] = qsa_math::level_weight_hi(_mm512_loadu_ps(qp + c * kW16), step[c]);
      }
      __m512 acc[kW], acc2[kW];
      for (int64_t j = 0; j < kW; ++j) acc[j] = _mm512_setzero_ps(), acc2[j] = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < kW; ++j)
          if (j < nsub)
            acc[j] = _mm512_fmadd_ps(wlo[c], lo_c[j][c], acc[j]), acc2[j] = _mm512_fmadd_ps(whi[c], hi_c[j][c], acc2[j]);
      vf half[kW];
      for (int64_t j = 0; j < kW; ++j) half[j] = fold16(_mm512_add_ps(acc[j], acc2[j]));
      put_sums(hsum8(half) + bound(qp, qn, kmin, kmax, D), g, nsub, out, stride, best);
    }
    if (!stride) store_lanes(best, nsub, out);
  }
#endif
#endif

  const Problem& p_;
  const Attrs& a_;
  Scratch& s_;
  const int64_t b_, h_, gn_, past_, n_;
  const int32_t* pages_;
  const float* q_;
};

}  // namespace qsa
