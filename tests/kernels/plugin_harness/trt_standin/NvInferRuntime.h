// STAND-IN for TensorRT's public NvInferRuntime.h - NOT TensorRT. Dev-only, never shipped.
//
// Declares just what plugins/tensorrt/ and the plugin harness (../harness.cpp) use, with the
// names, namespaces, enum values and virtual signatures of the public NVIDIA/TensorRT headers
// at TensorRT 11.1.0 (include/ of github.com/NVIDIA/TensorRT, commit a892d222, Apache-2.0),
// so the plugin's IPluginV3 glue compiles and runs where no TensorRT headers are installed
// (CI). IDimensionExpr / IExprBuilder keep TensorRT's shape: non-virtual wrappers around an
// apiv:: implementation pointer that the harness fills. With $TENSORRT_INCLUDE_DIR set, the
// harness test compiles against the real headers instead; the two must both compile the
// plugin unchanged (tests/kernels/test_plugin_harness.py). Mirrors the public API only: no
// ABI compatibility with libnvinfer is intended.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#define NV_TENSORRT_MAJOR 11
#define NV_TENSORRT_MINOR 1
#define NV_TENSORRT_PATCH 0
#define TINYSERVE_TRT_STANDIN 1
#define TENSORRTAPI __attribute__((visibility("default")))

namespace nvinfer1 {

using char_t = char;
using AsciiChar = char_t;
using InterfaceKind = char const*;

enum class DataType : int32_t {
    kFLOAT = 0, kHALF = 1, kINT8 = 2, kINT32 = 3, kBOOL = 4, kUINT8 = 5, kFP8 = 6, kBF16 = 7, kINT64 = 8,
    kINT4 = 9, kFP4 = 10, kE8M0 = 11,
};

enum class TensorFormat : int32_t { kLINEAR = 0, kCHW2 = 1, kHWC8 = 2, kCHW4 = 3, kCHW16 = 4, kCHW32 = 5 };

class Dims64 {
public:
    static constexpr int32_t MAX_DIMS{8};
    int32_t nbDims;
    int64_t d[MAX_DIMS];
};
using Dims = Dims64;

class InterfaceInfo {
public:
    InterfaceKind kind;
    int32_t major;
    int32_t minor;
};

enum class APILanguage : int32_t { kCPP = 0, kPYTHON = 1 };

class IVersionedInterface {
public:
    virtual APILanguage getAPILanguage() const noexcept { return APILanguage::kCPP; }
    virtual InterfaceInfo getInterfaceInfo() const noexcept = 0;
    virtual ~IVersionedInterface() noexcept = default;

protected:
    IVersionedInterface() = default;
    IVersionedInterface(IVersionedInterface const&) = default;
    IVersionedInterface(IVersionedInterface&&) = default;
    IVersionedInterface& operator=(IVersionedInterface const&) & = default;
    IVersionedInterface& operator=(IVersionedInterface&&) & = default;
};

class INoCopy {
protected:
    INoCopy() = default;
    virtual ~INoCopy() = default;
    INoCopy(INoCopy const& other) = delete;
    INoCopy& operator=(INoCopy const& other) = delete;
    INoCopy(INoCopy&& other) = delete;
    INoCopy& operator=(INoCopy&& other) = delete;
};

// ---- plugin fields (NvInferPluginBase.h) ----
enum class PluginFieldType : int32_t {
    kFLOAT16 = 0, kFLOAT32 = 1, kFLOAT64 = 2, kINT8 = 3, kINT16 = 4, kINT32 = 5, kCHAR = 6, kDIMS = 7,
    kUNKNOWN = 8, kBF16 = 9, kINT64 = 10, kFP8 = 11, kINT4 = 12, kFP4 = 13,
};

class PluginField {
public:
    AsciiChar const* name;
    void const* data;
    PluginFieldType type;
    int32_t length;
    PluginField(AsciiChar const* const name_ = nullptr, void const* const data_ = nullptr,
                PluginFieldType const type_ = PluginFieldType::kUNKNOWN, int32_t const length_ = 0) noexcept
        : name(name_), data(data_), type(type_), length(length_) {}
};

struct PluginFieldCollection {
    int32_t nbFields{};
    PluginField const* fields{};
};

enum class TensorRTPhase : int32_t { kBUILD = 0, kRUNTIME = 1 };
enum class PluginCapabilityType : int32_t { kCORE = 0, kBUILD = 1, kRUNTIME = 2 };

namespace v_1_0 {
class IPluginCapability : public IVersionedInterface {};

class IPluginCreatorInterface : public IVersionedInterface {
public:
    ~IPluginCreatorInterface() noexcept override = default;

protected:
    IPluginCreatorInterface() = default;
    IPluginCreatorInterface(IPluginCreatorInterface const&) = default;
    IPluginCreatorInterface(IPluginCreatorInterface&&) = default;
    IPluginCreatorInterface& operator=(IPluginCreatorInterface const&) & = default;
    IPluginCreatorInterface& operator=(IPluginCreatorInterface&&) & = default;
};

class IPluginV3 : public IVersionedInterface {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return InterfaceInfo{"PLUGIN", 1, 0}; }
    virtual IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept = 0;
    virtual IPluginV3* clone() noexcept = 0;
};
}  // namespace v_1_0
using IPluginCreatorInterface = v_1_0::IPluginCreatorInterface;
using IPluginV3 = v_1_0::IPluginV3;
using IPluginCapability = v_1_0::IPluginCapability;

