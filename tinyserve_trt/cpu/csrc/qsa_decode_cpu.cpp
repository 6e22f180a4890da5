// tinyserve.cpu::QueryAwareSparseAttentionDecode: one decode step (S == 1) of
// tinyserve::QueryAwareSparseAttention as an ONNX Runtime CPU custom op.
//
// The semantics are ops/reference.py's sparse_attention_ref for S == 1 (policies
// query_aware and dense; single-level and two-level selection), checked by
// tests/cpu/test_native_op.py. Per (sequence, KV head): score the sequence's pages
// from key_min/key_max, keep the best within the token budget (ties to the lower
// page index, as a stable sort by -score), then attend the kept cached tokens plus
// the new token, the G query heads of the GQA group together so each K/V row is read
// once. Reads only what the selection keeps; never writes the cache.
//
// Inputs (schema order): query [B,H,1,D], key/value [B,Hkv,1,D], key_cache/value_cache
// [P,Hkv,ps,D], key_min/key_max [Pm,Hkv,D], page_table [B,NP] int32, past_lens [B] int32,
// token_budget [B] int32, optional key_sub_bounds [Ps,Hkv,r,D] uint8 (two-level).
// Outputs: output [B,H,1,D], optional selected_pages [B,Hkv,NP] bool.
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
#include "qsa_decode_math.h"

namespace {

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
constexpr size_t kNumInputs = 11, kNumRequired = 10, kNumOutputs = 2;

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

OrtStatus* create_kernel_impl(const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  qsa::Attrs a;
  read_attr(api, api->KernelInfoGetAttribute_float, info, "scale", &a.scale);
  read_attr(api, api->KernelInfoGetAttribute_int64, info, "sink_pages", &a.sink_pages);
  read_attr(api, api->KernelInfoGetAttribute_int64, info, "recent_pages", &a.recent_pages);
  read_attr(api, api->KernelInfoGetAttribute_int64, info, "sub_page_size", &a.sub_page_size);
  read_attr(api, api->KernelInfoGetAttribute_float, info, "candidate_share", &a.candidate_share);
  std::string policy = "query_aware", reduce = "max";
  read_string(api, info, "policy", &policy);
  read_string(api, info, "group_reduce", &reduce);
  if (policy != "query_aware" && policy != "dense")
    return error(api, "policy '" + policy + "' is not supported (query_aware, dense)");
  if (reduce != "max" && reduce != "sum") return error(api, "group_reduce must be max or sum, got '" + reduce + "'");
  if (!(a.scale >= 0.0f)) return error(api, "scale must be >= 0");
  if (a.sink_pages < 0 || a.recent_pages < 1) return error(api, "sink_pages must be >= 0 and recent_pages >= 1");
  if (a.sub_page_size < 0) return error(api, "sub_page_size must be >= 0");
  if (!(a.candidate_share >= 0.0f && a.candidate_share <= 1.0f)) return error(api, "candidate_share must be in [0, 1]");
  a.dense = policy == "dense";
  a.reduce_sum = reduce == "sum";
  if (a.dense && a.sub_page_size > 0) return error(api, "sub_page_size > 0 (two-level) needs policy query_aware");
  *kernel = new Kernel{api, a};
  return nullptr;
}

// ---- inputs ----

struct Tensor {
  const void* data = nullptr;
  std::vector<int64_t> shape;
  int type = ORT_ELEM_UNDEFINED;
  size_t count = 0;  // elements
};

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
  if (t->type != input_type(nullptr, i) || t->count != product)  // ORT checks both; a wrong ABI slot would not
    return api->CreateStatus(ORT_FAIL, "QueryAwareSparseAttentionDecode: unexpected tensor metadata from "
                                       "onnxruntime (C ABI mismatch?)");
  void* data = nullptr;
  QSA_TRY(api->GetTensorMutableData(const_cast<OrtValue*>(v), &data));
  t->data = data;
  return nullptr;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

const char* const kInputNames[kNumInputs] = {"query", "key", "value", "key_cache", "value_cache", "key_min",
                                             "key_max", "page_table", "past_lens", "token_budget",
                                             "key_sub_bounds"};

// Checks every shape and index the math reads; returns a one-line error, or "" when valid.
std::string check(const Tensor* in, const qsa::Attrs& a, qsa::Problem* p) {
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
  int64_t id_limit = std::min(p->P, p->Pm);
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
  int64_t out_dims[4] = {p.B, p.H, 1, p.D};
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
  const bool ok = qsa::run(p, kernel.attrs);
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
int input_type(const OrtCustomOp*, size_t i) {
  return i < 7 ? ORT_ELEM_FLOAT : i < 10 ? ORT_ELEM_INT32 : ORT_ELEM_UINT8;
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
