// 8-wide float vector helpers of the CPU decode op (GCC/Clang vector extension).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__FMA__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "qsa_select_math.h"  // plugins/kernels: madd, the page score's term (shared with the CUDA kernels)

namespace qsa {

// 8 floats: one AVX register (GCC/Clang vector extension; __m256 is the same type).
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));  // 8 lanes, for code conversion
constexpr int kW = 8;
constexpr int64_t kMaxFusedGroup = 8;
constexpr int64_t kMaxChunks = 16;  // head dims up to 128 take the register-blocked paths  // GQA groups up to this size score sub-pages from registers
constexpr int64_t kPagesAhead = 8;  // prefetch distance of the page bounds while scoring

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// x in every lane: one broadcast (`vf{} + x` compiles to a scalar add of 0, then the broadcast)
inline vf vsplat(float x) {
#if defined(__AVX__)
  return _mm256_set1_ps(x);
#else
  return vf{x, x, x, x, x, x, x, x};
#endif
}

// a * b + c: qsa_math::madd, explicit FMA where the CPU has it (the node builds with
// -ffp-contract=off for the sub-page bound decode, so the compiler fuses nothing by itself).
using qsa_math::madd;

// Sum of the lanes as a fixed tree.
inline float hsum(vf v) {
  float t[kW];
  vstore(t, v);
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

// sum_d a[d] * b[d], two independent vector chains.
inline float dot(const float* a, const float* b, int64_t n) {
  vf acc0 = {}, acc1 = {};
  int64_t d = 0;
  for (; d + 2 * kW <= n; d += 2 * kW) {
    acc0 = madd(vload(a + d), vload(b + d), acc0);
    acc1 = madd(vload(a + d + kW), vload(b + d + kW), acc1);
  }
  if (d + kW <= n) acc0 = madd(vload(a + d), vload(b + d), acc0), d += kW;
  float tail = 0.0f;
  for (; d < n; ++d) tail = madd(a[d], b[d], tail);
  return hsum(acc0 + acc1) + tail;
}

// The query-aware bound sum_d max(q*lo, q*hi) (lo <= hi) over n channels: qsa_math::bound_madd's
// term on 8 lanes, two independent chains; qpos/qneg: qsa_math::query_pos/query_neg of the query.
inline float bound(const float* qpos, const float* qneg, const float* lo, const float* hi, int64_t n) {
  vf acc0 = {}, acc1 = {};
  int64_t d = 0;
  for (; d + 2 * kW <= n; d += 2 * kW) {
    acc0 = qsa_math::bound_madd(acc0, vload(qpos + d), vload(qneg + d), vload(lo + d), vload(hi + d));
    acc1 = qsa_math::bound_madd(acc1, vload(qpos + d + kW), vload(qneg + d + kW), vload(lo + d + kW),
                                vload(hi + d + kW));
  }
  if (d + kW <= n) acc0 = qsa_math::bound_madd(acc0, vload(qpos + d), vload(qneg + d), vload(lo + d), vload(hi + d)), d += kW;
  float tail = 0.0f;
  for (; d < n; ++d) tail = qsa_math::bound_madd(tail, qpos[d], qneg[d], lo[d], hi[d]);
  return hsum(acc0 + acc1) + tail;
}

// Every cache line of row [n] into L1 (Locality 3), or into L2 only (2: a row read later in the
// call, whose L1 line would be evicted before the read).
template <int Locality = 3>
inline void prefetch_row(const float* row, int64_t n) {
  for (int64_t d = 0; d < n; d += 64 / sizeof(float)) __builtin_prefetch(row + d, 0, Locality);
}

// o[d] += w * x[d]
inline void axpy(float w, const float* x, float* o, int64_t n) {
  const vf wv = vsplat(w);
  int64_t d = 0;
  for (; d + kW <= n; d += kW) vstore(o + d, madd(wv, vload(x + d), vload(o + d)));
  for (; d < n; ++d) o[d] = madd(w, x[d], o[d]);
}

#ifdef __AVX2__
// exp of 8 floats (Cephes' expf, as in avx_mathfun): x = n*ln2 + r, |r| <= ln2/2, a degree-5
// polynomial for e^r, 2^n from the exponent bits. Within 2 ulp of expf over the softmax's
// range (x <= 0); exp(x) = 0 below -88.38 (expf: denormals or 0), NaN stays NaN, +inf clamps
// (never reached: the logits minus their max are <= 0). std::exp here was one libm call per
// logit (a dense layer at 8K: 72K per KV head group); on 8 lanes the node is 5-14% faster at 8K
// (bench_native_op.py --baseline-lib, benchmarks/results/native_op_cpu.md).
inline vf vexp(vf x) {
  const vf hi = vf{} + 88.3762626647949f, lo = vf{} + -88.3762626647949f;
  const vf nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  vf v = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const vf n = _mm256_floor_ps(madd(v, vf{} + 1.44269504088896341f, vf{} + 0.5f));
  v = madd(n, vf{} + -0.693359375f, v);
  v = madd(n, vf{} + 2.12194440e-4f, v);
  const vf z = v * v;
  vf y = vf{} + 1.9875691500e-4f;
  y = madd(y, v, vf{} + 1.3981999507e-3f);
  y = madd(y, v, vf{} + 8.3334519073e-3f);
  y = madd(y, v, vf{} + 4.1665795894e-2f);
  y = madd(y, v, vf{} + 1.6666665459e-1f);
  y = madd(y, v, vf{} + 5.0000001201e-1f);
  y = madd(y, z, v) + 1.0f;
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  const vf r = y * _mm256_castsi256_ps(e);
  return _mm256_blendv_ps(_mm256_andnot_ps(under, r), x, nan);
}

// l[i] = exp(l[i] - m) for i < n; returns their sum (8 lane sums, then the tail: the scalar sum
// after the loop waited on each add).
inline float exp_shifted(float* l, int64_t n, float m) {
  const vf mv = vsplat(m);
  vf acc = {};
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const vf e = vexp(vload(l + i) - mv);
    vstore(l + i, e);
    acc += e;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) l[i] = std::exp(l[i] - m), sum += l[i];
  return sum;
}

#ifdef __AVX512F__
// 16 lanes to 8: lane i + lane i + 8 (a 16-channel sum handed to the 8-lane reductions below).
inline vf fold16(__m512 v) {
  return _mm512_castps512_ps256(v) + _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
#endif

// Sums of 8 vectors, one per lane: lane i of the result is the sum of the lanes of a[i].
inline vf hsum8(const vf* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_permute2f128_ps(s0123, s4567, 0x20) + _mm256_permute2f128_ps(s0123, s4567, 0x31);
}
#endif

}  // namespace qsa
