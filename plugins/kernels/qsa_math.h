/* The op's element math, once for every C++ target: the cold format's decode (INT8, INT4
 * format 3), the 4-bit sub-page bound decode and the INT4 key levels, as ops/cold_codec.py and
 * ops/fine_bounds.py define them (the numpy reference is the oracle).
 *
 * __host__ __device__-clean: no CUDA or TensorRT types, no std::, no allocation. nvcc compiles it
 * into the kernels (plugins/kernels: qsa_common.cuh, qsa_select_two_level.cu), g++ into the CPU
 * emulation of those kernels and into the CPU node (tinyserve_trt/cpu/csrc, compiled with -I to
 * this directory: tinyserve_trt/cpu/native.py; a wheel ships it as cuda/plugin_sources/kernels).
 * Only the parallel structure (warps, SIMD lanes) differs per target. The page scoring and the
 * selection rule are qsa_select_math.h's, on top of this file.
 *
 * Every product and sum is single-rounded float32 in the reference's order: __fmul_rn/__fadd_rn
 * on a GPU, plain operators on the host, where both builds use -ffp-contract=off (no FMA
 * contraction); madd is the one fused operation, for the dot products. The templates also take
 * GCC vector types (the CPU node's SIMD paths). */
#ifndef TINYSERVE_QSA_MATH_H
#define TINYSERVE_QSA_MATH_H

#include <stdint.h>
#if defined(__FMA__) && !defined(__CUDACC__) && !defined(QSA_EMULATION)
#include <immintrin.h>  // the CPU node's 8-wide fused multiply-add
#endif

#if defined(__CUDACC__) || defined(QSA_EMULATION)
#define QSA_HD __host__ __device__ __forceinline__
#else
#define QSA_HD inline
#endif

namespace qsa_math {

/* fine_bounds.INV_LEVELS: float32(1/15), the unit of the 4-bit codes and of the INT4 key levels. */
constexpr float kInvLevels = 1.0f / 15.0f;

QSA_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
QSA_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
QSA_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
/* Host SIMD vectors: element-wise, each op rounded once (-ffp-contract=off). */
template <typename V> inline V mul_rn(V a, V b) { return a * b; }
template <typename V> inline V add_rn(V a, V b) { return a + b; }
template <typename V> inline V sub_rn(V a, V b) { return a - b; }

/* a * b + c, fused where the target has FMA (a GPU; a host CPU built with FMA), else two
 * roundings. Dot products only (page scores, attention): never the bound or cold decodes above. */
QSA_HD float madd(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#elif defined(__FMA__)
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}
template <typename V> inline V madd(V a, V b, V c) {
#if defined(__FMA__) && !defined(__CUDACC__) && !defined(QSA_EMULATION)
    return _mm256_fmadd_ps(a, b, c);  // V: 8 floats (the CPU node's vf)
#else
    return a * b + c;
#endif
}

/* fine_bounds.level_step: one of the 15 steps between bounds lo <= hi. */
template <typename F> QSA_HD F level_step(F lo, F hi) { return mul_rn(sub_rn(hi, lo), F{} + kInvLevels); }

/* A byte's two 4-bit fields (integers or integer vectors): the low and the high nibble. */
template <typename I> QSA_HD I nibble_lo(I b) { return b & 15; }
template <typename I> QSA_HD I nibble_hi(I b) { return b >> 4; }

/* A key_sub_bounds code's two levels: the min's (low nibble) and the max's (high nibble). */
QSA_HD float code_lo(uint8_t code) { return float(nibble_lo(code)); }
QSA_HD float code_hi(uint8_t code) { return float(nibble_hi(code)); }

/* fine_bounds.decode: a sub-page's bounds from the page's (kmin, kmax), step = level_step(kmin, kmax). */
template <typename F> QSA_HD F sub_lo(F kmin, F lo_level, F step) { return add_rn(kmin, mul_rn(lo_level, step)); }
template <typename F> QSA_HD F sub_hi(F kmax, F hi_level, F step) { return sub_rn(kmax, mul_rn(hi_level, step)); }
QSA_HD void sub_bounds(float kmin, float kmax, uint8_t code, float* lo, float* hi) {
    const float step = level_step(kmin, kmax);
    *lo = sub_lo(kmin, code_lo(code), step);
    *hi = sub_hi(kmax, code_hi(code), step);
}

/* cold_codec.pack_int4: channel d < D/2 in the low nibble of byte d, d >= D/2 in the high nibble
 * of byte d - D/2; the level q in [0, 15]. */
QSA_HD float int4_level(const uint8_t* row, int32_t D, int32_t d) {
    const int32_t half = D >> 1;
    return d < half ? float(nibble_lo(row[d])) : float(nibble_hi(row[d - half]));
}
QSA_HD float int4_low(uint8_t b) { return float(nibble_lo(b)); }
QSA_HD float int4_high(uint8_t b) { return float(nibble_hi(b)); }

/* INT4 keys (format 3): level q between the (sub-)page bounds lo <= hi, min(lo + q * step, hi)
 * with step = level_step(lo, hi): never past hi, so the key stays inside the selection's bounds. */
QSA_HD float int4_key(float q, float lo, float step, float hi) {
    const float k = add_rn(lo, mul_rn(q, step));
    return hi < k ? hi : k;
}

/* INT4 values (format 3, asymmetric): q * scale + min. INT8 (keys and values): q * scale. */
QSA_HD float int4_value(float q, float scale, float vmin) { return add_rn(mul_rn(q, scale), vmin); }
QSA_HD float int8_value(float q, float scale) { return mul_rn(q, scale); }

}  // namespace qsa_math

#endif /* TINYSERVE_QSA_MATH_H */