// ---- tensor descriptions (NvInferRuntimePlugin.h) ----
struct PluginTensorDesc {
    Dims dims;
    DataType type;
    TensorFormat format;
    float scale;
};

// ---- shape expressions (NvInferRuntime.h): wrappers around an implementation pointer ----
enum class DimensionOperation : int32_t {
    kSUM = 0, kPROD = 1, kMAX = 2, kMIN = 3, kSUB = 4, kEQUAL = 5, kLESS = 6, kFLOOR_DIV = 7, kCEIL_DIV = 8,
};

class IDimensionExpr;
namespace apiv {
class VRoot {
public:
    virtual ~VRoot() noexcept = default;
};
class VDimensionExpr : public VRoot {
public:
    virtual bool isConstant() const = 0;
    virtual int64_t getConstantValue() const = 0;
    virtual bool isSizeTensor() const = 0;
};
class VExprBuilder : public VRoot {
public:
    virtual IDimensionExpr const* constant(int64_t value) = 0;
    virtual IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& first,
                                            IDimensionExpr const& second) = 0;
    virtual IDimensionExpr const* declareSizeTensor(int32_t outputIndex, IDimensionExpr const& opt,
                                                    IDimensionExpr const& upper) = 0;
};
}  // namespace apiv

class IDimensionExpr : public INoCopy {
public:
    bool isConstant() const noexcept { return mImpl->isConstant(); }
    int64_t getConstantValue() const noexcept { return mImpl->getConstantValue(); }
    bool isSizeTensor() const noexcept { return mImpl->isSizeTensor(); }

protected:
    apiv::VDimensionExpr* mImpl;
    virtual ~IDimensionExpr() noexcept = 0;
};
inline IDimensionExpr::~IDimensionExpr() noexcept = default;

class IExprBuilder : public INoCopy {
public:
    IDimensionExpr const* constant(int64_t value) noexcept { return mImpl->constant(value); }
    IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& first,
                                    IDimensionExpr const& second) noexcept {
        return mImpl->operation(op, first, second);
    }
    IDimensionExpr const* declareSizeTensor(int32_t outputIndex, IDimensionExpr const& opt,
                                            IDimensionExpr const& upper) {
        return mImpl->declareSizeTensor(outputIndex, opt, upper);
    }

protected:
    apiv::VExprBuilder* mImpl;
    virtual ~IExprBuilder() noexcept = 0;
};
inline IExprBuilder::~IExprBuilder() noexcept = default;

class DimsExprs {
public:
    int32_t nbDims;
    IDimensionExpr const* d[Dims::MAX_DIMS];
};

struct DynamicPluginTensorDesc {
    PluginTensorDesc desc;
    Dims min;
    Dims max;
    Dims opt;
};

// ---- logging and resources ----
namespace v_1_0 {
class ILogger : public IVersionedInterface {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return {"ILogger", 1, 0}; }
    enum class Severity : int32_t { kINTERNAL_ERROR = 0, kERROR = 1, kWARNING = 2, kINFO = 3, kVERBOSE = 4 };
    virtual void log(Severity severity, AsciiChar const* msg) noexcept = 0;
    ILogger() = default;
    ~ILogger() override = default;

protected:
    ILogger(ILogger const&) = default;
    ILogger(ILogger&&) = default;
    ILogger& operator=(ILogger const&) & = default;
    ILogger& operator=(ILogger&&) & = default;
};

class ILoggerFinder : public IVersionedInterface {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return {"ILoggerFinder", 1, 0}; }
    virtual ILogger* findLogger() = 0;

protected:
    ~ILoggerFinder() override = default;
};
class IGpuAllocator;
class IErrorRecorder;
}  // namespace v_1_0
using ILogger = v_1_0::ILogger;
using ILoggerFinder = v_1_0::ILoggerFinder;
using IGpuAllocator = v_1_0::IGpuAllocator;
using IErrorRecorder = v_1_0::IErrorRecorder;

