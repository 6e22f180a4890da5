// The plugin's fields, without TensorRT: what the creator parses and the plugin serializes.
//
// QsaField is our own plain record of one field (the adapter in QueryAwareSparseAttentionPlugin.cpp
// turns an nvinfer1::PluginField into one and back), so the parsing, its validation and the
// serialized form are compiled and tested without TensorRT's headers
// (tests/kernels/test_plugin_core.py). Names, types, ranges and defaults come from the generated
// plugins/generated/qsa_schema.h, i.e. from tinyserve_trt/ops/schema.py.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qsa_launch.h"

namespace tinyserve {

// A field's element type; kOther for one the plugin never reads (it is refused).
enum class QsaFieldType : int32_t { kInt8, kInt16, kInt32, kInt64, kFloat32, kFloat64, kChar, kOther };

// One field: `length` elements of `type` at `data` (kChar: bytes, with or without a trailing NUL).
struct QsaField {
    char const* name;
    void const* data;
    QsaFieldType type;
    int32_t length;
};

// What the fields configure: the op's attributes and the cold format (QSA_COLD_FORMAT_*).
struct QsaPluginConfig {
    QsaAttrs attrs;
    int32_t coldFormat;
};

// The schema's defaults (what absent fields mean).
QsaPluginConfig defaultConfig() noexcept;

// Parses `nbFields` fields into `config`, defaults for absent ones. Returns false with a reason for a
// bad value, type or unknown field; the ONNX parser's own plugin_namespace / plugin_version fields
// are accepted and ignored. `config` is only written on success.
bool parseFields(QsaField const* fields, int32_t nbFields, QsaPluginConfig& config, std::string& error) noexcept;

// The serialized form of a config: one field per schema attribute, in schema order, pointing into
// this object (valid while it lives and is not re-filled).
class QsaSerializedFields {
public:
    std::vector<QsaField> const& fill(QsaPluginConfig const& config);

private:
    QsaPluginConfig mConfig{};
    std::string mPolicy, mGroupReduce, mColdFormat;
    std::vector<QsaField> mFields;
};

// Schema field type (0 int, 1 float, 2 string, as QSA_FOR_EACH_ATTRIBUTE gives it) -> the type
// the plugin announces and serializes it with.
QsaFieldType schemaFieldType(int schemaType) noexcept;

}  // namespace tinyserve
