// Prefill (S > 1) of QueryAwareSparseAttention on CPU, free of ONNX Runtime types: exact causal
// attention of each new token over every cached token of its sequence plus the new tokens up to
// itself (ops/reference.py sparse_attention_ref for S > 1; selection does not apply), as a
// flash-attention loop: the cached pages and the new tokens go by in key blocks of kKB rows, each
// block's scores for a tile of query rows, an online softmax per row, and the rows' outputs
// accumulated in float32 - no [H, S, T] score tensor (the ONNX function's MatMul body writes one:
// 940 MB per layer for a 512-token chunk over 32K cached tokens of 14 heads).
//
// Work: a task per (sequence, KV head, block of new tokens); its rows are the block's tokens x the
// group's G query heads, so each K/V block is read (and cold pages dequantized) once for all of
// them. Per key block: K transposed into [Dp, kKB], V copied into [kKB, Dp] (Dp: D padded to the
// vector width, zeros), then a register tile of kRB rows x kKB scores (one broadcast-FMA per query
// element and key vector), the softmax update, and the value tile per vector of channels.
// FLOPs per layer: 4 * B * H * S * (past + S / 2) * D; bytes read: the cache once per token block.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qsa_cold.h"
#include "qsa_problem.h"
#include "qsa_thread_pool.h"
#include "qsa_vector.h"

namespace qsa {
namespace prefill {

#if defined(__AVX512F__)
constexpr int64_t kPW = 16;  // floats per vector: one zmm
constexpr int64_t kKB = 64;  // keys per block
constexpr int64_t kRB = 6;   // query rows per score tile: kRB * kKB / kPW accumulators (24 of 32 zmm)
#else
constexpr int64_t kPW = 8;
constexpr int64_t kKB = 32;
constexpr int64_t kRB = 2;   // 8 of 16 ymm
#endif
typedef float pvec __attribute__((vector_size(kPW * sizeof(float))));
typedef int32_t pint __attribute__((vector_size(kPW * sizeof(int32_t))));
constexpr int64_t kKV = kKB / kPW;     // vectors per score row
constexpr int64_t kVR = 8;             // query rows per value tile
constexpr int64_t kRowsPerTask = 256;  // query rows (tokens x heads) a task aims at

inline pvec pload(const float* p) {
  pvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void pstore(float* p, pvec v) { std::memcpy(p, &v, sizeof v); }
// x in every lane (a broadcast; `pvec{} + x` compiles to a scalar add of 0 first)
inline pvec splat(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX__)
  return _mm256_set1_ps(x);
#else
  pvec v;
  for (int64_t i = 0; i < kPW; ++i) v[i] = x;
  return v;
#endif
}
// a * b + c, fused where the CPU can (the library builds with -ffp-contract=off: nothing fuses by itself)
inline pvec pmadd(pvec a, pvec b, pvec c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}
inline float pmax(pvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(v);
#else
  float t[kPW];
  pstore(t, v);
  return *std::max_element(t, t + kPW);
#endif
}
inline float psum(pvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  float t[kPW], s = 0.0f;
  pstore(t, v);
  for (int64_t i = 0; i < kPW; ++i) s += t[i];
  return s;
#endif
}

#if defined(__AVX512F__)
// exp of 16 floats: vexp (qsa_vector.h, Cephes' expf) on one zmm; 0 below -88.38, NaN stays NaN.
inline pvec pexp(pvec xv) {
  const __m512 x = xv, hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  __m512 v = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  v = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), v);
  v = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), v);
  const __m512 z = _mm512_mul_ps(v, v);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, v), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 r = _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
  return _mm512_mask_mov_ps(r, nan, x);
}
#elif defined(__AVX2__)
inline pvec pexp(pvec x) { return vexp(x); }
#else
inline pvec pexp(pvec x) {
  float t[kPW];
  pstore(t, x);
  for (int64_t i = 0; i < kPW; ++i) t[i] = std::exp(t[i]);
  return pload(t);
}
#endif

