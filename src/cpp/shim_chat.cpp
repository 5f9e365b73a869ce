// common/chat.cpp, compiled here so that its private parts (the common_chat_templates
// struct, render_message_to_json / messages_inp_normalizer) can be reached. The
// static llama-common archive's own chat.cpp object is then never linked.
//
// The copy included is the build tree's (see CMakeLists.txt): its one call of
// common_chat_try_specialized_template goes through llamaprompt_try_specialized_template
// below, so a template can take the differential autoparser path on request.
#include "chat-auto-parser.h"
#include "chat.h"
#include "shim.h"

#include <cstdint>
#include <ctime>
#include <mutex>
#include <optional>

namespace llamaprompt {
thread_local handler_state * current_handler = nullptr;
}

static std::optional<common_chat_params> llamaprompt_try_specialized_template(
    const common_chat_template & tmpl, const std::string & src, autoparser::generation_params & params) {
    using llamaprompt::current_handler;
    if (current_handler && current_handler->skip_specialized) {
        return std::nullopt;
    }
    std::optional<common_chat_params> result = common_chat_try_specialized_template(tmpl, src, params);
    if (current_handler) {
        current_handler->specialized_used = result.has_value();
    }
    return result;
}

namespace llamaprompt {

// analyze_template's result depends only on the template (its source and caps) -- and on
// the date, which a template may print; the key holds all three. One cache per ChatTemplate.
struct analysis_cache {
    std::mutex mutex;
    std::map<std::string, std::shared_ptr<const autoparser::autoparser>> results;
};

std::shared_ptr<analysis_cache> make_analysis_cache() { return std::make_shared<analysis_cache>(); }

static std::string analysis_key(const common_chat_template & tmpl) {
    char day[32];
    const std::time_t now = std::time(nullptr);
    std::tm tm_now{};
#if defined(_WIN32)
    localtime_s(&tm_now, &now);
#else
    localtime_r(&now, &tm_now);
#endif
    std::strftime(day, sizeof(day), "%Y-%m-%d", &tm_now);
    return std::to_string(reinterpret_cast<uintptr_t>(&tmpl)) + "|" + tmpl.original_caps().to_string() + "|" + day;
}

}  // namespace llamaprompt

static void llamaprompt_analyze_template(autoparser::autoparser & ap, const common_chat_template & tmpl) {
    using namespace llamaprompt;
    analysis_cache * cache = current_handler ? current_handler->cache : nullptr;
    if (!cache) {
        ap.analyze_template(tmpl);
        return;
    }
    const std::string key = analysis_key(tmpl);
    {
        std::lock_guard<std::mutex> lock(cache->mutex);
        auto it = cache->results.find(key);
        if (it != cache->results.end()) {
            ap = *it->second;
            return;
        }
    }
    ap.analyze_template(tmpl);  // outside the lock: analyses of different keys run in parallel
    std::lock_guard<std::mutex> lock(cache->mutex);
    cache->results.emplace(key, std::make_shared<const autoparser::autoparser>(ap));
}

#include "thread_safe_time.h"
#include "chat.cpp"  // the generated copy
#undef localtime

namespace llamaprompt {

scoped_handler::scoped_handler(handler_state & st) : prev_(current_handler) { current_handler = &st; }
scoped_handler::~scoped_handler() { current_handler = prev_; }

void templates_set_add_bos_eos(common_chat_templates * tmpls, bool add_bos, bool add_eos) {
    GGML_ASSERT(tmpls != nullptr);
    tmpls->add_bos = add_bos;
    tmpls->add_eos = add_eos;
}

void templates_set_caps(common_chat_templates * tmpls, const std::map<std::string, bool> & caps) {
    GGML_ASSERT(tmpls != nullptr && tmpls->template_default != nullptr);
    // the jinja::caps members, by the names jinja::caps::to_map() reports
    using member = bool jinja::caps::*;
    static const std::map<std::string, member> members = {
        {"supports_tools", &jinja::caps::supports_tools},
        {"supports_tool_calls", &jinja::caps::supports_tool_calls},
        {"supports_system_role", &jinja::caps::supports_system_role},
        {"supports_parallel_tool_calls", &jinja::caps::supports_parallel_tool_calls},
        {"supports_preserve_reasoning", &jinja::caps::supports_preserve_reasoning},
        {"supports_reasoning_effort", &jinja::caps::supports_reasoning_effort},
        {"supports_string_content", &jinja::caps::supports_string_content},
        {"supports_typed_content", &jinja::caps::supports_typed_content},
        {"supports_object_arguments", &jinja::caps::supports_object_arguments},
    };
    for (const auto & [name, value] : caps) {
        if (!members.count(name)) {
            throw std::invalid_argument("unknown caps key: " + name);
        }
    }
    for (common_chat_template * t : {tmpls->template_default.get(), tmpls->template_tool_use.get()}) {
        if (!t) {
            continue;
        }
        for (const auto & [name, value] : caps) {
            t->caps.*(members.at(name)) = value;
        }
    }
}

const common_chat_template & templates_pick(const common_chat_templates * tmpls, bool with_tools) {
    GGML_ASSERT(tmpls != nullptr && tmpls->template_default != nullptr);
    // same choice as common_chat_templates_apply_jinja
    return with_tools && tmpls->template_tool_use ? *tmpls->template_tool_use : *tmpls->template_default;
}

json render_messages(const std::vector<common_chat_msg> & msgs, const common_chat_template & tmpl) {
    return render_message_to_json(msgs, tmpl.original_caps());
}

}  // namespace llamaprompt
