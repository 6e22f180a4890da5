// tinyserve_append_bounds: a decode step's page key bounds and sub-page codes, updated in place.
//
// The C form of tinyserve_trt/runtime/append_bounds.py::append_bounds_numpy (the reference),
// equal to it bit for bit (tests/cpu/test_native_append.py): each token is its page's only
// append this step, already written to the pool at offset `off` (the page's valid count before).
// Per (layer, token, KV head):
//   * key_min/key_max: min/max of the old bound and the token (a fresh page, off == 0: the token);
//   * sub-page codes (ops/fine_bounds.py encode): every written sub-page of the channels whose
//     page min or max moved (every channel of a fresh page), sub-pages without a written token
//     code 0; and the token's own sub-page in every channel.
// The numpy path spends ~500 small reductions per step on this (8 tokens, 30 layers); here it
// is one pass over the touched pages. float32 pools only (float16 stays on the numpy path).
//
// Build with -ffp-contract=off (native.py does): the encoder's decode check rounds each
// product and sum separately, as numpy does.
// Every loop over D here is selects, no branch: GCC if-converts (and so vectorizes) them only
// without trapping math, which concerns FP exception flags, never results. For the whole file
// (the headers too), so qsa_math's helpers still inline into these functions.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include <cmath>
#include <cstdint>
#include <vector>

#include "qsa_math.h"

namespace {

constexpr int kLevels = 15;  // fine_bounds.LEVELS

enum Status : int { kOk = 0, kBadPage = 1, kBadOffset = 2, kSharedPage = 3, kOutsidePage = 4 };

// fine_bounds.encode's first guess for each channel: the float64 floor of the distance in
// steps, clipped to [0, 15] (step <= 0: code 0). Branch-free, so the float64 divisions vectorize.
void first_codes(const float* smin, const float* smax, const float* kmin, const float* kmax, int64_t D,
                        int32_t* lo, int32_t* hi) {
  for (int64_t d = 0; d < D; ++d) {
    const float step = qsa_math::level_step(kmin[d], kmax[d]);
    const bool pos = step > 0;
    const double s = pos ? static_cast<double>(step) : 1.0;
    double lo_c = std::floor((static_cast<double>(smin[d]) - static_cast<double>(kmin[d])) / s);
    double hi_c = std::floor((static_cast<double>(kmax[d]) - static_cast<double>(smax[d])) / s);
    // max/min in this operand order are maxpd/minpd (a NaN - keys outside the contract - gives 0)
    lo_c = lo_c > 0.0 ? lo_c : 0.0;
    hi_c = hi_c > 0.0 ? hi_c : 0.0;
    lo_c = lo_c < kLevels ? lo_c : double(kLevels);
    hi_c = hi_c < kLevels ? hi_c : double(kLevels);
    lo[d] = static_cast<int32_t>(pos ? lo_c : 0.0);
    hi[d] = static_cast<int32_t>(pos ? hi_c : 0.0);
  }
}

// The rest of fine_bounds.encode for one (sub-page, channel): widen a code by one step while the
// float32 decode (each product and sum rounded once) lands inside [smin, smax]. The caller has
// checked kmin <= smin and smax <= kmax, so code 0 (the page bound) always ends it.
inline uint8_t widen(int lo, int hi, float smin, float smax, float kmin, float kmax) {
  const float step = qsa_math::level_step(kmin, kmax);
  for (;;) {  // the decode is qsa_math's (fine_bounds.decode), as the op's readers compute it
    const bool bad_lo = qsa_math::sub_lo(kmin, static_cast<float>(lo), step) > smin && lo > 0;
    const bool bad_hi = qsa_math::sub_hi(kmax, static_cast<float>(hi), step) < smax && hi > 0;
    if (!(bad_lo || bad_hi)) break;
    lo -= bad_lo;
    hi -= bad_hi;
  }
  return static_cast<uint8_t>(lo + (hi << 4));
}

// numpy's minimum/maximum: a NaN on either side propagates (a's if both). Selects only, no
// branch, so the loops over D vectorize (built without trapping math: see the file's top).
inline float np_min(float a, float b) {
  const float m = b < a ? b : a;
  return a != a ? a : (b != b ? b : m);
}
inline float np_max(float a, float b) {
  const float m = b > a ? b : a;
  return a != a ? a : (b != b ? b : m);
}

// The codes of one sub-page - its written tokens [t0, t1) of the page's keys kp [ps, D] - in the
// channels `moved` marks (every channel when null) into codes [D], against the page bounds mn/mx
// (fine_bounds.encode); smin/smax/lo/hi/done: [D] scratch. False when a token lies outside the bounds
// (the encoder's precondition: a stale page bound), with the channels before it written.
bool encode_sub_page(const float* kp, int64_t t0, int64_t t1, int64_t D, const float* mn, const float* mx,
                     const uint8_t* moved, float* smin, float* smax, int32_t* lo, int32_t* hi, uint8_t* done,
                     uint8_t* codes) {
  for (int64_t d = 0; d < D; ++d) smin[d] = smax[d] = kp[t0 * D + d];
  for (int64_t i = t0 + 1; i < t1; ++i) {
    const float* row = kp + i * D;
    for (int64_t d = 0; d < D; ++d) {
      smin[d] = np_min(smin[d], row[d]);
      smax[d] = np_max(smax[d], row[d]);
    }
  }
  first_codes(smin, smax, mn, mx, D, lo, hi);
  // widen's first test for all channels at once: most first guesses decode inside the sub-page
  for (int64_t d = 0; d < D; ++d) {
    const float step = qsa_math::level_step(mn[d], mx[d]);
    const bool bad_lo = qsa_math::sub_lo(mn[d], static_cast<float>(lo[d]), step) > smin[d] && lo[d] > 0;
    const bool bad_hi = qsa_math::sub_hi(mx[d], static_cast<float>(hi[d]), step) < smax[d] && hi[d] > 0;
    done[d] = !(bad_lo || bad_hi);
  }
  for (int64_t d = 0; d < D; ++d) {
    if (moved && !moved[d]) continue;
    if (smin[d] < mn[d] || smax[d] > mx[d]) return false;
    codes[d] = done[d] ? static_cast<uint8_t>(lo[d] + (hi[d] << 4)) : widen(lo[d], hi[d], smin[d], smax[d], mn[d], mx[d]);
  }
  return true;
}

}  // namespace

