// TensorRT IPluginV3 glue for tinyserve::QueryAwareSparseAttention: TensorRT's types in and out,
// every decision in QsaPluginCore / QsaPluginFields (TensorRT-free). See the header.
// Structure follows NVIDIA/TensorRT plugin/roiAlignPlugin (ROIAlignV3) and the
// plugin-library entry points of plugin/vc/vfcCommon.cpp (getCreators,
// setLoggerFinder), which IPluginRegistry::loadLibrary and
// `trtexec --dynamicPlugins` look up.
#include "QueryAwareSparseAttentionPlugin.h"

#include <exception>
#include <mutex>
#include <string>

using namespace nvinfer1;

namespace tinyserve {
namespace {

// ---- logging through the logger TensorRT hands the library ----
std::mutex gLoggerMutex;
ILoggerFinder* gLoggerFinder{nullptr};

void logError(std::string const& msg) noexcept {
    try {
        std::lock_guard<std::mutex> lock(gLoggerMutex);
        ILogger* logger = gLoggerFinder ? gLoggerFinder->findLogger() : nullptr;
        if (logger) logger->log(ILogger::Severity::kERROR, (std::string(QSA_OP_TYPE ": ") + msg).c_str());
    } catch (...) {
    }
}

// ---- TensorRT's types -> ours (the core's); anything the plugin does not read -> kOther ----
QsaElemType elemType(DataType t) {
    switch (t) {
        case DataType::kFLOAT: return QsaElemType::kFloat32;
        case DataType::kHALF: return QsaElemType::kFloat16;
        case DataType::kINT32: return QsaElemType::kInt32;
        case DataType::kINT8: return QsaElemType::kInt8;
        case DataType::kUINT8: return QsaElemType::kUInt8;
        default: return QsaElemType::kOther;
    }
}

QsaShape shapeOf(Dims const& d) {
    QsaShape s{};
    s.nbDims = d.nbDims < 0 ? d.nbDims : (d.nbDims > QsaShape::kMaxDims ? QsaShape::kMaxDims : d.nbDims);
    for (int32_t i = 0; i < s.nbDims; ++i) s.d[i] = d.d[i];
    return s;
}

QsaFieldType fieldTypeOf(PluginFieldType t) {
    switch (t) {
        case PluginFieldType::kINT8: return QsaFieldType::kInt8;
        case PluginFieldType::kINT16: return QsaFieldType::kInt16;
        case PluginFieldType::kINT32: return QsaFieldType::kInt32;
        case PluginFieldType::kINT64: return QsaFieldType::kInt64;
        case PluginFieldType::kFLOAT32: return QsaFieldType::kFloat32;
        case PluginFieldType::kFLOAT64: return QsaFieldType::kFloat64;
        case PluginFieldType::kCHAR: return QsaFieldType::kChar;
        default: return QsaFieldType::kOther;
    }
}

// Ours -> TensorRT's, for the fields the plugin announces and serializes (int32, float32, char).
PluginFieldType pluginFieldType(QsaFieldType t) {
    return t == QsaFieldType::kInt32 ? PluginFieldType::kINT32
                                     : (t == QsaFieldType::kFloat32 ? PluginFieldType::kFLOAT32 : PluginFieldType::kCHAR);
}

}  // namespace

// ============================ plugin ============================

QueryAwareSparseAttentionPlugin::QueryAwareSparseAttentionPlugin(QsaPluginConfig const& config, std::string ns)
    : mCore(config), mNamespace(std::move(ns)) {}

// Copies the configuration and the launch shape, not the serialization storage.
QueryAwareSparseAttentionPlugin::QueryAwareSparseAttentionPlugin(QueryAwareSparseAttentionPlugin const& other)
    : IPluginV3(), IPluginV3OneCore(), IPluginV3OneBuild(), IPluginV3OneRuntime(), mCore(other.mCore),
      mNamespace(other.mNamespace) {}

IPluginCapability* QueryAwareSparseAttentionPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
    switch (type) {
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    }
    return nullptr;
}

