// What the TensorRT plugin decides, without TensorRT: input layouts, output shapes and types, the
// format rule, configure checks, the workspace size, shapes -> launch dims, and enqueue over the
// launch structs (TensorRT's plugin samples keep the glue apart from the math the same way:
// efficientNMSPlugin's *Plugin.cpp vs *Inference.cu).
//
// QueryAwareSparseAttentionPlugin (the IPluginV3 class) is a thin adapter over this: it turns
// TensorRT's descriptors into QsaShape / QsaTensorFormat and calls these. No NvInfer header is
// included here, so tests/kernels/test_plugin_core.py compiles and drives this core in CI, where
// there are no TensorRT headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "QsaPluginFields.h"
#include "qsa_launch.h"

namespace tinyserve {

// A tensor's extents (as nvinfer1::Dims: at most 8 dims of int64).
struct QsaShape {
    static constexpr int32_t kMaxDims = 8;
    int32_t nbDims;
    int64_t d[kMaxDims];
};

// The element types the plugin reads or writes; kOther for any other (refused).
enum class QsaElemType : int32_t { kFloat32, kFloat16, kInt32, kInt8, kUInt8, kOther };

// One position's proposed type and layout, as format negotiation offers it.
struct QsaTensorFormat {
    QsaElemType type;
    bool linear;  // row-major (TensorRT's kLINEAR); the kernels read nothing else
};

// The node's input counts: required (10), + key_sub_bounds (11: a parser that drops skipped
// inputs), + the cold tier (14), + both (15: the schema's full list, where a two-level node
// without cold pages has its four cold inputs skipped).
bool nbInputsOk(int32_t nbInputs) noexcept;

// Position of key_sub_bounds among nbInputs inputs, or -1 when the node has none.
int32_t subBoundsInput(int32_t nbInputs) noexcept;

// Output shapes from input shapes: output [B, H, S, D] is query's, selected_pages is [B, Hkv, NP]
// (B from query, Hkv from key, NP from page_table). Shape is anything with `int32_t nbDims` and
// `d[]`: nvinfer1::DimsExprs (each dim an expression of the builder's) or a QsaShape of numbers -
// the formula only moves dims, so it is one formula over both. False for wrong counts or ranks.
template <typename Shape>
bool outputShapes(Shape const* inputs, int32_t nbInputs, Shape* outputs, int32_t nbOutputs) noexcept {
    if (inputs == nullptr || outputs == nullptr || nbInputs < QSA_NUM_REQUIRED_INPUTS || nbOutputs != QSA_NUM_OUTPUTS)
        return false;
    if (inputs[QSA_IN_QUERY].nbDims != 4 || inputs[QSA_IN_KEY].nbDims != 4 || inputs[QSA_IN_PAGE_TABLE].nbDims != 2)
        return false;
    outputs[QSA_OUT_OUTPUT] = inputs[QSA_IN_QUERY];    // [B, H, S, D]
    Shape& sel = outputs[QSA_OUT_SELECTED_PAGES];      // [B, Hkv, NP]
    sel.nbDims = 3;
    sel.d[0] = inputs[QSA_IN_QUERY].d[0];
    sel.d[1] = inputs[QSA_IN_KEY].d[1];
    sel.d[2] = inputs[QSA_IN_PAGE_TABLE].d[1];
    return true;
}

// Output types: output has query's float type; selected_pages is int32 0/1, because plugin
// outputs cannot be bool. `int32` is the caller's spelling of int32 (TensorRT's DataType or ours).
template <typename Type>
bool outputTypes(Type const* inputTypes, int32_t nbInputs, Type* types, int32_t nbOutputs, Type int32) noexcept {
    if (types == nullptr || inputTypes == nullptr || nbOutputs != QSA_NUM_OUTPUTS || nbInputs < 1) return false;
    types[QSA_OUT_OUTPUT] = inputTypes[QSA_IN_QUERY];
    types[QSA_OUT_SELECTED_PAGES] = int32;
    return true;
}

// The launch state onShapeChange derives from the runtime shapes, which enqueue reads (so enqueue
// queries nothing).
struct QsaLaunchShape {
    QsaDims dims{};
    QsaColdDims cold{};  // all zero without a cold tier
    int32_t dtype{QSA_DTYPE_FLOAT32};
    int32_t nbInputs{QSA_NUM_REQUIRED_INPUTS};
    bool hasCold{false};  // 14 inputs, or 15 whose cold inputs were not skipped
};

// The plugin's decisions for one configuration (the parsed fields); copyable, no TensorRT types.
class QsaPluginCore {
public:
    explicit QsaPluginCore(QsaPluginConfig const& config) noexcept : mConfig(config) {}

    QsaPluginConfig const& config() const noexcept { return mConfig; }

    // Whether position `pos` of inOut (nbInputs inputs, then the outputs) may have its proposed
    // type and layout: linear; query float32 or float16, the other floats and `output` its type;
    // ints int32; the cold tier's types by the cold format; key_sub_bounds uint8.
    bool supportsFormat(int32_t pos, QsaTensorFormat const* inOut, int32_t nbInputs, int32_t nbOutputs) const noexcept;

    // Build-time checks of the input and output counts; false with a reason.
    bool configure(int32_t nbInputs, int32_t nbOutputs, std::string& error) const;

    // Scratch bytes for the profile's largest shapes (`maxShapes`, one per input); enqueue uses a
    // prefix of it. 0 for shapes that do not fit together.
    size_t workspaceSize(QsaShape const* maxShapes, int32_t nbInputs) const noexcept;

    // Runtime shapes -> the launch state (replaced only on success); false with a reason.
    bool shapeChange(QsaShape const* shapes, QsaElemType queryType, int32_t nbInputs, int32_t nbOutputs,
                     std::string& error);

    QsaLaunchShape const& launchShape() const noexcept { return mLaunch; }

    // One forward over the device pointers (schema order, as the node's inputs), asynchronous on
    // `stream`; the kernels' QsaStatus. Allocates and synchronizes nothing.
    int32_t enqueue(void const* const* inputs, void* const* outputs, void* workspace, void* stream) const noexcept;

private:
    QsaPluginConfig mConfig;
    QsaLaunchShape mLaunch{};
};

}  // namespace tinyserve
