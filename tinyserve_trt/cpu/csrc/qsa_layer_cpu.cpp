// tinyserve.cpu::QueryAwareSparseAttentionLayer: the op (qsa_attention.h) with the layout and rotary
// work an exported attention layer does around it, in one ONNX Runtime CPU node.
//
// An export feeds the op [B, H, S, D] queries and keys made from the projections' [B, S, heads * D]
// rows by a Reshape, a Transpose and (LLaMA-family) a rotary embedding each, and reads its output
// back through Reshape, Transpose, Reshape: ~12 nodes a layer whose cost per node is most of a short
// decode step's overhead (benchmarks/results/decode_profile.md). export/native_layer.py matches that
// pattern and puts this node in its place; everything else is the op's.
//
// Inputs (cpu/node.py LAYER_INPUTS; positions 6.. are the op's from key_cache on, the schema's order):
//   0 query [B, S, H*D], 1 key [B, S, Hkv*D], 2 value [B, S, Hkv*D]  (float32, the projections' rows)
//   3 rotary_positions [B, S] int64, 4 cos_cache [R, D/2], 5 sin_cache [R, D/2] - all three or none:
//     ORT's RotaryEmbedding (non-interleaved, the whole head dim) on the query and key rows
//   6 key_cache .. 17 key_sub_bounds: the op's inputs QSA_IN_KEY_CACHE .. (optional ones as there)
// Outputs: 0 output [B, S, H*D] (the op's [B, H, S, D] output, transposed), 1 selected_pages
// [B, Hkv, NP], 2 new_key [B, Hkv, S, D] (rotated), 3 new_value [B, Hkv, S, D] - what the runtime
// writes into the pages after the step.
#include <string>
#include <vector>

#include "qsa_attention.h"
#include "qsa_inputs.h"
#include "qsa_layer_cpu.h"
#include "qsa_ort_kernel.h"

namespace {

using namespace qsa_inputs;
using qsa_ort::Kernel;

constexpr size_t kPrefix = 6;  // query, key, value, rotary_positions, cos_cache, sin_cache
constexpr size_t kOpFirst = QSA_IN_KEY_CACHE;  // the op's inputs from here on follow the prefix

// The rotation of one head's row x into out (ORT's RotaryEmbedding, non-interleaved: each output
// channel x[i] * cos + sign * x[j] * sin, rounded as it does - this file builds with -ffp-contract=off).
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * cos[i - half] + x[i - half] * sin[i - half];
}

struct LayerOp {
  static constexpr const char* kName = "QueryAwareSparseAttentionLayer";
  static constexpr size_t kNumInputs = kPrefix + qsa_inputs::kNumInputs - kOpFirst, kNumOutputs = 4;

  static size_t op_index(size_t i) { return i - kPrefix + kOpFirst; }  // layer input i >= kPrefix
  static int input_type(size_t i) {
    if (i < kPrefix) return i == 3 ? ORT_ELEM_INT64 : ORT_ELEM_FLOAT;
    switch (op_index(i)) {  // the cold inputs: any type (checked against cold_format)
      case QSA_IN_PAGE_TABLE: case QSA_IN_PAST_LENS: case QSA_IN_TOKEN_BUDGET: return ORT_ELEM_INT32;
      case QSA_IN_KEY_SUB_BOUNDS: return ORT_ELEM_UINT8;
      default: return op_index(i) < kNumRequired ? ORT_ELEM_FLOAT : ORT_ELEM_UNDEFINED;
    }
  }
  static bool input_required(size_t i) { return i < 3 || (i >= kPrefix && op_index(i) < kNumRequired); }
  static int output_type(size_t i) { return i == 1 ? ORT_ELEM_BOOL : ORT_ELEM_FLOAT; }

  static OrtStatus* compute(const Kernel& kernel, OrtKernelContext* ctx) {
    const OrtApi* api = kernel.api;
    Tensor pre[kPrefix], in[qsa_inputs::kNumInputs];
    for (size_t i = 0; i < kNumInputs; ++i) {
      Tensor* t = i < kPrefix ? &pre[i] : &in[op_index(i)];
      QSA_TRY(qsa_ort::read_input(api, ctx, i, input_type(i), kName, t));
      if (input_required(i) && !t->data && t->shape.empty())
        return qsa_ort::error(api, kName, std::string("missing input ") + name(i));
    }
    const auto& cache = in[QSA_IN_KEY_CACHE].shape;
    if (cache.size() != 4) return qsa_ort::error(api, kName, "key_cache must have rank 4, got " + shape_str(cache));
    const int64_t Hkv = cache[1], D = cache[3];
    std::string e = check_rows(pre, Hkv, D);
    if (!e.empty()) return qsa_ort::error(api, kName, e);
    const int64_t B = pre[0].shape[0], S = pre[0].shape[1], H = pre[0].shape[2] / D;
    void *out = nullptr, *sel = nullptr, *nk = nullptr, *nv = nullptr;
    QSA_TRY(qsa_ort::output(api, ctx, 0, {B, S, H * D}, &out));
    QSA_TRY(qsa_ort::output(api, ctx, 1, {B, Hkv, in[QSA_IN_PAGE_TABLE].shape.empty() ? 0 :
                                          in[QSA_IN_PAGE_TABLE].shape.back()}, &sel));
    QSA_TRY(qsa_ort::output(api, ctx, 2, {B, Hkv, S, D}, &nk));
    QSA_TRY(qsa_ort::output(api, ctx, 3, {B, Hkv, S, D}, &nv));
    // the op's query / key / value: the rows split into heads, rotated (the key and value straight
    // into their outputs; scratch where the graph does not read them)
    thread_local std::vector<float> q, k, v;
    q.resize(B * H * S * D);
    float* kp = static_cast<float*>(nk);
    float* vp = static_cast<float*>(nv);
    if (!kp) k.resize(B * Hkv * S * D), kp = k.data();
    if (!vp) v.resize(B * Hkv * S * D), vp = v.data();
    split_heads(pre, B, S, H, Hkv, D, q.data(), kp, vp);
    in[QSA_IN_QUERY] = Tensor{q.data(), {B, H, S, D}, ORT_ELEM_FLOAT, static_cast<size_t>(B * H * S * D)};
    in[QSA_IN_KEY] = Tensor{kp, {B, Hkv, S, D}, ORT_ELEM_FLOAT, static_cast<size_t>(B * Hkv * S * D)};
    in[QSA_IN_VALUE] = Tensor{vp, {B, Hkv, S, D}, ORT_ELEM_FLOAT, static_cast<size_t>(B * Hkv * S * D)};
    qsa::Problem p;
    e = check(in, kernel.attrs, &p);
    if (!e.empty()) return qsa_ort::error(api, kName, e);
    p.out = static_cast<float*>(out), p.out_bshd = true;
    p.selected = static_cast<bool*>(sel);
    if (!qsa_ort::on_ort_pool(api, ctx, [&] { return qsa::attend(p, kernel.attrs); }))
      return api->CreateStatus(ORT_FAIL, (std::string(kName) + ": out of memory").c_str());
    return nullptr;
  }

