// common/chat.cpp, compiled here so that its private parts (the common_chat_templates
// struct, render_message_to_json / messages_inp_normalizer) can be reached. The
// static llama-common archive's own chat.cpp object is then never linked.
//
// The copy included is the build tree's (see CMakeLists.txt): its one call of
// common_chat_try_specialized_template goes through llamaprompt_try_specialized_template
// below, so a template can take the differential autoparser path on request.
#include "chat-auto-parser.h"
#include "chat.h"
#include "jinja_guard.h"
#include "log.h"
#include "lp_prompt_ready.h"
#include "peg-parser.h"
#include "shim.h"
#include "tree.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <ctime>
#include <iomanip>
#include <locale>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_set>

namespace llamaprompt {
thread_local handler_state * current_handler = nullptr;
}

namespace llamaprompt {
static std::string parser_inputs_key(const common_chat_template & tmpl, const autoparser::generation_params & p);
static bool prompt_only_applies(const autoparser::generation_params & params);
static bool prompt_only_possible();
struct parser_memo;
static bool memo_knows(parser_memo & memo, const std::string & key);
static void memo_add(parser_memo & memo, std::string key);
static int memo_takes_handler(parser_memo & memo, const common_chat_template & tmpl);  // -1: not known yet
static void memo_set_takes_handler(parser_memo & memo, const common_chat_template & tmpl, bool takes);
}  // namespace llamaprompt

namespace llamaprompt {
// the prompt of the params a handler or generate_parser returned (a handler's through
// common_chat_try_specialized_template's optional; null: none returned)
static std::string * returned_prompt(common_chat_params & out) { return &out.prompt; }
static std::string * returned_prompt(std::optional<common_chat_params> & out) { return out ? &out->prompt : nullptr; }

// after a call that may have returned at its stop point: whether it did. Its params then hold
// the prompt and whatever the code before the stop point set; `out` is reset to empty params (as
// if the call had not returned) and `prompt` gets the prompt (which may be out's own)
template <typename T> static bool took_stop_point(handler_state & st, T & out, std::string & prompt) {
    std::string * returned = st.stopped ? returned_prompt(out) : nullptr;
    st.stopped = false;
    if (!returned) {
        return false;
    }
    std::string text = std::move(*returned);
    out = T{};
    prompt = std::move(text);
    return true;
}

// calls fn() (a handler, or generate_parser) with its prompt-only stop point armed
// (lp_prompt_ready.h): true, with `prompt`, when it returned there; false, with its result in
// `out`, when it has no stop point and ran in full
template <typename T, typename F>
static bool stopped_at_prompt(handler_state & st, F && fn, T & out, std::string & prompt) {
    struct armed {
        handler_state & st;
        ~armed() { st.stop_at_prompt = false; }
    } arm{st};
    st.stop_at_prompt = true;
    st.stopped = false;
    out = fn();
    if (took_stop_point(st, out, prompt)) {
        st.prompt_only_used = true;
        return true;
    }
    return false;
}
}  // namespace llamaprompt

// each stop point says "return now" by setting current_handler->stopped and returning true:
// the build-tree copy then returns its params at once (`if (...) { return data; }`), which the
// caller (stopped_at_prompt, llamaprompt_try_specialized_template) takes as a stop. Not an
// exception: a throw and its unwinding cost more than the rest of a short handler's request.
static bool stop_here(llamaprompt::handler_state & st) {
    st.stop_at_prompt = false;
    st.stopped = true;
    return true;
}

bool llamaprompt_prompt_ready(const char * handler) {
    using llamaprompt::current_handler;
    if (current_handler && handler) {  // null: the autoparser's generate_parser, not a handler
        current_handler->stop_point = handler;
    }
    return current_handler && current_handler->stop_at_prompt && stop_here(*current_handler);
}

bool llamaprompt_prompt_stop_armed(const char * handler) {
    using llamaprompt::current_handler;
    if (current_handler && handler) {
        current_handler->stop_point = handler;
    }
    return current_handler && current_handler->stop_at_prompt;
}

