// TensorRT IPluginV3 glue for tinyserve::QueryAwareSparseAttention. See the header.
// Structure follows NVIDIA/TensorRT plugin/roiAlignPlugin (ROIAlignV3) and the
// plugin-library entry points of plugin/vc/vfcCommon.cpp (getCreators,
// setLoggerFinder), which IPluginRegistry::loadLibrary and
// `trtexec --dynamicPlugins` look up.
#include "QueryAwareSparseAttentionPlugin.h"

#include <cstring>
#include <exception>
#include <initializer_list>
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

// The node's input counts: required (10), + key_sub_bounds (11: a parser that drops
// skipped inputs), + the cold tier (14), + both (15: the schema's full list, where a
// two-level node without cold pages has its four cold inputs skipped).
constexpr int32_t kNbTwoLevelInputs = QSA_NUM_REQUIRED_INPUTS + 1;
bool nbInputsOk(int32_t nb) {
    return nb == QSA_NUM_REQUIRED_INPUTS || nb == kNbTwoLevelInputs || nb == QSA_NUM_TIERED_INPUTS ||
           nb == QSA_NUM_INPUTS;
}

// Position of key_sub_bounds among nb inputs, or -1 when the node has none.
int32_t subBoundsInput(int32_t nb) {
    return nb == QSA_NUM_INPUTS ? QSA_IN_KEY_SUB_BOUNDS : (nb == kNbTwoLevelInputs ? QSA_NUM_REQUIRED_INPUTS : -1);
}

// The schema input (QSA_IN_*) at position pos among nb inputs.
int32_t inputRole(int32_t pos, int32_t nb) { return pos == subBoundsInput(nb) ? QSA_IN_KEY_SUB_BOUNDS : pos; }

// Two-level selection: the attribute asks for it and the page size is not the sub-page size.
bool twoLevel(QsaAttrs const& a, int32_t pageSize) { return a.sub_page_size > 0 && a.sub_page_size != pageSize; }

}  // namespace

// ============================ plugin ============================

QueryAwareSparseAttentionPlugin::QueryAwareSparseAttentionPlugin(QsaAttrs const& attrs, int32_t coldFormat,
                                                                 std::string ns)
    : mAttrs(attrs), mColdFormat(coldFormat), mNamespace(std::move(ns)) {}

QueryAwareSparseAttentionPlugin::QueryAwareSparseAttentionPlugin(QueryAwareSparseAttentionPlugin const& other)
    : IPluginV3(), IPluginV3OneCore(), IPluginV3OneBuild(), IPluginV3OneRuntime(),
      mAttrs(other.mAttrs), mColdFormat(other.mColdFormat), mNamespace(other.mNamespace), mDims(other.mDims), mCold(other.mCold),
      mDtype(other.mDtype), mNbInputs(other.mNbInputs), mHasCold(other.mHasCold) {}

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

// Both outputs always exist; selected_pages is int32 0/1 because plugin
// outputs cannot be kBOOL (NvInferRuntime.h, getOutputDataTypes).
int32_t QueryAwareSparseAttentionPlugin::getNbOutputs() const noexcept { return QSA_NUM_OUTPUTS; }

int32_t QueryAwareSparseAttentionPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                                         DynamicPluginTensorDesc const* out,
                                                         int32_t nbOutputs) noexcept {
    if (in == nullptr || out == nullptr || !nbInputsOk(nbInputs) || nbOutputs != QSA_NUM_OUTPUTS) {
        logError("expects 10, 11, 14 or 15 inputs and 2 outputs");
        return -1;
    }
    if (mAttrs.sub_page_size > 0 && subBoundsInput(nbInputs) < 0) {
        logError("sub_page_size > 0 (two-level selection) needs the key_sub_bounds input");
        return -1;
    }
    return 0;
}

bool QueryAwareSparseAttentionPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut,
                                                                int32_t nbInputs, int32_t nbOutputs) noexcept {
    if (inOut == nullptr || pos < 0 || pos >= nbInputs + nbOutputs) return false;
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR) return false;
    DataType const t = desc.type;
    if (pos == QSA_IN_QUERY) return t == DataType::kFLOAT || t == DataType::kHALF;
    DataType const ft = inOut[QSA_IN_QUERY].desc.type;
    if (pos >= nbInputs) return pos - nbInputs == QSA_OUT_OUTPUT ? t == ft : t == DataType::kINT32;
    switch (inputRole(pos, nbInputs)) {
        case QSA_IN_KEY:
        case QSA_IN_VALUE:
        case QSA_IN_KEY_CACHE:
        case QSA_IN_VALUE_CACHE:
        case QSA_IN_KEY_MIN:
        case QSA_IN_KEY_MAX: return t == ft;
        case QSA_IN_PAGE_TABLE:
        case QSA_IN_PAST_LENS:
        case QSA_IN_TOKEN_BUDGET: return t == DataType::kINT32;
        // Cold tier (14 inputs), whatever the float type of query (schema.COLD_DTYPES):
        // int8 pools + float32 scales, or int4 = packed uint8 pools + float16 scales.
        case QSA_IN_KEY_CACHE_INT8:
        case QSA_IN_VALUE_CACHE_INT8:
            return t == (mColdFormat == QSA_COLD_FORMAT_INT4 ? DataType::kUINT8 : DataType::kINT8);
        case QSA_IN_KEY_SCALE:
        case QSA_IN_VALUE_SCALE:
            return t == (mColdFormat == QSA_COLD_FORMAT_INT4 ? DataType::kHALF : DataType::kFLOAT);
        case QSA_IN_KEY_SUB_BOUNDS: return t == DataType::kUINT8;  // 4-bit min/max codes
        default: return false;
    }
}