  static std::string name(size_t i) {
    static const char* const kPrefixNames[kPrefix] = {kInputNames[QSA_IN_QUERY], kInputNames[QSA_IN_KEY],
                                                      kInputNames[QSA_IN_VALUE], "rotary_positions", "cos_cache",
                                                      "sin_cache"};
    return i < kPrefix ? kPrefixNames[i] : kInputNames[op_index(i)];
  }

  // The prefix inputs' shapes and the rotary positions; one-line error or "".
  static std::string check_rows(const Tensor* pre, int64_t Hkv, int64_t D) {
    for (size_t i = 0; i < 3; ++i)
      if (pre[i].shape.size() != 3) return name(i) + " must have rank 3, got " + shape_str(pre[i].shape);
    const auto& q = pre[0].shape;
    if (D < 1 || q[2] % D) return "query rows of " + std::to_string(q[2]) + " are not whole heads of " +
                                  std::to_string(D);
    if (q[1] < 1) return "query has no new token (S=" + std::to_string(q[1]) + ")";
    for (size_t i : {1, 2})
      if (pre[i].shape != std::vector<int64_t>{q[0], q[1], Hkv * D})
        return name(i) + " has shape " + shape_str(pre[i].shape) + ", expected " +
               shape_str({q[0], q[1], Hkv * D});
    const int given = (pre[3].data != nullptr) + (pre[4].data != nullptr) + (pre[5].data != nullptr);
    if (given == 0) return "";
    if (given != 3) return "rotary needs all of rotary_positions, cos_cache, sin_cache";
    if (D % 2) return "rotary needs an even head dim, got " + std::to_string(D);
    if (pre[3].shape != std::vector<int64_t>{q[0], q[1]})
      return "rotary_positions has shape " + shape_str(pre[3].shape) + ", expected " + shape_str({q[0], q[1]});
    const auto& c = pre[4].shape;
    if (c.size() != 2 || c[1] != D / 2 || pre[5].shape != c)
      return "cos_cache / sin_cache have shapes " + shape_str(c) + " / " + shape_str(pre[5].shape) + ", expected [R," +
             std::to_string(D / 2) + "] both";
    const int64_t* pos = static_cast<const int64_t*>(pre[3].data);
    for (int64_t i = 0; i < q[0] * q[1]; ++i)
      if (pos[i] < 0 || pos[i] >= c[0])
        return "rotary_positions[" + std::to_string(i) + "] = " + std::to_string(pos[i]) + " is outside the " +
               std::to_string(c[0]) + " cos_cache rows";
    return "";
  }

  // query [B,S,H*D] -> q [B,H,S,D], key -> k [B,Hkv,S,D] (both rotated when the rotary inputs are
  // given), value -> v [B,Hkv,S,D].
  static void split_heads(const Tensor* pre, int64_t B, int64_t S, int64_t H, int64_t Hkv, int64_t D, float* q,
                          float* k, float* v) {
    const float *xq = static_cast<const float*>(pre[0].data), *xk = static_cast<const float*>(pre[1].data),
                *xv = static_cast<const float*>(pre[2].data);
    const int64_t* pos = static_cast<const int64_t*>(pre[3].data);
    const float *cos = static_cast<const float*>(pre[4].data), *sin = static_cast<const float*>(pre[5].data);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        const int64_t row = b * S + s;
        const float* c = pos ? cos + pos[row] * (D / 2) : nullptr;
        const float* sn = pos ? sin + pos[row] * (D / 2) : nullptr;
        for (int64_t h = 0; h < H; ++h) {
          const float* x = xq + (row * H + h) * D;
          float* o = q + ((b * H + h) * S + s) * D;
          if (pos) rotate(x, c, sn, D, o); else std::copy(x, x + D, o);
        }
        for (int64_t h = 0; h < Hkv; ++h) {
          const float* x = xk + (row * Hkv + h) * D;
          float* o = k + ((b * Hkv + h) * S + s) * D;
          if (pos) rotate(x, c, sn, D, o); else std::copy(x, x + D, o);
          const float* y = xv + (row * Hkv + h) * D;
          std::copy(y, y + D, v + ((b * Hkv + h) * S + s) * D);
        }
      }
  }
};

const OrtCustomOp kLayerOp = qsa_ort::make_op<LayerOp>();

}  // namespace

namespace qsa_layer {

const OrtCustomOp* op() { return &kLayerOp; }

}  // namespace qsa_layer
