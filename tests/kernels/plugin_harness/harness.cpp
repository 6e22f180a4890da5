// Drives QueryAwareSparseAttentionPlugin through the IPluginV3 call sequence TensorRT uses,
// without TensorRT: dev-only (tests/kernels/test_plugin_harness.py builds and runs it).
//
//   getCreators (the library entry point) -> creator fields -> createPlugin(kBUILD)
//   -> capabilities -> getOutputDataTypes -> getOutputShapes through a stand-in IExprBuilder
//   (symbolic and constant dims, evaluated here as the builder would) -> supportsFormatCombination
//   at every position -> configurePlugin -> getWorkspaceSize -> clone -> onShapeChange -> enqueue
//   on the CPU-emulated kernels (plugins/emulation, host memory) -> getFieldsToSerialize, copied
//   out as an engine would serialize them; every plugin destroyed -> createPlugin(kRUNTIME) from
//   the copied fields -> attachToContext -> onShapeChange -> enqueue -> the two runs' outputs
//   must be byte-identical.
//
// Usage: plugin_harness CASE OUTDIR (CASE: see case_file.h). Writes OUTDIR/out<i>.bin (raw,
// row-major) and prints "key value..." lines on stdout (creator, output types and shapes,
// workspace bytes, same_output). Exits non-zero with a reason on the first call that fails.
// Compiles only against TensorRT's own headers ($TENSORRT_INCLUDE_DIR); core_harness.cpp drives
// the same sequence through the TensorRT-free core without them.
#include <NvInfer.h>

#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "QueryAwareSparseAttentionPlugin.h"
#include "case_file.h"

using namespace nvinfer1;
using plugin_case::fail;

extern "C" void setLoggerFinder(ILoggerFinder* finder);
extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace {

// ---- the logger TensorRT would hand the library ----
struct Logger : ILogger {
    int errors = 0;
    void log(Severity s, AsciiChar const* msg) noexcept override {
        if (s <= Severity::kERROR) ++errors;
        std::cerr << "plugin log: " << msg << std::endl;
    }
};
struct LoggerFinder : ILoggerFinder {
    Logger logger;
    ILogger* findLogger() override { return &logger; }
};

// ---- a stand-in IExprBuilder: expressions are a tree evaluated against bound symbols ----
struct Expr;
struct ExprImpl : apiv::VDimensionExpr {
    bool constant = false;
    int64_t value = 0;  // constants: the value; symbols: the bound value (not visible to the plugin)
    std::string symbol;
    DimensionOperation op{};
    Expr const* a = nullptr;
    Expr const* b = nullptr;
    bool isConstant() const override { return constant; }
    int64_t getConstantValue() const override { return constant ? value : -1; }
    bool isSizeTensor() const override { return false; }
};
struct Expr : IDimensionExpr {
    ExprImpl impl;
    Expr() { mImpl = &impl; }
    ~Expr() noexcept override = default;
};

struct Builder : IExprBuilder {
    struct Impl : apiv::VExprBuilder {
        Builder* owner = nullptr;
        IDimensionExpr const* constant(int64_t v) override { return owner->makeConstant(v); }
        IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& x,
                                        IDimensionExpr const& y) override {
            Expr* e = owner->make();
            e->impl.op = op;
            e->impl.a = owner->own(&x);
            e->impl.b = owner->own(&y);
            e->impl.constant = x.isConstant() && y.isConstant();
            if (e->impl.constant) e->impl.value = owner->eval(e);
            return e;
        }
        IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override {
            return nullptr;  // the plugin has no size-tensor outputs
        }
    } impl;
    std::vector<std::unique_ptr<Expr>> exprs;
    Builder() {
        impl.owner = this;
        mImpl = &impl;
    }
    ~Builder() noexcept override = default;
    Expr* make() { return exprs.emplace_back(std::make_unique<Expr>()).get(); }
    Expr const* makeConstant(int64_t v) {
        Expr* e = make();
        e->impl.constant = true;
        e->impl.value = v;
        return e;
    }
    Expr const* makeSymbol(std::string const& name, int64_t v) {
        Expr* e = make();
        e->impl.symbol = name;
        e->impl.value = v;
        return e;
    }
    // An expression the plugin returns must be one this builder made (or was given).
    Expr const* own(IDimensionExpr const* x) const {
        for (auto const& e : exprs)
            if (e.get() == x) return e.get();
        fail("getOutputShapes returned an expression the builder did not make");
    }
    int64_t eval(Expr const* e) const {
        ExprImpl const& i = e->impl;
        if (i.a == nullptr) return i.value;  // constant or symbol
        int64_t const x = eval(i.a), y = eval(i.b);
        switch (i.op) {
            case DimensionOperation::kSUM: return x + y;
            case DimensionOperation::kPROD: return x * y;
            case DimensionOperation::kMAX: return x > y ? x : y;
            case DimensionOperation::kMIN: return x < y ? x : y;
            case DimensionOperation::kSUB: return x - y;
            case DimensionOperation::kEQUAL: return x == y;
            case DimensionOperation::kLESS: return x < y;
            case DimensionOperation::kFLOOR_DIV: return y ? (x / y - ((x % y != 0) && ((x < 0) != (y < 0)))) : 0;
            case DimensionOperation::kCEIL_DIV: return y ? -((-x) / y - (((-x) % y != 0) && (((-x) < 0) != (y < 0)))) : 0;
        }
        return 0;
    }
    std::string show(Expr const* e) const {
        ExprImpl const& i = e->impl;
        if (i.a == nullptr) return i.constant ? std::to_string(i.value) : i.symbol;
        return "op" + std::to_string(int(i.op)) + "(" + show(i.a) + "," + show(i.b) + ")";
    }
};

