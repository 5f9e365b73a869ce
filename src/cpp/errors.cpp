#include "errors.h"

namespace py = pybind11;

namespace llamaprompt {

namespace {

// llamaprompt.errors' classes by error_kind, looked up once when the module is imported and kept
// for the process's life (strong references never released: nothing to destroy at exit)
PyObject * error_classes[4] = {nullptr, nullptr, nullptr, nullptr};

size_t class_index(error_kind kind) {
    switch (kind) {
        case error_kind::request:     return 0;
        case error_kind::template_:   return 1;
        case error_kind::server_args: return 2;
        case error_kind::gguf:        return 3;
    }
    return 1;
}

// The garbage collector off while the exception object is built: a collection started by one of
// its allocations could run a finalizer (Python code), and Python code may hand the GIL over --
// which is where CPython ends a daemon thread at interpreter exit (make_py_error's comment).
struct no_collection {
#if PY_VERSION_HEX >= 0x030A0000
    int was_enabled = PyGC_Disable();
    ~no_collection() {
        if (was_enabled) {
            PyGC_Enable();
        }
    }
#endif
};

}  // namespace

// Error.__init__ (llamaprompt/errors.py) without running it: Python code here could hand the GIL
// over, and a daemon thread asking for it back while the interpreter exits is ended by CPython with
// pthread_exit -- inside pybind11's exception translation (a catch block) that aborts the process,
// and in apply_template_many it would unwind the result list without the GIL. So the object is made
// by the class's tp_new (BaseException's or OSError's, C code) and given what __init__ gives it:
// args (message,), message, status. test_errors.py checks the result against the class's own
// constructor for every kind.
py::object make_py_error(error_kind kind, int status, const std::string & message) {
    no_collection quiet;
    auto * cls = reinterpret_cast<PyTypeObject *>(error_classes[class_index(kind)]);
    // llama.cpp's message may quote request or template bytes that are not UTF-8
    py::object msg = py::reinterpret_steal<py::object>(
        PyUnicode_DecodeUTF8(message.data(), (Py_ssize_t) message.size(), "replace"));
    if (!msg) {
        PyErr_Clear();
        msg = py::reinterpret_steal<py::object>(PyUnicode_FromString("(undecodable message)"));
    }
    py::object code = status ? py::object(py::int_(status)) : py::object(py::none());
    py::tuple args = py::make_tuple(msg);
    py::object exc = py::reinterpret_steal<py::object>(cls->tp_new(cls, args.ptr(), nullptr));
    if (!exc || PyObject_SetAttrString(exc.ptr(), "args", args.ptr()) != 0 ||
        PyObject_SetAttrString(exc.ptr(), "message", msg.ptr()) != 0 ||
        PyObject_SetAttrString(exc.ptr(), "status", code.ptr()) != 0) {
        throw py::error_already_set();
    }
    return exc;
}

void register_errors(py::module_ & m) {
    // an exception reported through sys.unraisablehook ("Exception ignored in: <context>"), as the
    // C++ calls report the errors of their Python call backs: CPython offers Python code no public
    // way to call the hook (its argument type has no constructor)
    m.def(
        "write_unraisable",
        [](const py::handle & exc, const std::string & context) {  // (not const char *: None would be null)
            if (!PyExceptionInstance_Check(exc.ptr())) {
                throw py::type_error("write_unraisable: an exception instance is needed");
            }
            PyObject * type = reinterpret_cast<PyObject *>(Py_TYPE(exc.ptr()));
            Py_INCREF(type);
            Py_INCREF(exc.ptr());
            PyErr_Restore(type, exc.ptr(), PyException_GetTraceback(exc.ptr()));  // (the traceback: new or null)
            py::error_already_set current;
            current.discard_as_unraisable(context.c_str());
        },
        py::arg("exc"), py::arg("context"));
    py::module_ errors = py::module_::import("llamaprompt.errors");
    const char * names[4] = {"RequestError", "TemplateError", "ServerArgsError", "GGUFError"};
    for (size_t i = 0; i < 4; ++i) {
        error_classes[i] = py::object(errors.attr(names[i])).release().ptr();
    }
    py::register_exception_translator([](std::exception_ptr p) {
        if (!p) {
            return;
        }
        try {
            std::rethrow_exception(p);
        } catch (const error & e) {
            py::object exc = make_py_error(e.kind, e.status, e.what());
            PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(exc.ptr())), exc.ptr());
        }
    });
}

}  // namespace llamaprompt
