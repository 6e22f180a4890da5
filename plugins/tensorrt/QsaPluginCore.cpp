// The plugin's TensorRT-free decisions (see QsaPluginCore.h).
#include "QsaPluginCore.h"

#include <initializer_list>

namespace tinyserve {
namespace {

constexpr int32_t kNbTwoLevelInputs = QSA_NUM_REQUIRED_INPUTS + 1;

// The schema input (QSA_IN_*) at position pos among nb inputs.
int32_t inputRole(int32_t pos, int32_t nb) { return pos == subBoundsInput(nb) ? QSA_IN_KEY_SUB_BOUNDS : pos; }

// Two-level selection: the attribute asks for it and the page size is not the sub-page size.
bool twoLevel(QsaAttrs const& a, int32_t pageSize) { return a.sub_page_size > 0 && a.sub_page_size != pageSize; }

// Dims from the five shapes that define them; false if ranks or shared extents disagree.
bool dimsFrom(QsaShape const* s, QsaDims& d) {
    QsaShape const &q = s[QSA_IN_QUERY], &k = s[QSA_IN_KEY], &kc = s[QSA_IN_KEY_CACHE], &km = s[QSA_IN_KEY_MIN],
                   &pt = s[QSA_IN_PAGE_TABLE];
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
bool coldDimsFrom(QsaShape const* s, QsaDims const& d, int32_t format, QsaColdDims& c) {
    int32_t const stored = format == QSA_COLD_FORMAT_INT4 ? d.head_dim / 2 : d.head_dim;
    QsaShape const &k8 = s[QSA_IN_KEY_CACHE_INT8], &v8 = s[QSA_IN_VALUE_CACHE_INT8], &ks = s[QSA_IN_KEY_SCALE],
                   &vs = s[QSA_IN_VALUE_SCALE];
    if (k8.nbDims != 4 || v8.nbDims != 4 || ks.nbDims != 4 || vs.nbDims != 4) return false;
    for (QsaShape const* x : {&k8, &v8, &ks, &vs})
        if (x->d[0] != k8.d[0] || x->d[1] != d.num_kv_heads) return false;
    for (QsaShape const* x : {&k8, &v8})
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
bool emptyInput(QsaShape const& x) {
    if (x.nbDims <= 0) return true;
    for (int32_t i = 0; i < x.nbDims; ++i)
        if (x.d[i] == 0) return true;
    return false;
}

// key_sub_bounds [Ptot, Hkv, r, D] uint8: r into d.sub_pages (0 without the input).
// qsa_check re-checks r == ps / sub_page_size; Ptot, Hkv and D are only visible here.
bool subBoundsFrom(QsaShape const* s, int32_t nbInputs, QsaDims& d) {
    d.sub_pages = 0;
    int32_t const pos = subBoundsInput(nbInputs);
    if (pos < 0) return true;
    QsaShape const& sb = s[pos];
    if (sb.nbDims != 4 || sb.d[0] != d.num_meta_pages || sb.d[1] != d.num_kv_heads || sb.d[3] != d.head_dim ||
        sb.d[2] < 1)
        return false;
    d.sub_pages = int32_t(sb.d[2]);
    return true;
}

}  // namespace

bool nbInputsOk(int32_t nb) noexcept {
    return nb == QSA_NUM_REQUIRED_INPUTS || nb == kNbTwoLevelInputs || nb == QSA_NUM_TIERED_INPUTS ||
           nb == QSA_NUM_INPUTS;
}

int32_t subBoundsInput(int32_t nb) noexcept {
    return nb == QSA_NUM_INPUTS ? QSA_IN_KEY_SUB_BOUNDS : (nb == kNbTwoLevelInputs ? QSA_NUM_REQUIRED_INPUTS : -1);
}

bool QsaPluginCore::supportsFormat(int32_t pos, QsaTensorFormat const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) const noexcept {
    if (inOut == nullptr || pos < 0 || pos >= nbInputs + nbOutputs || !inOut[pos].linear) return false;
    QsaElemType const t = inOut[pos].type;
    if (pos == QSA_IN_QUERY) return t == QsaElemType::kFloat32 || t == QsaElemType::kFloat16;
    QsaElemType const ft = inOut[QSA_IN_QUERY].type;
    if (pos >= nbInputs) return pos - nbInputs == QSA_OUT_OUTPUT ? t == ft : t == QsaElemType::kInt32;
    bool const int4 = mConfig.coldFormat == QSA_COLD_FORMAT_INT4;
    switch (inputRole(pos, nbInputs)) {
        case QSA_IN_KEY:
        case QSA_IN_VALUE:
        case QSA_IN_KEY_CACHE:
        case QSA_IN_VALUE_CACHE:
        case QSA_IN_KEY_MIN:
        case QSA_IN_KEY_MAX: return t == ft;
        case QSA_IN_PAGE_TABLE:
        case QSA_IN_PAST_LENS:
        case QSA_IN_TOKEN_BUDGET: return t == QsaElemType::kInt32;
        // Cold tier, whatever the float type of query (schema.COLD_DTYPES):
        // int8 pools + float32 scales, or int4 = packed uint8 pools + float16 scales.
        case QSA_IN_KEY_CACHE_INT8:
        case QSA_IN_VALUE_CACHE_INT8: return t == (int4 ? QsaElemType::kUInt8 : QsaElemType::kInt8);
        case QSA_IN_KEY_SCALE:
        case QSA_IN_VALUE_SCALE: return t == (int4 ? QsaElemType::kFloat16 : QsaElemType::kFloat32);
        case QSA_IN_KEY_SUB_BOUNDS: return t == QsaElemType::kUInt8;  // 4-bit min/max codes
        default: return false;
    }
}

bool QsaPluginCore::configure(int32_t nbInputs, int32_t nbOutputs, std::string& error) const {
    if (!nbInputsOk(nbInputs) || nbOutputs != QSA_NUM_OUTPUTS) {
        error = "expects 10, 11, 14 or 15 inputs and 2 outputs";
        return false;
    }
    if (mConfig.attrs.sub_page_size > 0 && subBoundsInput(nbInputs) < 0) {
        error = "sub_page_size > 0 (two-level selection) needs the key_sub_bounds input";
        return false;
    }
    return true;
}

size_t QsaPluginCore::workspaceSize(QsaShape const* maxShapes, int32_t nbInputs) const noexcept {
    if (maxShapes == nullptr || nbInputs < QSA_NUM_REQUIRED_INPUTS) return 0;
    QsaDims d{};
    if (!dimsFrom(maxShapes, d) || !subBoundsFrom(maxShapes, nbInputs, d)) return 0;
    return qsa_workspace_size(&d);
}

bool QsaPluginCore::shapeChange(QsaShape const* shapes, QsaElemType queryType, int32_t nbInputs, int32_t nbOutputs,
                                std::string& error) {
    if (shapes == nullptr || !nbInputsOk(nbInputs) || nbOutputs != QSA_NUM_OUTPUTS) {
        error = "expects 10, 11, 14 or 15 inputs and 2 outputs";
        return false;
    }
    QsaLaunchShape s{};
    if (!dimsFrom(shapes, s.dims)) {
        error = "inconsistent input shapes";
        return false;
    }
    // 14 or 15 inputs hold the cold tier, unless (15) its four inputs were skipped
    s.hasCold = nbInputs >= QSA_NUM_TIERED_INPUTS &&
                !(nbInputs == QSA_NUM_INPUTS && emptyInput(shapes[QSA_IN_KEY_CACHE_INT8]) &&
                  emptyInput(shapes[QSA_IN_VALUE_CACHE_INT8]) && emptyInput(shapes[QSA_IN_KEY_SCALE]) &&
                  emptyInput(shapes[QSA_IN_VALUE_SCALE]));
    if (s.hasCold && !coldDimsFrom(shapes, s.dims, mConfig.coldFormat, s.cold)) {
        error = "cold-tier shapes: want pools [Pcold, Hkv, ps, D] (int4: D/2) and scales [Pcold, Hkv, 1|ps, C] "
                "(int4 V: 2C)";
        return false;
    }
    if (!subBoundsFrom(shapes, nbInputs, s.dims)) {
        error = "key_sub_bounds shape: want uint8 [Ptot, Hkv, r, D] (Ptot and D as key_min)";
        return false;
    }
    QsaAttrs const& a = mConfig.attrs;
    if (twoLevel(a, s.dims.page_size) &&
        (s.dims.page_size % a.sub_page_size != 0 || s.dims.sub_pages != s.dims.page_size / a.sub_page_size)) {
        error = "sub_page_size must divide the page size, and key_sub_bounds hold page_size / sub_page_size rows";
        return false;
    }
    s.nbInputs = nbInputs;
    s.dtype = queryType == QsaElemType::kFloat16 ? QSA_DTYPE_FLOAT16 : QSA_DTYPE_FLOAT32;
    mLaunch = s;
    return true;
}

int32_t QsaPluginCore::enqueue(void const* const* inputs, void* const* outputs, void* workspace,
                               void* stream) const noexcept {
    if (inputs == nullptr || outputs == nullptr) return QSA_ERR_INVALID_ARGUMENT;
    QsaForwardParams p{};
    p.dims = mLaunch.dims;
    p.attrs = mConfig.attrs;
    p.dtype = mLaunch.dtype;
    p.num_splits = 0;
    p.selected_pages_elem_size = 4;  // int32 (outputTypes)
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
    if (mLaunch.hasCold) {  // cold tier (cold.format): page ids >= P read these
        p.cold = mLaunch.cold;
        p.key_cache_int8 = inputs[QSA_IN_KEY_CACHE_INT8];
        p.value_cache_int8 = inputs[QSA_IN_VALUE_CACHE_INT8];
        p.key_scale = inputs[QSA_IN_KEY_SCALE];
        p.value_scale = inputs[QSA_IN_VALUE_SCALE];
    }
    int32_t const subBounds = subBoundsInput(mLaunch.nbInputs);
    if (subBounds >= 0) p.key_sub_bounds = inputs[subBounds];  // two-level decode; INT4 cold keys (format 3)
    p.output = outputs[QSA_OUT_OUTPUT];
    p.selected_pages = outputs[QSA_OUT_SELECTED_PAGES];
    return qsa_forward(&p, workspace, qsa_workspace_size(&mLaunch.dims), stream);
}

}  // namespace tinyserve