class IPluginResourceContext {
public:
    virtual IGpuAllocator* getGpuAllocator() const noexcept = 0;
    virtual IErrorRecorder* getErrorRecorder() const noexcept = 0;
    virtual ~IPluginResourceContext() noexcept = 0;

protected:
    IPluginResourceContext() = default;
    IPluginResourceContext(IPluginResourceContext const&) = default;
    IPluginResourceContext(IPluginResourceContext&&) = default;
    IPluginResourceContext& operator=(IPluginResourceContext const&) & = default;
    IPluginResourceContext& operator=(IPluginResourceContext&&) & = default;
};
inline IPluginResourceContext::~IPluginResourceContext() noexcept = default;

// ---- the IPluginV3One capabilities ----
namespace v_1_0 {
class IPluginV3OneCore : public IPluginCapability {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return InterfaceInfo{"PLUGIN_V3ONE_CORE", 1, 0}; }
    virtual AsciiChar const* getPluginName() const noexcept = 0;
    virtual AsciiChar const* getPluginVersion() const noexcept = 0;
    virtual AsciiChar const* getPluginNamespace() const noexcept = 0;
};

class IPluginV3OneBuild : public IPluginCapability {
public:
    static constexpr int32_t kDEFAULT_FORMAT_COMBINATION_LIMIT = 100;
    InterfaceInfo getInterfaceInfo() const noexcept override { return InterfaceInfo{"PLUGIN_V3ONE_BUILD", 1, 0}; }
    virtual int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                    DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept = 0;
    virtual int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, const DataType* inputTypes,
                                       int32_t nbInputs) const noexcept = 0;
    virtual int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
                                    int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs,
                                    IExprBuilder& exprBuilder) noexcept = 0;
    virtual bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                           int32_t nbOutputs) noexcept = 0;
    virtual int32_t getNbOutputs() const noexcept = 0;
    virtual size_t getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
                                    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept {
        return 0;
    }
    virtual int32_t getValidTactics(int32_t* /*tactics*/, int32_t /*nbTactics*/) noexcept { return 0; }
    virtual int32_t getNbTactics() noexcept { return 0; }
    virtual char const* getTimingCacheID() noexcept { return nullptr; }
    virtual int32_t getFormatCombinationLimit() noexcept { return kDEFAULT_FORMAT_COMBINATION_LIMIT; }
    virtual char const* getMetadataString() noexcept { return nullptr; }
};

class IPluginV3OneRuntime : public IPluginCapability {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return InterfaceInfo{"PLUGIN_V3ONE_RUNTIME", 1, 0}; }
    virtual int32_t setTactic(int32_t /*tactic*/) noexcept { return 0; }
    virtual int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                                  int32_t nbOutputs) noexcept = 0;
    virtual int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                            void const* const* inputs, void* const* outputs, void* workspace,
                            cudaStream_t stream) noexcept = 0;
    virtual IPluginV3* attachToContext(IPluginResourceContext* context) noexcept = 0;
    virtual PluginFieldCollection const* getFieldsToSerialize() noexcept = 0;
};

class IPluginCreatorV3One : public IPluginCreatorInterface {
public:
    InterfaceInfo getInterfaceInfo() const noexcept override { return InterfaceInfo{"PLUGIN CREATOR_V3ONE", 1, 0}; }
    virtual IPluginV3* createPlugin(AsciiChar const* name, PluginFieldCollection const* fc,
                                    TensorRTPhase phase) noexcept = 0;
    virtual PluginFieldCollection const* getFieldNames() noexcept = 0;
    virtual AsciiChar const* getPluginName() const noexcept = 0;
    virtual AsciiChar const* getPluginVersion() const noexcept = 0;
    virtual AsciiChar const* getPluginNamespace() const noexcept = 0;
    IPluginCreatorV3One() = default;
    virtual ~IPluginCreatorV3One() = default;

protected:
    IPluginCreatorV3One(IPluginCreatorV3One const&) = default;
    IPluginCreatorV3One(IPluginCreatorV3One&&) = default;
    IPluginCreatorV3One& operator=(IPluginCreatorV3One const&) & = default;
    IPluginCreatorV3One& operator=(IPluginCreatorV3One&&) & = default;
};
}  // namespace v_1_0
using IPluginV3OneCore = v_1_0::IPluginV3OneCore;
using IPluginV3OneBuild = v_1_0::IPluginV3OneBuild;
using IPluginV3OneRuntime = v_1_0::IPluginV3OneRuntime;
using IPluginCreatorV3One = v_1_0::IPluginCreatorV3One;

}  // namespace nvinfer1
