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
#include "qsa_decode_step.h"
#include "qsa_inputs.h"
#include "qsa_prefill.h"

namespace {

using namespace qsa_inputs;

constexpr const char* kOpName = "QueryAwareSparseAttentionDecode";
constexpr const char* kDomain = "tinyserve.cpu";
constexpr uint32_t kApiVersion = 16;
constexpr uint32_t kParallelForApiVersion = 18;  // KernelContext_ParallelFor
// Set at registration: the runtime's C API has KernelContext_ParallelFor.
bool ort_parallel_for_ok = false;

bool own_pool_forced() {
  const char* env = std::getenv("TINYSERVE_NATIVE_POOL");
  return env && std::string(env) == "own";
}
constexpr size_t kNumOutputs = 2;

struct Kernel {
  const OrtApi* api;
  qsa::Attrs attrs;
};

OrtStatus* error(const OrtApi* api, const std::string& msg) {
  return api->CreateStatus(ORT_INVALID_ARGUMENT, (std::string(kOpName) + ": " + msg).c_str());
}

#define QSA_TRY(expr)                    \
  do {                                   \
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

bool read_string(const OrtApi* api, const OrtKernelInfo* info, const char* name, std::string* out) {
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

OrtStatus* create_kernel_impl(const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  qsa::Attrs a;  // the schema's defaults (qsa_problem.h reads them from qsa_schema.h)
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
    return error(api, "cold_format must be int8 or int4, got '" + cold + "'");
  a.cold_int4 = cold == kColdFormats[QSA_COLD_FORMAT_INT4];
  if (policy != kPolicies[QSA_POLICY_QUERY_AWARE] && policy != kPolicies[QSA_POLICY_DENSE])
    return error(api, "policy '" + policy + "' is not supported (query_aware, dense)");
  if (reduce != kReductions[QSA_GROUP_REDUCE_MAX] && reduce != kReductions[QSA_GROUP_REDUCE_SUM] &&
      reduce != kReductions[QSA_GROUP_REDUCE_HEAD])
    return error(api, "group_reduce must be max, sum or head, got '" + reduce + "'");
  for (const std::string& e :
       {out_of_range(QSA_ATTR_SCALE_NAME, a.scale, QSA_ATTR_SCALE_MIN, INFINITY),
        out_of_range(QSA_ATTR_SINK_PAGES_NAME, a.sink_pages, QSA_ATTR_SINK_PAGES_MIN, QSA_ATTR_SINK_PAGES_MAX),
        out_of_range(QSA_ATTR_RECENT_PAGES_NAME, a.recent_pages, QSA_ATTR_RECENT_PAGES_MIN, QSA_ATTR_RECENT_PAGES_MAX),
        out_of_range(QSA_ATTR_SUB_PAGE_SIZE_NAME, a.sub_page_size, QSA_ATTR_SUB_PAGE_SIZE_MIN,
                     QSA_ATTR_SUB_PAGE_SIZE_MAX),
        out_of_range(QSA_ATTR_CANDIDATE_SHARE_NAME, a.candidate_share, QSA_ATTR_CANDIDATE_SHARE_MIN,
                     QSA_ATTR_CANDIDATE_SHARE_MAX)})
    if (!e.empty()) return error(api, e);
  a.dense = policy == kPolicies[QSA_POLICY_DENSE];
  a.reduce_sum = reduce == kReductions[QSA_GROUP_REDUCE_SUM];
  a.per_head = reduce == kReductions[QSA_GROUP_REDUCE_HEAD];
  if (a.dense && a.sub_page_size > 0) return error(api, "sub_page_size > 0 (two-level) needs policy query_aware");
  *kernel = new Kernel{api, a};
  return nullptr;
}

// ---- inputs ----


int input_type(const OrtCustomOp*, size_t i);

// Shape, element type and count, and data of input i; leaves `t` empty for an omitted optional input.
OrtStatus* read_input(const OrtApi* api, const OrtKernelContext* ctx, size_t i, Tensor* t) {
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
  const int want = input_type(nullptr, i);  // the cold inputs' types depend on the format: check() checks them
  if ((want != ORT_ELEM_UNDEFINED && t->type != want) || t->count != product)  // ORT checks both; a wrong ABI slot would not
    return api->CreateStatus(ORT_FAIL, "QueryAwareSparseAttentionDecode: unexpected tensor metadata from "
                                       "onnxruntime (C ABI mismatch?)");
  void* data = nullptr;
  QSA_TRY(api->GetTensorMutableData(const_cast<OrtValue*>(v), &data));
  t->data = data;
  return nullptr;
}

OrtStatus* compute_impl(void* kernel_ptr, OrtKernelContext* ctx) {
  const Kernel& kernel = *static_cast<const Kernel*>(kernel_ptr);
  const OrtApi* api = kernel.api;
  Tensor in[kNumInputs];
  for (size_t i = 0; i < kNumInputs; ++i) {
    QSA_TRY(read_input(api, ctx, i, &in[i]));
    if (i < kNumRequired && !in[i].data && in[i].shape.empty())
      return error(api, std::string("missing input ") + kInputNames[i]);
  }
  qsa::Problem p;
  std::string e = check(in, kernel.attrs, &p);
  if (!e.empty()) return error(api, e);
  int64_t out_dims[4] = {p.B, p.H, p.S, p.D};
  OrtValue* out = nullptr;
  QSA_TRY(api->KernelContext_GetOutput(ctx, 0, out_dims, 4, &out));
  void* data = nullptr;
  QSA_TRY(api->GetTensorMutableData(out, &data));
  p.out = static_cast<float*>(data);
  size_t n_out = 0;
  QSA_TRY(api->KernelContext_GetOutputCount(ctx, &n_out));
  if (n_out > 1) {
    int64_t sel_dims[3] = {p.B, p.Hkv, p.NP};
    OrtValue* sel = nullptr;
    QSA_TRY(api->KernelContext_GetOutput(ctx, 1, sel_dims, 3, &sel));
    if (sel) {
      QSA_TRY(api->GetTensorMutableData(sel, &data));
      p.selected = static_cast<bool*>(data);
    }
  }
  // Parallel work on ORT's intra-op pool (its threads spin between nodes: ours would compete
  // with them) when the runtime has it; TINYSERVE_NATIVE_POOL=own keeps our pool.
  struct Dispatch {
    const OrtApi* api;
    OrtKernelContext* ctx;
    OrtStatus* status = nullptr;
  } dispatch{api, ctx};
  const bool use_ort = ort_parallel_for_ok && !own_pool_forced();
  if (use_ort) {
    qsa::external_pool.self = &dispatch;
    qsa::external_pool.run = [](void* self, int64_t n, const std::function<void(int64_t)>& fn) {
      auto* d = static_cast<Dispatch*>(self);
      auto trampoline = [](void* f, size_t i) {
        (*static_cast<const std::function<void(int64_t)>*>(f))(static_cast<int64_t>(i));
      };
      OrtStatus* st = d->api->KernelContext_ParallelFor(d->ctx, trampoline, static_cast<size_t>(n), 0,
                                                        const_cast<std::function<void(int64_t)>*>(&fn));
      if (st) {  // ORT could not run it: run it here, keep the first status to release
        if (!d->status) d->status = st; else d->api->ReleaseStatus(st);
        for (int64_t i = 0; i < n; ++i) fn(i);
      }
    };
  }
  const bool ok = p.S == 1 ? qsa::run(p, kernel.attrs) : qsa::prefill::run(p, kernel.attrs);
  qsa::external_pool = qsa::ExternalPool{};
  if (dispatch.status) api->ReleaseStatus(dispatch.status);
  if (!ok) return api->CreateStatus(ORT_FAIL, "QueryAwareSparseAttentionDecode: out of memory");
  return nullptr;
}

// ---- the op's callbacks: nothing throws across the C boundary ----

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  try {
    return create_kernel_impl(api, info, kernel);
  } catch (...) {
    return api->CreateStatus(ORT_FAIL, "QueryAwareSparseAttentionDecode: out of memory creating the kernel");
  }
}

OrtStatus* compute(void* kernel_ptr, OrtKernelContext* ctx) {
  try {
    return compute_impl(kernel_ptr, ctx);
  } catch (...) {
    const OrtApi* api = static_cast<const Kernel*>(kernel_ptr)->api;
    return api->CreateStatus(ORT_FAIL, "QueryAwareSparseAttentionDecode: out of memory");
  }
}

const char* op_name(const OrtCustomOp*) { return kOpName; }
const char* op_provider(const OrtCustomOp*) { return nullptr; }
int input_type(const OrtCustomOp*, size_t i) {  // the cold inputs: any type (checked against cold_format)
  switch (i) {
    case QSA_IN_PAGE_TABLE: case QSA_IN_PAST_LENS: case QSA_IN_TOKEN_BUDGET: return ORT_ELEM_INT32;
    case QSA_IN_KEY_SUB_BOUNDS: return ORT_ELEM_UINT8;
    default: return i < kNumRequired ? ORT_ELEM_FLOAT : ORT_ELEM_UNDEFINED;
  }
}
size_t input_count(const OrtCustomOp*) { return kNumInputs; }
int output_type(const OrtCustomOp*, size_t i) { return i == 0 ? ORT_ELEM_FLOAT : ORT_ELEM_BOOL; }
size_t output_count(const OrtCustomOp*) { return kNumOutputs; }
void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
int input_characteristic(const OrtCustomOp*, size_t i) { return i < kNumRequired ? ORT_IO_REQUIRED : ORT_IO_OPTIONAL; }
int output_characteristic(const OrtCustomOp*, size_t i) { return i == 0 ? ORT_IO_REQUIRED : ORT_IO_OPTIONAL; }
int default_memory(const OrtCustomOp*, size_t) { return 0; }
int variadic_zero(const OrtCustomOp*) { return 0; }

OrtCustomOp make_op() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = kApiVersion;  // >= 16: ORT calls the V2 callbacks, which return a status
  op.GetName = op_name;
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = output_count;
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = input_characteristic;
  op.GetOutputCharacteristic = output_characteristic;
  op.GetInputMemoryType = default_memory;
  op.GetVariadicInputMinArity = variadic_zero;
  op.GetVariadicInputHomogeneity = variadic_zero;
  op.GetVariadicOutputMinArity = variadic_zero;
  op.GetVariadicOutputHomogeneity = variadic_zero;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  return op;
}

const OrtCustomOp kOp = make_op();

}  // namespace

// The entry point SessionOptions.register_custom_ops_library calls. The domain is never
// released: ORT keeps a pointer to it for the sessions made from these options.
extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                             const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(kApiVersion);
  if (!api) {  // too old a runtime: report through the oldest API, whose CreateStatus every version has
    std::string msg = std::string("libtinyserve_cpu needs the ONNX Runtime C API ") + std::to_string(kApiVersion) +
                      " (onnxruntime >= 1.16), this is onnxruntime " + base->GetVersionString();
    return base->GetApi(1)->CreateStatus(ORT_FAIL, msg.c_str());
  }
  ort_parallel_for_ok = base->GetApi(kParallelForApiVersion) != nullptr;
  OrtCustomOpDomain* domain = nullptr;
  QSA_TRY(api->CreateCustomOpDomain(kDomain, &domain));
  QSA_TRY(api->CustomOpDomain_Add(domain, &kOp));
  return api->AddCustomOpDomain(options, domain);
}
