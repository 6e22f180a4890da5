// The math of one decode step of QueryAwareSparseAttention on CPU, free of ONNX Runtime
// types (qsa_decode_cpu.cpp validates shapes and page ids before calling run()).
// Float32 throughout; the numpy reference (ops/reference.py) computes in float64 and the
// tests hold this to schema.TOLERANCES["float32"].
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qsa_thread_pool.h"
#include "qsa_vector.h"

namespace qsa {

struct Attrs {  // defaults: schema.ATTRIBUTES
  float scale = 0.0f;
  int64_t sink_pages = 1, recent_pages = 1, sub_page_size = 0;
  float candidate_share = 0.5f;
  bool dense = false, reduce_sum = false;
};

struct Problem {  // named dims as in ops/schema.py; sp == ps and r == 1 for single-level
  int64_t B = 0, H = 0, Hkv = 0, G = 1, D = 0, P = 0, Pm = 0, ps = 1, NP = 0, sp = 1, r = 1;
  const float *q = nullptr, *k = nullptr, *v = nullptr, *kc = nullptr, *vc = nullptr, *kmin = nullptr,
              *kmax = nullptr;
  const int32_t *table = nullptr, *past = nullptr, *budget = nullptr;
  const uint8_t* sub = nullptr;
  float* out = nullptr;
  bool* selected = nullptr;  // may be null (output not requested)
};

struct Scratch {  // per thread, reused across calls
  std::vector<float> qpos, qneg, coarse, fine, lo, hi, step, logits;
  std::vector<int64_t> cand, rows;
  std::vector<char> keep, page_keep;
};

// Marks the k best of `cand` by score in `keep`; ties go to the lower index (the
// reference's stable argsort of -score). NaN scores rank last.
inline void keep_best(std::vector<int64_t>& cand, const float* score, size_t k, char* keep) {
  auto key = [score](int64_t i) { return std::isnan(score[i]) ? -INFINITY : score[i]; };
  auto better = [&](int64_t a, int64_t b) {
    float sa = key(a), sb = key(b);
    return sa > sb || (sa == sb && a < b);
  };
  k = std::min(k, cand.size());
  if (k < cand.size()) std::nth_element(cand.begin(), cand.begin() + k, cand.end(), better);
  for (size_t i = 0; i < k; ++i) keep[cand[i]] = 1;
}

// One (sequence, KV head): selection, then attention over the kept tokens.
class HeadStep {
 public:
  HeadStep(const Problem& p, const Attrs& a, Scratch& s, int64_t b, int64_t h)
      : p_(p), a_(a), s_(s), b_(b), h_(h), past_(p.past[b]), n_((past_ + p.ps - 1) / p.ps),
        pages_(p.table + b * p.NP), q_(p.q + (b * p.H + h * p.G) * p.D) {}

  void run() {
    select();
    if (p_.selected) {
      bool* sel = p_.selected + (b_ * p_.Hkv + h_) * p_.NP;
      std::fill(sel, sel + p_.NP, false);
      for (int64_t u = 0; u < n_ * p_.r; ++u)
        if (s_.keep[u]) sel[u / p_.r] = true;
    }
    attend();
  }

 private:
  bool forced(int64_t i) const { return i < a_.sink_pages || i >= n_ - a_.recent_pages; }
  const float* meta(const float* base, int64_t page) const { return base + (pages_[page] * p_.Hkv + h_) * p_.D; }

  float reduce(float acc, float x, int64_t g) const {
    return g == 0 ? x : a_.reduce_sum ? acc + x : std::max(acc, x);
  }

  void split_query() {
    const int64_t GD = p_.G * p_.D;
    s_.qpos.resize(GD), s_.qneg.resize(GD);
    for (int64_t i = 0; i < GD; ++i) {
      s_.qpos[i] = q_[i] > 0.0f ? q_[i] : 0.0f;
      s_.qneg[i] = q_[i] < 0.0f ? q_[i] : 0.0f;
    }
  }

