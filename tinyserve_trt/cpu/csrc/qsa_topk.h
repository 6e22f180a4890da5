// The selection's top-k on CPU: the k best of a step's candidates by score - the k largest
// qsa_math::rank_key (score order, NaN last; ties to the lower index: numpy's stable argsort of
// -score, ops/policies.py), the set the CUDA kernels' radix select keeps too (qsa_topk.cuh).
//
// A radix select on the 32-bit order keys, over the range the keys span: a histogram of at most
// 2^11 buckets splits [min key, max key] and finds the bucket the k-th key falls in, then the same
// over that bucket's range and candidates only; every key above the k-th is kept, and of the keys
// equal to it the first ones in candidate order (the candidates come in ascending unit order: the
// lower index). Three passes over the candidates at most, none branching on a comparison of two
// keys: std::nth_element over 64-bit rank keys was 9% of a decode step's kernel time at Qwen's 32K
// (8192 sub-pages per query head, 7 heads a task). Fixed digits (the keys' top 11 bits first) put
// one head's scores, a few binades wide, in a dozen buckets: the histogram's increments then wait
// on each other, and the pool after the first pass held a large share of the candidates.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qsa_select_math.h"

namespace qsa {

constexpr int kDigitBits = 11;  // 2^11 histogram buckets a level

struct TopkScratch {  // per thread, reused
  std::vector<uint32_t> key;   // order key per candidate
  std::vector<uint32_t> pool;  // candidates still tied with the k-th, by position
};

// The candidates first, first + 1, .., first + n - 1 (a run of units, as a std::vector of them would
// list them): keep_best then reads their scores and marks them in order, and its passes over the
// candidates vectorize (no gather through an index list).
struct UnitRange {
  int64_t first, n;
  size_t size() const { return static_cast<size_t>(n); }
  int64_t operator[](size_t i) const { return first + static_cast<int64_t>(i); }
};

// keep_best's view of its candidates, held in locals: read through the caller's object, each
// store to the keys or the marks would reload its fields (GCC then vectorizes none of the loops).
template <class T>
struct IndexList {
  const T* p;
  T operator[](size_t i) const { return p[i]; }
};
template <class T>
IndexList<T> view_of(const std::vector<T>& c) {
  return {c.data()};
}
inline UnitRange view_of(const UnitRange& c) { return c; }

// Calls mark(cand[i], kept) for every candidate, kept: whether it is among the k best
// (score[cand[i]]); the callers mark without a branch.
template <class Cands, class Mark>
inline void keep_best(const Cands& cands, const float* score, size_t k, TopkScratch& t, Mark mark) {
  const size_t n = cands.size();
  const auto cand = view_of(cands);
  if (k >= n || k == 0) {
    for (size_t i = 0; i < n; ++i) mark(cand[i], k != 0);
    return;
  }
  t.key.resize(n), t.pool.resize(n);
  uint32_t* key = t.key.data();
  uint32_t* pool = t.pool.data();
  uint32_t lo = UINT32_MAX, hi = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t ki = qsa_math::order_key(score[cand[i]]);
    key[i] = ki;
    lo = ki < lo ? ki : lo;
    hi = ki > hi ? ki : hi;
  }
  // The keys still undecided lie in [lo, hi] (every key above hi is kept), `need` of them are kept;
  // those candidates are the pool, by position, in candidate order (on the first level: all).
  // Each level splits the window's range into at most 2^11 buckets of 2^shift keys.
  size_t need = k, pooled = n;
  bool all = true;  // the pool is every candidate (not yet written)
  uint32_t hist[1 << kDigitBits];
  while (pooled != need && lo != hi) {
    const uint32_t range = hi - lo;
    const int width = 32 - __builtin_clz(range);
    const int shift = width > kDigitBits ? width - kDigitBits : 0;
    const uint32_t buckets = (range >> shift) + 1;
    std::memset(hist, 0, sizeof(uint32_t) * buckets);
    if (all) {
      for (size_t i = 0; i < n; ++i) ++hist[(key[i] - lo) >> shift];
    } else {
      for (size_t j = 0; j < pooled; ++j) ++hist[(key[pool[j]] - lo) >> shift];
    }
    uint32_t d = buckets - 1;
    size_t above = 0;
    while (above + hist[d] < need) above += hist[d--];  // the k-th key's bucket: need <= above + hist[d]
    need -= above;
    const uint32_t new_lo = lo + (d << shift);
    const uint32_t new_hi = static_cast<uint32_t>(
        std::min<uint64_t>(hi, static_cast<uint64_t>(new_lo) + ((uint64_t{1} << shift) - 1)));
    size_t w = 0;
    if (all) {
      for (size_t i = 0; i < n; ++i) {
        pool[w] = static_cast<uint32_t>(i);
        w += key[i] >= new_lo && key[i] <= new_hi;
      }
    } else {
      for (size_t j = 0; j < pooled; ++j) {
        pool[w] = pool[j];
        w += key[pool[j]] >= new_lo && key[pool[j]] <= new_hi;
      }
    }
    pooled = w, lo = new_lo, hi = new_hi, all = false;
  }
  if (all)  // every key equal: the first k by position
    for (size_t i = 0; i < need; ++i) pool[i] = static_cast<uint32_t>(i);
  // the keys above the window, then the first `need` in it (all of it, or - one key value left -
  // the ties with the k-th key: the lower indices)
  for (size_t i = 0; i < n; ++i) mark(cand[i], key[i] > hi);
  for (size_t j = 0; j < need; ++j) mark(cand[pool[j]], true);
}

}  // namespace qsa