struct Scratch {  // per thread, reused across calls
  std::vector<float> q, acc, m, l, kt, vb, probs, cold;
  std::vector<const float*> krows, vrows;
  ColdScratch cs;
};

// Padded head dim: a whole number of vectors.
inline int64_t padded(int64_t D) { return (D + kPW - 1) / kPW * kPW; }

// One key block of n <= kKB keys (K rows k[i], V rows v[i], D floats each) for `rows` query rows
// (s.q [rows][Dp], pre-scaled; state s.m, s.l, s.acc [rows][Dp]); row r sees the block's keys
// [0, limit(r)) (causal; limit >= n: all of them).
template <class Limit>
inline void attend_block(Scratch& s, int64_t rows, int64_t D, const float* const* k, const float* const* v, int64_t n,
                         Limit limit) {
  const int64_t Dp = padded(D);
  float* kt = s.kt.data();  // [Dp][kKB], zero past n and past D
  float* vb = s.vb.data();  // [kKB][Dp], zero past n and past D
  if (n < kKB || D < Dp) std::fill(kt, kt + Dp * kKB, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k[j];
    for (int64_t d = 0; d < D; ++d) kt[d * kKB + j] = kj[d];
  }
  for (int64_t j = 0; j < n; ++j) {
    std::memcpy(vb + j * Dp, v[j], D * sizeof(float));
    std::fill(vb + j * Dp + D, vb + (j + 1) * Dp, 0.0f);
  }
  pint iota;
  for (int64_t i = 0; i < kPW; ++i) iota[i] = static_cast<int32_t>(i);
  float* probs = s.probs.data();  // [kVR][kKB]: the value tile's probabilities
  for (int64_t r0 = 0; r0 < rows; r0 += kVR) {
    const int64_t rn = std::min(kVR, rows - r0);
    for (int64_t t0 = 0; t0 < rn; t0 += kRB) {  // scores and softmax update, kRB rows at a time
      const float* qr[kRB];
      for (int64_t i = 0; i < kRB; ++i) qr[i] = s.q.data() + (r0 + std::min(t0 + i, rn - 1)) * Dp;
      pvec acc[kRB][kKV] = {};
      for (int64_t d = 0; d < Dp; ++d) {
        pvec kv[kKV];
        for (int64_t c = 0; c < kKV; ++c) kv[c] = pload(kt + d * kKB + c * kPW);
        for (int64_t i = 0; i < kRB; ++i) {
          const pvec qd = splat(qr[i][d]);
          for (int64_t c = 0; c < kKV; ++c) acc[i][c] = pmadd(qd, kv[c], acc[i][c]);
        }
      }
      for (int64_t i = 0; i < kRB && t0 + i < rn; ++i) {
        const int64_t r = r0 + t0 + i, lim = std::min<int64_t>(limit(r), n);
        float* p = probs + (t0 + i) * kKB;
        if (lim <= 0) {  // nothing of this block is visible to the row
          std::fill(p, p + kKB, 0.0f);
          continue;
        }
        if (lim < kKB)  // hidden keys (causal, or past n): -inf, exp 0
          for (int64_t c = 0; c < kKV; ++c) {
            const pint visible = (iota + static_cast<int32_t>(c * kPW)) < static_cast<int32_t>(lim);
            acc[i][c] = visible ? acc[i][c] : splat(-INFINITY);
          }
        pvec best = acc[i][0];
        for (int64_t c = 1; c < kKV; ++c) best = acc[i][c] > best ? acc[i][c] : best;
        const float m_old = s.m[r], m_new = std::max(m_old, pmax(best));
        pvec sum = {};
        for (int64_t c = 0; c < kKV; ++c) {
          const pvec e = pexp(acc[i][c] - splat(m_new));  // exp(-inf) = 0 for the hidden keys
          pstore(p + c * kPW, e);
          sum += e;
        }
        const float corr = m_old == m_new ? 1.0f : m_old == -INFINITY ? 0.0f : std::exp(m_old - m_new);
        s.l[r] = s.l[r] * corr + psum(sum);
        s.m[r] = m_new;
        if (corr != 1.0f) {
          float* a = s.acc.data() + r * Dp;
          for (int64_t d = 0; d < Dp; d += kPW) pstore(a + d, pload(a + d) * splat(corr));
        }
      }
    }
    // values: acc[r] += sum_j p[r][j] * v[j], two vectors of channels at a time (each row's
    // probability broadcast once for both: 10 loads per 16 FMAs, where one vector took 9 per 8)
    int64_t c = 0;
    for (; c + 2 * kPW <= Dp; c += 2 * kPW) {
      pvec a[kVR], b[kVR];
      for (int64_t i = 0; i < kVR; ++i) {
        a[i] = i < rn ? pload(s.acc.data() + (r0 + i) * Dp + c) : pvec{};
        b[i] = i < rn ? pload(s.acc.data() + (r0 + i) * Dp + c + kPW) : pvec{};
      }
      for (int64_t j = 0; j < n; ++j) {
        const pvec va = pload(vb + j * Dp + c), vb2 = pload(vb + j * Dp + c + kPW);
        for (int64_t i = 0; i < kVR; ++i) {
          const pvec p = splat(probs[i * kKB + j]);
          a[i] = pmadd(p, va, a[i]), b[i] = pmadd(p, vb2, b[i]);
        }
      }
      for (int64_t i = 0; i < rn; ++i) {
        pstore(s.acc.data() + (r0 + i) * Dp + c, a[i]);
        pstore(s.acc.data() + (r0 + i) * Dp + c + kPW, b[i]);
      }
    }
    for (; c < Dp; c += kPW) {
      pvec a[kVR];
      for (int64_t i = 0; i < kVR; ++i) a[i] = i < rn ? pload(s.acc.data() + (r0 + i) * Dp + c) : pvec{};
      for (int64_t j = 0; j < n; ++j) {
        const pvec vj = pload(vb + j * Dp + c);
        for (int64_t i = 0; i < kVR; ++i) a[i] = pmadd(splat(probs[i * kKB + j]), vj, a[i]);
      }
      for (int64_t i = 0; i < rn; ++i) pstore(s.acc.data() + (r0 + i) * Dp + c, a[i]);
    }
  }
}

