// Plugin fields <-> QsaAttrs and the cold format: what the creator reads and the plugin serializes.
// Names, types, ranges and defaults all come from the generated schema header.
#include "QueryAwareSparseAttentionPlugin.h"

#include <exception>
#include <string>

using namespace nvinfer1;

namespace tinyserve {
namespace {

char const* const kPolicyNames[] = QSA_POLICY_NAMES;
char const* const kGroupReduceNames[] = QSA_GROUP_REDUCE_NAMES;
char const* const kColdFormatNames[] = QSA_COLD_FORMAT_NAMES;

QsaAttrs defaultAttrs() {
    QsaAttrs a{};
    a.scale = QSA_ATTR_SCALE_DEFAULT;
    a.policy = QSA_ATTR_POLICY_DEFAULT_INDEX;
    a.sink_pages = QSA_ATTR_SINK_PAGES_DEFAULT;
    a.recent_pages = QSA_ATTR_RECENT_PAGES_DEFAULT;
    a.group_reduce = QSA_ATTR_GROUP_REDUCE_DEFAULT_INDEX;
    a.sub_page_size = QSA_ATTR_SUB_PAGE_SIZE_DEFAULT;
    a.candidate_share = QSA_ATTR_CANDIDATE_SHARE_DEFAULT;
    return a;
}

// The ONNX parser may pass an int attribute as INT32 or INT64 and a float as
// FLOAT32 or FLOAT64, depending on its version; accept any numeric width.
bool readNumber(PluginField const& f, double& out) {
    if (f.data == nullptr || f.length < 1) return false;
    switch (f.type) {
        case PluginFieldType::kFLOAT64: out = *static_cast<double const*>(f.data); return true;
        case PluginFieldType::kFLOAT32: out = *static_cast<float const*>(f.data); return true;
        case PluginFieldType::kINT64: out = double(*static_cast<int64_t const*>(f.data)); return true;
        case PluginFieldType::kINT32: out = *static_cast<int32_t const*>(f.data); return true;
        case PluginFieldType::kINT16: out = *static_cast<int16_t const*>(f.data); return true;
        case PluginFieldType::kINT8: out = *static_cast<int8_t const*>(f.data); return true;
        default: return false;
    }
}

// Strings arrive as kCHAR of `length` bytes, with or without a trailing NUL.
bool readString(PluginField const& f, std::string& out) {
    if (f.type != PluginFieldType::kCHAR || f.data == nullptr) return false;
    out.assign(static_cast<char const*>(f.data), size_t(f.length > 0 ? f.length : 0));
    out = out.substr(0, out.find('\0'));
    return true;
}

bool readEnum(PluginField const& f, char const* const* names, int count, int32_t& out) {
    std::string s;
    if (!readString(f, s)) return false;
    for (int i = 0; i < count; ++i)
        if (s == names[i]) {
            out = i;
            return true;
        }
    return false;
}

}  // namespace

char const* policyName(int32_t policy) noexcept { return kPolicyNames[policy]; }
char const* groupReduceName(int32_t groupReduce) noexcept { return kGroupReduceNames[groupReduce]; }
char const* coldFormatName(int32_t coldFormat) noexcept { return kColdFormatNames[coldFormat]; }

PluginFieldType fieldType(int schemaType) noexcept {
    return schemaType == 0 ? PluginFieldType::kINT32
                           : (schemaType == 1 ? PluginFieldType::kFLOAT32 : PluginFieldType::kCHAR);
}


bool parseFields(PluginFieldCollection const* fc, QsaAttrs& attrs, int32_t& coldFormat, std::string& error) noexcept {
    try {
        attrs = defaultAttrs();
        coldFormat = QSA_ATTR_COLD_FORMAT_DEFAULT_INDEX;
        if (fc == nullptr) return true;
        for (int32_t i = 0; i < fc->nbFields; ++i) {
            PluginField const& f = fc->fields[i];
            std::string const name = f.name ? f.name : "";
            double v = 0;
            bool ok = true;
            if (name == QSA_ATTR_SCALE_NAME) {
                ok = readNumber(f, v) && v >= QSA_ATTR_SCALE_MIN;
                attrs.scale = float(v);
            } else if (name == QSA_ATTR_SINK_PAGES_NAME) {
                ok = readNumber(f, v) && v >= QSA_ATTR_SINK_PAGES_MIN && v <= QSA_ATTR_SINK_PAGES_MAX &&
                     v == double(int32_t(v));
                attrs.sink_pages = int32_t(v);
            } else if (name == QSA_ATTR_RECENT_PAGES_NAME) {
                ok = readNumber(f, v) && v >= QSA_ATTR_RECENT_PAGES_MIN && v <= QSA_ATTR_RECENT_PAGES_MAX &&
                     v == double(int32_t(v));
                attrs.recent_pages = int32_t(v);
            } else if (name == QSA_ATTR_POLICY_NAME) {
                ok = readEnum(f, kPolicyNames, QSA_NUM_POLICIES, attrs.policy);
            } else if (name == QSA_ATTR_GROUP_REDUCE_NAME) {
                ok = readEnum(f, kGroupReduceNames, QSA_NUM_GROUP_REDUCTIONS, attrs.group_reduce);
            } else if (name == QSA_ATTR_SUB_PAGE_SIZE_NAME) {
                ok = readNumber(f, v) && v >= QSA_ATTR_SUB_PAGE_SIZE_MIN && v <= QSA_ATTR_SUB_PAGE_SIZE_MAX &&
                     v == double(int32_t(v));
                attrs.sub_page_size = int32_t(v);  // whether it divides ps is checked at the shapes
            } else if (name == QSA_ATTR_CANDIDATE_SHARE_NAME) {
                ok = readNumber(f, v) && v >= QSA_ATTR_CANDIDATE_SHARE_MIN && v <= QSA_ATTR_CANDIDATE_SHARE_MAX;
                attrs.candidate_share = float(v);
            } else if (name == QSA_ATTR_COLD_FORMAT_NAME) {
                ok = readEnum(f, kColdFormatNames, QSA_NUM_COLD_FORMATS, coldFormat);
            } else if (name == "plugin_namespace" || name == "plugin_version") {
                continue;  // the ONNX parser's routing attributes, not ours
            } else {
                error = "unknown field '" + name + "'";
                return false;
            }
            if (!ok) {
                error = "bad value or type for field '" + name + "'";
                return false;
            }
        }
        // schema.OpAttributes: two-level re-ranks sub-pages by the query_aware bound only
        if (attrs.sub_page_size > 0 && attrs.policy != QSA_POLICY_QUERY_AWARE) {
            error = "sub_page_size > 0 (two-level selection) needs policy 'query_aware'";
            return false;
        }
        return true;
    } catch (std::exception const& e) {
        error = e.what();
        return false;
    }
}

}  // namespace tinyserve
