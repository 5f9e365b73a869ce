#include "request.h"

#include "gil.h"
#include "jinja_guard.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace llamaprompt {

namespace {

// Python's recursion counter for one container level, as the json encoder takes one per list
// or dict (Py_EnterRecursiveCall): where the encoder would raise RecursionError (the text path's
// "request is nested too deeply"), the builder declines first
struct recursion_level {
    bool entered;
    recursion_level() : entered(Py_EnterRecursiveCall(" while building a request") == 0) {
        if (!entered) {
            PyErr_Clear();
        }
    }
    ~recursion_level() {
        if (entered) {
            Py_LeaveRecursiveCall();
        }
    }
    recursion_level(const recursion_level &) = delete;
    recursion_level & operator=(const recursion_level &) = delete;
};

// the frames between ChatTemplate's call and the encoder's first level (request_body, encode,
// iterencode) and a few more: the builder runs that many levels closer to the limit
constexpr int encoder_frames_margin = 8;

struct tree_builder {
    uint64_t lookups = 0;  // as parse_body counts them for the text
    // the containers being built, outermost first: one met again is a cycle, which the encoder
    // refuses ("Circular reference detected") -- found here before copying it 256 times over
    std::vector<PyObject *> path;

    // a str's UTF-8, or false for one that has none (a lone surrogate)
    static bool utf8(PyObject * s, std::string & out) {
        if (PyUnicode_IS_COMPACT_ASCII(s)) {
            out.assign(static_cast<const char *>(PyUnicode_DATA(s)), size_t(PyUnicode_GET_LENGTH(s)));
            return true;
        }
        // (a bytes object of its own: PyUnicode_AsUTF8 would keep a copy in the caller's str)
        PyObject * bytes = PyUnicode_AsUTF8String(s);
        if (!bytes) {
            PyErr_Clear();
            return false;
        }
        out.assign(PyBytes_AS_STRING(bytes), size_t(PyBytes_GET_SIZE(bytes)));
        Py_DECREF(bytes);
        return true;
    }

    bool build(PyObject * v, common_json & out, int depth) {
        if (v == Py_None) {
            out = common_json(nullptr);
        } else if (v == Py_True || v == Py_False) {
            out = common_json(v == Py_True);
        } else if (PyUnicode_CheckExact(v)) {
            std::string s;
            if (!utf8(v, s)) {
                return false;
            }
            out = common_json(std::move(s));
        } else if (PyLong_CheckExact(v)) {
            // JSON text of an int: "-..." parses as a signed integer, digits alone as an
            // unsigned one; beyond 64 bits as a double (the text path gives that)
            int overflow = 0;
            const long long i = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (overflow == 0 && !(i == -1 && PyErr_Occurred())) {
                out = i < 0 ? common_json(int64_t(i)) : common_json(uint64_t(i));
            } else if (overflow > 0) {
                PyErr_Clear();
                const unsigned long long u = PyLong_AsUnsignedLongLong(v);
                if (u == (unsigned long long) -1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    return false;
                }
                out = common_json(uint64_t(u));
            } else {
                PyErr_Clear();
                return false;
            }
        } else if (PyFloat_CheckExact(v)) {
            // repr() reads back as the same double; NaN and the infinities are no JSON
            const double d = PyFloat_AS_DOUBLE(v);
            if (!(d - d == 0)) {
                return false;
            }
            out = common_json(d);
        } else if (PyList_CheckExact(v)) {
            recursion_level level;
            if (depth >= tree_depth || !level.entered || std::find(path.begin(), path.end(), v) != path.end()) {
                return false;
            }
            path.push_back(v);
            common_json a = common_json::array();
            // (the list cannot change meanwhile: no Python code runs here)
            // each item built in place (a partly built tree is dropped whole)
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); ++i) {
                a.push_back(nullptr);
                if (!build(PyList_GET_ITEM(v, i), a.back(), depth + 1)) {
                    return false;
                }
            }
            path.pop_back();
            out = std::move(a);
        } else if (PyDict_CheckExact(v)) {
            recursion_level level;
            if (depth >= tree_depth || !level.entered || std::find(path.begin(), path.end(), v) != path.end()) {
                return false;
            }
            const uint64_t n = uint64_t(PyDict_GET_SIZE(v));
            if (n > max_object_members || (lookups += n ? n * (n - 1) / 2 : 0) > max_body_lookups) {
                return false;  // the text path refuses it, with its message
            }
            path.push_back(v);
            common_json o = common_json::object();
            Py_ssize_t pos = 0;
            PyObject * key = nullptr;
            PyObject * value = nullptr;
            std::string k;
            while (PyDict_Next(v, &pos, &key, &value)) {
                if (!PyUnicode_CheckExact(key) || !utf8(key, k) || !build(value, o[k], depth + 1)) {
                    return false;
                }
            }
            path.pop_back();
            out = std::move(o);
        } else {
            return false;
        }
        return true;
    }
};

}  // namespace

bool body_tree(PyObject * request, common_json & out) {
    // a thread with a small stack (threading.stack_size) builds no tree: the builder recurses
    // per level on the caller's stack (the call itself then moves to a big stack: gil.h)
    if (!PyDict_CheckExact(request) || stack_left() < min_stack_left) {
        return false;
    }
    struct margin_levels {
        int entered = 0;
        ~margin_levels() {
            for (; entered > 0; --entered) {
                Py_LeaveRecursiveCall();
            }
        }
    } margin;
    for (; margin.entered < encoder_frames_margin; ++margin.entered) {
        if (Py_EnterRecursiveCall(" while building a request") != 0) {
            PyErr_Clear();
            return false;
        }
    }
    tree_builder b;
    return b.build(request, out, 0);
}

body_in take_body(py::handle request, py::handle encode) {
    body_in body;
    if (PyDict_CheckExact(request.ptr())) {
        if (body_tree(request.ptr(), body.tree)) {
            body.is_tree = true;
            return body;
        }
        body.tree = common_json();
        if (encode.is_none()) {
            throw py::type_error("a dict body this core does not take as a tree needs `encode`");
        }
        py::object text = encode(request);
        body.text = text.cast<std::string>();
        return body;
    }
    if (!PyBytes_Check(request.ptr())) {
        throw py::type_error("a request body is bytes or a dict");
    }
    body.text = request.cast<std::string>();
    return body;
}

}  // namespace llamaprompt