// Tokens per task: about kRowsPerTask rows of the group's G heads.
inline int64_t tokens_per_task(const Problem& p) { return std::max<int64_t>(1, kRowsPerTask / p.G); }

// One task: sequence b, KV head h, new tokens [s0, s1).
inline void run_task(const Problem& p, bool int4, float scale, Scratch& s, int64_t b, int64_t h, int64_t s0, int64_t s1) {
  const int64_t D = p.D, Dp = padded(D), G = p.G, T = s1 - s0, rows = T * G;
  s.q.assign(rows * Dp, 0.0f), s.acc.assign(rows * Dp, 0.0f);
  s.m.assign(rows, -INFINITY), s.l.assign(rows, 0.0f);
  s.kt.resize(Dp * kKB), s.vb.resize(kKB * Dp), s.probs.assign(kVR * kKB, 0.0f);
  s.krows.resize(kKB), s.vrows.resize(kKB);
  for (int64_t t = 0; t < T; ++t)  // row (t, g): token s0 + t, query head h*G + g
    for (int64_t g = 0; g < G; ++g) {
      const float* q = p.q_row(b, h * G + g, s0 + t);
      float* row = s.q.data() + (t * G + g) * Dp;
      for (int64_t d = 0; d < D; ++d) row[d] = q[d] * scale;
    }
  auto all = [](int64_t) { return kKB; };
  // cached tokens: every page of the sequence, each visible to every new token; blocks of whole
  // pages (a page larger than a block: in pieces), cold pages dequantized into s.cold
  const int64_t past = p.past[b], n = (past + p.ps - 1) / p.ps, cap = std::max(kKB, p.ps);
  const int32_t* pages = p.table + b * p.NP;
  ColdRows cold(p, int4, s.cs);
  if (p.cold.Pc) s.cold.resize(2 * cap * D);
  float *ck = s.cold.data(), *cv = ck + cap * D;
  int64_t count = 0, cold_used = 0;
  auto flush = [&] {
    if (count) attend_block(s, rows, D, s.krows.data(), s.vrows.data(), count, all);
    count = 0;
  };
  for (int64_t j = 0; j < n; ++j) {
    const int64_t id = pages[j], len = std::min(p.ps, past - j * p.ps);
    if (count + len > kKB) flush();
    if (count == 0) cold_used = 0;
    const float *kbase, *vbase;
    if (id < p.P) {
      kbase = p.kc + (id * p.Hkv + h) * p.ps * D, vbase = p.vc + (id * p.Hkv + h) * p.ps * D;
    } else {  // a sub-page at a time: two-level INT4 keys sit on its bounds
      kbase = ck + cold_used * D, vbase = cv + cold_used * D;
      for (int64_t t = 0; t < len; t += p.sp)
        cold.rows(id, h, t, std::min(t + p.sp, len), ck + (cold_used + t) * D, cv + (cold_used + t) * D);
      cold_used += len;
    }
    for (int64_t t = 0; t < len; ++t) {
      s.krows[count] = kbase + t * D, s.vrows[count] = vbase + t * D;
      if (++count == kKB) flush();
    }
  }
  flush();
  // new tokens 0 .. s1-1: token s0 + t sees those up to itself
  for (int64_t u0 = 0; u0 < s1; u0 += kKB) {
    const int64_t m = std::min(kKB, s1 - u0);
    for (int64_t i = 0; i < m; ++i) s.krows[i] = p.k_row(b, h, u0 + i), s.vrows[i] = p.v_row(b, h, u0 + i);
    attend_block(s, rows, D, s.krows.data(), s.vrows.data(), m,
                 [&](int64_t r) { return s0 + r / G - u0 + 1; });
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      float* out = p.out_row(b, h * G + g, s0 + t);
      const float inv = 1.0f / s.l[r];
      for (int64_t d = 0; d < D; ++d) out[d] = s.acc[r * Dp + d] * inv;
    }
}

