// Softmax attention over a decode step's kept K/V rows, in chunks merged after (online softmax parts):
// the second half of qsa_decode_math.h's run(). Float32; the numpy reference computes in float64.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qsa_problem.h"
#include "qsa_vector.h"

namespace qsa {

// std::max_element's value over l [T] (-inf for T = 0): NaN only where l[0] is (a NaN after the
// first compares false and is passed over). On 8 lanes a chain of vector maxes: the scalar loop
// waited on each compare (perf: 11% of attend_part at a 512-token dense step).
inline float max_of(const float* l, int64_t T) {
  if (T == 0) return -INFINITY;
#ifdef __AVX2__
  if (T >= kW && l[0] == l[0]) {
    vf acc = vsplat(l[0]);
    int64_t t = 0;
    for (; t + kW <= T; t += kW) acc = _mm256_max_ps(vload(l + t), acc);  // a NaN lane keeps acc's
    float lanes[kW];
    vstore(lanes, acc);
    float m = lanes[0];
    for (int64_t i = 1; i < kW; ++i) m = lanes[i] > m ? lanes[i] : m;
    for (; t < T; ++t) m = l[t] > m ? l[t] : m;
    return m;
  }
#endif
  return *std::max_element(l, l + T);
}

// A query head's softmax statistics over its T logits l (masked rows -inf): part[0] = the max m,
// part[1] = sum exp(l - m), with l[t] = exp(l[t] - m); a head that attends no row here (m = -inf:
// an empty chunk) gets part[1] = 0 and l all 0, which merge_parts skips.
inline void softmax_stats(float* l, int64_t T, float* part) {
  const float m = max_of(l, T);
  part[0] = m;
  if (m == -INFINITY) {
    std::fill(l, l + T, 0.0f);
    part[1] = 0.0f;
    return;
  }
#ifdef __AVX2__
  part[1] = exp_shifted(l, T, m);
#else
  float sum = 0.0f;
  for (int64_t t = 0; t < T; ++t) l[t] = std::exp(l[t] - m), sum += l[t];
  part[1] = sum;
#endif
}

// Softmax attention of a task's gn queries (sequence b, KV head h, query heads g0 .. g0 + gn of its
// group) over `count` kept rows (K rows krows[t], V rows vrows[t]) and, if with_new, the new token: per query, part[0] = the max
// logit m, part[1] = sum exp(logit - m), part[2..2+D) = sum exp(logit - m) * v. Part layout
// [gn][2 + D].
inline void attend_part_generic(const Problem& p, const Attrs& a, const Task& task, const float* const* krows,
                                const float* const* vrows, int64_t count, bool with_new, std::vector<float>& logits,
                                float* part) {
  const int64_t D = p.D, G = task.gn, T = count + (with_new ? 1 : 0), new_row = (task.b * p.Hkv + task.h) * D;
  const float* q = p.q + (task.b * p.H + task.h * p.G + task.g0) * D;
  const float scale = a.scale > 0.0f ? a.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  logits.resize(G * T);
  // Kept sub-pages are scattered over the pools: prefetch the K and V rows kAhead ahead (V
  // for the second pass); 8-64 measured alike at batch 8, 8K, cold caches.
  constexpr int64_t kAhead = 16;
  for (int64_t t = 0; t < T; ++t) {
    const float* krow = t < count ? krows[t] : p.k + new_row;
    if (t + kAhead < count) {
      prefetch_row(krows[t + kAhead], D);
      prefetch_row(vrows[t + kAhead], D);
    }
    for (int64_t g = 0; g < G; ++g) logits[g * T + t] = dot(q + g * D, krow, D) * scale;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* out = part + g * (2 + D);
    softmax_stats(&logits[g * T], T, out);
    std::fill(out + 2, out + 2 + D, 0.0f);
  }
  for (int64_t t = 0; t < T; ++t) {
    const float* vrow = t < count ? vrows[t] : p.v + new_row;
    for (int64_t g = 0; g < G; ++g) axpy(logits[g * T + t], vrow, part + g * (2 + D) + 2, D);
  }
}


// attend_part_generic, blocked: the logits of 8 rows per query head at a time (one reduction
// for 8 dot products instead of 8); the values in blocks of kValueBlock rows, each block read once
// for all the task's heads (its rows stay in L1) and each head's output accumulated in registers
// over the block. For D a multiple of 8, D <= 128; same sums in another order (float32 rounding, within schema.TOLERANCES).
inline void attend_part(const Problem& p, const Attrs& a, const Task& task, const float* const* krows,
                        const float* const* vrows, int64_t count, bool with_new, std::vector<float>& logits,
                        float* part) {
#ifdef __AVX2__
  const int64_t D = p.D, G = task.gn, T = count + (with_new ? 1 : 0), new_row = (task.b * p.Hkv + task.h) * D;
  if (D % kW != 0 || D / kW > kMaxChunks)
    return attend_part_generic(p, a, task, krows, vrows, count, with_new, logits, part);
  const int64_t C = D / kW, LT = T + kW;  // a head's logits row: T, padded to whole blocks
  const float* q = p.q + (task.b * p.H + task.h * p.G + task.g0) * D;
  const float scale = a.scale > 0.0f ? a.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  logits.resize(G * LT);
  auto krow = [&](int64_t t) { return t < count ? krows[t] : p.k + new_row; };
  auto vrow = [&](int64_t t) { return t < count ? vrows[t] : p.v + new_row; };
  constexpr int64_t kAhead = 16;
  for (int64_t t0 = 0; t0 < T; t0 += kW) {
    const int64_t n = std::min<int64_t>(kW, T - t0);
    for (int64_t t = t0 + kAhead; t < std::min(t0 + kAhead + kW, count); ++t) {
      prefetch_row(krows[t], D);
      prefetch_row<2>(vrows[t], D);
    }
    const float* k[kW];
    for (int64_t i = 0; i < kW; ++i) k[i] = krow(t0 + (i < n ? i : 0));
    for (int64_t g = 0; g < G; ++g) {
      vf acc[kW] = {};
      const float* qg = q + g * D;
#ifdef __AVX512F__
      if (C % 2 == 0) {  // 16 channels a register: half the FMAs; each row's sum folds to 8 lanes
        __m512 wide[kW];
        for (int64_t i = 0; i < kW; ++i) wide[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < C / 2; ++c) {
          const __m512 qc = _mm512_loadu_ps(qg + c * 16);
          for (int64_t i = 0; i < kW; ++i) wide[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k[i] + c * 16), wide[i]);
        }
        for (int64_t i = 0; i < kW; ++i) acc[i] = fold16(wide[i]);
        vstore(&logits[g * LT + t0], hsum8(acc) * scale);
        continue;
      }
#endif
      for (int64_t c = 0; c < C; ++c) {
        const vf qc = vload(qg + c * kW);
        for (int64_t i = 0; i < kW; ++i) acc[i] = madd(qc, vload(k[i] + c * kW), acc[i]);
      }
      vstore(&logits[g * LT + t0], hsum8(acc) * scale);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* out = part + g * (2 + D);
    softmax_stats(&logits[g * LT], T, out);
    std::fill(out + 2, out + 2 + D, 0.0f);
  }
  constexpr int64_t kValueBlock = 32;
  for (int64_t t0 = 0; t0 < T; t0 += kValueBlock) {
    const int64_t t1 = std::min(t0 + kValueBlock, T);
    for (int64_t g = 0; g < G; ++g) {
      float* out = part + g * (2 + D) + 2;
      if (out[-1] == 0.0f) continue;  // no row
      const float* l = &logits[g * LT];
#ifdef __AVX512F__
      if (C % 2 == 0) {  // 16 channels a register: half the FMAs of the 8-lane loop below
        __m512 acc[kMaxChunks / 2];
        for (int64_t c = 0; c < C / 2; ++c) acc[c] = _mm512_loadu_ps(out + c * 16);
        for (int64_t t = t0; t < t1; ++t) {
          if (g == 0 && t + kAhead < count) prefetch_row(vrows[t + kAhead], D);
          const __m512 w = _mm512_set1_ps(l[t]);
          const float* v = vrow(t);
          for (int64_t c = 0; c < C / 2; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + c * 16), acc[c]);
        }
        for (int64_t c = 0; c < C / 2; ++c) _mm512_storeu_ps(out + c * 16, acc[c]);
        continue;
      }
#endif
      vf acc[kMaxChunks];
      for (int64_t c = 0; c < C; ++c) acc[c] = vload(out + c * kW);
      for (int64_t t = t0; t < t1; ++t) {
        if (g == 0 && t + kAhead < count) prefetch_row(vrows[t + kAhead], D);
        const vf w = vsplat(l[t]);
        const float* v = vrow(t);
        for (int64_t c = 0; c < C; ++c) acc[c] = madd(w, vload(v + c * kW), acc[c]);
      }
      for (int64_t c = 0; c < C; ++c) vstore(out + c * kW, acc[c]);
    }
  }
#else
  attend_part_generic(p, a, task, krows, vrows, count, with_new, logits, part);
#endif
}

// output[b, h*G + g0 + g] from the chunks' parts [chunks][gn][2 + D] (flash-decoding's merge).
inline void merge_parts(const Problem& p, const Task& task, const float* parts, int64_t chunks) {
  const int64_t D = p.D, G = task.gn, stride = G * (2 + D);
  float* out = p.out + (task.b * p.H + task.h * p.G + task.g0) * D;
  for (int64_t g = 0; g < G; ++g) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, parts[c * stride + g * (2 + D)]);
    float* o = out + g * D;
    std::fill(o, o + D, 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* part = parts + c * stride + g * (2 + D);
      if (part[1] == 0.0f) continue;  // an empty chunk
      const float w = chunks == 1 ? 1.0f : std::exp(part[0] - m);
      sum += w * part[1];
      axpy(w, part + 2, o, D);
    }
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

}  // namespace qsa