int32_t QueryAwareSparseAttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs,
                                                            DataType const* inputTypes,
                                                            int32_t nbInputs) const noexcept {
    if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != QSA_NUM_OUTPUTS || nbInputs < 1) return -1;
    outputTypes[QSA_OUT_OUTPUT] = inputTypes[QSA_IN_QUERY];
    outputTypes[QSA_OUT_SELECTED_PAGES] = DataType::kINT32;
    return 0;
}

int32_t QueryAwareSparseAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
                                                         DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/,
                                                         DimsExprs* outputs, int32_t nbOutputs,
                                                         IExprBuilder& /*exprBuilder*/) noexcept {
    if (inputs == nullptr || outputs == nullptr || nbInputs < QSA_NUM_REQUIRED_INPUTS || nbOutputs != QSA_NUM_OUTPUTS)
        return -1;
    if (inputs[QSA_IN_QUERY].nbDims != 4 || inputs[QSA_IN_KEY].nbDims != 4 || inputs[QSA_IN_PAGE_TABLE].nbDims != 2)
        return -1;
    outputs[QSA_OUT_OUTPUT] = inputs[QSA_IN_QUERY];  // [B, H, S, D]
    DimsExprs& sel = outputs[QSA_OUT_SELECTED_PAGES];  // [B, Hkv, NP]
    sel.nbDims = 3;
    sel.d[0] = inputs[QSA_IN_QUERY].d[0];
    sel.d[1] = inputs[QSA_IN_KEY].d[1];
    sel.d[2] = inputs[QSA_IN_PAGE_TABLE].d[1];
    return 0;
}

namespace {
// Dims from the eight shapes that define them; false if ranks are wrong.
template <typename GetDims>
bool dimsFrom(GetDims dimsOf, QsaDims& d) {
    Dims const q = dimsOf(QSA_IN_QUERY), k = dimsOf(QSA_IN_KEY), kc = dimsOf(QSA_IN_KEY_CACHE),
               km = dimsOf(QSA_IN_KEY_MIN), pt = dimsOf(QSA_IN_PAGE_TABLE);
    if (q.nbDims != 4 || k.nbDims != 4 || kc.nbDims != 4 || km.nbDims != 3 || pt.nbDims != 2) return false;
    d.batch = int32_t(q.d[0]);
    d.num_heads = int32_t(q.d[1]);
    d.new_tokens = int32_t(q.d[2]);
    d.head_dim = int32_t(q.d[3]);
    d.num_kv_heads = int32_t(k.d[1]);
    d.num_pages = int32_t(kc.d[0]);
    d.page_size = int32_t(kc.d[2]);
    d.table_width = int32_t(pt.d[1]);
    d.num_meta_pages = int32_t(km.d[0]);
    return kc.d[1] == k.d[1] && kc.d[3] == q.d[3] && km.d[2] == q.d[3] && pt.d[0] == q.d[0];
}

// Cold tier from the four optional inputs: pools [Pcold, Hkv, ps, D] like the hot pool
// (int4: D/2 packed bytes), scales [Pcold, Hkv, 1|ps, C] (int4 V: 2C, scales then mins - format 3,
// passed on as value_scale_channels = 2C). qsa_check re-checks the
// extents, the format and Ptot >= P + Pcold; the pool shapes are only visible here.
template <typename GetDims>
bool coldDimsFrom(GetDims dimsOf, QsaDims const& d, int32_t format, QsaColdDims& c) {
    int32_t const stored = format == QSA_COLD_FORMAT_INT4 ? d.head_dim / 2 : d.head_dim;
    Dims const k8 = dimsOf(QSA_IN_KEY_CACHE_INT8), v8 = dimsOf(QSA_IN_VALUE_CACHE_INT8),
               ks = dimsOf(QSA_IN_KEY_SCALE), vs = dimsOf(QSA_IN_VALUE_SCALE);
    if (k8.nbDims != 4 || v8.nbDims != 4 || ks.nbDims != 4 || vs.nbDims != 4) return false;
    for (Dims const* x : {&k8, &v8, &ks, &vs})
        if (x->d[0] != k8.d[0] || x->d[1] != d.num_kv_heads) return false;
    for (Dims const* x : {&k8, &v8})
        if (x->d[2] != d.page_size || x->d[3] != stored) return false;
    c.num_pages = int32_t(k8.d[0]);
    c.key_scale_tokens = int32_t(ks.d[2]);
    c.key_scale_channels = int32_t(ks.d[3]);
    c.value_scale_tokens = int32_t(vs.d[2]);
    c.value_scale_channels = int32_t(vs.d[3]);
    c.format = format;
    return true;
}

// A skipped ONNX input (""), as a parser may hand it to the plugin: no extent.
bool emptyInput(Dims const& x) {
    if (x.nbDims <= 0) return true;
    for (int32_t i = 0; i < x.nbDims; ++i)
        if (x.d[i] == 0) return true;
    return false;
}

// key_sub_bounds [Ptot, Hkv, r, D] uint8: r into d.sub_pages (0 without the input).
// qsa_check re-checks r == ps / sub_page_size; Ptot, Hkv and D are only visible here.
template <typename GetDims>
bool subBoundsFrom(GetDims dimsOf, int32_t nbInputs, QsaDims& d) {
    d.sub_pages = 0;
    int32_t const pos = subBoundsInput(nbInputs);
    if (pos < 0) return true;
    Dims const sb = dimsOf(pos);
    if (sb.nbDims != 4 || sb.d[0] != d.num_meta_pages || sb.d[1] != d.num_kv_heads || sb.d[3] != d.head_dim ||
        sb.d[2] < 1)
        return false;
    d.sub_pages = int32_t(sb.d[2]);
    return true;
}
}  // namespace

