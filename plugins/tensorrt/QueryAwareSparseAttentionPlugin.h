// TensorRT IPluginV3 glue for tinyserve::QueryAwareSparseAttention (TensorRT >= 10.0).
//
// Glue only: shapes, types, fields, workspace. The math is in plugins/kernels
// behind qsa_launch.h (the efficientNMSPlugin split of *Plugin.cpp vs
// *Inference.cu). Name, namespace, version and fields come from the generated
// plugins/generated/qsa_schema.h, i.e. from tinyserve_trt/ops/schema.py.
#pragma once

#include <NvInfer.h>
#include <NvInferRuntime.h>

#include <string>
#include <vector>

#include "qsa_launch.h"

namespace tinyserve {

class QueryAwareSparseAttentionPlugin : public nvinfer1::IPluginV3,
                                        public nvinfer1::IPluginV3OneCore,
                                        public nvinfer1::IPluginV3OneBuild,
                                        public nvinfer1::IPluginV3OneRuntime {
public:
    // coldFormat: QSA_COLD_FORMAT_* of the cold-tier inputs (the schema's cold_format attribute).
    QueryAwareSparseAttentionPlugin(QsaAttrs const& attrs, int32_t coldFormat, std::string ns);
    QueryAwareSparseAttentionPlugin(QueryAwareSparseAttentionPlugin const& other);
    ~QueryAwareSparseAttentionPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                               nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
                            int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                            nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                    void const* const* inputs, void* const* outputs, void* workspace,
                    cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    QsaAttrs mAttrs;
    int32_t mColdFormat{QSA_COLD_FORMAT_INT8};
    std::string mNamespace;
    // Set by onShapeChange, read by enqueue (no device queries there).
    QsaDims mDims{};
    QsaColdDims mCold{};  // all zero without a cold tier
    int32_t mDtype{QSA_DTYPE_FLOAT32};
    int32_t mNbInputs{QSA_NUM_REQUIRED_INPUTS};  // 10, 11 (+ key_sub_bounds), 14 (+ cold tier) or 15 (both)
    bool mHasCold{false};  // 14 inputs, or 15 whose cold inputs were not skipped
    // Storage the serialized PluginFields point into.
    std::string mPolicyName, mGroupReduceName, mColdFormatName;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

class QueryAwareSparseAttentionPluginCreator : public nvinfer1::IPluginCreatorV3One {
public:
    QueryAwareSparseAttentionPluginCreator();
    ~QueryAwareSparseAttentionPluginCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::vector<nvinfer1::PluginField> mFieldNames;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

// Parses PluginFields into attributes and the cold format (QSA_COLD_FORMAT_*; defaults
// from the schema for absent ones). Returns false with a reason for a bad value or
// unknown field; the ONNX parser's own plugin_namespace / plugin_version fields are accepted.
bool parseFields(nvinfer1::PluginFieldCollection const* fc, QsaAttrs& attrs, int32_t& coldFormat,
                 std::string& error) noexcept;

// Schema enum index -> its attribute string; schema field type (0 int, 1 float, 2 string) -> PluginFieldType.
char const* policyName(int32_t policy) noexcept;
char const* groupReduceName(int32_t groupReduce) noexcept;
char const* coldFormatName(int32_t coldFormat) noexcept;
nvinfer1::PluginFieldType fieldType(int schemaType) noexcept;

}  // namespace tinyserve