// Every (sequence, KV head, token block) task over the pool's threads; selected_pages (if asked)
// marks every page a sequence holds. Returns false when a task could not allocate its scratch.
inline bool run(const Problem& p, const Attrs& a) {
  const float scale = a.scale > 0.0f ? a.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.D)));
  const int64_t per = tokens_per_task(p), blocks = (p.S + per - 1) / per, tasks = p.B * p.Hkv * blocks;
  std::atomic<bool> ok{true};
  parallel_for(tasks, [&](int64_t i) {
    try {
      thread_local Scratch s;
      const int64_t blk = i % blocks, bh = i / blocks, b = bh / p.Hkv, h = bh % p.Hkv;
      run_task(p, a.cold_int4, scale, s, b, h, blk * per, std::min(p.S, (blk + 1) * per));
    } catch (...) {
      ok = false;
    }
  }, 1);
  if (ok && p.selected)
    for (int64_t b = 0; b < p.B; ++b) {
      const int64_t n = (p.past[b] + p.ps - 1) / p.ps;
      for (int64_t h = 0; h < p.Hkv; ++h) {
        bool* sel = p.selected + (b * p.Hkv + h) * p.NP;
        std::fill(sel, sel + p.NP, false);
        std::fill(sel, sel + n, true);
      }
    }
  return ok;
}

}  // namespace prefill
}  // namespace qsa
