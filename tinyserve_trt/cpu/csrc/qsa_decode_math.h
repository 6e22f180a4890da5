// The math of one decode step of QueryAwareSparseAttention on CPU, free of ONNX Runtime
// types (qsa_decode_cpu.cpp validates shapes and page ids before calling run()).
// Float32 throughout; the numpy reference (ops/reference.py) computes in float64 and the
// tests hold this to schema.TOLERANCES["float32"].
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "qsa_attend.h"
#include "qsa_cold.h"
#include "qsa_problem.h"
#include "qsa_thread_pool.h"
#include "qsa_vector.h"

namespace qsa {

// The K and V rows one (sequence, KV head) attends: pointers into the hot pools, or into `cold`,
// which holds the kept cold rows dequantized (K rows, then V rows).
struct Rows {
  std::vector<const float*> k, v;
  std::vector<float> cold;
};

struct Scratch {  // per thread, reused across calls
  std::vector<float> qpos, qneg, coarse, fine, lo, hi, step, logits, part;
  std::vector<int64_t> cand;
  Rows rows;
  ColdScratch cold;
  std::vector<char> keep, page_keep;
};

// Marks the k best of `cand` by score in `keep`: the k largest qsa_math::rank_key (ties to the
// lower index, NaN last: the reference's stable argsort of -score); nth_element then compares
// integers, not floats through a lambda.
inline void keep_best(std::vector<int64_t>& cand, const float* score, size_t k, char* keep) {
  thread_local std::vector<uint64_t> keys;
  k = std::min(k, cand.size());
  if (k == cand.size()) {
    for (size_t i = 0; i < k; ++i) keep[cand[i]] = 1;
    return;
  }
  keys.resize(cand.size());
  for (size_t i = 0; i < cand.size(); ++i)
    keys[i] = qsa_math::rank_key(score[cand[i]], static_cast<uint32_t>(cand[i]));
  std::nth_element(keys.begin(), keys.begin() + k, keys.end(), std::greater<uint64_t>());
  for (size_t i = 0; i < k; ++i) keep[qsa_math::rank_index(keys[i])] = 1;
}

// One task (a sequence's KV head and its group's query heads, or one query head: Task): the
// selection of its query heads, then the rows they attend.
class HeadStep {
 public:
  HeadStep(const Problem& p, const Attrs& a, Scratch& s, const Task& t)
      : p_(p), a_(a), s_(s), b_(t.b), h_(t.h), gn_(t.gn), past_(p.past[t.b]), n_((past_ + p.ps - 1) / p.ps),
        pages_(p.table + t.b * p.NP), q_(p.q + (t.b * p.H + t.h * p.G + t.g0) * p.D) {}

  // Selects, marks the task's attended pages in sel [NP] (if not null), and fills `rows` with the
  // kept K/V rows (logical order).
  void select_rows(Rows& rows, bool* sel) {
    select();
    if (sel) {
      std::fill(sel, sel + p_.NP, false);
      for (int64_t u = 0; u < n_ * p_.r; ++u)
        if (s_.keep[u]) sel[u / p_.r] = true;
    }
    rows.k.clear(), rows.v.clear();
    const int64_t D = p_.D;
    int64_t n_cold = 0;  // kept cold tokens: their buffer is sized before any pointer into it is taken
    if (p_.cold.Pc)
      for (int64_t u = 0; u < n_ * p_.r; ++u)
        if (s_.keep[u] && pages_[u / p_.r] >= p_.P) n_cold += std::min((u + 1) * p_.sp, past_) - u * p_.sp;
    rows.cold.resize(2 * n_cold * D);
    float *ck = rows.cold.data(), *cv = ck + n_cold * D;
    ColdRows cold(p_, a_.cold_int4, s_.cold);
    for (int64_t u = 0; u < n_ * p_.r; ++u) {
      if (!s_.keep[u]) continue;
      const int64_t page = u / p_.r, first = u * p_.sp, last = std::min(first + p_.sp, past_), id = pages_[page];
      if (id < p_.P) {
        const int64_t base = (id * p_.Hkv + h_) * p_.ps - page * p_.ps;
        for (int64_t t = first; t < last; ++t) rows.k.push_back(p_.kc + (base + t) * D), rows.v.push_back(p_.vc + (base + t) * D);
        continue;
      }
      cold.rows(id, h_, first - page * p_.ps, last - page * p_.ps, ck, cv);
      for (int64_t t = first; t < last; ++t, ck += D, cv += D) rows.k.push_back(ck), rows.v.push_back(cv);
    }
  }

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
    keep_best(s_.cand, s_.coarse.data(), static_cast<size_t>(rule.kept_free()), keep);
  }

  // Fills s_.keep [n * r] per unit (a page, or a sub-page when two-level).
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
    keep_best(s_.cand, s_.fine.data(), static_cast<size_t>(rule.kept_free(static_cast<int64_t>(s_.cand.size()))),
              s_.keep.data());
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
  void page_fine_scores(const float* kmin, const float* kmax, const uint8_t* codes, int64_t nsub, float* out) {
    const int64_t D = p_.D, C = D / kW;
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
      const vf sums = hsum8(acc) + bound(qp, qn, kmin, kmax, D);
      best = qsa_math::group_combine(best, sums, g == 0, a_.reduce_sum);
    }
    float lanes[kW];
    vstore(lanes, best);
    for (int64_t j = 0; j < nsub; ++j) out[j] = lanes[j];
  }
#endif

  const Problem& p_;
  const Attrs& a_;
  Scratch& s_;
  const int64_t b_, h_, gn_, past_, n_;
  const int32_t* pages_;
  const float* q_;
};

