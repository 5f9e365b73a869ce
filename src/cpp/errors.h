// One C++ exception type for everything that leaves the bindings; module.cpp turns it
// into llamaprompt.errors.* with llama.cpp's message and llama-server's HTTP status.
#pragma once

#include <pybind11/pybind11.h>

#include "gil.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace llamaprompt {

enum class error_kind { request, template_, server_args, gguf };

struct error : std::runtime_error {
    error_kind kind;
    int status;  // the HTTP status llama-server answers with, 0 when there is none
    error(error_kind kind, int status, const std::string & message)
        : std::runtime_error(message), kind(kind), status(status) {}
};

// Run `fn` with the GIL released and translate every C++ exception as llama-server's
// ex_wrapper (tools/server/server.cpp) does: std::invalid_argument -> 400 (a request
// error), any other exception -> 500, "unknown error" for non-std exceptions.
template <typename F>
auto call_upstream(F && fn) -> decltype(fn()) {
    return without_gil([&]() -> decltype(fn()) {
        try {
            return fn();
        } catch (const error &) {
            throw;
        } catch (const std::invalid_argument & e) {
            throw error(error_kind::request, 400, e.what());
        } catch (const std::exception & e) {
            throw error(error_kind::template_, 500, e.what());
        } catch (...) {
            throw error(error_kind::template_, 500, "unknown error");
        }
    });
}

// the llamaprompt.errors exception object for an error (needs the GIL)
pybind11::object make_py_error(error_kind kind, int status, const std::string & message);

void register_errors(pybind11::module_ & m);

}  // namespace llamaprompt
