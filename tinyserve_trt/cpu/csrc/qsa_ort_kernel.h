// The ONNX Runtime side shared by the library's two custom ops (qsa_decode_cpu.cpp: the op's node;
// qsa_layer_cpu.cpp: the attention layer around it): attributes from the schema, inputs as
// qsa_inputs::Tensor, one-line errors, and parallel work on the session's intra-op pool.
// Nothing here throws across the C boundary; the ops' callbacks catch what the C++ inside throws.
#pragma once

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "ort_abi.h"
#include "qsa_inputs.h"
#include "qsa_problem.h"
#include "qsa_thread_pool.h"

namespace qsa_ort {

constexpr const char* kDomain = "tinyserve.cpu";
constexpr uint32_t kApiVersion = 16;
constexpr uint32_t kParallelForApiVersion = 18;  // KernelContext_ParallelFor
// Set at registration: the runtime's C API has KernelContext_ParallelFor.
inline bool ort_parallel_for_ok = false;

// Read once, as pool_threads() (qsa_thread_pool.h).
inline bool own_pool_forced() {
  static const bool forced = [] {
    const char* env = std::getenv("TINYSERVE_NATIVE_POOL");
    return env && std::string(env) == "own";
  }();
  return forced;
}

struct Kernel {
  const OrtApi* api;
  qsa::Attrs attrs;
  const char* op;  // the op's name, for its messages
};

inline OrtStatus* error(const OrtApi* api, const char* op, const std::string& msg) {
  return api->CreateStatus(ORT_INVALID_ARGUMENT, (std::string(op) + ": " + msg).c_str());
}

#define QSA_TRY(expr)                        \
  do {                                       \
    if (OrtStatus* st_ = (expr)) return st_; \
  } while (0)

// ---- attributes ----

template <typename T, typename Get>
void read_attr(const OrtApi* api, Get get, const OrtKernelInfo* info, const char* name, T* out) {
  T v;
  if (OrtStatus* st = get(info, name, &v)) {
    api->ReleaseStatus(st);  // absent: keep the schema default
    return;
  }
  *out = v;
}

inline bool read_string(const OrtApi* api, const OrtKernelInfo* info, const char* name, std::string* out) {
  size_t size = 0;
  if (OrtStatus* st = api->KernelInfoGetAttribute_string(info, name, nullptr, &size)) {
    api->ReleaseStatus(st);
    return false;
  }
  std::vector<char> buf(size + 1, '\0');
  if (OrtStatus* st = api->KernelInfoGetAttribute_string(info, name, buf.data(), &size)) {
    api->ReleaseStatus(st);
    return false;
  }
  *out = std::string(buf.data());
  return true;
}

// A numeric attribute outside the schema's range -> its one-line error, else "".
template <typename T>
std::string out_of_range(const char* name, T v, double lo, double hi) {
  if (v >= lo && v <= hi) return "";  // NaN fails both
  return std::string(name) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
         std::to_string(v);
}

// The op's attributes (the schema's defaults where absent, qsa_problem.h), checked as the schema says.
inline OrtStatus* read_attrs(const OrtApi* api, const OrtKernelInfo* info, const char* op, qsa::Attrs* out) {
  qsa::Attrs a;
  read_attr(api, api->KernelInfoGetAttribute_float, info, QSA_ATTR_SCALE_NAME, &a.scale);
  read_attr(api, api->KernelInfoGetAttribute_int64, info, QSA_ATTR_SINK_PAGES_NAME, &a.sink_pages);
  read_attr(api, api->KernelInfoGetAttribute_int64, info, QSA_ATTR_RECENT_PAGES_NAME, &a.recent_pages);
  read_attr(api, api->KernelInfoGetAttribute_int64, info, QSA_ATTR_SUB_PAGE_SIZE_NAME, &a.sub_page_size);
  read_attr(api, api->KernelInfoGetAttribute_float, info, QSA_ATTR_CANDIDATE_SHARE_NAME, &a.candidate_share);
  std::string policy = QSA_ATTR_POLICY_DEFAULT, reduce = QSA_ATTR_GROUP_REDUCE_DEFAULT,
              cold = QSA_ATTR_COLD_FORMAT_DEFAULT;
  read_string(api, info, QSA_ATTR_POLICY_NAME, &policy);
  read_string(api, info, QSA_ATTR_GROUP_REDUCE_NAME, &reduce);
  read_string(api, info, QSA_ATTR_COLD_FORMAT_NAME, &cold);
  static const char* const kColdFormats[] = QSA_COLD_FORMAT_NAMES;
  static const char* const kPolicies[] = QSA_POLICY_NAMES;
  static const char* const kReductions[] = QSA_GROUP_REDUCE_NAMES;
  if (cold != kColdFormats[QSA_COLD_FORMAT_INT8] && cold != kColdFormats[QSA_COLD_FORMAT_INT4])
    return error(api, op, "cold_format must be int8 or int4, got '" + cold + "'");
  a.cold_int4 = cold == kColdFormats[QSA_COLD_FORMAT_INT4];
  if (policy != kPolicies[QSA_POLICY_QUERY_AWARE] && policy != kPolicies[QSA_POLICY_DENSE])
    return error(api, op, "policy '" + policy + "' is not supported (query_aware, dense)");
  if (reduce != kReductions[QSA_GROUP_REDUCE_MAX] && reduce != kReductions[QSA_GROUP_REDUCE_SUM] &&
      reduce != kReductions[QSA_GROUP_REDUCE_HEAD])
    return error(api, op, "group_reduce must be max, sum or head, got '" + reduce + "'");
  for (const std::string& e :
       {out_of_range(QSA_ATTR_SCALE_NAME, a.scale, QSA_ATTR_SCALE_MIN, INFINITY),
        out_of_range(QSA_ATTR_SINK_PAGES_NAME, a.sink_pages, QSA_ATTR_SINK_PAGES_MIN, QSA_ATTR_SINK_PAGES_MAX),
        out_of_range(QSA_ATTR_RECENT_PAGES_NAME, a.recent_pages, QSA_ATTR_RECENT_PAGES_MIN, QSA_ATTR_RECENT_PAGES_MAX),
        out_of_range(QSA_ATTR_SUB_PAGE_SIZE_NAME, a.sub_page_size, QSA_ATTR_SUB_PAGE_SIZE_MIN,
                     QSA_ATTR_SUB_PAGE_SIZE_MAX),
        out_of_range(QSA_ATTR_CANDIDATE_SHARE_NAME, a.candidate_share, QSA_ATTR_CANDIDATE_SHARE_MIN,
                     QSA_ATTR_CANDIDATE_SHARE_MAX)})
    if (!e.empty()) return error(api, op, e);
  a.dense = policy == kPolicies[QSA_POLICY_DENSE];
  a.reduce_sum = reduce == kReductions[QSA_GROUP_REDUCE_SUM];
  a.per_head = reduce == kReductions[QSA_GROUP_REDUCE_HEAD];
  if (a.dense && a.sub_page_size > 0) return error(api, op, "sub_page_size > 0 (two-level) needs policy query_aware");
  *out = a;
  return nullptr;
}

// ---- inputs and outputs ----

// Shape, element type and count, and data of input i; leaves `t` empty for an omitted optional
// input. `want`: the element type ORT has already checked (ORT_ELEM_UNDEFINED: any).
inline OrtStatus* read_input(const OrtApi* api, const OrtKernelContext* ctx, size_t i, int want, const char* op,
                             qsa_inputs::Tensor* t) {
  size_t count = 0;
  QSA_TRY(api->KernelContext_GetInputCount(ctx, &count));
  if (i >= count) return nullptr;  // an omitted optional input
  const OrtValue* v = nullptr;
  QSA_TRY(api->KernelContext_GetInput(ctx, i, &v));
  if (!v) return nullptr;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  QSA_TRY(api->GetTensorTypeAndShape(v, &info));
  size_t rank = 0;
  OrtStatus* st = api->GetDimensionsCount(info, &rank);
  if (!st) {
    t->shape.resize(rank);
    st = api->GetDimensions(info, t->shape.data(), rank);
  }
  if (!st) st = api->GetTensorElementType(info, &t->type);
  if (!st) st = api->GetTensorShapeElementCount(info, &t->count);
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (st) return st;
  size_t product = 1;
  for (int64_t d : t->shape) product *= static_cast<size_t>(d < 0 ? 0 : d);
  if ((want != ORT_ELEM_UNDEFINED && t->type != want) || t->count != product)  // ORT checks both; a wrong ABI slot would not
    return api->CreateStatus(ORT_FAIL, (std::string(op) + ": unexpected tensor metadata from onnxruntime (C ABI "
                                        "mismatch?)").c_str());
  void* data = nullptr;
  QSA_TRY(api->GetTensorMutableData(const_cast<OrtValue*>(v), &data));
  t->data = data;
  return nullptr;
}

// Output i with `dims` (its data in *data), or *data null when the graph does not use it.
inline OrtStatus* output(const OrtApi* api, OrtKernelContext* ctx, size_t i, std::vector<int64_t> dims, void** data) {
  *data = nullptr;
  size_t n_out = 0;
  QSA_TRY(api->KernelContext_GetOutputCount(ctx, &n_out));
  if (i >= n_out) return nullptr;
  OrtValue* out = nullptr;
  QSA_TRY(api->KernelContext_GetOutput(ctx, i, dims.data(), dims.size(), &out));
  if (out) QSA_TRY(api->GetTensorMutableData(out, data));
  return nullptr;
}

// Runs fn() with the library's parallel_for on ORT's intra-op pool (its threads spin between
// nodes: ours would compete with them) when the runtime has it; TINYSERVE_NATIVE_POOL=own keeps
// our pool. Returns fn()'s result.
inline bool on_ort_pool(const OrtApi* api, OrtKernelContext* ctx, const std::function<bool()>& fn) {
  struct Dispatch {
    const OrtApi* api;
    OrtKernelContext* ctx;
    OrtStatus* status = nullptr;
  } dispatch{api, ctx};
  if (ort_parallel_for_ok && !own_pool_forced()) {
    qsa::external_pool.self = &dispatch;
    qsa::external_pool.run = [](void* self, int64_t n, const std::function<void(int64_t)>& f) {
      auto* d = static_cast<Dispatch*>(self);
      auto trampoline = [](void* p, size_t i) {
        (*static_cast<const std::function<void(int64_t)>*>(p))(static_cast<int64_t>(i));
      };
      OrtStatus* st = d->api->KernelContext_ParallelFor(d->ctx, trampoline, static_cast<size_t>(n), 0,
                                                        const_cast<std::function<void(int64_t)>*>(&f));
      if (st) {  // ORT could not run it: run it here, keep the first status to release
        if (!d->status) d->status = st; else d->api->ReleaseStatus(st);
        for (int64_t i = 0; i < n; ++i) f(i);
      }
    };
  }
  const bool ok = fn();
  qsa::external_pool = qsa::ExternalPool{};
  if (dispatch.status) api->ReleaseStatus(dispatch.status);
  return ok;
}

// An OrtCustomOp whose callbacks are the Op class's static functions (name, types, counts,
// characteristics, CreateKernelV2, KernelComputeV2).
template <class Op>
OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = kApiVersion;  // >= 16: ORT calls the V2 callbacks, which return a status
  op.GetName = [](const OrtCustomOp*) { return Op::kName; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) { return Op::input_type(i); };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return Op::kNumInputs; };
  op.GetOutputType = [](const OrtCustomOp*, size_t i) { return Op::output_type(i); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return Op::kNumOutputs; };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) -> int {
    return Op::input_required(i) ? ORT_IO_REQUIRED : ORT_IO_OPTIONAL;
  };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t i) -> int {
    return i == 0 ? ORT_IO_REQUIRED : ORT_IO_OPTIONAL;
  };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return 0; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return 0; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 0; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 0; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 0; };
  op.CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
    try {
      qsa::Attrs a;
      QSA_TRY(read_attrs(api, info, Op::kName, &a));
      *kernel = new Kernel{api, a, Op::kName};
      return nullptr;
    } catch (...) {
      return api->CreateStatus(ORT_FAIL, (std::string(Op::kName) + ": out of memory creating the kernel").c_str());
    }
  };
  op.KernelComputeV2 = [](void* kernel, OrtKernelContext* ctx) -> OrtStatus* {
    const Kernel& k = *static_cast<const Kernel*>(kernel);
    try {
      return Op::compute(k, ctx);
    } catch (...) {
      return k.api->CreateStatus(ORT_FAIL, (std::string(Op::kName) + ": out of memory").c_str());
    }
  };
  return op;
}

}  // namespace qsa_ort