size_t QueryAwareSparseAttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                                                         DynamicPluginTensorDesc const* /*outputs*/,
                                                         int32_t /*nbOutputs*/) const noexcept {
    if (inputs == nullptr || nbInputs < QSA_NUM_REQUIRED_INPUTS) return 0;
    QsaDims d{};
    // Sized once from the profile's max dims; enqueue uses a prefix of it.
    auto maxDims = [&](int i) { return inputs[i].max; };
    if (!dimsFrom(maxDims, d) || !subBoundsFrom(maxDims, nbInputs, d)) return 0;
    return qsa_workspace_size(&d);
}

int32_t QueryAwareSparseAttentionPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs,
                                                       PluginTensorDesc const* out, int32_t nbOutputs) noexcept {
    if (in == nullptr || out == nullptr || !nbInputsOk(nbInputs) || nbOutputs != QSA_NUM_OUTPUTS) return -1;
    auto dimsOf = [&](int i) { return in[i].dims; };
    if (!dimsFrom(dimsOf, mDims)) {
        logError("inconsistent input shapes");
        return -1;
    }
    mCold = QsaColdDims{};
    // 14 or 15 inputs hold the cold tier, unless (15) its four inputs were skipped
    mHasCold = nbInputs >= QSA_NUM_TIERED_INPUTS &&
               !(nbInputs == QSA_NUM_INPUTS && emptyInput(in[QSA_IN_KEY_CACHE_INT8].dims) &&
                 emptyInput(in[QSA_IN_VALUE_CACHE_INT8].dims) && emptyInput(in[QSA_IN_KEY_SCALE].dims) &&
                 emptyInput(in[QSA_IN_VALUE_SCALE].dims));
    if (mHasCold && !coldDimsFrom(dimsOf, mDims, mColdFormat, mCold)) {
        logError("cold-tier shapes: want pools [Pcold, Hkv, ps, D] (int4: D/2) and scales [Pcold, Hkv, 1|ps, C] (int4 V: 2C)");
        return -1;
    }
    if (!subBoundsFrom(dimsOf, nbInputs, mDims)) {
        logError("key_sub_bounds shape: want uint8 [Ptot, Hkv, r, D] (Ptot and D as key_min)");
        return -1;
    }
    if (twoLevel(mAttrs, mDims.page_size) &&
        (mDims.page_size % mAttrs.sub_page_size != 0 || mDims.sub_pages != mDims.page_size / mAttrs.sub_page_size)) {
        logError("sub_page_size must divide the page size, and key_sub_bounds hold page_size / sub_page_size rows");
        return -1;
    }
    mNbInputs = nbInputs;
    mDtype = in[QSA_IN_QUERY].type == DataType::kHALF ? QSA_DTYPE_FLOAT16 : QSA_DTYPE_FLOAT32;
    return 0;
}