IPluginV3* QueryAwareSparseAttentionPlugin::clone() noexcept {
    try {
        return new QueryAwareSparseAttentionPlugin(*this);
    } catch (std::exception const& e) {
        logError(e.what());
    }
    return nullptr;
}

char const* QueryAwareSparseAttentionPlugin::getPluginName() const noexcept { return QSA_OP_TYPE; }
char const* QueryAwareSparseAttentionPlugin::getPluginVersion() const noexcept { return QSA_PLUGIN_VERSION; }
char const* QueryAwareSparseAttentionPlugin::getPluginNamespace() const noexcept { return mNamespace.c_str(); }

// Both outputs always exist (outputTypes: selected_pages is int32 0/1).
int32_t QueryAwareSparseAttentionPlugin::getNbOutputs() const noexcept { return QSA_NUM_OUTPUTS; }

int32_t QueryAwareSparseAttentionPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                                         DynamicPluginTensorDesc const* out,
                                                         int32_t nbOutputs) noexcept {
    try {
        std::string error = "no tensor descriptors";
        if (in != nullptr && out != nullptr && mCore.configure(nbInputs, nbOutputs, error)) return 0;
        logError(error);
    } catch (std::exception const& e) {
        logError(e.what());
    }
    return -1;
}

bool QueryAwareSparseAttentionPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut,
                                                                int32_t nbInputs, int32_t nbOutputs) noexcept {
    if (inOut == nullptr || pos < 0 || pos >= nbInputs + nbOutputs) return false;
    // The rule reads position pos and query (position 0); the other positions are not looked at.
    QsaTensorFormat formats[QSA_NUM_INPUTS + QSA_NUM_OUTPUTS]{};
    if (nbInputs + nbOutputs > QSA_NUM_INPUTS + QSA_NUM_OUTPUTS) return false;
    for (int32_t i = 0; i < nbInputs + nbOutputs; ++i)
        formats[i] = {elemType(inOut[i].desc.type), inOut[i].desc.format == TensorFormat::kLINEAR};
    return mCore.supportsFormat(pos, formats, nbInputs, nbOutputs);
}

int32_t QueryAwareSparseAttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs,
                                                            DataType const* inputTypes,
                                                            int32_t nbInputs) const noexcept {
    return tinyserve::outputTypes(inputTypes, nbInputs, outputTypes, nbOutputs, DataType::kINT32) ? 0 : -1;
}

int32_t QueryAwareSparseAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
                                                         DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/,
                                                         DimsExprs* outputs, int32_t nbOutputs,
                                                         IExprBuilder& /*exprBuilder*/) noexcept {
    return outputShapes(inputs, nbInputs, outputs, nbOutputs) ? 0 : -1;
}

size_t QueryAwareSparseAttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                                                         DynamicPluginTensorDesc const* /*outputs*/,
                                                         int32_t /*nbOutputs*/) const noexcept {
    if (inputs == nullptr || nbInputs < 0 || nbInputs > QSA_NUM_INPUTS) return 0;
    QsaShape maxShapes[QSA_NUM_INPUTS]{};  // sized once from the profile's max dims
    for (int32_t i = 0; i < nbInputs; ++i) maxShapes[i] = shapeOf(inputs[i].max);
    return mCore.workspaceSize(maxShapes, nbInputs);
}

int32_t QueryAwareSparseAttentionPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs,
                                                       PluginTensorDesc const* out, int32_t nbOutputs) noexcept {
    try {
        std::string error = "expects 10, 11, 14 or 15 inputs and 2 outputs";
        if (in != nullptr && out != nullptr && nbInputs >= 0 && nbInputs <= QSA_NUM_INPUTS) {
            QsaShape shapes[QSA_NUM_INPUTS]{};
            for (int32_t i = 0; i < nbInputs; ++i) shapes[i] = shapeOf(in[i].dims);
            if (mCore.shapeChange(shapes, elemType(in[QSA_IN_QUERY].type), nbInputs, nbOutputs, error)) return 0;
        }
        logError(error);
    } catch (std::exception const& e) {
        logError(e.what());
    }
    return -1;
}