// ---- the case, in TensorRT's types ----
DataType parseType(std::string const& s) {
    static std::map<std::string, DataType> const m = {{"f32", DataType::kFLOAT}, {"f16", DataType::kHALF},
                                                      {"i32", DataType::kINT32}, {"i8", DataType::kINT8},
                                                      {"u8", DataType::kUINT8}};
    auto it = m.find(s);
    if (it == m.end()) fail("unknown dtype " + s);
    return it->second;
}
PluginFieldType parseFieldType(std::string const& s) {
    static std::map<std::string, PluginFieldType> const m = {
        {"int32", PluginFieldType::kINT32}, {"int64", PluginFieldType::kINT64},
        {"float32", PluginFieldType::kFLOAT32}, {"float64", PluginFieldType::kFLOAT64}, {"char", PluginFieldType::kCHAR}};
    auto it = m.find(s);
    if (it == m.end()) fail("unknown field type " + s);
    return it->second;
}
char const* typeName(DataType t) {
    switch (t) {
        case DataType::kFLOAT: return "f32";
        case DataType::kHALF: return "f16";
        case DataType::kINT32: return "i32";
        case DataType::kINT8: return "i8";
        case DataType::kUINT8: return "u8";
        case DataType::kBOOL: return "bool";
        default: return "other";
    }
}
Dims dimsOf(std::vector<int64_t> const& v) {
    Dims d{};
    d.nbDims = int32_t(v.size());
    for (size_t i = 0; i < v.size(); ++i) d.d[i] = v[i];
    return d;
}
size_t bytesOf(PluginTensorDesc const& d) {
    return plugin_case::volume(std::vector<int64_t>(d.dims.d, d.dims.d + d.dims.nbDims)) *
           plugin_case::elemSize(typeName(d.type));
}

struct Outputs {
    std::vector<std::vector<char>> bufs;
};

// onShapeChange + enqueue on one runtime plugin; outputs start as 0xff bytes (NaN / -1) so an
// unwritten row shows.
Outputs run(IPluginV3* plugin, std::vector<plugin_case::Input> const& inputs, std::vector<PluginTensorDesc> const& inDesc,
            std::vector<PluginTensorDesc> const& outDesc, size_t workspaceBytes, char const* what) {
    auto* rt = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (rt == nullptr) fail(std::string(what) + ": no runtime capability");
    int32_t const nbIn = int32_t(inputs.size()), nbOut = int32_t(outDesc.size());
    if (rt->onShapeChange(inDesc.data(), nbIn, outDesc.data(), nbOut) != 0) fail(std::string(what) + ": onShapeChange");
    Outputs o;
    std::vector<void const*> inPtrs;
    for (auto const& x : inputs) inPtrs.push_back(x.data.empty() ? nullptr : x.data.data());
    std::vector<void*> outPtrs;
    for (auto const& d : outDesc) {
        o.bufs.emplace_back(bytesOf(d), char(0xff));
        outPtrs.push_back(o.bufs.back().data());
    }
    std::vector<char> workspace(workspaceBytes + 1);
    int32_t const status = rt->enqueue(inDesc.data(), outDesc.data(), inPtrs.data(), outPtrs.data(),
                                       workspaceBytes ? workspace.data() : nullptr, nullptr);
    if (status != 0) fail(std::string(what) + ": enqueue returned " + std::to_string(status));
    return o;
}

