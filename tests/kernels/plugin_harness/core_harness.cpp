// Drives the plugin's TensorRT-free core (plugins/tensorrt/QsaPluginCore.h, QsaPluginFields.h)
// through the call sequence TensorRT makes of the IPluginV3 class, which is a thin adapter over
// it: dev-only, and no TensorRT header anywhere (tests/kernels/test_plugin_core.py builds and runs
// it in CI; harness.cpp drives the adapter itself where TensorRT's headers are).
//
//   fields -> parseFields -> outputTypes -> outputShapes over our own symbolic dims (named
//   symbols and constants, as the builder's expressions) and over plain numbers, which must agree
//   -> supportsFormat at every position -> configure -> workspaceSize -> a copy of the core (the
//   builder's clone) -> shapeChange -> enqueue on the CPU-emulated kernels -> serialized fields,
//   copied out as bytes; every core destroyed -> parseFields of no fields (the schema defaults)
//   and of the copies -> shapeChange -> enqueue -> the two runs' outputs must be byte-identical.
//
// Usage: core_harness CASE OUTDIR (CASE: see case_file.h). Prints the report lines harness.cpp
// prints for the same steps (output, workspace, serialized, same_output) and writes
// OUTDIR/out<i>.bin. Exits non-zero with a reason on the first step that fails.
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "QsaPluginCore.h"
#include "QsaPluginFields.h"
#include "case_file.h"

using namespace tinyserve;
using plugin_case::fail;

namespace {

// The expression the output-shape formula is instantiated with here: a named symbol (a dim the
// profile leaves dynamic) or a constant, with its value.
struct Dim {
    std::string symbol;  // "" for a constant
    int64_t value;
};
struct SymShape {
    int32_t nbDims;
    Dim d[QsaShape::kMaxDims];
};

QsaElemType parseType(std::string const& s) {
    static std::map<std::string, QsaElemType> const m = {
        {"f32", QsaElemType::kFloat32}, {"f16", QsaElemType::kFloat16}, {"i32", QsaElemType::kInt32},
        {"i8", QsaElemType::kInt8}, {"u8", QsaElemType::kUInt8}};
    auto it = m.find(s);
    if (it == m.end()) fail("unknown dtype " + s);
    return it->second;
}
char const* typeName(QsaElemType t) {
    switch (t) {
        case QsaElemType::kFloat32: return "f32";
        case QsaElemType::kFloat16: return "f16";
        case QsaElemType::kInt32: return "i32";
        case QsaElemType::kInt8: return "i8";
        case QsaElemType::kUInt8: return "u8";
        default: return "other";
    }
}
QsaFieldType parseFieldType(std::string const& s) {
    static std::map<std::string, QsaFieldType> const m = {
        {"int32", QsaFieldType::kInt32}, {"int64", QsaFieldType::kInt64}, {"float32", QsaFieldType::kFloat32},
        {"float64", QsaFieldType::kFloat64}, {"char", QsaFieldType::kChar}};
    auto it = m.find(s);
    if (it == m.end()) fail("unknown field type " + s);
    return it->second;
}
size_t fieldElemSize(QsaFieldType t) {
    switch (t) {
        case QsaFieldType::kInt8: case QsaFieldType::kChar: return 1;
        case QsaFieldType::kInt16: return 2;
        case QsaFieldType::kInt32: case QsaFieldType::kFloat32: return 4;
        case QsaFieldType::kInt64: case QsaFieldType::kFloat64: return 8;
        default: fail("serialized a field of an unknown type");
    }
}

std::string show(Dim const& d) { return d.symbol.empty() ? std::to_string(d.value) : d.symbol; }

struct Tensor {
    QsaShape shape;
    QsaElemType type;
};

QsaShape shapeOf(std::vector<int64_t> const& v) {
    QsaShape s{};
    s.nbDims = int32_t(v.size());
    for (size_t i = 0; i < v.size(); ++i) s.d[i] = v[i];
    return s;
}

// shapeChange + enqueue on one core; outputs start as 0xff bytes (NaN / -1) so an unwritten row shows.
std::vector<std::vector<char>> run(QsaPluginCore& core, std::vector<plugin_case::Input> const& inputs,
                                   std::vector<Tensor> const& in, std::vector<Tensor> const& out, size_t workspaceBytes,
                                   char const* what) {
    std::vector<QsaShape> shapes;
    for (auto const& t : in) shapes.push_back(t.shape);
    std::string error;
    if (!core.shapeChange(shapes.data(), in[QSA_IN_QUERY].type, int32_t(in.size()), int32_t(out.size()), error))
        fail(std::string(what) + ": shapeChange: " + error);
    std::vector<void const*> inPtrs;
    for (auto const& x : inputs) inPtrs.push_back(x.data.empty() ? nullptr : x.data.data());
    std::vector<std::vector<char>> bufs;
    std::vector<void*> outPtrs;
    for (auto const& t : out) {
        std::vector<int64_t> const dims(t.shape.d, t.shape.d + t.shape.nbDims);
        bufs.emplace_back(plugin_case::volume(dims) * plugin_case::elemSize(typeName(t.type)), char(0xff));
        outPtrs.push_back(bufs.back().data());
    }
    std::vector<char> workspace(workspaceBytes + 1);
    int32_t const status =
        core.enqueue(inPtrs.data(), outPtrs.data(), workspaceBytes ? workspace.data() : nullptr, nullptr);
    if (status != QSA_OK) fail(std::string(what) + ": enqueue returned " + qsa_status_string(status));
    return bufs;
}

std::unique_ptr<QsaPluginCore> fromFields(std::vector<QsaField> const& fields, char const* what) {
    QsaPluginConfig config{};
    std::string error;
    if (!parseFields(fields.data(), int32_t(fields.size()), config, error))
        fail(std::string(what) + " refused the fields: " + error);
    return std::make_unique<QsaPluginCore>(config);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) fail("usage: core_harness CASE OUTDIR");
    std::vector<plugin_case::Field> fields;
    std::vector<plugin_case::Input> inputs;
    plugin_case::readCase(argv[1], fields, inputs);
    int32_t const nbIn = int32_t(inputs.size()), nbOut = QSA_NUM_OUTPUTS;

