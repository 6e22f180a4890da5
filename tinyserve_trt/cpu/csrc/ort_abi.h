// Our own minimal declarations of the ONNX Runtime C ABI that qsa_decode_cpu.cpp uses.
//
// Written from the documented ABI (OrtApi is an append-only table of function pointers;
// OrtCustomOp a versioned struct of callbacks), not copied from onnxruntime's header:
// only the slots we call are named, the others are placeholders that keep the offsets.
// The static_asserts pin each named slot's index; tests/cpu/test_native_op.py proves
// the ones the library calls by running the op in onnxruntime's Python package
// (GetErrorCode and GetErrorMessage, slots 1-2, are declared but not called).
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtStatus;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtKernelInfo;
struct OrtKernelContext;

enum OrtErrorCode { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };

// ONNXTensorElementDataType values we use.
enum : int {
  ORT_ELEM_UNDEFINED = 0, ORT_ELEM_FLOAT = 1, ORT_ELEM_UINT8 = 2, ORT_ELEM_INT8 = 3, ORT_ELEM_INT32 = 6,
  ORT_ELEM_INT64 = 7, ORT_ELEM_BOOL = 9, ORT_ELEM_FLOAT16 = 10,
};

// OrtCustomOpInputOutputCharacteristic
enum : int { ORT_IO_REQUIRED = 0, ORT_IO_OPTIONAL = 1, ORT_IO_VARIADIC = 2 };

struct OrtApi;

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);  // nullptr when this runtime lacks that API version
  const char* (*GetVersionString)();
};

struct OrtApi {
  OrtStatus* (*CreateStatus)(OrtErrorCode code, const char* msg);  // 0: returns the status, not an error
  OrtErrorCode (*GetErrorCode)(const OrtStatus* status);             // 1
  const char* (*GetErrorMessage)(const OrtStatus* status);           // 2
  void* _unused_3_25[23];                                            // 3..25
  OrtStatus* (*CreateCustomOpDomain)(const char* domain, OrtCustomOpDomain** out);              // 26
  OrtStatus* (*CustomOpDomain_Add)(OrtCustomOpDomain* domain, const struct OrtCustomOp* op);    // 27
  OrtStatus* (*AddCustomOpDomain)(OrtSessionOptions* options, OrtCustomOpDomain* domain);      // 28
  void* _unused_29_50[22];                                                                      // 29..50
  OrtStatus* (*GetTensorMutableData)(OrtValue* value, void** out);                              // 51
  void* _unused_52_59[8];                                                                       // 52..59
  OrtStatus* (*GetTensorElementType)(const OrtTensorTypeAndShapeInfo* info, int* out);          // 60
  OrtStatus* (*GetDimensionsCount)(const OrtTensorTypeAndShapeInfo* info, size_t* out);         // 61
  OrtStatus* (*GetDimensions)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t n);  // 62
  void* _unused_63;                                                                             // 63
  OrtStatus* (*GetTensorShapeElementCount)(const OrtTensorTypeAndShapeInfo* info, size_t* out); // 64
  OrtStatus* (*GetTensorTypeAndShape)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);  // 65
  void* _unused_66_84[19];                                                                      // 66..84
  OrtStatus* (*KernelInfoGetAttribute_float)(const OrtKernelInfo* info, const char* name, float* out);    // 85
  OrtStatus* (*KernelInfoGetAttribute_int64)(const OrtKernelInfo* info, const char* name, int64_t* out);  // 86
  OrtStatus* (*KernelInfoGetAttribute_string)(const OrtKernelInfo* info, const char* name, char* out,
                                              size_t* size);                                     // 87
  OrtStatus* (*KernelContext_GetInputCount)(const OrtKernelContext* ctx, size_t* out);          // 88
  OrtStatus* (*KernelContext_GetOutputCount)(const OrtKernelContext* ctx, size_t* out);         // 89
  OrtStatus* (*KernelContext_GetInput)(const OrtKernelContext* ctx, size_t index, const OrtValue** out);  // 90
  OrtStatus* (*KernelContext_GetOutput)(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t n,
                                        OrtValue** out);                                         // 91
  void* _unused_92;                                                                             // 92
  void (*ReleaseStatus)(OrtStatus* status);                                                     // 93
  void* _unused_94_98[5];                                                                       // 94..98
  void (*ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo* info);                       // 99
  void* _unused_100_273[174];                                                                   // 100..273
  // C API >= 18: fn(usr_data, i) for i in [0, total) on the session's intra-op thread pool
  // (num_batch 0: one task per index)
  OrtStatus* (*KernelContext_ParallelFor)(const OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t total,
                                          size_t num_batch, void* usr_data);                    // 274
};

#define QSA_ORT_SLOT(field, index) \
  static_assert(offsetof(OrtApi, field) == (index) * sizeof(void*), #field " must be OrtApi slot " #index)
QSA_ORT_SLOT(CreateStatus, 0);
QSA_ORT_SLOT(GetErrorMessage, 2);
QSA_ORT_SLOT(CreateCustomOpDomain, 26);
QSA_ORT_SLOT(AddCustomOpDomain, 28);
QSA_ORT_SLOT(GetTensorMutableData, 51);
QSA_ORT_SLOT(GetTensorElementType, 60);
QSA_ORT_SLOT(GetTensorShapeElementCount, 64);
QSA_ORT_SLOT(GetTensorTypeAndShape, 65);
QSA_ORT_SLOT(KernelInfoGetAttribute_float, 85);
QSA_ORT_SLOT(KernelContext_GetOutput, 91);
QSA_ORT_SLOT(ReleaseStatus, 93);
QSA_ORT_SLOT(ReleaseTensorTypeAndShapeInfo, 99);
QSA_ORT_SLOT(KernelContext_ParallelFor, 274);
#undef QSA_ORT_SLOT

// A custom op's callbacks. With version >= 16 ORT calls CreateKernelV2 / KernelComputeV2
// (which return a status) instead of CreateKernel / KernelCompute; fields added after
// KernelComputeV2 are read only for version >= 17, so the struct stops here.
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);  // nullptr: the CPU provider
  int (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  int (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* ctx);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);  // 0: OrtMemTypeDefault
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* ctx);
};

}  // extern "C"
