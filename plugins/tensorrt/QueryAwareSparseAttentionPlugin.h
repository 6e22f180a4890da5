// TensorRT IPluginV3 glue for tinyserve::QueryAwareSparseAttention (TensorRT >= 10.0).
//
// An adapter only: it turns TensorRT's descriptors and PluginFields into our plain types and
// calls QsaPluginCore / QsaPluginFields, which decide shapes, types, formats, fields and the
// workspace without TensorRT (tested in CI without its headers); the math is in plugins/kernels
// behind qsa_launch.h (the efficientNMSPlugin split of *Plugin.cpp vs *Inference.cu). Name,
// namespace, version and fields come from the generated plugins/generated/qsa_schema.h, i.e.
// from tinyserve_trt/ops/schema.py.
#pragma once

#include <NvInfer.h>
#include <NvInferRuntime.h>

#include <string>
#include <vector>

#include "QsaPluginCore.h"
#include "QsaPluginFields.h"

namespace tinyserve {

class QueryAwareSparseAttentionPlugin : public nvinfer1::IPluginV3,
                                        public nvinfer1::IPluginV3OneCore,
                                        public nvinfer1::IPluginV3OneBuild,
                                        public nvinfer1::IPluginV3OneRuntime {
public:
    QueryAwareSparseAttentionPlugin(QsaPluginConfig const& config, std::string ns);
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
    QsaPluginCore mCore;  // the fields' decisions and, after onShapeChange, the launch shape
    std::string mNamespace;
    // Storage the serialized PluginFields point into.
    QsaSerializedFields mSerialized;
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

}  // namespace tinyserve
