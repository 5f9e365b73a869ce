// common/arg.cpp, compiled here to reach its non-exiting parser common_params_parse_ex.
// The public common_params_parse prints and calls exit() on --help, --version and
// errors, which must never happen inside a Python process.
#include "arg.cpp"

#include "shim.h"

#include <algorithm>
#include <set>

namespace llamaprompt {

namespace {

// flags whose handlers print something and call exit(), or only print usage
const std::set<std::string> & exiting_flags() {
    static const std::set<std::string> flags = {
        "-h", "--help", "--usage", "--version", "--completion-bash",
        "-cl", "--cache-list", "--list-devices",
    };
    return flags;
}

std::string normalized_flag(std::string arg) {
    // common_params_parse_ex accepts '_' for '-' in long flags
    if (arg.rfind("--", 0) == 0) {
        std::replace(arg.begin(), arg.end(), '_', '-');
    }
    return arg;
}

}  // namespace

common_params parse_server_args(const std::vector<std::string> & args) {
    for (const auto & a : args) {
        const std::string flag = normalized_flag(a);
        if (exiting_flags().count(flag)) {
            throw std::invalid_argument("server_args: " + a + " only prints information and exits llama-server; it is not accepted here");
        }
    }

    common_params params;
    common_params_context ctx = common_params_parser_init(params, LLAMA_EXAMPLE_SERVER, nullptr);
    // llama-server would also read LLAMA_ARG_* environment variables; a library call
    // must not depend on its process environment, so every option forgets its variable
    for (auto & opt : ctx.options) {
        opt.env = nullptr;
    }

    std::vector<std::string> argv_storage;
    argv_storage.reserve(args.size() + 1);
    argv_storage.push_back("llama-server");
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<char *> argv;
    for (auto & s : argv_storage) {
        argv.push_back(s.data());
    }
    argv.push_back(nullptr);

    // common_params_parse_ex sets the log threshold from --verbosity; keep ours
    const int verbosity = common_log_get_verbosity_thold();
    try {
        common_params_parse_ex((int) argv_storage.size(), argv.data(), ctx);
    } catch (const std::exception & e) {
        common_log_set_verbosity_thold(verbosity);
        throw std::invalid_argument(e.what());
    }
    common_log_set_verbosity_thold(verbosity);

    const common_params & p = ctx.params;
    auto model_given = [](const common_params_model & m) {
        return !m.path.empty() || !m.url.empty() || !m.hf_repo.empty() || !m.docker_repo.empty();
    };
    if (model_given(p.model) || model_given(p.mmproj)) {
        throw std::invalid_argument(
            "server_args: flags that load a model or a projector are not accepted; "
            "llamaprompt needs no model (use ChatTemplate.from_gguf for a model's template)");
    }
    if (!p.chat_template.empty()) {
        throw std::invalid_argument(
            "server_args: --chat-template/--chat-template-file are not accepted; "
            "pass the template to ChatTemplate(...) or ChatTemplate.from_file(...)");
    }
    return p;
}

}  // namespace llamaprompt
