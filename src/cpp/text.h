// Text and JSON crossing into Python. Prompts are bytes that llama.cpp built; they are
// returned as str decoded with "surrogateescape", so a prompt that is not valid UTF-8
// (a template can cut a multi-byte character) still round-trips byte for byte through
// str.encode("utf-8", "surrogateescape") instead of being silently altered.
#pragma once

#include <pybind11/pybind11.h>

#include "tree.h"

#include <string>

namespace llamaprompt {

inline pybind11::object text_to_py(const std::string & s) {
    PyObject * o = PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t) s.size(), "surrogateescape");
    if (!o) {
        throw pybind11::error_already_set();
    }
    return pybind11::reinterpret_steal<pybind11::object>(o);
}

inline pybind11::object json_text_to_py(const std::string & s) {
    return pybind11::module_::import("json").attr("loads")(text_to_py(s));
}

// bad UTF-8 in strings is replaced, as llama-server's JSON responses do (safe_json_to_str)
inline pybind11::object json_to_py(const common_json & j) {
    return json_text_to_py(dump_safe(j));
}

}  // namespace llamaprompt