int32_t QueryAwareSparseAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                                 void const* const* inputs, void* const* outputs, void* workspace,
                                                 cudaStream_t stream) noexcept {
    if (inputDesc == nullptr || outputDesc == nullptr) return -1;
    int32_t const status = mCore.enqueue(inputs, outputs, workspace, stream);
    if (status != QSA_OK) logError(qsa_status_string(status));
    return status;
}

IPluginV3* QueryAwareSparseAttentionPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept {
    return clone();
}

PluginFieldCollection const* QueryAwareSparseAttentionPlugin::getFieldsToSerialize() noexcept {
    try {
        mFields.clear();
        for (QsaField const& f : mSerialized.fill(mCore.config()))
            mFields.emplace_back(f.name, f.data, pluginFieldType(f.type), f.length);
        mFieldCollection.nbFields = int32_t(mFields.size());
        mFieldCollection.fields = mFields.data();
        return &mFieldCollection;
    } catch (std::exception const& e) {
        logError(e.what());
    }
    return nullptr;
}

// ============================ creator ============================

QueryAwareSparseAttentionPluginCreator::QueryAwareSparseAttentionPluginCreator() {
    // One field per schema attribute, in schema order (the generated X-macro).
#define TINYSERVE_FIELD(IDENT, NAME, TYPE) \
    mFieldNames.emplace_back(NAME, nullptr, pluginFieldType(schemaFieldType(TYPE)), 1);
    QSA_FOR_EACH_ATTRIBUTE(TINYSERVE_FIELD)
#undef TINYSERVE_FIELD
    mFieldCollection.nbFields = int32_t(mFieldNames.size());
    mFieldCollection.fields = mFieldNames.data();
}

char const* QueryAwareSparseAttentionPluginCreator::getPluginName() const noexcept { return QSA_OP_TYPE; }
char const* QueryAwareSparseAttentionPluginCreator::getPluginVersion() const noexcept { return QSA_PLUGIN_VERSION; }
char const* QueryAwareSparseAttentionPluginCreator::getPluginNamespace() const noexcept {
    return QSA_PLUGIN_NAMESPACE;
}
PluginFieldCollection const* QueryAwareSparseAttentionPluginCreator::getFieldNames() noexcept {
    return &mFieldCollection;
}

IPluginV3* QueryAwareSparseAttentionPluginCreator::createPlugin(char const* /*name*/, PluginFieldCollection const* fc,
                                                                TensorRTPhase /*phase*/) noexcept {
    try {
        std::vector<QsaField> fields;
        for (int32_t i = 0; fc != nullptr && fc->fields != nullptr && i < fc->nbFields; ++i) {
            PluginField const& f = fc->fields[i];
            fields.push_back({f.name, f.data, fieldTypeOf(f.type), f.length});
        }
        QsaPluginConfig config{};
        std::string error;
        if (!parseFields(fields.data(), int32_t(fields.size()), config, error)) {
            logError(error);
            return nullptr;
        }
        return new QueryAwareSparseAttentionPlugin(config, QSA_PLUGIN_NAMESPACE);
    } catch (std::exception const& e) {
        logError(e.what());
    }
    return nullptr;
}

}  // namespace tinyserve

// ============================ library entry points ============================
// TensorRT >= 10 loads a plugin library (IPluginRegistry::loadLibrary, Python
// `trt.get_plugin_registry().load_library(path)`, trtexec --dynamicPlugins)
// through these two symbols.

extern "C" TENSORRTAPI void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
    std::lock_guard<std::mutex> lock(tinyserve::gLoggerMutex);
    if (tinyserve::gLoggerFinder == nullptr) tinyserve::gLoggerFinder = finder;
}

extern "C" TENSORRTAPI nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    static tinyserve::QueryAwareSparseAttentionPluginCreator sCreator;
    static nvinfer1::IPluginCreatorInterface* const sCreators[] = {&sCreator};
    nbCreators = 1;
    return sCreators;
}
