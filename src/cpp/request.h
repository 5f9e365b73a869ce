// A request body as Python hands it to the core: JSON text (bytes), or a dict. A dict of
// plain values becomes the tree llama-server's json::parse would make of the text Python's
// json.dumps writes for it, built directly (no text written, none parsed); a dict holding
// anything else is encoded by Python and parsed as text, as before.
#pragma once

#include <pybind11/pybind11.h>

#include "tree.h"

#include <cstddef>
#include <cstdint>
#include <string>

namespace llamaprompt {

// The limits parse_body puts on a body's JSON text before parsing it (template.cpp says why).
constexpr int max_body_depth = 1000;
constexpr size_t max_object_members = 10000;
// an object of n members costs n * (n - 1) / 2 key comparisons to parse (ordered_json)
constexpr uint64_t max_body_lookups = uint64_t(max_object_members - 1) * max_object_members;

struct body_in {
    std::string text;   // the JSON text (when !is_tree)
    common_json tree;   // the parsed body (when is_tree)
    bool is_tree = false;
};

// The tree json::parse(json.dumps(request, ensure_ascii=False)) gives, when `request` is a
// dict holding only values whose JSON text reads back as exactly that value: dict (str keys),
// list, str (UTF-8, no lone surrogates), int in [-2^63, 2^64), finite float, bool, None --
// each of exactly that type -- nested at most `tree_depth` levels, its objects within
// parse_body's member limits. False for anything else (a subclass, a tuple, a non-str key,
// NaN, a big int, a lone surrogate, a container that holds itself, nesting that would reach
// Python's recursion limit in the encoder, a caller's thread with a small stack): the text path
// then decides, exactly as before. Needs the GIL; runs no Python code.
constexpr int tree_depth = 256;  // deeper: Python's encoder may refuse it (its recursion limit)
bool body_tree(PyObject * request, common_json & out);

// `request` (bytes, or a dict) as the core takes it: bytes as text; a dict as its tree, or
// (body_tree declined) as the bytes `encode(request)` returns. Needs the GIL; the errors
// `encode` raises propagate (py::error_already_set).
body_in take_body(pybind11::handle request, pybind11::handle encode);

}  // namespace llamaprompt
