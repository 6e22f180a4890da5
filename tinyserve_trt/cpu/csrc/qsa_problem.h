// The inputs of one decode step of QueryAwareSparseAttention on CPU (pointers into ORT's tensors, named
// dims as in ops/schema.py) and the node's attributes: what qsa_decode_math.h and qsa_attend.h read.
#pragma once

#include <cstdint>

namespace qsa {

struct Attrs {  // defaults: schema.ATTRIBUTES
  float scale = 0.0f;
  int64_t sink_pages = 1, recent_pages = 1, sub_page_size = 0;
  float candidate_share = 0.5f;
  bool dense = false, reduce_sum = false;
};

struct Problem {  // named dims as in ops/schema.py; sp == ps and r == 1 for single-level
  int64_t B = 0, H = 0, Hkv = 0, G = 1, D = 0, P = 0, Pm = 0, ps = 1, NP = 0, sp = 1, r = 1;
  const float *q = nullptr, *k = nullptr, *v = nullptr, *kc = nullptr, *vc = nullptr, *kmin = nullptr,
              *kmax = nullptr;
  const int32_t *table = nullptr, *past = nullptr, *budget = nullptr;
  const uint8_t* sub = nullptr;
  float* out = nullptr;
  bool* selected = nullptr;  // may be null (output not requested)
};

}  // namespace qsa
