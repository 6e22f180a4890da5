// The case file both plugin harnesses read (harness.cpp: the IPluginV3 class, needs TensorRT's
// headers; core_harness.cpp: the TensorRT-free core). Dev-only; no TensorRT or plugin types here,
// so each harness maps the type names to its own.
//
// CASE is text, one item a line:
//   field NAME TYPE VALUE        TYPE int32 | int64 | float32 | float64 | char (VALUE one token)
//   input DTYPE NBDIMS DIM... FILE   DTYPE f32 | f16 | i32 | i8 | u8; DIM "7" (constant) or
//                                "B=2" (symbolic, named, with its value); NBDIMS 0 and FILE "-":
//                                a skipped optional input (ONNX "")
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace plugin_case {

[[noreturn]] inline void fail(std::string const& msg) {
    std::cerr << "harness: " << msg << std::endl;
    std::exit(1);
}

struct Field {
    std::string name;
    std::string type;  // int32 | int64 | float32 | float64 | char
    std::vector<char> bytes;
    int32_t length;  // elements; a string's bytes without a NUL, as ONNX gives it
};

struct Input {
    std::string dtype;                 // f32 | f16 | i32 | i8 | u8
    std::vector<int64_t> dims;         // the values
    std::vector<std::string> dimSpec;  // "7" or "B=2", per dim
    std::vector<char> data;            // empty for a skipped input
};

// Bytes per element of a dtype name (also "bool"); 0 for an unknown one.
inline size_t elemSize(std::string const& dtype) {
    if (dtype == "f32" || dtype == "i32") return 4;
    if (dtype == "f16") return 2;
    if (dtype == "i8" || dtype == "u8" || dtype == "bool") return 1;
    return 0;
}

// Elements of a shape; 0 for rank 0 (a skipped input).
inline size_t volume(std::vector<int64_t> const& dims) {
    size_t n = 1;
    for (int64_t d : dims) n *= size_t(d);
    return dims.empty() ? 0 : n;
}

// The symbol of a dim spec ("B=2" -> "B"), "" for a constant.
inline std::string symbolOf(std::string const& spec) {
    auto eq = spec.find('=');
    return eq == std::string::npos ? std::string() : spec.substr(0, eq);
}

template <typename T>
std::vector<char> bytesOf(T v) {
    std::vector<char> b(sizeof(T));
    std::memcpy(b.data(), &v, sizeof(T));
    return b;
}

inline void readCase(char const* path, std::vector<Field>& fields, std::vector<Input>& inputs) {
    std::ifstream in(path);
    if (!in) fail(std::string("cannot read ") + path);
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream ls(line);
        std::string kind;
        if (!(ls >> kind) || kind[0] == '#') continue;
        if (kind == "field") {
            Field f;
            std::string value;
            ls >> f.name >> f.type >> value;
            if (f.type == "int32") f.bytes = bytesOf(int32_t(std::stoll(value)));
            else if (f.type == "int64") f.bytes = bytesOf(int64_t(std::stoll(value)));
            else if (f.type == "float32") f.bytes = bytesOf(std::stof(value));
            else if (f.type == "float64") f.bytes = bytesOf(std::stod(value));
            else if (f.type == "char") f.bytes.assign(value.begin(), value.end());
            else fail("unknown field type " + f.type);
            f.length = f.type == "char" ? int32_t(f.bytes.size()) : 1;
            fields.push_back(std::move(f));
        } else if (kind == "input") {
            Input x;
            int32_t nbDims = 0;
            std::string file;
            ls >> x.dtype >> nbDims;
            if (elemSize(x.dtype) == 0 || x.dtype == "bool") fail("unknown dtype " + x.dtype);
            if (nbDims < 0 || nbDims > 8) fail("bad rank in: " + line);
            for (int32_t i = 0; i < nbDims; ++i) {
                std::string spec;
                ls >> spec;
                auto eq = spec.find('=');
                x.dims.push_back(std::stoll(eq == std::string::npos ? spec : spec.substr(eq + 1)));
                x.dimSpec.push_back(spec);
            }
            ls >> file;
            if (file != "-") {
                std::ifstream f(file, std::ios::binary);
                x.data.assign(std::istreambuf_iterator<char>(f), {});
                if (x.data.size() != volume(x.dims) * elemSize(x.dtype)) fail("size of " + file + " != its dims");
            }
            inputs.push_back(std::move(x));
        } else {
            fail("unknown case line: " + line);
        }
    }
}

// OUTDIR/out<i>.bin, raw.
inline void writeOutputs(std::string const& dir, std::vector<std::vector<char>> const& bufs) {
    for (size_t o = 0; o < bufs.size(); ++o) {
        std::ofstream f(dir + "/out" + std::to_string(o) + ".bin", std::ios::binary);
        f.write(bufs[o].data(), std::streamsize(bufs[o].size()));
    }
}

// A serialized field copied out of the plugin (`bytes` at `data`), as an engine keeps bytes
// rather than the plugin's pointers.
struct SavedField {
    std::string name;
    std::vector<char> data;
};

inline SavedField saveField(char const* name, void const* data, size_t bytes) {
    return SavedField{name, std::vector<char>(static_cast<char const*>(data), static_cast<char const*>(data) + bytes)};
}

}  // namespace plugin_case
