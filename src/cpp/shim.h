// Accessors that reach upstream code kept private to a llama.cpp translation unit.
//
// Each shim_*.cpp compiles one upstream .cpp file inside a translation unit of ours
// (so its static functions and private structs are in scope) and exports the few
// functions declared here. None of them re-derives upstream logic: they call it.
#pragma once

#include "chat-auto-parser.h"
#include "chat.h"
#include "common.h"
#include "server-common.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace llamaprompt {

// ---- shim_chat.cpp (common/chat.cpp) --------------------------------------

// Which handler common_chat_templates_apply_jinja may use, and which it used, for the
// calls made on this thread while a scoped_handler is alive.
struct analysis_cache;  // per-template results of autoparser::analyze_template (shim_chat.cpp)
std::shared_ptr<analysis_cache> make_analysis_cache();

// Per-template set of parser-generation inputs (everything autoparser's generate_parser
// reads except the messages) for which the parser and grammar were generated without error.
struct parser_memo;
std::shared_ptr<parser_memo> make_parser_memo();

// One execution of the template by common_chat_template_direct_apply_impl.
struct captured_render {
    const common_chat_template * tmpl = nullptr;  // which template (default or tool_use variant)
    std::string context;                          // the context object, as JSON text
    bool mark_input = true;                       // global_from_json's mark_input argument
    std::string output;                           // the render (before BOS/EOS stripping)
    bool has_output = false;
};

struct handler_state {
    bool skip_specialized = false;  // in: take the differential autoparser path
    bool specialized_used = false;  // out: a specialized handler produced the params
    analysis_cache * cache = nullptr;  // in: reuse the template analysis (null: analyze every call)
    // in: the caller needs only the prompt (POST /apply-template). With a memo, a request whose
    // parser inputs already produced a parser without error gets the prompt from
    // common_chat_template_direct_apply alone (generate_parser's first step), nothing else.
    bool prompt_only = false;
    parser_memo * memo = nullptr;
    bool prompt_only_used = false;  // out: the prompt-only path was taken
    bool stop_at_prompt = false;    // a specialized handler ends at its prompt (lp_prompt_ready.h)
    bool stopped = false;           // a stop point said "return now" (the params returned hold the prompt)
    const char * stop_point = nullptr;  // out: the specialized handler that passed its stop point
    // a stop point after the generation prompt (llamaprompt_prompt_ready_after): the memo key of
    // this call's non-message inputs while it may stop there, then the key with the generation
    // prompt, to add to the memo when the handler finishes without error
    const std::string * key_before_generation_prompt = nullptr;
    std::string key_with_generation_prompt;
    // in (benchmarks): called with the template and generation_params the autoparser path renders
    std::function<void(const common_chat_template &, const autoparser::generation_params &)> on_generate;
    // in (template_inputs): each render of this request -- its Jinja context, as
    // common_chat_template_direct_apply_impl hands it to jinja::global_from_json, and its
    // output -- is appended here (not the template analysis' probe renders)
    std::vector<captured_render> * renders = nullptr;
    bool in_analysis = false;  // while autoparser::analyze_template runs
};
class scoped_handler {
  public:
    explicit scoped_handler(handler_state & st);
    ~scoped_handler();
    scoped_handler(const scoped_handler &) = delete;
    scoped_handler & operator=(const scoped_handler &) = delete;

  private:
    handler_state * prev_;
};

// Replace the caps llama.cpp uses for the default and tool_use templates (the
// common_chat_template::caps that original_caps() returns, which drives
// messages_inp_normalizer and the caps-driven workarounds). Keys are jinja::caps::to_map()'s;
// an unknown key throws std::invalid_argument.
void templates_set_caps(common_chat_templates * tmpls, const std::map<std::string, bool> & caps);

// llama.cpp's engine on a given context (ChatTemplate.render_inputs): the context handed to
// common_chat_template_direct_apply_impl as overrides, so that the object it builds is this one
// (key order included) and everything it does besides (caps_apply_*) is upstream's. No BOS/EOS
// stripping. Throws what the render throws.
std::string render_context(const common_chat_template & tmpl, const json & context, bool mark_input);

// The chat_template_caps keys of this tree, as jinja::caps::to_map() names them (GET /props).
std::vector<std::string> caps_keys();

// Set the private common_chat_templates::add_bos/add_eos, which upstream fills only
// from a model's vocab (llama_vocab_get_add_bos/eos) in common_chat_templates_init.
void templates_set_add_bos_eos(common_chat_templates * tmpls, bool add_bos, bool add_eos);

// The template common_chat_templates_apply_jinja would render with: the tool_use
// variant when `with_tools` and the file has one, else the default template.
const common_chat_template & templates_pick(const common_chat_templates * tmpls, bool with_tools);

// render_message_to_json(msgs, caps): what the template receives as `messages`
// (to_json_oaicompat per message, then messages_inp_normalizer for these caps).
json render_messages(const std::vector<common_chat_msg> & msgs, const common_chat_template & tmpl);

// ---- shim_server.cpp (tools/server/server-common.cpp) ---------------------

// Per-call options that llama-server takes from its process (env, network).
struct call_options {
    std::string media_marker = "<__media__>";  // what get_media_marker() returns for this call
    bool fetch_remote_media = false;          // let handle_media download http(s) URLs
};

// Everything one POST /apply-template (oaicompat_chat_params_parse) computes.
struct apply_result {
    json llama_params;               // the JSON object oaicompat_chat_params_parse returns
    common_chat_params chat_params;  // what it got from common_chat_templates_apply
    bool has_chat_params = false;
};

// Runs oaicompat_chat_params_parse(body, opt, files) and captures the
// common_chat_params it computes. Throws what upstream throws.
apply_result apply_request(json body, const server_chat_params & opt, const call_options & call);

// Runs oaicompat_chat_params_parse only until it calls common_chat_templates_apply,
// and returns the inputs it built (messages after media-part handling and parsing).
common_chat_templates_inputs request_inputs(json body, const server_chat_params & opt, const call_options & call);

// ---- shim_arg.cpp (common/arg.cpp) ----------------------------------------

// Parse llama-server command-line flags with upstream's parser for LLAMA_EXAMPLE_SERVER
// (common_params_parser_init + common_params_parse_ex, incl. its post-processing), without
// exiting, without LLAMA_ARG_* environment variables, and rejecting flags that load a
// model, a projector or a template or that print and exit. Throws std::invalid_argument.
common_params parse_server_args(const std::vector<std::string> & args);

// What llama-server's argument parser says of `--chat-template NAME` (with `--no-jinja` unless
// use_jinja): its error message (common_params_parse_ex checks common_chat_verify_template), or
// "" when it accepts the name.
std::string check_chat_template_arg(const std::string & name, bool use_jinja);

// ---- shim_server.cpp -------------------------------------------------------

// Fill server_chat_params as server-context.cpp's load_model() does for these params
// and templates. Throws what common_chat_templates_support_enable_thinking throws.
server_chat_params make_server_chat_params(const common_params & params, common_chat_templates_ptr tmpls);

}  // namespace llamaprompt
