// Plugin fields <-> QsaPluginConfig: what the creator reads and the plugin serializes (no TensorRT
// types: see QsaPluginFields.h). Names, types, ranges and defaults all come from the generated schema header.
#include "QsaPluginFields.h"

#include <exception>
#include <string>

namespace tinyserve {
namespace {

char const* const kPolicyNames[] = QSA_POLICY_NAMES;
char const* const kGroupReduceNames[] = QSA_GROUP_REDUCE_NAMES;
char const* const kColdFormatNames[] = QSA_COLD_FORMAT_NAMES;

QsaAttrs defaultAttrs() noexcept {
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
bool readNumber(QsaField const& f, double& out) {
    if (f.data == nullptr || f.length < 1) return false;
    switch (f.type) {
        case QsaFieldType::kFloat64: out = *static_cast<double const*>(f.data); return true;
        case QsaFieldType::kFloat32: out = *static_cast<float const*>(f.data); return true;
        case QsaFieldType::kInt64: out = double(*static_cast<int64_t const*>(f.data)); return true;
        case QsaFieldType::kInt32: out = *static_cast<int32_t const*>(f.data); return true;
        case QsaFieldType::kInt16: out = *static_cast<int16_t const*>(f.data); return true;
        case QsaFieldType::kInt8: out = *static_cast<int8_t const*>(f.data); return true;
        default: return false;
    }
}

// Strings arrive as kCHAR of `length` bytes, with or without a trailing NUL.
bool readString(QsaField const& f, std::string& out) {
    if (f.type != QsaFieldType::kChar || f.data == nullptr) return false;
    out.assign(static_cast<char const*>(f.data), size_t(f.length > 0 ? f.length : 0));
    out = out.substr(0, out.find('\0'));
    return true;
}

bool readEnum(QsaField const& f, char const* const* names, int count, int32_t& out) {
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

QsaPluginConfig defaultConfig() noexcept { return QsaPluginConfig{defaultAttrs(), QSA_ATTR_COLD_FORMAT_DEFAULT_INDEX}; }

QsaFieldType schemaFieldType(int schemaType) noexcept {
    return schemaType == 0 ? QsaFieldType::kInt32 : (schemaType == 1 ? QsaFieldType::kFloat32 : QsaFieldType::kChar);
}

bool parseFields(QsaField const* fields, int32_t nbFields, QsaPluginConfig& config, std::string& error) noexcept {
    try {
        QsaPluginConfig parsed = defaultConfig();
        QsaAttrs& attrs = parsed.attrs;
        for (int32_t i = 0; fields != nullptr && i < nbFields; ++i) {
            QsaField const& f = fields[i];
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
                ok = readEnum(f, kColdFormatNames, QSA_NUM_COLD_FORMATS, parsed.coldFormat);
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
        config = parsed;
        return true;
    } catch (std::exception const& e) {
        error = e.what();
        return false;
    }
}

std::vector<QsaField> const& QsaSerializedFields::fill(QsaPluginConfig const& config) {
    mConfig = config;
    mPolicy = kPolicyNames[config.attrs.policy];
    mGroupReduce = kGroupReduceNames[config.attrs.group_reduce];
    mColdFormat = kColdFormatNames[config.coldFormat];
    QsaAttrs const& a = mConfig.attrs;
    auto text = [](std::string const& s) { return int32_t(s.size() + 1); };  // with its NUL
    mFields = {
        {QSA_ATTR_SCALE_NAME, &a.scale, QsaFieldType::kFloat32, 1},
        {QSA_ATTR_POLICY_NAME, mPolicy.c_str(), QsaFieldType::kChar, text(mPolicy)},
        {QSA_ATTR_SINK_PAGES_NAME, &a.sink_pages, QsaFieldType::kInt32, 1},
        {QSA_ATTR_RECENT_PAGES_NAME, &a.recent_pages, QsaFieldType::kInt32, 1},
        {QSA_ATTR_GROUP_REDUCE_NAME, mGroupReduce.c_str(), QsaFieldType::kChar, text(mGroupReduce)},
        {QSA_ATTR_SUB_PAGE_SIZE_NAME, &a.sub_page_size, QsaFieldType::kInt32, 1},
        {QSA_ATTR_CANDIDATE_SHARE_NAME, &a.candidate_share, QsaFieldType::kFloat32, 1},
        {QSA_ATTR_COLD_FORMAT_NAME, mColdFormat.c_str(), QsaFieldType::kChar, text(mColdFormat)},
    };
    return mFields;
}

}  // namespace tinyserve
