// Cold (quantized) K/V rows of the CPU decode op, dequantized as ops/cold_codec.py does: the
// element math is qsa_math.h's (the CUDA kernels' too), the same float32 operations in the same
// order (this file builds with -ffp-contract=off), so a cold row equals ColdCodec.dequantize /
// dequantize_keys bit for bit. The loops run per channel group and per nibble plane so that the
// compiler vectorizes them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qsa_math.h"
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

// The INT4 levels of a packed row as floats: channel j from the low nibble of byte j, j + D/2
// from the high one.
inline void unpack_levels(const uint8_t* row, int64_t D, float* q) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) q[j] = qsa_math::int4_low(row[j]);
  for (int64_t j = 0; j < half; ++j) q[half + j] = qsa_math::int4_high(row[j]);
}

// out[d] = float(q[d]) * scale[d / (D / cols)]
inline void int8_row(const int8_t* q, const float* scale, int64_t cols, int64_t D, float* out) {
  const int64_t per = D / cols;
  for (int64_t c = 0; c < cols; ++c) {
    const float s = scale[c];
    for (int64_t d = c * per; d < (c + 1) * per; ++d) out[d] = qsa_math::int8_value(static_cast<float>(q[d]), s);
  }
}

struct ColdScratch {  // per thread, reused
  std::vector<float> lo, hi, step, q, vs;
};

// The cold rows of tokens [first, last) of cold page `id` (a page id >= P), KV head h: keys into
// ck, values into cv, D floats per token. The tokens lie in one sub-page when the node is
// two-level (its INT4 keys sit on that sub-page's bounds), else anywhere in the page.
class ColdRows {
 public:
  ColdRows(const Problem& p, bool int4, ColdScratch& s)
      : p_(p), int4_(int4), lo_(s.lo), hi_(s.hi), step_(s.step), q_(s.q), vs_(s.vs) {}

  void rows(int64_t id, int64_t h, int64_t first, int64_t last, float* ck, float* cv) {
    const Cold& c = p_.cold;
    const int64_t D = p_.D, page = (id - p_.P) * p_.Hkv + h;
    if (!int4_) {
      for (int64_t t = first; t < last; ++t, ck += D, cv += D) {
        const int64_t kr = c.k_rows == 1 ? 0 : t, vr = c.v_rows == 1 ? 0 : t;
        int8_row(static_cast<const int8_t*>(c.kq) + (page * p_.ps + t) * D,
                 static_cast<const float*>(c.ks) + (page * c.k_rows + kr) * c.k_cols, c.k_cols, D, ck);
        int8_row(static_cast<const int8_t*>(c.vq) + (page * p_.ps + t) * D,
                 static_cast<const float*>(c.vs) + (page * c.v_rows + vr) * c.v_cols, c.v_cols, D, cv);
      }
      return;
    }
    key_bounds(id, h, first);
    q_.resize(D), vs_.resize(2 * c.v_cols);
    const int64_t per = D / c.v_cols;
    for (int64_t t = first; t < last; ++t, ck += D, cv += D) {
      unpack_levels(static_cast<const uint8_t*>(c.kq) + (page * p_.ps + t) * (D / 2), D, q_.data());
      for (int64_t d = 0; d < D; ++d) ck[d] = qsa_math::int4_key(q_[d], lo_[d], step_[d], hi_[d]);
      unpack_levels(static_cast<const uint8_t*>(c.vq) + (page * p_.ps + t) * (D / 2), D, q_.data());
      const uint16_t* s = static_cast<const uint16_t*>(c.vs) + (page * c.v_rows + (c.v_rows == 1 ? 0 : t)) * 2 * c.v_cols;
      for (int64_t g = 0; g < 2 * c.v_cols; ++g) vs_[g] = half_to_float(s[g]);  // [scales | mins]
      for (int64_t g = 0; g < c.v_cols; ++g) {  // v' = q * scale + vmin
        const float scale = vs_[g], vmin = vs_[c.v_cols + g];
        for (int64_t d = g * per; d < (g + 1) * per; ++d) cv[d] = qsa_math::int4_value(q_[d], scale, vmin);
      }
    }
  }

 private:
  // lo/hi/step of the INT4 keys of token t's sub-page (two-level node) or page (cold_codec.token_bounds).
  void key_bounds(int64_t id, int64_t h, int64_t t) {
    const int64_t D = p_.D;
    const float *kmin = p_.kmin + (id * p_.Hkv + h) * D, *kmax = p_.kmax + (id * p_.Hkv + h) * D;
    lo_.assign(kmin, kmin + D), hi_.assign(kmax, kmax + D), step_.resize(D);
    if (p_.sub) {  // fine_bounds.decode
      const uint8_t* code = p_.sub + ((id * p_.Hkv + h) * p_.r + t / p_.sp) * D;
      for (int64_t d = 0; d < D; ++d) qsa_math::sub_bounds(kmin[d], kmax[d], code[d], &lo_[d], &hi_[d]);
    }
    for (int64_t d = 0; d < D; ++d) step_[d] = qsa_math::level_step(lo_[d], hi_[d]);
  }

  const Problem& p_;
  const bool int4_;
  std::vector<float> &lo_, &hi_, &step_, &q_, &vs_;
};

}  // namespace qsa
