// Text and JSON crossing into Python. Prompts are bytes that llama.cpp built; they are
// returned as str decoded with "surrogateescape", so a prompt that is not valid UTF-8
// (a template can cut a multi-byte character) still round-trips byte for byte through
// str.encode("utf-8", "surrogateescape") instead of being silently altered.
#pragma once

#include <pybind11/pybind11.h>

#include "errors.h"
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

// A result that echoes the request (llama_params) can be nested as deeply as a request may be
// (1000 levels, parse_body) -- deeper than Python's decoder reaches from inside a call (its
// recursion limit counts the caller's frames): a RequestError then, as for a deeper request,
// rather than a RecursionError from inside llamaprompt (errors.py TOO_DEEP_FOR_PYTHON: the same text).
inline pybind11::object json_text_to_py(const std::string & s) {
    try {
        return pybind11::module_::import("json").attr("loads")(text_to_py(s));
    } catch (pybind11::error_already_set & e) {
        if (e.matches(PyExc_RecursionError)) {
            throw error(error_kind::request, 400,
                        "request is nested too deeply (its echo exceeds Python's recursion limit at this call's stack depth)");
        }
        throw;
    }
}

// bad UTF-8 in strings is replaced, as llama-server's JSON responses do (safe_json_to_str)
inline pybind11::object json_to_py(const common_json & j) {
    return json_text_to_py(dump_safe(j));
}

}  // namespace llamaprompt
