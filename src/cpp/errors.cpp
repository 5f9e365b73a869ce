#include "errors.h"

namespace py = pybind11;

namespace llamaprompt {

void register_errors(py::module_ & m) {
    (void) m;
    py::register_exception_translator([](std::exception_ptr p) {
        if (!p) {
            return;
        }
        try {
            std::rethrow_exception(p);
        } catch (const error & e) {
            const char * cls = "TemplateError";
            switch (e.kind) {
                case error_kind::request:     cls = "RequestError"; break;
                case error_kind::template_:   cls = "TemplateError"; break;
                case error_kind::server_args: cls = "ServerArgsError"; break;
                case error_kind::gguf:        cls = "GGUFError"; break;
            }
            py::object errors = py::module_::import("llamaprompt.errors");
            py::object status = e.status ? py::object(py::int_(e.status)) : py::object(py::none());
            // llama.cpp's message may quote request or template bytes that are not UTF-8
            const std::string text = e.what();
            PyObject * msg = PyUnicode_DecodeUTF8(text.data(), (Py_ssize_t) text.size(), "replace");
            if (!msg) {
                PyErr_Clear();
                msg = PyUnicode_FromString("(undecodable message)");
            }
            py::object exc = errors.attr(cls)(py::reinterpret_steal<py::str>(msg), status);
            PyErr_SetObject(py::type::handle_of(exc).ptr(), exc.ptr());
        }
    });
}

}  // namespace llamaprompt