    std::vector<QsaField> qf;
    for (auto const& f : fields) qf.push_back({f.name.c_str(), f.bytes.data(), parseFieldType(f.type), f.length});
    std::unique_ptr<QsaPluginCore> core = fromFields(qf, "parseFields (build)");

    std::vector<Tensor> in;
    std::vector<QsaElemType> inTypes;
    for (auto const& x : inputs) {
        in.push_back({shapeOf(x.dims), parseType(x.dtype)});
        inTypes.push_back(in.back().type);
    }
    std::vector<QsaElemType> outTypes(static_cast<size_t>(nbOut), QsaElemType::kOther);
    if (!outputTypes(inTypes.data(), nbIn, outTypes.data(), nbOut, QsaElemType::kInt32)) fail("outputTypes");

    // The formula over symbolic dims (dynamic dims named, static ones constant) and over numbers.
    std::vector<SymShape> symIn(static_cast<size_t>(nbIn)), symOut(static_cast<size_t>(nbOut));
    std::vector<QsaShape> numIn, numOut(static_cast<size_t>(nbOut));
    for (int32_t i = 0; i < nbIn; ++i) {
        auto const& x = inputs[size_t(i)];
        symIn[size_t(i)].nbDims = int32_t(x.dims.size());
        for (size_t j = 0; j < x.dims.size(); ++j)
            symIn[size_t(i)].d[j] = Dim{plugin_case::symbolOf(x.dimSpec[j]), x.dims[j]};
        numIn.push_back(in[size_t(i)].shape);
    }
    if (!outputShapes(symIn.data(), nbIn, symOut.data(), nbOut)) fail("outputShapes (symbolic)");
    if (!outputShapes(numIn.data(), nbIn, numOut.data(), nbOut)) fail("outputShapes (numbers)");
    std::vector<Tensor> out;
    for (int32_t o = 0; o < nbOut; ++o) {
        SymShape const& e = symOut[size_t(o)];
        if (e.nbDims < 0 || e.nbDims > QsaShape::kMaxDims) fail("outputShapes: bad rank");
        if (e.nbDims != numOut[size_t(o)].nbDims) fail("outputShapes: the ranks over symbols and numbers differ");
        QsaShape s{};
        s.nbDims = e.nbDims;
        std::cout << "output " << o << " " << typeName(outTypes[size_t(o)]) << " " << e.nbDims;
        for (int32_t j = 0; j < e.nbDims; ++j) {
            s.d[j] = e.d[j].value;
            if (s.d[j] != numOut[size_t(o)].d[j]) fail("outputShapes: symbols and numbers give other dims");
            std::cout << " " << s.d[j];
        }
        std::cout << " symbolic";
        for (int32_t j = 0; j < e.nbDims; ++j) std::cout << " " << show(e.d[j]);
        std::cout << "\n";
        out.push_back({s, outTypes[size_t(o)]});
    }

    // Format negotiation: every position of this combination is supported, a non-linear query is not.
    std::vector<QsaTensorFormat> formats;
    for (auto const& t : in) formats.push_back({t.type, true});
    for (auto const& t : out) formats.push_back({t.type, true});
    for (int32_t pos = 0; pos < nbIn + nbOut; ++pos)
        if (!core->supportsFormat(pos, formats.data(), nbIn, nbOut))
            fail("supportsFormat refused position " + std::to_string(pos));
    formats[0].linear = false;
    if (core->supportsFormat(0, formats.data(), nbIn, nbOut)) fail("accepted a non-linear query");
    formats[0].linear = true;
    std::string error;
    if (!core->configure(nbIn, nbOut, error)) fail("configure: " + error);
    std::vector<QsaShape> maxShapes;
    for (auto const& t : in) maxShapes.push_back(t.shape);
    size_t const ws = core->workspaceSize(maxShapes.data(), nbIn);
    std::cout << "workspace " << ws << "\n";

    // Build phase: the builder times a clone of the configured plugin.
    auto timed = std::make_unique<QsaPluginCore>(*core);
    auto const a = run(*timed, inputs, in, out, ws, "build clone");

    // Serialize: copy the fields out as bytes, then destroy every build-phase object.
    auto ser = std::make_unique<QsaSerializedFields>();
    std::vector<plugin_case::SavedField> saved;
    std::vector<QsaField> const& serFields = ser->fill(core->config());
    std::cout << "serialized";
    for (QsaField const& f : serFields) {
        saved.push_back(plugin_case::saveField(f.name, f.data, size_t(f.length) * fieldElemSize(f.type)));
        std::cout << " " << f.name;
    }
    std::cout << "\n";
    std::vector<QsaField> restoredFields;
    for (size_t i = 0; i < saved.size(); ++i)
        restoredFields.push_back({saved[i].name.c_str(), saved[i].data.data(), serFields[i].type, serFields[i].length});
    timed.reset();
    core.reset();
    ser.reset();

    fromFields({}, "parseFields (runtime, no fields: schema defaults)");
    std::unique_ptr<QsaPluginCore> restored = fromFields(restoredFields, "parseFields (runtime)");
    auto const b = run(*restored, inputs, in, out, ws, "runtime core");

    std::cout << "same_output " << (a == b ? 1 : 0) << "\n";
    plugin_case::writeOutputs(argv[2], b);
    return 0;
}