  float coarse_score(int64_t page) const {
    const float *lo = meta(p_.kmin, page), *hi = meta(p_.kmax, page);
    float s = 0.0f;
    for (int64_t g = 0; g < p_.G; ++g)
      s = reduce(s, bound(&s_.qpos[g * p_.D], &s_.qneg[g * p_.D], lo, hi, p_.D), g);
    return s;
  }

  // select_pages over the pages not forced; returns false when every page is kept.
  bool select_pages(int64_t budget_tokens, char* keep) {
    int64_t n_forced = 0;
    for (int64_t i = 0; i < n_; ++i) n_forced += forced(i);
    int64_t keep_n = std::max(budget_tokens / p_.ps, n_forced);
    std::fill(keep, keep + n_, 1);
    if (budget_tokens <= 0 || keep_n >= n_) return false;
    s_.cand.clear();
    s_.coarse.resize(n_);
    for (int64_t i = 0; i < n_; ++i) {
      if (i + kPagesAhead < n_) {  // the pages' bounds sit at random pool slots
        prefetch_row(meta(p_.kmin, i + kPagesAhead), p_.D);
        prefetch_row(meta(p_.kmax, i + kPagesAhead), p_.D);
      }
      keep[i] = forced(i);
      if (!keep[i]) s_.cand.push_back(i), s_.coarse[i] = coarse_score(i);
    }
    keep_best(s_.cand, s_.coarse.data(), static_cast<size_t>(keep_n - n_forced), keep);
    return true;
  }

  // Fills s_.keep [n * r] per unit (a page, or a sub-page when two-level).
  void select() {
    const int64_t units = n_ * p_.r, written = (past_ + p_.sp - 1) / p_.sp, budget = p_.budget[b_];
    s_.keep.assign(units, 0);
    std::fill(s_.keep.begin(), s_.keep.begin() + written, 1);
    if (a_.dense || budget <= 0 || n_ == 0) return;
    split_query();
    if (p_.r == 1) {
      select_pages(budget, s_.keep.data());
      return;
    }
    int64_t n_forced = 0;
    for (int64_t u = 0; u < written; ++u) n_forced += forced(u / p_.r);
    const int64_t keep_n = std::max(budget / p_.sp, n_forced);
    if (keep_n >= written) return;
    // two_level.candidate_pages: the share times n rounds in float32
    float share_n = a_.candidate_share * static_cast<float>(n_);
    int64_t cand_pages = std::max(static_cast<int64_t>(std::floor(share_n)), budget / p_.ps);
    s_.page_keep.resize(n_);
    select_pages(std::max(cand_pages * p_.ps, budget), s_.page_keep.data());
    fine_scores(written);
    for (int64_t u = 0; u < units; ++u) s_.keep[u] = u < written && forced(u / p_.r);
    keep_best(s_.cand, s_.fine.data(), static_cast<size_t>(keep_n - n_forced), s_.keep.data());
  }

  // Sub-page scores of the candidate pages' written, not forced sub-pages (into s_.cand).
  void fine_scores(int64_t written) {
    const int64_t D = p_.D, r = p_.r;
    const float inv_levels = static_cast<float>(1.0 / 15.0);  // fine_bounds.INV_LEVELS
    s_.fine.resize(n_ * r), s_.lo.resize(D), s_.hi.resize(D), s_.step.resize(D);
    s_.cand.clear();
    int64_t ahead = 0;  // the candidate page whose codes are being prefetched
    for (int64_t i = 0; i < n_; ++i) {
      if (!s_.page_keep[i] || forced(i) || i * r >= written) continue;
      for (ahead = std::max(ahead, i + 1); ahead < n_ && !s_.page_keep[ahead]; ++ahead) {
      }
      if (ahead < n_) {
        const char* next = reinterpret_cast<const char*>(p_.sub + (pages_[ahead] * p_.Hkv + h_) * r * D);
        for (int64_t off = 0; off < r * D; off += 64) __builtin_prefetch(next + off);
      }
      const float *kmin = meta(p_.kmin, i), *kmax = meta(p_.kmax, i);
      // fine_bounds.decode: each product and sum rounds once (this file builds with -ffp-contract=off)
      for (int64_t d = 0; d < D; ++d) s_.step[d] = (kmax[d] - kmin[d]) * inv_levels;
      const uint8_t* codes = p_.sub + (pages_[i] * p_.Hkv + h_) * r * D;
      for (int64_t j = 0; j < r && i * r + j < written; ++j) {
        const uint8_t* c = codes + j * D;
        for (int64_t d = 0; d < D; ++d) {
          float lo_step = static_cast<float>(c[d] & 15) * s_.step[d];
          float hi_step = static_cast<float>(c[d] >> 4) * s_.step[d];
          s_.lo[d] = kmin[d] + lo_step;
          s_.hi[d] = kmax[d] - hi_step;
        }
        float s = 0.0f;
        for (int64_t g = 0; g < p_.G; ++g)
          s = reduce(s, bound(&s_.qpos[g * D], &s_.qneg[g * D], s_.lo.data(), s_.hi.data(), D), g);
        s_.fine[i * r + j] = s;
        s_.cand.push_back(i * r + j);
      }
    }
  }

