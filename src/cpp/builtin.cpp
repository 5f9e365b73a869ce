// Built-in (non-Jinja) chat templates: llama.cpp's own list and its C renderer, as used
// by llama-server --no-jinja --chat-template NAME (common_chat_templates_apply_legacy).
#include "errors.h"
#include "shim.h"
#include "text.h"

#include "chat.h"
#include "llama.h"

#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace llamaprompt {

namespace {

// llama_chat_builtin_templates: the names llama_chat_apply_template knows
std::vector<std::string> builtin_template_names() {
    const int32_t n = llama_chat_builtin_templates(nullptr, 0);
    std::vector<const char *> names(n > 0 ? n : 0);
    llama_chat_builtin_templates(names.data(), names.size());
    return std::vector<std::string>(names.begin(), names.end());
}

// llama_chat_apply_template called directly (the C API), for plain role/content messages
py::object chat_apply_template(const std::string & tmpl, const std::vector<std::pair<std::string, std::string>> & msgs,
                               bool add_ass) {
    std::string out = call_upstream([&]() {
        std::vector<llama_chat_message> chat;
        size_t size = 0;
        for (const auto & [role, content] : msgs) {
            chat.push_back({role.c_str(), content.c_str()});
            size += role.size() + content.size();
        }
        std::vector<char> buf(size * 2 + 256);
        int32_t res = llama_chat_apply_template(tmpl.c_str(), chat.data(), chat.size(), add_ass, buf.data(), buf.size());
        if (res > (int32_t) buf.size()) {
            buf.resize(res);
            res = llama_chat_apply_template(tmpl.c_str(), chat.data(), chat.size(), add_ass, buf.data(), buf.size());
        }
        if (res < 0) {
            throw std::invalid_argument("llama_chat_apply_template: template not supported: " + tmpl);
        }
        return std::string(buf.data(), res);
    });
    return text_to_py(out);
}

}  // namespace

void register_builtin(py::module_ & m) {
    m.def("builtin_template_names", &builtin_template_names);
    m.def("chat_apply_template", &chat_apply_template, py::arg("template"), py::arg("messages"), py::arg("add_ass"));
    // common_chat_verify_template: what llama-server's argument parser checks for --chat-template
    m.def("verify_template", [](const std::string & tmpl, bool use_jinja) {
        return without_gil([&]() { return common_chat_verify_template(tmpl, use_jinja); });
    }, py::arg("template"), py::arg("use_jinja"));
    // llama-server's own refusal of `--chat-template NAME`: its message, or "" when accepted
    m.def("check_chat_template_arg", [](const std::string & name, bool use_jinja) {
        return without_gil([&]() { return check_chat_template_arg(name, use_jinja); });
    }, py::arg("name"), py::arg("use_jinja"));
}

}  // namespace llamaprompt
