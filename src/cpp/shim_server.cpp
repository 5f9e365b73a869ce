// tools/server/server-common.cpp, compiled here (it lives only in llama-server's
// server-context target upstream). Three call sites are renamed around the include so
// that one request's work can be observed or kept local; the code stays upstream's:
//   - common_chat_templates_apply -> capture_apply: records the common_chat_params
//     (or only the inputs) that oaicompat_chat_params_parse computes;
//   - common_remote_get_content -> remote_get_content: no network access from a render
//     unless asked (the prompt is the same as after a successful download);
//   - get_media_marker(): per call instead of once per process (CMakeLists.txt renames
//     upstream's definition in the generated copy of the file).
#include "shim.h"

#include "download.h"

#include <stdexcept>

namespace llamaprompt {
namespace {

enum class capture_mode { full, inputs_only };

struct capture_state {
    capture_mode mode = capture_mode::full;
    const call_options * call = nullptr;
    common_chat_templates_inputs inputs;
    common_chat_params params;
    bool captured = false;
};

thread_local capture_state * current = nullptr;

// thrown through oaicompat_chat_params_parse to stop it once the inputs are known
struct inputs_captured {};

common_chat_params capture_apply(const common_chat_templates * tmpls, const common_chat_templates_inputs & inputs) {
    if (current && current->mode == capture_mode::inputs_only) {
        current->inputs = inputs;
        current->captured = true;
        throw inputs_captured{};
    }
    common_chat_params params = common_chat_templates_apply(tmpls, inputs);
    if (current) {
        current->params = params;
        current->captured = true;
    }
    return params;
}

std::pair<long, std::vector<char>> remote_get_content(const std::string & url, const common_remote_params & params) {
    if (current && current->call && current->call->fetch_remote_media) {
        return common_remote_get_content(url, params);
    }
    return {200, {}};
}

struct scoped_capture {
    capture_state * prev;
    explicit scoped_capture(capture_state & st) : prev(current) { current = &st; }
    ~scoped_capture() { current = prev; }
};

}  // namespace
}  // namespace llamaprompt

// the media marker for the current call (upstream's definition is renamed, see above)
const char * get_media_marker() {
    using namespace llamaprompt;
    static const std::string fallback = "<__media__>";
    return current && current->call ? current->call->media_marker.c_str() : fallback.c_str();
}

// oaicompat_chat_params_parse's `caps` where its engine rewrite applies (adapt_tree.py
// caps_lookup_edits): what common_chat_templates_get_caps(tmpls)[name] gives, without building the
// map for the one name it reads. llamaprompt_templates_caps: get_caps's own choice of template, in
// the generated chat.cpp (linked only where this is used)
const jinja::caps & llamaprompt_templates_caps(const common_chat_templates * chat_templates);
struct llamaprompt_caps_lookup {
    const common_chat_templates * tmpls;
    explicit llamaprompt_caps_lookup(const common_chat_templates * t) : tmpls(t) {}
    bool operator[](const std::string & name) const {
        if (name == "supports_parallel_tool_calls") {  // caps::to_map()'s entry for that member (probed)
            return llamaprompt_templates_caps(tmpls).supports_parallel_tool_calls;
        }
        return common_chat_templates_get_caps(tmpls)[name];
    }
};

#define common_chat_templates_apply llamaprompt::capture_apply
#define common_remote_get_content llamaprompt::remote_get_content
#include "server-common.cpp"  // the generated copy, see CMakeLists.txt
#undef common_chat_templates_apply
#undef common_remote_get_content

namespace llamaprompt {

apply_result apply_request(json body, const server_chat_params & opt, const call_options & call) {
    capture_state st;
    st.call = &call;
    scoped_capture guard(st);
    std::vector<raw_buffer> files;  // media bytes: not needed for a prompt
    apply_result res;
    res.llama_params = oaicompat_chat_params_parse(body, opt, files);
    res.chat_params = std::move(st.params);
    res.has_chat_params = st.captured;
    return res;
}

common_chat_templates_inputs request_inputs(json body, const server_chat_params & opt, const call_options & call) {
    capture_state st;
    st.mode = capture_mode::inputs_only;
    st.call = &call;
    scoped_capture guard(st);
    std::vector<raw_buffer> files;
    try {
        oaicompat_chat_params_parse(body, opt, files);
    } catch (const inputs_captured &) {
        return std::move(st.inputs);
    }
    throw std::runtime_error("oaicompat_chat_params_parse returned without applying the template");
}

server_chat_params make_server_chat_params(const common_params & params, common_chat_templates_ptr tmpls) {
    // mirrors tools/server/server-context.cpp, load_model(), "populate chat template params":
    //   template_supports_thinking = params_base.use_jinja && common_chat_templates_support_enable_thinking(...)
    //   enable_thinking = params_base.enable_reasoning != 0 && template_supports_thinking
    // and the server_chat_params initializer that follows it. allow_image/audio/video start as
    // a loaded vision+audio projector reports them (the reference fixtures were made with one);
    // ChatTemplate(media=...) then sets them (core_template::set_media).
    const bool template_supports_thinking =
        params.use_jinja && common_chat_templates_support_enable_thinking(tmpls.get());
    const bool enable_thinking = params.enable_reasoning != 0 && template_supports_thinking;
    // member by member, by name (a member added upstream keeps its default here, and
    // third_party/adapt_tree.py fails configuration when server-context.cpp's initializer --
    // its members and the expressions they come from -- is no longer the one mirrored here)
    server_chat_params out{};
    out.use_jinja = params.use_jinja;
    out.prefill_assistant = params.prefill_assistant;
    out.reasoning_format = params.reasoning_format;
    out.chat_template_kwargs = params.default_template_kwargs;
    out.tmpls = std::move(tmpls);
    out.allow_image = true;
    out.allow_audio = true;
    out.allow_video = true;
    out.enable_thinking = enable_thinking;
    out.reasoning_budget = params.sampling.reasoning_budget_tokens;
    out.reasoning_budget_message = params.sampling.reasoning_budget_message;
    out.media_path = params.media_path;
    out.force_pure_content = params.force_pure_content_parser;
    return out;
}

}  // namespace llamaprompt