int32_t QueryAwareSparseAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                                 void const* const* inputs, void* const* outputs, void* workspace,
                                                 cudaStream_t stream) noexcept {
    if (inputDesc == nullptr || outputDesc == nullptr || inputs == nullptr || outputs == nullptr) return -1;
    QsaForwardParams p{};
    p.dims = mDims;
    p.attrs = mAttrs;
    p.dtype = mDtype;
    p.num_splits = 0;
    p.selected_pages_elem_size = 4;
    p.query = inputs[QSA_IN_QUERY];
    p.key = inputs[QSA_IN_KEY];
    p.value = inputs[QSA_IN_VALUE];
    p.key_cache = inputs[QSA_IN_KEY_CACHE];
    p.value_cache = inputs[QSA_IN_VALUE_CACHE];
    p.key_min = inputs[QSA_IN_KEY_MIN];
    p.key_max = inputs[QSA_IN_KEY_MAX];
    p.page_table = static_cast<int32_t const*>(inputs[QSA_IN_PAGE_TABLE]);
    p.past_lens = static_cast<int32_t const*>(inputs[QSA_IN_PAST_LENS]);
    p.token_budget = static_cast<int32_t const*>(inputs[QSA_IN_TOKEN_BUDGET]);
    if (mHasCold) {  // cold tier (mCold.format): page ids >= P read these
        p.cold = mCold;
        p.key_cache_int8 = inputs[QSA_IN_KEY_CACHE_INT8];
        p.value_cache_int8 = inputs[QSA_IN_VALUE_CACHE_INT8];
        p.key_scale = inputs[QSA_IN_KEY_SCALE];
        p.value_scale = inputs[QSA_IN_VALUE_SCALE];
    }
    int32_t const subBounds = subBoundsInput(mNbInputs);
    if (subBounds >= 0) p.key_sub_bounds = inputs[subBounds];  // two-level decode; INT4 cold keys (format 3)
    p.output = outputs[QSA_OUT_OUTPUT];
    p.selected_pages = outputs[QSA_OUT_SELECTED_PAGES];
    int32_t const status = qsa_forward(&p, workspace, qsa_workspace_size(&mDims), stream);
    if (status != QSA_OK) logError(qsa_status_string(status));
    return status;
}

IPluginV3* QueryAwareSparseAttentionPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept {
    return clone();
}

PluginFieldCollection const* QueryAwareSparseAttentionPlugin::getFieldsToSerialize() noexcept {
    mPolicyName = policyName(mAttrs.policy);
    mGroupReduceName = groupReduceName(mAttrs.group_reduce);
    mColdFormatName = coldFormatName(mColdFormat);
    mFields.clear();
    mFields.emplace_back(QSA_ATTR_SCALE_NAME, &mAttrs.scale, PluginFieldType::kFLOAT32, 1);
    mFields.emplace_back(QSA_ATTR_POLICY_NAME, mPolicyName.c_str(), PluginFieldType::kCHAR,
                         int32_t(mPolicyName.size() + 1));
    mFields.emplace_back(QSA_ATTR_SINK_PAGES_NAME, &mAttrs.sink_pages, PluginFieldType::kINT32, 1);
    mFields.emplace_back(QSA_ATTR_RECENT_PAGES_NAME, &mAttrs.recent_pages, PluginFieldType::kINT32, 1);
    mFields.emplace_back(QSA_ATTR_GROUP_REDUCE_NAME, mGroupReduceName.c_str(), PluginFieldType::kCHAR,
                         int32_t(mGroupReduceName.size() + 1));
    mFields.emplace_back(QSA_ATTR_SUB_PAGE_SIZE_NAME, &mAttrs.sub_page_size, PluginFieldType::kINT32, 1);
    mFields.emplace_back(QSA_ATTR_CANDIDATE_SHARE_NAME, &mAttrs.candidate_share, PluginFieldType::kFLOAT32, 1);
    mFields.emplace_back(QSA_ATTR_COLD_FORMAT_NAME, mColdFormatName.c_str(), PluginFieldType::kCHAR,
                         int32_t(mColdFormatName.size() + 1));
    mFieldCollection.nbFields = int32_t(mFields.size());
    mFieldCollection.fields = mFields.data();
    return &mFieldCollection;
}

// ============================ creator ============================

QueryAwareSparseAttentionPluginCreator::QueryAwareSparseAttentionPluginCreator() {
    // One field per schema attribute, in schema order (the generated X-macro).
#define TINYSERVE_FIELD(IDENT, NAME, TYPE) mFieldNames.emplace_back(NAME, nullptr, fieldType(TYPE), 1);
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
        QsaAttrs attrs{};
        int32_t coldFormat = QSA_COLD_FORMAT_INT8;
        std::string error;
        if (!parseFields(fc, attrs, coldFormat, error)) {
            logError(error);
            return nullptr;
        }
        return new QueryAwareSparseAttentionPlugin(attrs, coldFormat, QSA_PLUGIN_NAMESPACE);
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
