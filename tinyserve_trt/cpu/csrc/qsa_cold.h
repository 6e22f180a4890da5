// Cold (quantized) K/V rows of the CPU decode op, dequantized as ops/cold_codec.py does: the
// same float32 operations in the same order (this file builds with -ffp-contract=off), so a
// cold row equals ColdCodec.dequantize / dequantize_keys bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qsa_problem.h"

namespace qsa {

inline float half_to_float(uint16_t h) {  // IEEE binary16 -> binary32, exact (subnormals, inf, NaN too)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man) {  // subnormal: normalize
    exp = 113;
    while (!(man & 0x400u)) man <<= 1, --exp;
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  } else {
    bits = sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr float kInvLevels = static_cast<float>(1.0 / 15.0);  // fine_bounds.INV_LEVELS

// The INT4 nibble of channel d in a packed row (channel j low in byte j, j + D/2 high).
inline float nibble(const uint8_t* row, int64_t d, int64_t half) {
  return static_cast<float>(d < half ? row[d] & 15 : row[d - half] >> 4);
}

// Key row t (token in the page) of cold page `id` (a page id >= P), KV head h, into out[D].
inline void cold_key_row(const Problem& p, bool int4, int64_t id, int64_t h, int64_t t, float* out) {
  const Cold& c = p.cold;
  const int64_t D = p.D, page = (id - p.P) * p.Hkv + h;
  if (!int4) {
    const int8_t* q = static_cast<const int8_t*>(c.kq) + (page * p.ps + t) * D;
    const float* s = static_cast<const float*>(c.ks) + (page * c.k_rows + (c.k_rows == 1 ? 0 : t)) * c.k_cols;
    const int64_t per = D / c.k_cols;
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(q[d]) * s[d / per];
    return;
  }
  // keys on the bounds: the sub-page's decoded fine bounds in a two-level node, else the page's
  const float *kmin = p.kmin + (id * p.Hkv + h) * D, *kmax = p.kmax + (id * p.Hkv + h) * D;
  const uint8_t* q = static_cast<const uint8_t*>(c.kq) + (page * p.ps + t) * (D / 2);
  const uint8_t* code = p.sub ? p.sub + ((id * p.Hkv + h) * p.r + t / p.sp) * D : nullptr;
  for (int64_t d = 0; d < D; ++d) {
    float lo = kmin[d], hi = kmax[d];
    if (code) {
      const float fine = (kmax[d] - kmin[d]) * kInvLevels;
      const float lo_step = static_cast<float>(code[d] & 15) * fine, hi_step = static_cast<float>(code[d] >> 4) * fine;
      lo = kmin[d] + lo_step, hi = kmax[d] - hi_step;
    }
    const float step = (hi - lo) * kInvLevels, q_step = nibble(q, d, D / 2) * step;
    out[d] = std::min(lo + q_step, hi);
  }
}

// Value row t of cold page `id`, KV head h, into out[D].
inline void cold_value_row(const Problem& p, bool int4, int64_t id, int64_t h, int64_t t, float* out) {
  const Cold& c = p.cold;
  const int64_t D = p.D, page = (id - p.P) * p.Hkv + h, per = D / c.v_cols;
  const int64_t row = page * c.v_rows + (c.v_rows == 1 ? 0 : t);
  if (!int4) {
    const int8_t* q = static_cast<const int8_t*>(c.vq) + (page * p.ps + t) * D;
    const float* s = static_cast<const float*>(c.vs) + row * c.v_cols;
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(q[d]) * s[d / per];
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(c.vq) + (page * p.ps + t) * (D / 2);
  const uint16_t* s = static_cast<const uint16_t*>(c.vs) + row * 2 * c.v_cols;  // [scales | mins]
  for (int64_t d = 0; d < D; ++d) {
    const float scaled = nibble(q, d, D / 2) * half_to_float(s[d / per]);
    out[d] = scaled + half_to_float(s[c.v_cols + d / per]);
  }
}

}  // namespace qsa
