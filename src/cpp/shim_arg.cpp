// common/arg.cpp, compiled here to reach its non-exiting parser common_params_parse_ex.
// The public common_params_parse prints and calls exit() on --help, --version and
// errors, which must never happen inside a Python process. The copy included is the build
// tree's (see CMakeLists.txt): llama.cpp's config.ini files are not applied.
#include "common.h"

// llama-server applies /etc/llama.cpp/config.ini and ~/.config/llama.cpp/config.ini here
static void llamaprompt_no_system_config(common_params &, enum llama_example) {}

#include "arg.cpp"  // the generated copy

#include "shim.h"

#include <algorithm>
#include <set>

namespace llamaprompt {

namespace {

// flags whose handlers print something and call exit(), only print usage, or change the
// process-wide llama.cpp log (which llamaprompt routes to Python's logging)
// (third_party/adapt_tree.py checks at configure time that every flag of the tree whose handler
// calls exit() is listed)
const std::set<std::string> & exiting_flags() {
    static const std::set<std::string> flags = {
#include "server_args_refused.inc"
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

// common_params_parse_ex for LLAMA_EXAMPLE_SERVER on these flags, without LLAMA_ARG_* variables
common_params run_parser(const std::vector<std::string> & args) {
    common_params params;
    common_params_context ctx = common_params_parser_init(params, LLAMA_EXAMPLE_SERVER, nullptr);
    // common_params_parse_ex starts by setting the log threshold from params.verbosity:
    // keep llama.cpp's common log as silent as the module made it (no global change, no race)
    ctx.params.verbosity = common_log_get_verbosity_thold();
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

    try {
        common_params_parse_ex((int) argv_storage.size(), argv.data(), ctx);
    } catch (const std::exception & e) {
        throw std::invalid_argument(e.what());
    }
    return ctx.params;
}

}  // namespace

std::string check_chat_template_arg(const std::string & name, bool use_jinja) {
    std::vector<std::string> args = {"--chat-template", name};
    if (!use_jinja) {
        args.push_back("--no-jinja");
    }
    try {
        run_parser(args);
    } catch (const std::exception & e) {
        return e.what();
    }
    return "";
}

common_params parse_server_args(const std::vector<std::string> & args) {
    for (const auto & a : args) {
        const std::string flag = normalized_flag(a);
        if (exiting_flags().count(flag)) {
            throw std::invalid_argument("server_args: " + a +
                                        " prints and exits, or changes llama.cpp's process-wide log; it is not "
                                        "accepted here (llama.cpp's log goes to logging.getLogger(\"llamaprompt\"))");
        }
    }

    const common_params p = run_parser(args);
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
