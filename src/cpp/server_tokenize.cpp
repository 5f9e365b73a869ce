// _core.post_tokenize / _core.post_detokenize: llama-server's POST /tokenize and /detokenize
// handlers (tools/server/server-context.cpp, server_routes' post_tokenize and post_detokenize),
// compiled from the tree. third_party/adapt_tree.py copies each lambda's body into
// generated/lp_post_tokenize.inc / lp_post_detokenize.inc, having checked that it uses nothing of
// llama-server's but what this file gives it in place of the server's: `req.body`, `ctx_server.vocab`
// and `create_response()` with its `ok()` / `error()`. The body's calls that take the vocab are
// renamed to lp_vocab's below, which first check what llama.cpp would assert (check_tokenize:
// a GGUF without a tokenizer aborts the process) and then make upstream's call.
//
// So the body is read as llama-server reads it -- nlohmann's parse of the raw bytes, json_value's
// defaults for flags of another type, tokenize_mixed's strings and ids, get<llama_tokens>()'s
// casts -- and what it throws is answered as llama-server's ex_wrapper answers it (call_upstream:
// 500 with the exception's message, 400 for std::invalid_argument).
#include "errors.h"
#include "model.h"
#include "shim.h"
#include "text.h"
#include "tree.h"

#include <memory>
#include <string>
#include <utility>

namespace py = pybind11;

namespace llamaprompt {

#if LP_HAS_SERVE_TOKENIZE
namespace {

// the vocab's calls a handler body makes (adapt_tree.py VOCAB_CALLS), checked first
namespace lp_vocab {

llama_tokens tokenize_mixed(const llama_vocab * vocab, const json & prompt, bool add_special, bool parse_special) {
    check_tokenize(vocab, add_special);
    return ::tokenize_mixed(vocab, prompt, add_special, parse_special);
}

template <typename... Args>
std::string common_token_to_piece(const llama_vocab * vocab, Args &&... args) {
    check_tokenize(vocab, false);
    return ::common_token_to_piece(vocab, std::forward<Args>(args)...);
}

template <typename... Args>
std::string tokens_to_str(const llama_vocab * vocab, Args &&... args) {
    check_tokenize(vocab, false);
    return ::tokens_to_str(vocab, std::forward<Args>(args)...);
}

}  // namespace lp_vocab

// what server_routes' handlers see of llama-server: the request, ctx_server, the response
struct handler_request {
    std::string body;
};
struct handler_server {
    const llama_vocab * vocab;
};
// server_res_generator's ok() / error(): the status and the JSON text of the response
struct handler_response {
    int status = 500;
    std::string data;
    void ok(const json & response_data) {
        status = 200;
        data = dump_safe(response_data);
    }
    void error(const json & error_data) {
        status = json_value(error_data, "code", 500);
        data = dump_safe({{"error", error_data}});
    }
};

// server_routes as its two handlers see it: each method's body is the tree's lambda body
struct handler_routes {
    handler_server ctx_server;

    static std::unique_ptr<handler_response> create_response() { return std::make_unique<handler_response>(); }

    std::unique_ptr<handler_response> post_tokenize(const handler_request & req) const {
#include "lp_post_tokenize.inc"
    }

    std::unique_ptr<handler_response> post_detokenize(const handler_request & req) const {
#include "lp_post_detokenize.inc"
    }
};

using handler_result = std::pair<int, std::string>;
using handler_method = std::unique_ptr<handler_response> (handler_routes::*)(const handler_request &) const;

handler_result run_route(const core_model & mdl, handler_method route, std::string body) {
    const handler_routes routes{handler_server{mdl.vocab()}};
    auto res = (routes.*route)(handler_request{std::move(body)});
    return {res->status, std::move(res->data)};
}

// (status, response body as JSON text), the GIL released while the handler runs; an exception
// of the handler is a llamaprompt error (call_upstream), as llama-server's 500 / 400
py::tuple run_handler(const core_model * mdl, handler_method route, const std::string & body) {
    if (!mdl) {
        throw py::type_error("model must be a _core.Model");
    }
    handler_result out = call_upstream([&]() { return run_route(*mdl, route, body); });
    return py::make_tuple(out.first, text_to_py(out.second));
}

}  // namespace
#endif

// without the handlers in the tree (adapt_tree.py tokenize_handler_bodies) there are no functions;
// the Python layer then answers 501 (llamaprompt.features["serve_tokenize"] is False)
void register_server_tokenize(py::module_ & m) {
#if !LP_HAS_SERVE_TOKENIZE
    (void) m;
#else
    m.def("post_tokenize", [](std::shared_ptr<core_model> mdl, const std::string & body) {
        return run_handler(mdl.get(), &handler_routes::post_tokenize, body);
    }, py::arg("model"), py::arg("body"));
    m.def("post_detokenize", [](std::shared_ptr<core_model> mdl, const std::string & body) {
        return run_handler(mdl.get(), &handler_routes::post_detokenize, body);
    }, py::arg("model"), py::arg("body"));
#endif
}

}  // namespace llamaprompt
