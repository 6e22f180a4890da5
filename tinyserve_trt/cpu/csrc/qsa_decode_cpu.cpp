// tinyserve.cpu::QueryAwareSparseAttentionDecode: tinyserve::QueryAwareSparseAttention as an ONNX
// Runtime CPU custom op - a decode step (S == 1) and, since node version 3, a prefill chunk (S > 1:
// qsa_prefill.h, exact causal attention over every cached token; tests/cpu/test_native_prefill.py).
//
// The semantics are ops/reference.py's sparse_attention_ref (policies query_aware and dense;
// single-level and two-level selection), checked by tests/cpu/test_native_op.py. Decode, per
// (sequence, KV head): score the sequence's pages
// from key_min/key_max, keep the best within the token budget (ties to the lower
// page index, as a stable sort by -score), then attend the kept cached tokens plus
// the new token, the G query heads of the GQA group together so each K/V row is read
// once. Reads only what the selection keeps; never writes the cache.
//
// Inputs (schema order): query [B,H,S,D], key/value [B,Hkv,S,D], key_cache/value_cache
// [P,Hkv,ps,D], key_min/key_max [Pm,Hkv,D], page_table [B,NP] int32, past_lens [B] int32,
// token_budget [B] int32, then optionally the four cold-page inputs (key_cache_int8,
// value_cache_int8, key_scale, value_scale; attribute cold_format), whose element types depend on
// the format, then optionally key_sub_bounds [Ps,Hkv,r,D] uint8 (two-level). Positions, attribute
// names, defaults and ranges are the schema's, from the generated qsa_schema.h (an omitted
// optional input never shifts the ones after it).
// Outputs: output [B,H,S,D], optional selected_pages [B,Hkv,NP] bool.
//
// Build with -ffp-contract=off (tinyserve_trt/cpu/native.py does): the sub-page bound
// decode (ops/fine_bounds.py) must round each product and sum separately; the dot
// products use explicit FMA (fmadd) instead.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ort_abi.h"
#include "qsa_attention.h"
#include "qsa_inputs.h"
#include "qsa_layer_cpu.h"
#include "qsa_ort_kernel.h"

namespace {

using namespace qsa_inputs;
using qsa_ort::Kernel;

struct DecodeOp {
  static constexpr const char* kName = "QueryAwareSparseAttentionDecode";
  static constexpr size_t kNumInputs = qsa_inputs::kNumInputs, kNumOutputs = 2;

  static int input_type(size_t i) {  // the cold inputs: any type (checked against cold_format)
    switch (i) {
      case QSA_IN_PAGE_TABLE: case QSA_IN_PAST_LENS: case QSA_IN_TOKEN_BUDGET: return ORT_ELEM_INT32;
      case QSA_IN_KEY_SUB_BOUNDS: return ORT_ELEM_UINT8;
      default: return i < kNumRequired ? ORT_ELEM_FLOAT : ORT_ELEM_UNDEFINED;
    }
  }
  static bool input_required(size_t i) { return i < kNumRequired; }
  static int output_type(size_t i) { return i == 0 ? ORT_ELEM_FLOAT : ORT_ELEM_BOOL; }

  static OrtStatus* compute(const Kernel& kernel, OrtKernelContext* ctx) {
    const OrtApi* api = kernel.api;
    Tensor in[kNumInputs];
    for (size_t i = 0; i < kNumInputs; ++i) {
      QSA_TRY(qsa_ort::read_input(api, ctx, i, input_type(i), kName, &in[i]));
      if (i < kNumRequired && !in[i].data && in[i].shape.empty())
        return qsa_ort::error(api, kName, std::string("missing input ") + kInputNames[i]);
    }
    qsa::Problem p;
    std::string e = check(in, kernel.attrs, &p);
    if (!e.empty()) return qsa_ort::error(api, kName, e);
    void* data = nullptr;
    QSA_TRY(qsa_ort::output(api, ctx, 0, {p.B, p.H, p.S, p.D}, &data));
    p.out = static_cast<float*>(data);
    QSA_TRY(qsa_ort::output(api, ctx, 1, {p.B, p.Hkv, p.NP}, &data));
    p.selected = static_cast<bool*>(data);
    if (!qsa_ort::on_ort_pool(api, ctx, [&] { return qsa::attend(p, kernel.attrs); }))
      return api->CreateStatus(ORT_FAIL, (std::string(kName) + ": out of memory").c_str());
    return nullptr;
  }
};

const OrtCustomOp kDecodeOp = qsa_ort::make_op<DecodeOp>();

}  // namespace

// The entry point SessionOptions.register_custom_ops_library calls: both ops of the tinyserve.cpu
// domain. The domain is never released: ORT keeps a pointer to it for the sessions made from
// these options.
extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                             const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(qsa_ort::kApiVersion);
  if (!api) {  // too old a runtime: report through the oldest API, whose CreateStatus every version has
    std::string msg = std::string("libtinyserve_cpu needs the ONNX Runtime C API ") +
                      std::to_string(qsa_ort::kApiVersion) + " (onnxruntime >= 1.16), this is onnxruntime " +
                      base->GetVersionString();
    return base->GetApi(1)->CreateStatus(ORT_FAIL, msg.c_str());
  }
  qsa_ort::ort_parallel_for_ok = base->GetApi(qsa_ort::kParallelForApiVersion) != nullptr;
  OrtCustomOpDomain* domain = nullptr;
  QSA_TRY(api->CreateCustomOpDomain(qsa_ort::kDomain, &domain));
  QSA_TRY(api->CustomOpDomain_Add(domain, &kDecodeOp));
  QSA_TRY(api->CustomOpDomain_Add(domain, qsa_layer::op()));
  return api->AddCustomOpDomain(options, domain);
}