void llamaprompt_prompt_stop() {
    if (llamaprompt::current_handler) {
        stop_here(*llamaprompt::current_handler);
    }
}

bool llamaprompt_prompt_ready_after(const std::string & generation_prompt, const char * handler) {
    using namespace llamaprompt;
    handler_state * st = current_handler;
    if (!st) {
        return false;
    }
    if (handler) {
        st->stop_point = handler;
    }
    if (!st->key_before_generation_prompt || !st->memo) {
        return false;
    }
    std::string key = *st->key_before_generation_prompt + "\x1fgeneration_prompt:" + generation_prompt;
    st->key_before_generation_prompt = nullptr;  // one stop point per call
    if (memo_knows(*st->memo, key)) {
        return stop_here(*st);
    }
    st->key_with_generation_prompt = std::move(key);
    return false;
}

// the call of common_chat_try_specialized_template in common_chat_templates_apply_jinja.
// The prompt-only path (as llamaprompt_generate_parser's below, for the handlers whose file
// has a stop point): once a handler produced its params without error for these non-message
// inputs, it stops at its prompt for other messages.
static std::optional<common_chat_params> llamaprompt_try_specialized_template(
    const common_chat_template & tmpl, const std::string & src, autoparser::generation_params & params) {
    using namespace llamaprompt;
    handler_state * st = current_handler;
    if (st && st->skip_specialized) {
        return std::nullopt;
    }
    std::string key;
    const int takes_handler = st && st->memo ? memo_takes_handler(*st->memo, tmpl) : -1;
#if LP_HANDLER_CHOICE_BY_SOURCE
    if (takes_handler == 0) {
        // the choice reads only tmpl's source (adapt_tree.py handler_choice_problems), which took
        // no handler before: the chain of source searches would choose none again
        st->specialized_used = false;
        return std::nullopt;
    }
#endif
    if (st && st->memo && llamaprompt::prompt_only_applies(params) && takes_handler != 0) {
        try {
            key = "handler\x1f" + parser_inputs_key(tmpl, params);
        } catch (const std::exception &) {
            key.clear();  // not serializable: the full path decides
        }
    }
    std::optional<common_chat_params> result;
    // a handler whose stop point follows its generation prompt decides there (with the key)
    struct after_generation_prompt {
        handler_state * st;
        ~after_generation_prompt() {
            if (st) {
                st->key_before_generation_prompt = nullptr;
            }
        }
    } armed_after{!key.empty() && st->prompt_only ? st : nullptr};
    if (armed_after.st) {
        st->key_before_generation_prompt = &key;
        st->key_with_generation_prompt.clear();
    }
    if (!key.empty() && st->prompt_only && memo_knows(*st->memo, key)) {
        common_chat_params data;
        if (stopped_at_prompt(*st, [&]() { return common_chat_try_specialized_template(tmpl, src, params); }, result,
                              data.prompt)) {
            st->specialized_used = true;
            return data;
        }
    } else {
        if (st) {
            st->stopped = false;
        }
        result = common_chat_try_specialized_template(tmpl, src, params);
        if (st && st->stopped) {
            // a stop point after the generation prompt, its key known good
            common_chat_params data;
            if (took_stop_point(*st, result, data.prompt)) {
                st->prompt_only_used = true;
                st->specialized_used = true;
                return data;
            }
        }
    }
    if (st) {
        st->specialized_used = result.has_value();
    }
    if (st && st->memo && takes_handler != int(result.has_value())) {
        memo_set_takes_handler(*st->memo, tmpl, result.has_value());
    }
    if (result && !key.empty()) {
        if (!st->key_with_generation_prompt.empty()) {
            memo_add(*st->memo, std::move(st->key_with_generation_prompt));
            st->key_with_generation_prompt.clear();
        }
        memo_add(*st->memo, std::move(key));
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

// caps.to_string(), kept per thread for the last caps seen: jinja::caps is plain bools, so
// equal bytes give the same text (computed again when they differ; `changed` is then set)
static const std::string & caps_text(const jinja::caps & caps, bool & changed) {
    thread_local std::string text;
    if constexpr (std::is_trivially_copyable_v<jinja::caps>) {
        thread_local unsigned char bytes[sizeof(jinja::caps)];
        thread_local bool valid = false;
        changed = !valid || std::memcmp(bytes, &caps, sizeof(jinja::caps)) != 0;
        if (changed) {
            text = caps.to_string();
            std::memcpy(bytes, &caps, sizeof(jinja::caps));
            valid = true;
        }
    } else {
        text = caps.to_string();
        changed = true;
    }
    return text;
}

std::shared_ptr<analysis_cache> make_analysis_cache() { return std::make_shared<analysis_cache>(); }

// The analysis cache's key: the template (its address), its caps and the local date. Kept per
// thread for the last template, caps and second seen (each request asks twice: its analysis and
// its parser-inputs key), so a request usually builds no text for it.
static const std::string & analysis_key(const common_chat_template & tmpl) {
    // the local date, formatted at most once a second per thread (every request asks)
    struct day_text {  // trivial: a thread-local without a guard
        std::time_t second;
        bool known;
        char text[32];
    };
    thread_local day_text day;
    struct last_key {
        const common_chat_template * tmpl = nullptr;
        std::time_t second = 0;
        std::string text;
    };
    thread_local last_key last;
    const std::time_t now = std::time(nullptr);
    if (!day.known || day.second != now) {
        std::tm tm_now{};
#if defined(_WIN32)
        localtime_s(&tm_now, &now);
#else
        localtime_r(&now, &tm_now);
#endif
        std::strftime(day.text, sizeof(day.text), "%Y-%m-%d", &tm_now);
        day.second = now;
        day.known = true;
    }
    bool caps_changed = false;
    const std::string & caps = caps_text(tmpl.original_caps(), caps_changed);
    if (caps_changed || last.tmpl != &tmpl || last.second != now || last.text.empty()) {
        last.text = std::to_string(reinterpret_cast<uintptr_t>(&tmpl)) + "|" + caps + "|" + day.text;
        last.tmpl = &tmpl;
        last.second = now;
    }
    return last.text;
}

}  // namespace llamaprompt

// jinja::context keeps its variables in a private member (its only dump, print_vars, goes to
// stdout). Reading it without changing upstream's header: a pointer to the member formed in an
// explicit template instantiation, where access is not checked ([temp.spec.general]/6).
#if LP_HAS_TEMPLATE_INPUTS
namespace llamaprompt {
struct context_env_tag {
    using type = jinja::value_object jinja::context::*;
    friend type context_env_member(context_env_tag);
};
template <typename Tag, typename Tag::type Member> struct expose_member {
    friend typename Tag::type context_env_member(Tag) { return Member; }
};
template struct expose_member<context_env_tag, &jinja::context::env>;
}  // namespace llamaprompt
#endif

// inserted after common_chat_template_direct_apply_impl's jinja::global_from_json(ctx, inp, ...):
// the engine's variables at that point -- `inp` and what caps_apply_* set before it -- as a
// JSON object in the context's own order (value_to_json, the engine's own conversion), without
// the constants every jinja::context starts with
template <class Json>
static void llamaprompt_capture_inputs(const common_chat_template & tmpl, jinja::context & ctx, const Json & inp,
                                       bool mark_input) {
    using namespace llamaprompt;
    handler_state * st = current_handler;
#if !LP_HAS_TEMPLATE_INPUTS  // the tree lacks a capture point: template_inputs raises FeatureError
    (void) tmpl, (void) ctx, (void) inp, (void) mark_input, (void) st;
    return;
#else
    if (!st || !st->renders || st->in_analysis) {
        return;
    }
    captured_render r;
    r.tmpl = &tmpl;
    r.mark_input = mark_input;
    try {
        std::string text = "{";
        bool first = true;
        const jinja::value_object & env = ctx.*context_env_member(context_env_tag{});
        for (const auto & [key, val] : env->as_ordered_object()) {
            const std::string name = key->as_string().str();
            if (name == "true" || name == "True" || name == "false" || name == "False" || name == "none" ||
                name == "None") {
                continue;  // jinja::context's constructor's constants
            }
            text += first ? "" : ", ";
            first = false;
            text += Json(name).dump() + ": " + jinja::value_to_json(val);
        }
        text += "}";
        r.context = dump_safe(Json::parse(text));
    } catch (const std::exception &) {
        r.context = dump_safe(inp);  // not representable as JSON text: the object it was set from
    }
    st->renders->push_back(std::move(r));
#endif
}

// wraps the same function's `parts->as_string().str()`: the output of the render just captured
static std::string llamaprompt_capture_output(std::string output) {
    using namespace llamaprompt;
    handler_state * st = current_handler;
    if (st && st->renders && !st->in_analysis && !st->renders->empty() && !st->renders->back().has_output) {
        st->renders->back().output = output;
        st->renders->back().has_output = true;
    }
    return output;
}

// the template analysis renders probe inputs: not this request's renders
struct llamaprompt_analysis_scope {
    llamaprompt::handler_state * st;
    bool prev;
    explicit llamaprompt_analysis_scope(llamaprompt::handler_state * s) : st(s), prev(s ? s->in_analysis : false) {
        if (st) {
            st->in_analysis = true;
        }
    }
    ~llamaprompt_analysis_scope() {
        if (st) {
            st->in_analysis = prev;
        }
    }
};

// the template's analysis: the cached one (per ChatTemplate, by analysis_key), or a new one --
// kept in the cache unless a budget stopped some of its renders (which the analysis catches).
// Shared and never changed once made: common_chat_templates_apply_jinja reads it in place (the
// shared_analysis engine rewrite, adapt_tree.py) or copies it (llamaprompt_analyze_template).
static std::shared_ptr<const autoparser::autoparser> llamaprompt_shared_analysis(const common_chat_template & tmpl) {
    using namespace llamaprompt;
    llamaprompt_analysis_scope analysis(current_handler);
    analysis_cache * cache = current_handler ? current_handler->cache : nullptr;
    std::string key;
    if (cache) {
        const std::string & known = analysis_key(tmpl);
        {
            std::lock_guard<std::mutex> lock(cache->mutex);
            auto it = cache->results.find(known);
            if (it != cache->results.end()) {
                return it->second;
            }
        }
        key = known;  // (the thread's text: copied before the analysis renders anything)
    }
    auto made = std::make_shared<autoparser::autoparser>();
    const uint64_t fired = jinja_guard_fired();
    made->analyze_template(tmpl);  // outside the lock: analyses of different keys run in parallel
    if (cache && jinja_guard_fired() == fired) {
        std::lock_guard<std::mutex> lock(cache->mutex);
        cache->results.emplace(std::move(key), made);
    }
    return made;
}

// replaces `autoparser.analyze_template(tmpl)` in common_chat_templates_apply_jinja
static void llamaprompt_analyze_template(autoparser::autoparser & ap, const common_chat_template & tmpl) {
    ap = *llamaprompt_shared_analysis(tmpl);
}

namespace llamaprompt {

// generate_parser(tmpl, params, autoparser) reads, besides params.messages: the analysis
// (fixed per analysis_key), the template, and these fields of params. The messages reach
// the parser only through the generation prompt, which build_parser uses as a literal
// prefix. So once generation with these inputs succeeded, it succeeds for other messages.
struct parser_memo {
    std::mutex mutex;
    std::unordered_set<std::string> ok;
    static constexpr size_t max_entries = 4096;  // then it starts over
    // whether common_chat_try_specialized_template chose a handler for this template (it
    // decides by the template's source): no handler key is built for the others
    std::map<const common_chat_template *, bool> takes_handler;
    // llamaprompt_source_find: per template, the source searched (its address and size) and the
    // position each marker literal (by address) was found at
    struct source_searches {
        const std::string * src = nullptr;
        size_t size = 0;
        std::map<const char *, size_t> at;
    };
    std::map<const common_chat_template *, source_searches> source_finds;
};

std::shared_ptr<parser_memo> make_parser_memo() { return std::make_shared<parser_memo>(); }

// whether a and b have the same JSON text: node for node, keys in order, strings byte for byte;
// null and Booleans by value; any other value (a number: integer or float, signed or not, -0.0)
// by its own text, as dump() writes it
template <class Json> static bool same_json_text(const Json & a, const Json & b) {
    if (a.is_object()) {
        if (!b.is_object() || a.size() != b.size()) {
            return false;
        }
        const auto ia = a.items();
        const auto ib = b.items();
        auto y = ib.begin();
        for (auto x = ia.begin(); x != ia.end(); ++x, ++y) {
            const auto & ea = *x;
            const auto & eb = *y;
            if (ea.key() != eb.key() || !same_json_text(ea.value(), eb.value())) {
                return false;
            }
        }
        return true;
    }
    if (a.is_array()) {
        if (!b.is_array() || a.size() != b.size()) {
            return false;
        }
        for (size_t i = 0; i < a.size(); ++i) {
            if (!same_json_text(a.at(i), b.at(i))) {
                return false;
            }
        }
        return true;
    }
    if (a.is_string()) {
        return b.is_string() && a.template get<std::string>() == b.template get<std::string>();
    }
    if (a.is_null()) {
        return b.is_null();
    }
    if (a.is_boolean()) {
        return b.is_boolean() && a.template get<bool>() == b.template get<bool>();
    }
    return !b.is_object() && !b.is_array() && !b.is_string() && a.dump() == b.dump();
}

// j.dump(), kept per thread for the last few values seen (every request dumps tools, schema and
// template variables again; comparing is much cheaper than writing JSON text): for each Field, a
// list of its own (so that the values of one field do not push out another's), at most `kept`
// values, each with a text of at most max_text bytes (longer ones are written every time)
template <int Field, class Json> static const std::string & dump_recent(const Json & j) {
    struct entry {
        Json value;
        std::string text;
    };
    static constexpr size_t kept = 6;
    static constexpr size_t max_text = 1 << 14;
    thread_local std::vector<entry> recent;  // the most recent last
    thread_local std::string uncached;
    for (size_t i = recent.size(); i-- > 0;) {
        if (same_json_text(j, recent[i].value)) {
            if (i + 1 != recent.size()) {
                std::rotate(recent.begin() + i, recent.begin() + i + 1, recent.end());
            }
            return recent.back().text;
        }
    }
    std::string text = j.dump();
    if (text.size() > max_text) {
        uncached = std::move(text);
        return uncached;
    }
    if (recent.size() == kept) {
        recent.erase(recent.begin());
    }
    recent.push_back(entry{j, std::move(text)});
    return recent.back().text;
}

static std::string parser_inputs_key(const common_chat_template & tmpl, const autoparser::generation_params & p) {
    std::string key = analysis_key(tmpl);
    const auto add = [&key](const std::string & part) {
        key += '\x1f';
        key += std::to_string(part.size());
        key += ':';
        key += part;
    };
    add(dump_recent<0>(p.tools));
    add(dump_recent<1>(p.json_schema));
    add(dump_recent<2>(p.extra_context));
    add(p.grammar);
    for (int flag : {(int) p.tool_choice, (int) p.parallel_tool_calls, (int) p.reasoning_format, (int) p.stream,
                     (int) p.add_generation_prompt, (int) p.continue_final_message, (int) p.enable_thinking,
                     (int) p.add_bos, (int) p.add_eos, (int) p.is_inference, (int) p.add_inference,
                     (int) p.mark_input}) {
        key += '\x1f';
        key += std::to_string(flag);
    }
    return key;
}

// not at debug verbosity (chat.cpp then dumps the generated parser)
static bool prompt_only_possible() { return common_log_get_verbosity_thold() < LOG_LEVEL_DEBUG; }

// the prompt is exactly the full path's first render: no continuation (which appends to it),
// and the generation prompt's own render is the same call
static bool prompt_only_applies(const autoparser::generation_params & params) {
    return params.add_generation_prompt && params.continue_final_message == COMMON_CHAT_CONTINUATION_NONE &&
           prompt_only_possible();
}

static bool memo_knows(parser_memo & memo, const std::string & key) {
    std::lock_guard<std::mutex> lock(memo.mutex);
    return memo.ok.count(key) > 0;
}

static int memo_takes_handler(parser_memo & memo, const common_chat_template & tmpl) {
    std::lock_guard<std::mutex> lock(memo.mutex);
    auto it = memo.takes_handler.find(&tmpl);
    return it == memo.takes_handler.end() ? -1 : int(it->second);
}

static void memo_set_takes_handler(parser_memo & memo, const common_chat_template & tmpl, bool takes) {
    std::lock_guard<std::mutex> lock(memo.mutex);
    memo.takes_handler[&tmpl] = takes;
}

static void memo_add(parser_memo & memo, std::string key) {
    std::lock_guard<std::mutex> lock(memo.mutex);
    if (memo.ok.size() >= parser_memo::max_entries) {
        memo.ok.clear();
    }
    memo.ok.insert(std::move(key));
}

}  // namespace llamaprompt

// src.find(text) in chat.cpp, where adapt_tree.py's source_find_edits rewrote it (an engine
// rewrite): the position is kept in the ChatTemplate's memo when src is tmpl's own source, which
// does not change while the template lives (the memo lives as long as the templates); any other
// string, or a call without a memo, is searched as before
static size_t llamaprompt_source_find(const common_chat_template & tmpl, const std::string & src, const char * text) {
    llamaprompt::handler_state * st = llamaprompt::current_handler;
    if (!st || !st->memo || &src != &tmpl.source()) {
        return src.find(text);
    }
    llamaprompt::parser_memo & memo = *st->memo;
    {
        std::lock_guard<std::mutex> lock(memo.mutex);
        auto & kept = memo.source_finds[&tmpl];
        if (kept.src != &src || kept.size != src.size()) {
            kept = {&src, src.size(), {}};
        }
        auto it = kept.at.find(text);
        if (it != kept.at.end()) {
            return it->second;
        }
    }
    const size_t at = src.find(text);
    std::lock_guard<std::mutex> lock(memo.mutex);
    memo.source_finds[&tmpl].at.emplace(text, at);
    return at;
}

// replaces the call of autoparser::peg_generator::generate_parser in
// common_chat_templates_apply_jinja
static common_chat_params llamaprompt_generate_parser(const common_chat_template & tmpl,
                                                      const autoparser::generation_params & params,
                                                      const autoparser::autoparser & ap) {
    using namespace llamaprompt;
    handler_state * st = current_handler;
    if (st && st->on_generate) {
        st->on_generate(tmpl, params);
    }
    parser_memo * memo = st ? st->memo : nullptr;
    std::string key;
    if (memo && prompt_only_possible()) {
        try {
            key = parser_inputs_key(tmpl, params);
        } catch (const std::exception &) {
            key.clear();  // not serializable: the full path decides
        }
    }
    if (!key.empty() && st->prompt_only && memo_knows(*memo, key)) {
        if (prompt_only_applies(params)) {
            common_chat_params data;
            data.prompt = common_chat_template_direct_apply(tmpl, params);
            st->prompt_only_used = true;
            return data;
        }
        // a continuation, or no generation prompt: generate_parser's own prompt and generation
        // prompt renders, up to its stop point before the parser (adapt_tree.py generator_rewrite);
        // a tree without that stop point runs it in full
        common_chat_params data;
        stopped_at_prompt(*st, [&]() { return autoparser::peg_generator::generate_parser(tmpl, params, ap); }, data,
                          data.prompt);
        return data;
    }
    common_chat_params data = autoparser::peg_generator::generate_parser(tmpl, params, ap);
    if (!key.empty()) {
        memo_add(*memo, std::move(key));
    }
    return data;
}

// replaces `arena.load(auto_params.parser)` (it only feeds a debug log line): there is no
// parser to load when the prompt-only path was taken
static void llamaprompt_load_parser(common_peg_arena & arena, const std::string & parser) {
    if (llamaprompt::current_handler && llamaprompt::current_handler->prompt_only_used) {
        return;
    }
    arena.load(parser);
}

namespace llamaprompt {
// the prompt just rendered, and the inputs it was rendered with (llamaprompt_rendered_prompt)
struct rendered_prompt_state {
    const std::string * prompt = nullptr;
    const void * inputs = nullptr;
};
thread_local rendered_prompt_state rendered_prompt;
}  // namespace llamaprompt

llamaprompt_rendered_prompt::llamaprompt_rendered_prompt(const std::string & prompt, const void * inputs)
    : prev_prompt_(llamaprompt::rendered_prompt.prompt), prev_inputs_(llamaprompt::rendered_prompt.inputs) {
    llamaprompt::rendered_prompt = {&prompt, inputs};
}

llamaprompt_rendered_prompt::~llamaprompt_rendered_prompt() {
    llamaprompt::rendered_prompt = {prev_prompt_, prev_inputs_};
}

// replaces a render of common_chat_template_generation_prompt_impl (adapt_tree.py
// no_gen_reuse_problems: its inputs' copy differs from `inputs` only in fields that
// common_chat_template_direct_apply_impl does not read, and in add_generation_prompt): the prompt
// its caller rendered with the same arguments just before, if there is one for these inputs and
// `same_render` (the copy's add_generation_prompt is the request's), else render() -- always
// render() while template_inputs records every render of the request. `last_use`: the prompt is
// handed to no later render (each generation_prompt_impl call's last replaced render clears it)
template <typename Render>
static std::string llamaprompt_reuse_render(const void * inputs, bool same_render, bool last_use, Render && render) {
    const llamaprompt::rendered_prompt_state known = llamaprompt::rendered_prompt;
    if (last_use) {
        llamaprompt::rendered_prompt = {};
    }
    const llamaprompt::handler_state * st = llamaprompt::current_handler;
    if (known.prompt && known.inputs == inputs && same_render && !(st && st->renders)) {
        return *known.prompt;
    }
    return render();
}

// the render without add_generation_prompt (the only one replaced: a tree whose second render,
// with add_generation_prompt, is not written as expected)
template <typename Render>
static std::string llamaprompt_no_gen_render(const void * inputs, bool no_generation_prompt, Render && render) {
    return llamaprompt_reuse_render(inputs, no_generation_prompt, true, std::forward<Render>(render));
}

// the render without add_generation_prompt, then the one with it (both replaced)
template <typename Render>
static std::string llamaprompt_no_gen_render_first(const void * inputs, bool no_generation_prompt, Render && render) {
    return llamaprompt_reuse_render(inputs, no_generation_prompt, false, std::forward<Render>(render));
}

template <typename Render>
static std::string llamaprompt_gen_render(const void * inputs, bool generation_prompt, Render && render) {
    return llamaprompt_reuse_render(inputs, generation_prompt, true, std::forward<Render>(render));
}

namespace llamaprompt {
#if defined(__GLIBC__)
// every field strftime may read (glibc's tm_gmtoff and tm_zone: %z, %Z, and locales whose %c
// prints the zone)
static bool same_broken_down_time(const std::tm & a, const std::tm & b) {
    return a.tm_sec == b.tm_sec && a.tm_min == b.tm_min && a.tm_hour == b.tm_hour && a.tm_mday == b.tm_mday &&
           a.tm_mon == b.tm_mon && a.tm_year == b.tm_year && a.tm_wday == b.tm_wday && a.tm_yday == b.tm_yday &&
           a.tm_isdst == b.tm_isdst && a.tm_gmtoff == b.tm_gmtoff &&
           (a.tm_zone == b.tm_zone || (a.tm_zone && b.tm_zone && std::strcmp(a.tm_zone, b.tm_zone) == 0));
}
#endif
}  // namespace llamaprompt

// replaces format_time's `std::ostringstream ss; ss << std::put_time(&local_time, format.c_str());
// return ss.str();` (adapt_tree.py: an engine rewrite): the same text. A new stream is imbued with
// the global C++ locale; its text is a function of the broken-down time, the format and that
// locale, so the last one printed on this thread is reused while all three are the same (every
// request prints the same two dates within a second). Other C libraries: printed every time.
static std::string llamaprompt_put_time(const std::tm & local_time, const std::string & format) {
#if defined(__GLIBC__)
    struct printed {
        bool valid = false;
        std::tm time{};
        std::string format;
        std::locale locale;
        std::string text;
    };
    static thread_local printed last[2];  // the request's two formats
    const std::locale locale;             // the global locale, as a new stream's
    for (const printed & p : last) {
        if (p.valid && p.format == format && llamaprompt::same_broken_down_time(p.time, local_time) &&
            p.locale == locale) {
            return p.text;
        }
    }
#endif
    std::ostringstream ss;
    ss << std::put_time(&local_time, format.c_str());
#if defined(__GLIBC__)
    // the first slot for the first format printed, the second for any other
    printed & slot = !last[0].valid || last[0].format == format ? last[0] : last[1];
    slot.valid = false;
    slot.time = local_time;
    slot.format = format;
    slot.locale = locale;
    slot.text = ss.str();
    slot.valid = true;
    return slot.text;
#else
    return ss.str();
#endif
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
#if LP_HAS_CAPS_REASONING_EFFORT
        {"supports_reasoning_effort", &jinja::caps::supports_reasoning_effort},
#endif
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

std::vector<std::string> caps_keys() {
    std::vector<std::string> keys;
    for (const auto & [name, value] : jinja::caps{}.to_map()) {
        keys.push_back(name);
    }
    return keys;
}

const common_chat_template & templates_pick(const common_chat_templates * tmpls, bool with_tools) {
    GGML_ASSERT(tmpls != nullptr && tmpls->template_default != nullptr);
    // same choice as common_chat_templates_apply_jinja
    return with_tools && tmpls->template_tool_use ? *tmpls->template_tool_use : *tmpls->template_default;
}

json render_messages(const std::vector<common_chat_msg> & msgs, const common_chat_template & tmpl) {
    return render_message_to_json(msgs, tmpl.original_caps());
}

std::string render_context(const common_chat_template & tmpl, const json & context, bool mark_input) {
#if !LP_HAS_TEMPLATE_INPUTS
    (void) tmpl;
    (void) context;
    (void) mark_input;
    throw std::runtime_error("this llama.cpp tree has no common_chat_template_direct_apply_impl to render a context");
#else
    if (!context.is_object()) {
        throw std::invalid_argument("the template context must be a JSON object");
    }
    // common_chat_template_direct_apply_impl builds {messages, bos_token, eos_token, enable_thinking,
    // [tools], [extra context...], [add_generation_prompt]}: give it the parts so that it builds
    // exactly `context` (the additional context, applied last, puts back every other key in order)
    autoparser::generation_params params;
    params.enable_thinking = context.contains("enable_thinking") && context.at("enable_thinking").is_boolean()
                                 ? context.at("enable_thinking").get<bool>()
                                 : params.enable_thinking;
    params.add_generation_prompt = false;  // the context's own add_generation_prompt, if any, is kept below
    params.add_bos = false;
    params.add_eos = false;
    params.mark_input = mark_input;
    std::optional<json> messages = context.contains("messages") ? std::optional<json>(context.at("messages"))
                                                                : std::optional<json>(json::array());
    std::optional<json> tools;
    if (context.contains("tools")) {
        tools = context.at("tools");
    }
    json rest = json::object();
    for (const auto & [k, v] : context.items()) {
        if (k != "messages" && k != "tools") {
            rest[k] = v;
        }
    }
    return common_chat_template_direct_apply_impl(tmpl, params, messages, tools, rest);
#endif
}

}  // namespace llamaprompt
