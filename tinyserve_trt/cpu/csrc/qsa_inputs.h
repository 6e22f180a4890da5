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
#include "qsa_schema.h"

namespace qsa_inputs {

// Input positions are the schema's (qsa_schema.h, generated from ops/schema.py): optional inputs
// never shift - the cold tier at QSA_FIRST_COLD_INPUT.., key_sub_bounds at QSA_IN_KEY_SUB_BOUNDS.
constexpr size_t kNumInputs = QSA_NUM_INPUTS, kNumRequired = QSA_NUM_REQUIRED_INPUTS,
                 kFirstCold = QSA_FIRST_COLD_INPUT, kEndCold = QSA_FIRST_COLD_INPUT + QSA_NUM_COLD_INPUTS;

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

inline const char* const kInputNames[kNumInputs] = QSA_INPUT_NAMES;

// The cold inputs: all four or none, element types and shapes as ops/cold_codec.py
// stores them; fills p->cold. Returns a one-line error, or "".
inline std::string check_cold(const Tensor* in, const qsa::Attrs& a, qsa::Problem* p) {
  int given = 0;
  for (size_t i = kFirstCold; i < kEndCold; ++i) given += in[i].data != nullptr;
  if (given == 0) return "";
  if (given != 4) return "cold pages need all of key_cache_int8, value_cache_int8, key_scale, value_scale";
  const bool int4 = a.cold_int4;
  const int q_type = int4 ? ORT_ELEM_UINT8 : ORT_ELEM_INT8, s_type = int4 ? ORT_ELEM_FLOAT16 : ORT_ELEM_FLOAT;
  const char* fmt = int4 ? "int4" : "int8";
  for (size_t i = kFirstCold; i < kEndCold; ++i) {
    const int want = i == QSA_IN_KEY_CACHE_INT8 || i == QSA_IN_VALUE_CACHE_INT8 ? q_type : s_type;
    if (in[i].type != want)
      return std::string(kInputNames[i]) + " has element type " + std::to_string(in[i].type) + ", cold_format " + fmt +
             " stores " + std::to_string(want);
    if (in[i].shape.size() != 4) return std::string(kInputNames[i]) + " must have rank 4, got " + shape_str(in[i].shape);
  }
  qsa::Cold& c = p->cold;
  c.Pc = in[QSA_IN_KEY_CACHE_INT8].shape[0];
  if (int4 && p->D % 2) return "int4 cold pages need an even head dim, got " + std::to_string(p->D);
  const int64_t width = int4 ? p->D / 2 : p->D;
  for (size_t i : {QSA_IN_KEY_CACHE_INT8, QSA_IN_VALUE_CACHE_INT8}) {
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
  const Tensor& ks = in[QSA_IN_KEY_SCALE];
  if (!int4 && !(e = scale_dims(QSA_IN_KEY_SCALE, &c.k_rows, &c.k_cols, false)).empty()) return e;
  if (int4 && (ks.shape[0] != c.Pc || ks.shape[1] != p->Hkv))
    return "key_scale has shape " + shape_str(ks.shape) + ", expected [" + std::to_string(c.Pc) + "," +
           std::to_string(p->Hkv) + ",1,1]";
  if (!(e = scale_dims(QSA_IN_VALUE_SCALE, &c.v_rows, &c.v_cols, int4)).empty()) return e;
  c.kq = in[QSA_IN_KEY_CACHE_INT8].data, c.vq = in[QSA_IN_VALUE_CACHE_INT8].data, c.ks = ks.data,
  c.vs = in[QSA_IN_VALUE_SCALE].data;
  return "";
}

// Rank of required input i (schema position).
inline size_t required_rank(size_t i) {
  switch (i) {
    case QSA_IN_KEY_MIN: case QSA_IN_KEY_MAX: return 3;
    case QSA_IN_PAGE_TABLE: return 2;
    case QSA_IN_PAST_LENS: case QSA_IN_TOKEN_BUDGET: return 1;
    default: return 4;  // query, key, value, key_cache, value_cache
  }
}

// Checks every shape and index the math reads; returns a one-line error, or "" when valid.
inline std::string check(const Tensor* in, const qsa::Attrs& a, qsa::Problem* p) {
  auto want = [&](int i, std::vector<int64_t> dims) -> std::string {
    if (in[i].shape == dims) return "";
    return std::string(kInputNames[i]) + " has shape " + shape_str(in[i].shape) + ", expected " + shape_str(dims);
  };
  for (size_t i = 0; i < kNumRequired; ++i) {
    const size_t rank = required_rank(i);
    if (in[i].shape.size() != rank)
      return std::string(kInputNames[i]) + " must have rank " + std::to_string(rank) + ", got " +
             shape_str(in[i].shape);
  }
  const auto& q = in[QSA_IN_QUERY].shape;
  if (q[2] < 1) return "query has no new token (S=" + std::to_string(q[2]) + ")";
  p->B = q[0], p->H = q[1], p->S = q[2], p->D = q[3], p->Hkv = in[QSA_IN_KEY].shape[1];
  p->P = in[QSA_IN_KEY_CACHE].shape[0], p->ps = in[QSA_IN_KEY_CACHE].shape[2];
  p->Pm = in[QSA_IN_KEY_MIN].shape[0], p->NP = in[QSA_IN_PAGE_TABLE].shape[1];
  if (p->Hkv < 1 || p->H % p->Hkv) return "query heads " + std::to_string(p->H) + " not a multiple of KV heads " +
                                         std::to_string(p->Hkv);
  if (p->ps < 1 || p->D < 1) return "page size and head dim must be >= 1";
  p->G = p->H / p->Hkv;
  std::string e;
  for (int i : {QSA_IN_KEY, QSA_IN_VALUE})
    if (!(e = want(i, {p->B, p->Hkv, p->S, p->D})).empty()) return e;
  for (int i : {QSA_IN_KEY_CACHE, QSA_IN_VALUE_CACHE})
    if (!(e = want(i, {p->P, p->Hkv, p->ps, p->D})).empty()) return e;
  for (int i : {QSA_IN_KEY_MIN, QSA_IN_KEY_MAX})
    if (!(e = want(i, {p->Pm, p->Hkv, p->D})).empty()) return e;
  if (!(e = want(QSA_IN_PAGE_TABLE, {p->B, p->NP})).empty()) return e;
  for (int i : {QSA_IN_PAST_LENS, QSA_IN_TOKEN_BUDGET})
    if (!(e = want(i, {p->B})).empty()) return e;
  if (!(e = check_cold(in, a, p)).empty()) return e;
  int64_t id_limit = std::min(p->P + p->cold.Pc, p->Pm);
  p->sp = (a.sub_page_size == 0 || a.sub_page_size == p->ps) ? p->ps : a.sub_page_size;
  p->r = p->ps / p->sp;
  if (p->sp != p->ps) {
    if (p->ps % p->sp)
      return "sub_page_size " + std::to_string(p->sp) + " must divide the page size " + std::to_string(p->ps);
    if (!in[QSA_IN_KEY_SUB_BOUNDS].data) return "two-level selection (sub_page_size " + std::to_string(p->sp) + ") needs key_sub_bounds";
    const auto& s = in[QSA_IN_KEY_SUB_BOUNDS].shape;
    if (s.size() != 4 || s[1] != p->Hkv || s[2] != p->r || s[3] != p->D)
      return "key_sub_bounds has shape " + shape_str(s) + ", expected [Ps," + std::to_string(p->Hkv) + "," +
             std::to_string(p->r) + "," + std::to_string(p->D) + "]";
    id_limit = std::min(id_limit, s[0]);
    p->sub = static_cast<const uint8_t*>(in[QSA_IN_KEY_SUB_BOUNDS].data);
  }
  auto f32 = [&](int i) { return static_cast<const float*>(in[i].data); };
  auto i32 = [&](int i) { return static_cast<const int32_t*>(in[i].data); };
  p->q = f32(QSA_IN_QUERY), p->k = f32(QSA_IN_KEY), p->v = f32(QSA_IN_VALUE);
  p->kc = f32(QSA_IN_KEY_CACHE), p->vc = f32(QSA_IN_VALUE_CACHE);
  p->kmin = f32(QSA_IN_KEY_MIN), p->kmax = f32(QSA_IN_KEY_MAX);
  p->table = i32(QSA_IN_PAGE_TABLE), p->past = i32(QSA_IN_PAST_LENS), p->budget = i32(QSA_IN_TOKEN_BUDGET);
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
