// The inputs of one decode step of QueryAwareSparseAttention on CPU (pointers into ORT's tensors, named
// dims as in ops/schema.py) and the node's attributes: what qsa_decode_math.h and qsa_attend.h read.
#pragma once

#include <cstdint>

#include "qsa_schema.h"

namespace qsa {

struct Attrs {  // defaults: schema.ATTRIBUTES, through the generated header
  float scale = QSA_ATTR_SCALE_DEFAULT;
  int64_t sink_pages = QSA_ATTR_SINK_PAGES_DEFAULT, recent_pages = QSA_ATTR_RECENT_PAGES_DEFAULT,
          sub_page_size = QSA_ATTR_SUB_PAGE_SIZE_DEFAULT;
  float candidate_share = QSA_ATTR_CANDIDATE_SHARE_DEFAULT;
  // dense / reduce_sum / per_head / cold_int4: policy "dense", group_reduce "sum" / "head", cold_format "int4"
  bool dense = QSA_ATTR_POLICY_DEFAULT_INDEX == QSA_POLICY_DENSE,
       reduce_sum = QSA_ATTR_GROUP_REDUCE_DEFAULT_INDEX == QSA_GROUP_REDUCE_SUM,
       per_head = QSA_ATTR_GROUP_REDUCE_DEFAULT_INDEX == QSA_GROUP_REDUCE_HEAD,
       cold_int4 = QSA_ATTR_COLD_FORMAT_DEFAULT_INDEX == QSA_COLD_FORMAT_INT4;
};

// The cold page pools (page ids P .. P+Pc-1; ops/cold_codec.py), absent when Pc == 0. INT8: int8
// values, float32 scales [Pc, Hkv, k_rows, k_cols]; INT4: packed uint8 [Pc, Hkv, ps, D/2], keys on
// the page (or sub-page) bounds, V float16 scales and mins [Pc, Hkv, v_rows, 2 v_cols].
struct Cold {
  int64_t Pc = 0, k_rows = 1, k_cols = 1, v_rows = 1, v_cols = 1;
  const void *kq = nullptr, *vq = nullptr, *ks = nullptr, *vs = nullptr;
};

struct Problem {  // named dims as in ops/schema.py; sp == ps and r == 1 for single-level; S new tokens
  int64_t B = 0, H = 0, Hkv = 0, G = 1, D = 0, P = 0, Pm = 0, ps = 1, NP = 0, sp = 1, r = 1, S = 1;
  const float *q = nullptr, *k = nullptr, *v = nullptr, *kc = nullptr, *vc = nullptr, *kmin = nullptr,
              *kmax = nullptr;
  const int32_t *table = nullptr, *past = nullptr, *budget = nullptr;
  const uint8_t* sub = nullptr;
  Cold cold;
  float* out = nullptr;
  bool* selected = nullptr;  // may be null (output not requested)

  // Rows of query / output [B, H, S, D] and of the new key / value [B, Hkv, S, D].
  const float* q_row(int64_t b, int64_t qh, int64_t s) const { return q + ((b * H + qh) * S + s) * D; }
  const float* k_row(int64_t b, int64_t h, int64_t s) const { return k + ((b * Hkv + h) * S + s) * D; }
  const float* v_row(int64_t b, int64_t h, int64_t s) const { return v + ((b * Hkv + h) * S + s) * D; }
  // the output's layout: [B, H, S, D] (the op's), or [B, S, H * D] (out_bshd: the attention layer's
  // node, which feeds the output projection); one layout when S == 1
  bool out_bshd = false;
  float* out_row(int64_t b, int64_t qh, int64_t s) const {
    return out + (out_bshd ? (b * S + s) * H + qh : (b * H + qh) * S + s) * D;
  }
};

// One task of a decode step: sequence b, KV head h and its query heads h*G + g0 .. h*G + g0 + gn - 1.
// The whole group: one selection shared, or with group_reduce "head" one selection per query head,
// attended together (each kept K/V row read once for the heads that keep it). Groups larger than
// kMaxUnionHeads run a task per query head (ops/reference.py group_keeps).
struct Task {
  int64_t b = 0, h = 0, g0 = 0, gn = 1;
};

constexpr int64_t kMaxUnionHeads = 64;  // a row's query heads: one bit each of a uint64_t

// Whether group_reduce "head" runs a task per query head (a group too large for the row masks).
inline bool head_tasks(const Problem& p, const Attrs& a) { return a.per_head && p.G > kMaxUnionHeads; }

inline int64_t num_tasks(const Problem& p, const Attrs& a) { return p.B * (head_tasks(p, a) ? p.H : p.Hkv); }

inline Task task_of(const Problem& p, const Attrs& a, int64_t i) {
  if (!head_tasks(p, a)) return {i / p.Hkv, i % p.Hkv, 0, p.G};
  const int64_t qh = i % p.H;
  return {i / p.H, qh / p.G, qh % p.G, 1};
}

}  // namespace qsa
