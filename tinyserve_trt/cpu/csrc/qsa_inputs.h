// The decode op's inputs as ONNX Runtime hands them over, and their validation: every shape, element
// type and page id the math reads is checked here, each failure one line (qsa_decode_cpu.cpp adds
// the op's name). Fills the Problem that qsa_decode_math.h runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ort_abi.h"
#include "qsa_problem.h"

namespace qsa_inputs {

constexpr size_t kNumInputs = 15, kNumRequired = 10, kFirstCold = 11;

struct Tensor {
  const void* data = nullptr;
  std::vector<int64_t> shape;
  int type = ORT_ELEM_UNDEFINED;
  size_t count = 0;  // elements
};

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

inline const char* const kInputNames[kNumInputs] = {"query", "key", "value", "key_cache", "value_cache", "key_min",
                                             "key_max", "page_table", "past_lens", "token_budget",
                                             "key_sub_bounds", "key_cache_int8", "value_cache_int8", "key_scale",
                                             "value_scale"};

// The cold inputs (11-14): all four or none, element types and shapes as ops/cold_codec.py
// stores them; fills p->cold. Returns a one-line error, or "".
inline std::string check_cold(const Tensor* in, const qsa::Attrs& a, qsa::Problem* p) {
  int given = 0;
  for (size_t i = kFirstCold; i < kNumInputs; ++i) given += in[i].data != nullptr;
  if (given == 0) return "";
  if (given != 4) return "cold pages need all of key_cache_int8, value_cache_int8, key_scale, value_scale";
  const bool int4 = a.cold_int4;
  const int q_type = int4 ? ORT_ELEM_UINT8 : ORT_ELEM_INT8, s_type = int4 ? ORT_ELEM_FLOAT16 : ORT_ELEM_FLOAT;
  const char* fmt = int4 ? "int4" : "int8";
  for (size_t i = kFirstCold; i < kNumInputs; ++i) {
    const int want = i < kFirstCold + 2 ? q_type : s_type;
    if (in[i].type != want)
      return std::string(kInputNames[i]) + " has element type " + std::to_string(in[i].type) + ", cold_format " + fmt +
             " stores " + std::to_string(want);
    if (in[i].shape.size() != 4) return std::string(kInputNames[i]) + " must have rank 4, got " + shape_str(in[i].shape);
  }
  qsa::Cold& c = p->cold;
  c.Pc = in[11].shape[0];
  if (int4 && p->D % 2) return "int4 cold pages need an even head dim, got " + std::to_string(p->D);
  const int64_t width = int4 ? p->D / 2 : p->D;
  for (size_t i : {kFirstCold, kFirstCold + 1}) {
    const std::vector<int64_t> dims{c.Pc, p->Hkv, p->ps, width};
    if (in[i].shape != dims)
      return std::string(kInputNames[i]) + " has shape " + shape_str(in[i].shape) + ", expected " + shape_str(dims);
  }
  // scales [Pc, Hkv, ps|1, C] with C dividing D (int4 V: 2C columns; int4 K: an unread placeholder)
  auto scale_dims = [&](size_t i, int64_t* rows, int64_t* cols, bool doubled) -> std::string {
    const auto& s = in[i].shape;
    const int64_t C = doubled ? s[3] / 2 : s[3];
    if (s[0] != c.Pc || s[1] != p->Hkv || (s[2] != 1 && s[2] != p->ps) || C < 1 || (doubled && s[3] % 2) || p->D % C)
      return std::string(kInputNames[i]) + " has shape " + shape_str(s) + ", expected [" + std::to_string(c.Pc) + "," +
             std::to_string(p->Hkv) + ",ps|1," + (doubled ? "2C" : "C") + "] with C dividing " + std::to_string(p->D);
    *rows = s[2], *cols = C;
    return "";
  };
  std::string e;
  if (!int4 && !(e = scale_dims(13, &c.k_rows, &c.k_cols, false)).empty()) return e;
  if (int4 && (in[13].shape[0] != c.Pc || in[13].shape[1] != p->Hkv))
    return "key_scale has shape " + shape_str(in[13].shape) + ", expected [" + std::to_string(c.Pc) + "," +
           std::to_string(p->Hkv) + ",1,1]";
  if (!(e = scale_dims(14, &c.v_rows, &c.v_cols, int4)).empty()) return e;
  c.kq = in[11].data, c.vq = in[12].data, c.ks = in[13].data, c.vs = in[14].data;
  return "";
}

// Checks every shape and index the math reads; returns a one-line error, or "" when valid.
inline std::string check(const Tensor* in, const qsa::Attrs& a, qsa::Problem* p) {
  auto want = [&](int i, std::vector<int64_t> dims) -> std::string {
    if (in[i].shape == dims) return "";
    return std::string(kInputNames[i]) + " has shape " + shape_str(in[i].shape) + ", expected " + shape_str(dims);
  };
  for (int i = 0; i < 10; ++i) {
    static const size_t rank[10] = {4, 4, 4, 4, 4, 3, 3, 2, 1, 1};
    if (in[i].shape.size() != rank[i])
      return std::string(kInputNames[i]) + " must have rank " + std::to_string(rank[i]) + ", got " +
             shape_str(in[i].shape);
  }
  const auto& q = in[0].shape;
  if (q[2] != 1) return "decode only (S=" + std::to_string(q[2]) + ")";
  p->B = q[0], p->H = q[1], p->D = q[3], p->Hkv = in[1].shape[1];
  p->P = in[3].shape[0], p->ps = in[3].shape[2], p->Pm = in[5].shape[0], p->NP = in[7].shape[1];
  if (p->Hkv < 1 || p->H % p->Hkv) return "query heads " + std::to_string(p->H) + " not a multiple of KV heads " +
                                         std::to_string(p->Hkv);
  if (p->ps < 1 || p->D < 1) return "page size and head dim must be >= 1";
  p->G = p->H / p->Hkv;
  std::string e;
  for (int i : {1, 2})
    if (!(e = want(i, {p->B, p->Hkv, 1, p->D})).empty()) return e;
  for (int i : {3, 4})
    if (!(e = want(i, {p->P, p->Hkv, p->ps, p->D})).empty()) return e;
  for (int i : {5, 6})
    if (!(e = want(i, {p->Pm, p->Hkv, p->D})).empty()) return e;
  if (!(e = want(7, {p->B, p->NP})).empty()) return e;
  for (int i : {8, 9})
    if (!(e = want(i, {p->B})).empty()) return e;
  if (!(e = check_cold(in, a, p)).empty()) return e;
  int64_t id_limit = std::min(p->P + p->cold.Pc, p->Pm);
  p->sp = (a.sub_page_size == 0 || a.sub_page_size == p->ps) ? p->ps : a.sub_page_size;
  p->r = p->ps / p->sp;
  if (p->sp != p->ps) {
    if (p->ps % p->sp)
      return "sub_page_size " + std::to_string(p->sp) + " must divide the page size " + std::to_string(p->ps);
    if (!in[10].data) return "two-level selection (sub_page_size " + std::to_string(p->sp) + ") needs key_sub_bounds";
    const auto& s = in[10].shape;
    if (s.size() != 4 || s[1] != p->Hkv || s[2] != p->r || s[3] != p->D)
      return "key_sub_bounds has shape " + shape_str(s) + ", expected [Ps," + std::to_string(p->Hkv) + "," +
             std::to_string(p->r) + "," + std::to_string(p->D) + "]";
    id_limit = std::min(id_limit, s[0]);
    p->sub = static_cast<const uint8_t*>(in[10].data);
  }
  p->q = static_cast<const float*>(in[0].data), p->k = static_cast<const float*>(in[1].data);
  p->v = static_cast<const float*>(in[2].data), p->kc = static_cast<const float*>(in[3].data);
  p->vc = static_cast<const float*>(in[4].data), p->kmin = static_cast<const float*>(in[5].data);
  p->kmax = static_cast<const float*>(in[6].data), p->table = static_cast<const int32_t*>(in[7].data);
  p->past = static_cast<const int32_t*>(in[8].data), p->budget = static_cast<const int32_t*>(in[9].data);
  for (int64_t b = 0; b < p->B; ++b) {
    int64_t past = p->past[b];
    if (past < 0) return "past_lens[" + std::to_string(b) + "] is negative";
    int64_t n = (past + p->ps - 1) / p->ps;
    if (n > p->NP)
      return "sequence " + std::to_string(b) + ": " + std::to_string(past) + " cached tokens need " +
             std::to_string(n) + " pages, page table has " + std::to_string(p->NP);
    for (int64_t i = 0; i < n; ++i) {
      int64_t id = p->table[b * p->NP + i];
      if (id < 0 || id >= id_limit)
        return "page_table[" + std::to_string(b) + "," + std::to_string(i) + "] = " + std::to_string(id) +
               " is outside the page pool (" + std::to_string(id_limit) + " pages)";
    }
  }
  return "";
}

}  // namespace qsa_inputs