// The selected_pages rows of a call's tasks: the output's own rows for shared selections; with
// per-head tasks (the query heads of a group run on different threads) a row per task in `marks`,
// OR-ed into the output's group rows by finish().
class SelectedRows {
 public:
  SelectedRows(const Problem& p, const Attrs& a) : p_(p), per_head_(a.per_head && p.selected) {
    if (!per_head_) return;
    thread_local std::unique_ptr<bool[]> marks;
    thread_local int64_t size = 0;
    const int64_t need = p.B * p.H * p.NP;
    try {
      if (need > size) marks.reset(new bool[need]), size = need;
    } catch (...) {
      return;  // failed(): nothing may throw into ORT
    }
    marks_ = marks.get();
  }
  bool failed() const { return per_head_ && !marks_; }
  bool* row(const Task& t) const {
    if (!p_.selected) return nullptr;
    if (!per_head_) return p_.selected + (t.b * p_.Hkv + t.h) * p_.NP;
    return marks_ + ((t.b * p_.H + t.h * p_.G + t.g0) * p_.NP);
  }
  void finish() const {
    if (!per_head_) return;
    for (int64_t bh = 0; bh < p_.B * p_.Hkv; ++bh) {
      bool* out = p_.selected + bh * p_.NP;
      const bool* m = marks_ + bh * p_.G * p_.NP;
      for (int64_t i = 0; i < p_.NP; ++i) {
        bool any = false;
        for (int64_t g = 0; g < p_.G; ++g) any = any || m[g * p_.NP + i];
        out[i] = any;
      }
    }
  }

 private:
  const Problem& p_;
  const bool per_head_;
  bool* marks_ = nullptr;
};

// Whether sequence b's decode step selects (a rule that keeps every unit attends them all: dense).
inline bool row_selects(const Problem& p, const Attrs& a, int64_t b) {
  if (a.dense) return false;
  const int64_t past = p.past[b], n = (past + p.ps - 1) / p.ps;
  if (p.r == 1) return !qsa_math::page_rule(n, p.budget[b], p.ps, a.sink_pages, a.recent_pages).all;
  return !qsa_math::sub_page_rule(n, past, p.budget[b], p.ps, p.sp, a.candidate_share, a.sink_pages, a.recent_pages)
              .all;
}

// Every task of the call (Task: a (sequence, KV head), or per query head) over the pool's threads.
// With fewer than 2 of them per thread (batch 1), the selection runs one task each and the
// attention splits each one's kept rows into chunks, merged after. Returns false when a task could
// not allocate its scratch (nothing may throw into ORT or out of a pool thread).
inline bool run(const Problem& p, const Attrs& attrs) {
  // Per-query-head tasks only when a row selects: a dense step (short contexts, budget 0) attends
  // every row either way, and one task per group reads each K/V row once for its G queries.
  Attrs a = attrs;
  if (a.per_head) {
    bool any = false;
    for (int64_t b = 0; b < p.B && !any; ++b) any = row_selects(p, a, b);
    a.per_head = any;
  }
  std::atomic<bool> ok{true};
  const int64_t tasks = num_tasks(p, a), threads = pool_size(), part_size = task_of(p, a, 0).gn * (2 + p.D);
  auto guarded = [&ok](auto&& fn) {
    return [&ok, fn](int64_t i) {
      try {
        fn(i);
      } catch (...) {
        ok = false;
      }
    };
  };
  const SelectedRows sel(p, a);
  if (sel.failed()) return false;
  if (threads == 1 || tasks >= 2 * threads) {
    parallel_for(tasks, guarded([&](int64_t i) {
      thread_local Scratch s;
      const Task t = task_of(p, a, i);
      HeadStep(p, a, s, t).select_rows(s.rows, sel.row(t));
      s.part.resize(part_size);
      attend_part(p, a, t, s.rows.k.data(), s.rows.v.data(), static_cast<int64_t>(s.rows.k.size()), true, s.logits,
                  s.part.data());
      merge_parts(p, t, s.part.data(), 1);
    }));
    if (ok) sel.finish();
    return ok;
  }
  const int64_t chunks = (2 * threads + tasks - 1) / tasks;
  // The calling thread's buffers, named by reference: inside the lambdas a thread_local name
  // would be each worker's own.
  thread_local std::vector<Rows> call_rows;
  thread_local std::vector<float> call_parts;
  auto& rows = call_rows;
  auto& parts = call_parts;
  try {
    rows.resize(tasks), parts.resize(tasks * chunks * part_size);
  } catch (...) {
    return false;
  }
  parallel_for(tasks, guarded([&](int64_t i) {
    thread_local Scratch s;
    const Task t = task_of(p, a, i);
    HeadStep(p, a, s, t).select_rows(rows[i], sel.row(t));
  }), 1);
  parallel_for(tasks * chunks, guarded([&](int64_t i) {
    thread_local Scratch s;
    const int64_t task = i / chunks, c = i % chunks, n = static_cast<int64_t>(rows[task].k.size());
    const int64_t begin = n * c / chunks, end = n * (c + 1) / chunks;
    attend_part(p, a, task_of(p, a, task), rows[task].k.data() + begin, rows[task].v.data() + begin, end - begin,
                c == chunks - 1, s.logits, parts.data() + i * part_size);
  }), 1);
  if (ok) {
    for (int64_t task = 0; task < tasks; ++task)
      merge_parts(p, task_of(p, a, task), parts.data() + task * chunks * part_size, chunks);
    sel.finish();
  }
  return ok;
}

}  // namespace qsa