  // Softmax attention of the G queries over the kept cached tokens and the new token.
  void attend() {
    const int64_t D = p_.D, G = p_.G, sp = p_.sp, units = n_ * p_.r;
    s_.rows.clear();  // offsets of the kept K/V rows in the pools, in logical order
    for (int64_t u = 0; u < units; ++u) {
      if (!s_.keep[u]) continue;
      int64_t page = u / p_.r, first = u * sp, last = std::min(first + sp, past_);
      int64_t base = (pages_[page] * p_.Hkv + h_) * p_.ps - page * p_.ps;
      for (int64_t t = first; t < last; ++t) s_.rows.push_back((base + t) * D);
    }
    const int64_t T = static_cast<int64_t>(s_.rows.size()) + 1, new_row = (b_ * p_.Hkv + h_) * D;
    const float scale = a_.scale > 0.0f ? a_.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    s_.logits.resize(G * T);
    // Kept sub-pages are scattered over the pools: prefetch the K and V rows kAhead ahead (V
    // for the second pass); 8-64 measured alike at batch 8, 8K, cold caches.
    constexpr int64_t kAhead = 16;
    for (int64_t t = 0; t < T; ++t) {
      const float* krow = t + 1 < T ? p_.kc + s_.rows[t] : p_.k + new_row;
      if (t + kAhead + 1 < T) {
        prefetch_row(p_.kc + s_.rows[t + kAhead], D);
        prefetch_row(p_.vc + s_.rows[t + kAhead], D);
      }
      for (int64_t g = 0; g < G; ++g) s_.logits[g * T + t] = dot(q_ + g * D, krow, D) * scale;
    }
    float* out = p_.out + (b_ * p_.H + h_ * G) * D;
    std::fill(out, out + G * D, 0.0f);
    std::vector<float> inv_sum(G);
    for (int64_t g = 0; g < G; ++g) {
      float* l = &s_.logits[g * T];
      float m = *std::max_element(l, l + T), sum = 0.0f;
      for (int64_t t = 0; t < T; ++t) sum += (l[t] = std::exp(l[t] - m));
      inv_sum[g] = 1.0f / sum;
    }
    for (int64_t t = 0; t < T; ++t) {
      const float* vrow = t + 1 < T ? p_.vc + s_.rows[t] : p_.v + new_row;
      for (int64_t g = 0; g < G; ++g) {
        axpy(s_.logits[g * T + t], vrow, out + g * D, D);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inv_sum[g];
  }

  const Problem& p_;
  const Attrs& a_;
  Scratch& s_;
  const int64_t b_, h_, past_, n_;
  const int32_t* pages_;
  const float* q_;
};

// Every (sequence, KV head) of the call, spread over the pool's threads.
// Returns false when a task could not allocate its scratch (nothing may throw into ORT or
// out of a pool thread).
inline bool run(const Problem& p, const Attrs& a) {
  std::atomic<bool> ok{true};
  parallel_for(p.B * p.Hkv, [&](int64_t task) {
    try {
      thread_local Scratch scratch;
      HeadStep(p, a, scratch, task / p.Hkv, task % p.Hkv).run();
    } catch (...) {
      ok = false;
    }
  });
  return ok;
}

}  // namespace qsa