struct ResourceContext : IPluginResourceContext {
    IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
    IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
};

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) fail("usage: plugin_harness CASE OUTDIR");
    std::vector<plugin_case::Field> fields;
    std::vector<plugin_case::Input> inputs;
    plugin_case::readCase(argv[1], fields, inputs);
    int32_t const nbIn = int32_t(inputs.size());

    static LoggerFinder finder;
    setLoggerFinder(&finder);
    int32_t nbCreators = 0;
    IPluginCreatorInterface* const* creators = getCreators(nbCreators);
    if (nbCreators != 1 || creators == nullptr) fail("getCreators: expected one creator");
    if (std::strcmp(creators[0]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0) fail("creator kind");
    auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
    std::cout << "creator " << creator->getPluginName() << " " << creator->getPluginVersion() << " "
              << creator->getPluginNamespace() << "\n";
    PluginFieldCollection const* names = creator->getFieldNames();
    std::cout << "field_names";
    for (int32_t i = 0; i < names->nbFields; ++i) std::cout << " " << names->fields[i].name;
    std::cout << "\n";

    std::vector<PluginField> pf;
    for (auto const& f : fields) pf.emplace_back(f.name.c_str(), f.bytes.data(), parseFieldType(f.type), f.length);
    PluginFieldCollection fc{int32_t(pf.size()), pf.data()};
    IPluginV3* plugin = creator->createPlugin("qsa_node", &fc, TensorRTPhase::kBUILD);
    if (plugin == nullptr) fail("createPlugin(kBUILD) refused the fields");
    auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    if (core == nullptr || build == nullptr) fail("missing core or build capability");
    std::cout << "plugin " << core->getPluginName() << " " << core->getPluginVersion() << " "
              << core->getPluginNamespace() << "\n";

    int32_t const nbOut = build->getNbOutputs();
    if (nbOut < 1 || nbOut > 8) fail("getNbOutputs");
    std::vector<DataType> inTypes, outTypes(size_t(nbOut), DataType::kINT64);
    for (auto const& x : inputs) inTypes.push_back(parseType(x.dtype));
    if (build->getOutputDataTypes(outTypes.data(), nbOut, inTypes.data(), nbIn) != 0) fail("getOutputDataTypes");

    // Input shapes as TensorRT hands them to the builder: dynamic dims symbolic, static ones constant.
    Builder builder;
    std::vector<DimsExprs> inExprs(static_cast<size_t>(nbIn));
    for (int32_t i = 0; i < nbIn; ++i) {
        plugin_case::Input const& x = inputs[size_t(i)];
        inExprs[size_t(i)].nbDims = int32_t(x.dims.size());
        for (size_t j = 0; j < x.dims.size(); ++j) {
            std::string const sym = plugin_case::symbolOf(x.dimSpec[j]);
            inExprs[size_t(i)].d[j] = sym.empty() ? builder.makeConstant(x.dims[j]) : builder.makeSymbol(sym, x.dims[j]);
        }
    }
    std::vector<DimsExprs> outExprs(static_cast<size_t>(nbOut));
    if (build->getOutputShapes(inExprs.data(), nbIn, nullptr, 0, outExprs.data(), nbOut, builder) != 0)
        fail("getOutputShapes");
    std::vector<PluginTensorDesc> inDesc(static_cast<size_t>(nbIn)), outDesc(static_cast<size_t>(nbOut));
    for (int32_t i = 0; i < nbIn; ++i)
        inDesc[size_t(i)] = PluginTensorDesc{dimsOf(inputs[size_t(i)].dims), inTypes[size_t(i)], TensorFormat::kLINEAR, 1.f};
    for (int32_t o = 0; o < nbOut; ++o) {
        DimsExprs const& e = outExprs[size_t(o)];
        if (e.nbDims < 0 || e.nbDims > Dims::MAX_DIMS) fail("getOutputShapes: bad rank");
        Dims d{};
        d.nbDims = e.nbDims;
        std::cout << "output " << o << " " << typeName(outTypes[size_t(o)]) << " " << e.nbDims;
        for (int32_t j = 0; j < e.nbDims; ++j) {
            Expr const* x = builder.own(e.d[j]);
            d.d[j] = builder.eval(x);
            std::cout << " " << d.d[j];
        }
        std::cout << " symbolic";
        for (int32_t j = 0; j < e.nbDims; ++j) std::cout << " " << builder.show(builder.own(e.d[j]));
        std::cout << "\n";
        outDesc[size_t(o)] = PluginTensorDesc{d, outTypes[size_t(o)], TensorFormat::kLINEAR, 1.f};
    }

    // The builder's format negotiation: every position of this combination is supported, a
    // non-linear layout of query is not.
    std::vector<DynamicPluginTensorDesc> inOut;
    for (auto const& d : inDesc) inOut.push_back(DynamicPluginTensorDesc{d, d.dims, d.dims, d.dims});
    for (auto const& d : outDesc) inOut.push_back(DynamicPluginTensorDesc{d, d.dims, d.dims, d.dims});
    for (int32_t pos = 0; pos < nbIn + nbOut; ++pos)
        if (!build->supportsFormatCombination(pos, inOut.data(), nbIn, nbOut))
            fail("supportsFormatCombination refused position " + std::to_string(pos));
    DynamicPluginTensorDesc const query = inOut[0];
    inOut[0].desc.format = TensorFormat::kCHW4;
    if (build->supportsFormatCombination(0, inOut.data(), nbIn, nbOut)) fail("accepted a CHW4 query");
    inOut[0] = query;
    if (build->configurePlugin(inOut.data(), nbIn, inOut.data() + nbIn, nbOut) != 0) fail("configurePlugin");
    size_t const ws = build->getWorkspaceSize(inOut.data(), nbIn, inOut.data() + nbIn, nbOut);
    std::cout << "workspace " << ws << "\n";

    // Build phase: the builder times a clone of the configured plugin.
    IPluginV3* timed = plugin->clone();
    if (timed == nullptr) fail("clone");
    Outputs const a = run(timed, inputs, inDesc, outDesc, ws, "build clone");

    // Serialize: copy the fields out (an engine keeps bytes, not the plugin's pointers), then
    // destroy every build-phase object before the runtime recreates the plugin.
    auto* rtBuild = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* ser = rtBuild->getFieldsToSerialize();
    if (ser == nullptr) fail("getFieldsToSerialize");
    std::vector<plugin_case::SavedField> saved;
    std::vector<PluginField> serFields;
    std::cout << "serialized";
    for (int32_t i = 0; i < ser->nbFields; ++i) {
        PluginField const& f = ser->fields[i];
        size_t const bytes = f.type == PluginFieldType::kCHAR ? size_t(f.length)
                           : f.type == PluginFieldType::kINT32 || f.type == PluginFieldType::kFLOAT32 ? 4 * size_t(f.length)
                           : 8 * size_t(f.length);
        saved.push_back(plugin_case::saveField(f.name, f.data, bytes));
        std::cout << " " << f.name;
    }
    std::cout << "\n";
    for (size_t i = 0; i < saved.size(); ++i)
        serFields.emplace_back(saved[i].name.c_str(), saved[i].data.data(), ser->fields[i].type, ser->fields[i].length);
    delete timed;
    delete plugin;

    IPluginV3* restored = creator->createPlugin("qsa_node", nullptr, TensorRTPhase::kRUNTIME);
    if (restored == nullptr) fail("createPlugin(kRUNTIME) without fields (schema defaults)");
    delete restored;
    PluginFieldCollection serFc{int32_t(serFields.size()), serFields.data()};
    restored = creator->createPlugin("qsa_node", &serFc, TensorRTPhase::kRUNTIME);
    if (restored == nullptr) fail("createPlugin(kRUNTIME) refused the serialized fields");
    ResourceContext ctx;
    auto* rtRestored = static_cast<IPluginV3OneRuntime*>(restored->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    IPluginV3* attached = rtRestored->attachToContext(&ctx);
    if (attached == nullptr) fail("attachToContext");
    Outputs const b = run(attached, inputs, inDesc, outDesc, ws, "runtime plugin");
    delete attached;
    delete restored;

    bool same = a.bufs == b.bufs;
    std::cout << "same_output " << (same ? 1 : 0) << "\n";
    plugin_case::writeOutputs(argv[2], b.bufs);
    std::cout << "logged_errors " << finder.logger.errors << "\n";
    return 0;
}