// keys [L, N, H, ps, D] float32 (the hot pool, tokens written); key_min/key_max [L, Nm, H, D]
// float32; sub [L, Nm, H, r, D] uint8 or null (single-level: r unused); page/off [T] int64;
// k [L, T, H, D] float32 (the appended keys). All C-contiguous. Returns 0, or a Status:
// checks 1-3 run before anything is written; 4 (the encoder's precondition, a stale page bound)
// stops midway, like the numpy path's ValueError.
extern "C" __attribute__((visibility("default"))) int tinyserve_append_bounds(
    const float* keys, float* key_min, float* key_max, uint8_t* sub, const int64_t* page, const int64_t* off,
    const float* k, int64_t L, int64_t N, int64_t Nm, int64_t H, int64_t ps, int64_t D, int64_t T, int64_t r) {
  for (int64_t t = 0; t < T; ++t) {
    if (page[t] < 0 || page[t] >= N || page[t] >= Nm) return kBadPage;
    if (off[t] < 0 || off[t] >= ps) return kBadOffset;
    for (int64_t u = 0; u < t; ++u)
      if (page[u] == page[t]) return kSharedPage;
  }
  const int64_t sp = sub ? ps / r : ps;
  std::vector<uint8_t> moved(D);
  std::vector<float> smin(D), smax(D);
  std::vector<int32_t> lo(D), hi(D);
  std::vector<uint8_t> done(D);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = page[t], valid = off[t] + 1, j = off[t] / sp;
      const bool fresh = off[t] == 0;
      for (int64_t h = 0; h < H; ++h) {
        const float* kt = k + ((l * T + t) * H + h) * D;
        float* mn = key_min + ((l * Nm + p) * H + h) * D;
        float* mx = key_max + ((l * Nm + p) * H + h) * D;
        int64_t n_moved = 0;
        for (int64_t d = 0; d < D; ++d) {
          const float new_min = fresh ? kt[d] : np_min(mn[d], kt[d]);
          const float new_max = fresh ? kt[d] : np_max(mx[d], kt[d]);
          moved[d] = fresh || new_min != mn[d] || new_max != mx[d];
          n_moved += moved[d];
          mn[d] = new_min;
          mx[d] = new_max;
        }
        if (!sub) continue;
        const float* kp = keys + ((l * N + p) * H + h) * ps * D;
        uint8_t* codes = sub + ((l * Nm + p) * H + h) * r * D;
        // sub-pages 0..j hold tokens: j (the token's own) changes in every channel, 0..j-1 in the
        // moved ones. Each is encoded over all D channels at once (its rows' min/max and the first
        // guesses vectorize: one pass per sub-page cost less than a strided pass per moved channel,
        // perf) and written in the channels that change.
        for (int64_t s = n_moved ? 0 : j; s <= j; ++s) {
          const int64_t t0 = s * sp, t1 = (s + 1) * sp < valid ? (s + 1) * sp : valid;
          if (!encode_sub_page(kp, t0, t1, D, mn, mx, s != j ? moved.data() : nullptr, smin.data(), smax.data(),
                               lo.data(), hi.data(), done.data(), codes + s * D))
            return kOutsidePage;
        }
        for (int64_t s = j + 1; s < r; ++s)  // no written token: the coarse bound, code 0
          for (int64_t d = 0; d < D; ++d)
            if (moved[d]) codes[s * D + d] = 0;
      }
    }
  }
  return kOk;
}

