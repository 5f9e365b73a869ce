#include "errors.h"

namespace py = pybind11;

namespace llamaprompt {

py::object make_py_error(error_kind kind, int status, const std::string & message) {
    const char * cls = "TemplateError";
    switch (kind) {
        case error_kind::request:     cls = "RequestError"; break;
        case error_kind::template_:   cls = "TemplateError"; break;
        case error_kind::server_args: cls = "ServerArgsError"; break;
        case error_kind::gguf:        cls = "GGUFError"; break;
    }
    py::object errors = py::module_::import("llamaprompt.errors");
    py::object code = status ? py::object(py::int_(status)) : py::object(py::none());
    // llama.cpp's message may quote request or template bytes that are not UTF-8
    PyObject * msg = PyUnicode_DecodeUTF8(message.data(), (Py_ssize_t) message.size(), "replace");
    if (!msg) {
        PyErr_Clear();
        msg = PyUnicode_FromString("(undecodable message)");
    }
    return errors.attr(cls)(py::reinterpret_steal<py::str>(msg), code);
}

void register_errors(py::module_ & m) {
    (void) m;
    py::register_exception_translator([](std::exception_ptr p) {
        if (!p) {
            return;
        }
        try {
            std::rethrow_exception(p);
        } catch (const error & e) {
            py::object exc = make_py_error(e.kind, e.status, e.what());
            PyErr_SetObject(py::type::handle_of(exc).ptr(), exc.ptr());
        }
    });
}

}  // namespace llamaprompt
