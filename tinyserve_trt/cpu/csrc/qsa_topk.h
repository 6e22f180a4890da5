// The selection's top-k on CPU: the k best of a step's candidates by score - the k largest
// qsa_math::rank_key (score order, NaN last; ties to the lower index: numpy's stable argsort of
// -score, ops/policies.py), the set the CUDA kernels' radix select keeps too (qsa_topk.cuh).
//
// A radix select on the 32-bit order keys: a histogram of the top 11 bits finds the bucket the k-th
// key falls in, then 11 and 10 more bits over that bucket's candidates only; every key above the
// k-th is kept, and of the keys equal to it the first ones in candidate order (the candidates come
// in ascending unit order: the lower index). Three passes over the candidates at most, none
// branching on a comparison of two keys: std::nth_element over 64-bit rank keys was 9% of a
// decode step's kernel time at Qwen's 32K (8192 sub-pages per query head, 7 heads a task).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "qsa_select_math.h"

namespace qsa {

struct TopkScratch {  // per thread, reused
  std::vector<uint32_t> key;   // order key per candidate
  std::vector<uint32_t> pool;  // candidates still tied with the k-th, by position
};

// Calls mark(cand[i], kept) for every candidate, kept: whether it is among the k best
// (score[cand[i]]); the callers mark without a branch.
template <class Cand, class Mark>
inline void keep_best(const Cand& cand, const float* score, size_t k, TopkScratch& t, Mark mark) {
  const size_t n = cand.size();
  if (k >= n || k == 0) {
    for (size_t i = 0; i < n; ++i) mark(cand[i], k != 0);
    return;
  }
  t.key.resize(n), t.pool.resize(n);
  uint32_t* key = t.key.data();
  uint32_t* pool = t.pool.data();
  // digit by digit from the top: the k-th largest key's digit, and how many keys lie above it
  constexpr int kShift[3] = {21, 10, 0}, kBits[3] = {11, 11, 10};
  uint32_t hist[1 << 11];
  size_t need = k;  // keys still to take among those sharing the fixed digits
  size_t pooled = 0;  // candidates sharing the fixed digits, by position, in candidate order
  uint32_t prefix = 0, high = 0;  // the k-th key's digits fixed so far, and their bits
  for (int level = 0; level < 3; ++level) {
    const int shift = kShift[level];
    const uint32_t mask = (1u << kBits[level]) - 1;
    std::memset(hist, 0, sizeof(uint32_t) << kBits[level]);
    if (level == 0) {
      for (size_t i = 0; i < n; ++i) {
        key[i] = qsa_math::order_key(score[cand[i]]);
        ++hist[key[i] >> shift];
      }
    } else {
      for (size_t j = 0; j < pooled; ++j) ++hist[(key[pool[j]] >> shift) & mask];
    }
    uint32_t d = mask;
    size_t above = 0;
    while (above + hist[d] < need) above += hist[d--];  // the k-th key's digit: need <= above + hist[d]
    need -= above;
    prefix |= d << shift;
    high |= mask << shift;
    size_t w = 0;
    if (level == 0) {
      for (size_t i = 0; i < n; ++i) {
        pool[w] = static_cast<uint32_t>(i);
        w += (key[i] >> shift) == d;
      }
    } else {
      for (size_t j = 0; j < pooled; ++j) {
        pool[w] = pool[j];
        w += (key[pool[j]] & high) == prefix;
      }
    }
    pooled = w;
    if (pooled == need) break;  // all still tied are kept: the lower digits do not matter
  }
  // the keys above the fixed digits, then the first `need` sharing them (all of them, or - every
  // digit fixed - the ties with the k-th key: the lower indices)
  for (size_t i = 0; i < n; ++i) mark(cand[i], (key[i] & high) > prefix);
  for (size_t j = 0; j < need; ++j) mark(cand[pool[j]], true);
}

}  // namespace qsa