// tinyserve_page_bounds: key_min/key_max and sub-page codes of whole pages, recomputed from the
// pool over each page's valid tokens - the C form of host_storage's _refresh_minmax for every
// layer (numpy min/max with where= and initial=+-inf, then fine_bounds.pages_sub_bounds), equal
// to it bit for bit (tests/cpu/test_native_page_bounds.py). What a prefill chunk's write needs:
// it fills pages, so no append rule applies. keys [L, N, H, ps, D] float32; key_min/key_max
// [L, Nm, H, D]; sub [L, Nm, H, r, D] uint8 or null; pages [U] int64; valid [L, U] int64 in
// [0, ps]. Returns 0, or a Status (1: a page id outside the pool, 2: a valid count outside
// [0, ps]; both checked before anything is written; 4: as tinyserve_append_bounds).
extern "C" __attribute__((visibility("default"))) int tinyserve_page_bounds(
    const float* keys, float* key_min, float* key_max, uint8_t* sub, const int64_t* pages, const int64_t* valid,
    int64_t L, int64_t N, int64_t Nm, int64_t H, int64_t ps, int64_t D, int64_t U, int64_t r) {
  for (int64_t u = 0; u < U; ++u)
    if (pages[u] < 0 || pages[u] >= N || pages[u] >= Nm) return kBadPage;
  for (int64_t i = 0; i < L * U; ++i)
    if (valid[i] < 0 || valid[i] > ps) return kBadOffset;
  const int64_t sp = sub ? ps / r : ps;
  std::vector<float> smin(D), smax(D);
  std::vector<int32_t> lo(D), hi(D);
  std::vector<uint8_t> done(D);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t u = 0; u < U; ++u) {
      const int64_t p = pages[u], n = valid[l * U + u];
      for (int64_t h = 0; h < H; ++h) {
        const float* kp = keys + ((l * N + p) * H + h) * ps * D;
        float* mn = key_min + ((l * Nm + p) * H + h) * D;
        float* mx = key_max + ((l * Nm + p) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          mn[d] = INFINITY;
          mx[d] = -INFINITY;
        }
        for (int64_t i = 0; i < n; ++i) {
          const float* row = kp + i * D;
          for (int64_t d = 0; d < D; ++d) {
            mn[d] = np_min(mn[d], row[d]);
            mx[d] = np_max(mx[d], row[d]);
          }
        }
        if (!sub) continue;
        uint8_t* codes = sub + ((l * Nm + p) * H + h) * r * D;
        for (int64_t s = 0; s < r; ++s) {
          const int64_t t0 = s * sp, t1 = (s + 1) * sp < n ? (s + 1) * sp : n;
          if (t0 >= t1) {  // no written token: the coarse bound, code 0
            for (int64_t d = 0; d < D; ++d) codes[s * D + d] = 0;
            continue;
          }
          if (!encode_sub_page(kp, t0, t1, D, mn, mx, nullptr, smin.data(), smax.data(), lo.data(), hi.data(), done.data(),
                               codes + s * D))
            return kOutsidePage;
        }
      }
    }
  }
  return kOk;
}
