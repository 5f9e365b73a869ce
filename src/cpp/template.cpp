// _core.Template: one chat template loaded as llama-server loads it, and the calls
// llama-server makes with it (GET /props, POST /apply-template). JSON crosses the
// boundary as text: common_json is not nlohmann, so Python's json does the rest.
#include "errors.h"
#include "jinja_guard.h"
#include "logging.h"
#include "memory.h"
#include "model.h"
#include "request.h"
#include "shim.h"
#include "text.h"
#include "tree.h"
#include "worker_pool.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace py = pybind11;

namespace llamaprompt {

namespace {

// what parse_body refuses in a parsed body (llama-server has none of these limits)
json check_body(json body, size_t max_tools) {
    // llama.cpp's parser and grammar generation grow faster than linearly with the number of
    // tools (5000 tools: ~7 s and 1.5 GB; 10^5 exhaust memory): refused above the limit
    if (max_tools && body.is_object() && body.contains("tools") && body.at("tools").is_array() &&
        body.at("tools").size() > max_tools) {
        throw error(error_kind::request, 400,
                    "the request has " + std::to_string(body.at("tools").size()) + " tools, more than max_tools (" +
                        std::to_string(max_tools) + ")");
    }
    // a tool's (or response format's) JSON schema with very many properties: llama.cpp's
    // parser/grammar generation grows faster than linearly (Qwen3: 1000 properties ~2 s,
    // 2000 ~22 s, 20000 exhausted 6 GB and crashed); refused above max_schema_properties
    constexpr size_t max_schema_properties = 1024;
    std::vector<const json *> todo;
    for (const char * key : {"tools", "response_format", "json_schema"}) {
        if (body.is_object() && body.contains(key)) {
            todo.push_back(&body.at(key));
        }
    }
    while (!todo.empty()) {
        const json * v = todo.back();
        todo.pop_back();
        if (v->is_object()) {
            if (v->contains("properties") && v->at("properties").is_object() &&
                v->at("properties").size() > max_schema_properties) {
                throw error(error_kind::request, 400,
                            "a JSON schema in the request has " + std::to_string(v->at("properties").size()) +
                                " properties, more than llamaprompt accepts (" +
                                std::to_string(max_schema_properties) + ")");
            }
            for (const auto & [k, item] : v->items()) {
                todo.push_back(&item);
            }
        } else if (v->is_array()) {
            for (const auto & item : *v) {
                todo.push_back(&item);
            }
        }
    }
    return body;
}

// the request body's JSON text, parsed as post_apply_template does (json::parse(req.body)):
// a common_json_error is a std::runtime_error, so llama-server answers 500
json parse_body(const std::string & text, size_t max_tools) {
    // llama.cpp's JSON copies nest recursively: a body nested deeper than max_body_depth would
    // overflow the C++ stack (~150k levels in nlohmann's recursive copy), so it is refused
    // first; llama-server has no such limit (it would crash)
    // an object's parse looks each new key up among the ones before it (ordered_json: a
    // linear search), so its time grows with the square of its members: 30,000 keys ~2 s,
    // 100,000 ~30 s, before any budget applies. Refused first: an object of more than
    // max_object_members (10,000), and objects whose lookups add up to more than two such
    // objects' (twelve of 10,000 took 3 s). llama-server has no such limit: it parses them.
    constexpr size_t max_object_commas = max_object_members - 1;
    uint64_t lookups = 0;  // a member after n others: n key comparisons
    int depth = 0;
    bool in_string = false;
    std::vector<size_t> commas;  // per open object (arrays hold SIZE_MAX: not counted)
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\') {
                ++i;
            } else if (c == '"') {
                in_string = false;
            }
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            if (++depth > max_body_depth) {
                throw error(error_kind::request, 400, "request is nested too deeply");
            }
            commas.push_back(c == '{' ? 0 : SIZE_MAX);
        } else if (c == ']' || c == '}') {
            --depth;
            if (!commas.empty()) {
                commas.pop_back();
            }
        } else if (c == ',' && !commas.empty() && commas.back() != SIZE_MAX) {
            if (++commas.back() > max_object_commas) {
                throw error(error_kind::request, 400,
                            "a JSON object in the request has more than " + std::to_string(max_object_commas + 1) +
                                " members (llamaprompt's limit)");
            }
            if ((lookups += commas.back()) > max_body_lookups) {
                throw error(error_kind::request, 400,
                            "the JSON objects in the request have too many members together: parsing them would "
                            "take as long as more than two objects of " + std::to_string(max_object_commas + 1) +
                                " members (llamaprompt's limit)");
            }
        }
    }
    return check_body(json::parse(text), max_tools);
}

// the body as the core received it: a tree (request.h: what json::parse gives for Python's
// text of it) or the text
json parse_body(body_in && in, size_t max_tools) {
    return in.is_tree ? check_body(std::move(in.tree), max_tools) : parse_body(in.text, max_tools);
}

json trigger_to_json(const common_grammar_trigger & t) {
    // the same fields server_grammar_trigger::to_json writes
    json out = server_grammar_trigger(t).to_json();
    return out;
}

json chat_params_to_json(const common_chat_params & p) {
    json triggers = json::array();
    for (const auto & t : p.grammar_triggers) {
        triggers.push_back(trigger_to_json(t));
    }
    json out = json::object();
    out["format"] = std::string(common_chat_format_name(p.format));
    out["prompt"] = p.prompt;
    out["grammar"] = p.grammar;
    out["grammar_lazy"] = p.grammar_lazy;
    out["grammar_triggers"] = triggers;
    out["preserved_tokens"] = p.preserved_tokens;
    out["additional_stops"] = p.additional_stops;
    out["generation_prompt"] = p.generation_prompt;
    out["supports_thinking"] = p.supports_thinking;
    out["thinking_start_tag"] = p.thinking_start_tag;
#if LP_HAS_THINKING_END_TAGS
    out["thinking_end_tags"] = p.thinking_end_tags;
#else
    // this tree's common_chat_params has one thinking_end_tag: reported as a list of it
    out["thinking_end_tags"] = p.thinking_end_tag.empty() ? std::vector<std::string>{}
                                                           : std::vector<std::string>{p.thinking_end_tag};
#endif
    out["parser"] = p.parser;
#if LP_HAS_MESSAGE_DELIMITERS
    out["message_delimiters"] = p.message_delimiters.to_json();
#else
    out["message_delimiters"] = nullptr;  // not in this tree's common_chat_params
#endif
    return out;
}

// Run `fn` under a jinja_budget. An exception raised while a budget guard fired is a
// TemplateError (500) with upstream's message, whatever upstream wrapped it in (the
// autoparser path rethrows template failures as std::invalid_argument, a 400).
template <typename F>
auto budgeted(const jinja_limits & limits, F && fn) -> decltype(fn()) {
    jinja_budget budget(limits);
    const uint64_t fired = jinja_guard_fired();
    try {
        return fn();
    } catch (const error &) {
        throw;
    } catch (const std::exception & e) {
        if (jinja_guard_fired() != fired) {
            throw error(error_kind::template_, 500, e.what());
        }
        throw;
    }
}

}  // namespace

class core_template {
  public:
    // a template given as text (llama-server --chat-template-file), BOS/EOS and
    // add_bos/add_eos given by the caller instead of a model's vocab
    core_template(const std::string & source, const std::string & bos_token, const std::string & eos_token,
                  bool add_bos, bool add_eos, const std::vector<std::string> & server_args,
                  const std::string & media_marker, bool fetch_remote_media,
                  const std::map<std::string, bool> & caps, bool skip_specialized, bool fast_path, double timeout,
                  size_t max_output_bytes, size_t max_tools) {
        configure(caps, skip_specialized, fast_path, timeout, max_output_bytes, max_tools);
        const std::unique_ptr<common_params> params = parse_args(server_args);
        if (source.empty()) {
            // common_chat_templates_init would take the model's template (GGML_ASSERT(model))
            throw error(error_kind::template_, 0, "the chat template is empty");
        }
        init(*params, media_marker, fetch_remote_media, bos_token, eos_token, [&]() {
            common_chat_templates_ptr tmpls = common_chat_templates_init(nullptr, source, bos_token, eos_token);
            templates_set_add_bos_eos(tmpls.get(), add_bos, add_eos);
            return tmpls;
        }, source);
    }

    // a model's template, as llama-server -m FILE [--chat-template-file F] loads it:
    // common_chat_templates_init(model, params.chat_template) takes the default template,
    // the tool_use variant (or chatml), the BOS/EOS text and add_bos/add_eos from the vocab
    core_template(std::shared_ptr<core_model> model, const std::string & chat_template_override,
                  const std::vector<std::string> & server_args, const std::string & media_marker,
                  bool fetch_remote_media, const std::map<std::string, bool> & caps, bool skip_specialized,
                  bool fast_path, double timeout, size_t max_output_bytes, size_t max_tools) {
        configure(caps, skip_specialized, fast_path, timeout, max_output_bytes, max_tools);
        const std::unique_ptr<common_params> params = parse_args(server_args);
        const llama_vocab * vocab = model->vocab();
        // the BOS/EOS text GET /props reports (server-context.cpp: common_token_to_piece(ctx, id, true))
        const llama_token bos_id = llama_vocab_bos(vocab);
        const llama_token eos_id = llama_vocab_eos(vocab);
        const std::string bos = bos_id != LLAMA_TOKEN_NULL ? common_token_to_piece(vocab, bos_id, true) : "";
        const std::string eos = eos_id != LLAMA_TOKEN_NULL ? common_token_to_piece(vocab, eos_id, true) : "";
        // (for a parse error's message: the template common_chat_templates_init parses as the default
        // -- the override, else the file's, and where that is missing or "chatml" the tool_use one)
        const char * in_file = llama_model_chat_template(model->model(), nullptr);
        const char * tool_use = llama_model_chat_template(model->model(), "tool_use");
        std::string shown = !chat_template_override.empty() ? chat_template_override : (in_file ? in_file : "");
        if ((shown.empty() || shown == "chatml") && tool_use != nullptr && *tool_use != '\0') {
            shown = tool_use;
        }
        init(*params, media_marker, fetch_remote_media, bos, eos, [&]() {
            return common_chat_templates_init(model->model(), chat_template_override);
        }, shown);
    }

    std::map<std::string, bool> caps() const { return common_chat_templates_get_caps(opt_.tmpls.get()); }

    std::string source(const std::string & variant) const {
        return common_chat_templates_source(opt_.tmpls.get(), variant);
    }

    bool enable_thinking() const { return opt_.enable_thinking; }

    // which media a request may carry: llama-server sets these from the loaded projector
    // (mtmd_support_vision / _audio, mtmd_helper_support_video; all false without --mmproj).
    // Called once by ChatTemplate right after construction, before the object is shared.
    void set_media(bool image, bool audio, bool video) {
        opt_.allow_image = image;
        opt_.allow_audio = audio;
        opt_.allow_video = video;
    }
    bool use_jinja() const { return use_jinja_; }

    // The top-level request keys ChatTemplate's notices wait for (llamaprompt/notices.py): bit i
    // stands for keys[i], and a bit of `nonempty` counts only a non-empty array there. apply_template
    // (and _many) look for the pending ones in the body they parse anyway, and call
    // on_seen(bits seen) -> the bits still pending, with the GIL, after the render (also when it
    // failed). Called once by ChatTemplate right after construction, before the object is shared.
    void watch_notices(std::vector<std::string> keys, uint32_t nonempty, uint32_t pending, py::function on_seen) {
        if (keys.size() > 32) {
            throw std::invalid_argument("watch_notices: at most 32 keys");
        }
        notice_keys_ = std::move(keys);
        notice_nonempty_ = nonempty;
        notice_pending_->store(pending, std::memory_order_relaxed);
        notice_seen_ = std::move(on_seen);
    }
    // how many apply_template calls took the prompt-only path (tests, benchmarks)
    uint64_t prompt_only_renders() const { return prompt_only_renders_->load(); }
    // how many apply_template / apply bodies the core took as trees, not text (request.h; tests)
    uint64_t tree_bodies() const { return tree_bodies_->load(); }
    // take_body, counted
    body_in take(py::handle request, py::handle encode) const {
        body_in body = take_body(request, encode);
        if (body.is_tree) {
            tree_bodies_->fetch_add(1, std::memory_order_relaxed);
        }
        return body;
    }
    const std::map<std::string, bool> & detected_caps() const { return detected_caps_; }

    // the chat-template part of GET /props (get_res_props in server-context.cpp)
    py::object props() const {
        py::dict props;
        props["chat_template"] = text_to_py(source(""));
        props["chat_template_caps"] = caps();
        props["bos_token"] = text_to_py(bos_token_);
        props["eos_token"] = text_to_py(eos_token_);
        props["media_marker"] = text_to_py(call_.media_marker);
        // {"vision", "video", "audio"}: what the projector supports (has_inp_image/video/audio)
        py::dict modalities;
        modalities["vision"] = opt_.allow_image;
        modalities["video"] = opt_.allow_video;
        modalities["audio"] = opt_.allow_audio;
        props["modalities"] = modalities;
        const std::string tool_use = source("tool_use");
        if (use_jinja_ && !tool_use.empty()) {
            props["chat_template_tool_use"] = text_to_py(tool_use);
        }
        return props;
    }

    // POST /apply-template: the prompt for a body given as JSON text (bytes) or a dict
    // (request.h: take_body; `encode(dict)` -> bytes for a dict it does not take as a tree).
    // `notices`: look for the watch_notices keys in the body; false for a body a hook made,
    // whose keys the caller did not send.
    py::object apply_template(py::handle request, double timeout, bool notices, py::handle encode) const {
        body_in body = take(request, encode);
        std::atomic<uint32_t> seen{0};
        return with_log_capture([&]() {
            std::string prompt;
            try {
                prompt = call_upstream([&]() { return prompt_for(std::move(body), timeout, notices ? &seen : nullptr); });
            } catch (const error &) {
                notify_seen(seen.load());  // (no Python object of ours is alive: see with_log_capture)
                throw;
            }
            notify_seen(seen.load());
            return text_to_py(prompt);
        });
    }

    // apply_template for each body (bytes or dict, as for apply_template), on `threads` threads
    // (the GIL released throughout the renders); each item is the prompt (str) or the
    // llamaprompt.errors exception it raised (or the exception `encode` raised for it)
    py::list apply_template_many(const py::list & requests, int threads, double timeout, py::handle encode) const {
        struct outcome {
            std::string text;  // the prompt, or the error message
            int status = 0;    // 0: a prompt; else the HTTP status (400 / 500)
            std::vector<log_record> logs;  // llama.cpp's log lines of this render (emitted in order)
        };
        const size_t n = requests.size();
        // a batch this large makes and frees its memory without the GIL (the pages written or given
        // back would keep the other Python threads waiting: ~30 ms each way for 300,000)
        constexpr size_t large_batch = 4096;
        std::vector<body_in> bodies;
        std::vector<py::object> refused(n);  // what `encode` raised (untouched without the GIL)
        std::vector<outcome> out;
        // their memory made (written, page by page: ~30 ms for 300,000) without the GIL, for a
        // batch large enough to keep the other Python threads waiting that long (and freed so, below)
        const auto make_room = [&]() {
            bodies.resize(n);
            out.resize(n);
        };
        if (n >= large_batch) {
            without_gil(make_room);
        } else {
            make_room();
        }
        std::atomic<uint32_t> seen{0};
        // the bodies taken so far: the renders start on the pool's threads while this thread,
        // GIL held, still takes the next ones (the pool's threads touch no Python object)
        struct {
            std::mutex mutex;
            std::condition_variable more;
            size_t ready = 0;
            bool abandoned = false;  // taking them failed: render no more (the batch raises)
        } feed;
        std::atomic<size_t> next{0};
        // set when the caller is interrupted (a signal handler raised, or the thread is unwound
        // taking the GIL back): no thread starts another render, and the renders in progress stop
        // at their next time check (jinja_cancel): no one gets their prompts
        std::atomic<bool> stop{false};
        const auto render = [&](size_t i) {
            if (refused[i]) {
                return;
            }
            fork_hold hold;
            jinja_cancel cancel(stop, "the batch was interrupted");  // (its prompts are not returned)
            log_capture logs;  // as apply_template's, per render
            // the same classification as call_upstream (llama-server's ex_wrapper)
            try {
                out[i].text = prompt_for(std::move(bodies[i]), timeout, &seen);
            } catch (const error & e) {
                out[i] = {e.what(), e.status ? e.status : 500};
            } catch (const std::invalid_argument & e) {
                out[i] = {e.what(), 400};
            } catch (const std::exception & e) {
                out[i] = {e.what(), 500};
            } catch (...) {
                out[i] = {"unknown error", 500};
            }
            out[i].logs = logs.records();
        };
        const std::function<void()> work = [&]() {  // (thread_batch keeps a reference to it)
            for (size_t i; !stop.load(std::memory_order_relaxed) && (i = next++) < bodies.size();) {
                {
                    std::unique_lock<std::mutex> lock(feed.mutex);
                    feed.more.wait(lock, [&] { return feed.ready > i || feed.abandoned; });
                    if (feed.abandoned) {
                        return;
                    }
                }
                render(i);
            }
        };
        // the calling thread and threads kept between calls (worker_pool.h)
        thread_batch batch(std::max<size_t>(1, std::min<size_t>(threads, bodies.size())), work);
        // the rest of the batch: this thread's share, then the renders in progress, GIL released
        // (other Python threads run meanwhile)
        // (and the calling thread's arena's freed chunks merged while the GIL is released: memory.h)
        const auto join = [&]() {
            without_gil([&]() {
                batch.join();
                merge_freed_chunks();
            }, gil_released::per_render);
        };
        // interrupted: no thread starts another render, the renders in progress stop at their next
        // time check (jinja_cancel), and once they have, the caller gets the interruption
        const auto stop_and_join = [&]() {
            stop.store(true);
            join();
        };
        try {
            // when taking a body throws (a KeyboardInterrupt; also a thread's forced unwinding):
            // the pool's threads end the render they are in and start no other, so the exception
            // is not held up (GIL held) by renders whose prompts no one will get
            struct abandon_unless_all_taken {
                decltype(feed) & f;
                bool all_taken = false;
                ~abandon_unless_all_taken() {
                    if (all_taken) {
                        return;
                    }
                    {
                        std::lock_guard<std::mutex> lock(f.mutex);
                        f.abandoned = true;
                    }
                    f.more.notify_all();
                }
            } close_feed{feed};
            // a dict is taken without running Python code: the signal handlers are run before each
            // request, and the GIL is offered to the other threads (gil.h: gil_offer)
            gil_offer offer;
            for (size_t i = 0; i < bodies.size(); ++i) {
                if (PyErr_CheckSignals() != 0) {
                    throw py::error_already_set();
                }
                offer(i);
                try {
                    bodies[i] = take(requests[i], encode);
                } catch (py::error_already_set & e) {
                    if (!e.matches(PyExc_Exception)) {
                        throw;  // KeyboardInterrupt ...
                    }
                    refused[i] = e.value();
                }
                {
                    std::lock_guard<std::mutex> lock(feed.mutex);
                    feed.ready = i + 1;
                }
                feed.more.notify_all();
            }
            close_feed.all_taken = true;
        } catch (py::error_already_set &) {
            stop_and_join();  // (the feed is abandoned: only the renders in progress)
            throw;
        }
        {
            // every body taken: this thread renders too, without the GIL, in slices of
            // `signal_check` -- between them it takes the GIL back only to run Python's signal
            // handlers, so a Ctrl-C reaches the caller after the renders in progress, not after
            // the batch. Interrupted (or unwound taking the GIL), no thread starts another render.
            struct stop_unless_done {
                std::atomic<bool> & s;
                bool done = false;
                ~stop_unless_done() {
                    if (!done) {
                        s.store(true);
                    }
                }
            } stop_guard{stop};
            // (a Ctrl-C also stops the render in progress here, without_gil's sigint_watch: its
            // KeyboardInterrupt is thrown out of the slice, and the pool's renders are stopped)
            constexpr auto signal_check = std::chrono::milliseconds(100);
            while (next.load() < bodies.size()) {
                try {
                    without_gil(
                        [&]() {
                            const auto until = std::chrono::steady_clock::now() + signal_check;
                            for (size_t i; std::chrono::steady_clock::now() < until && !sigint_watch_saw_signal() &&
                                           (i = next++) < bodies.size();) {
                                render(i);
                            }
                        },
                        gil_released::per_render);
                } catch (py::error_already_set &) {
                    stop_and_join();
                    throw;
                } catch (const error &) {  // (stopped, and no handler raised: raise_watched_interrupt)
                    stop_and_join();
                    throw;
                }
                if (PyErr_CheckSignals() != 0) {
                    py::error_already_set interrupted;  // (fetched before the GIL is released)
                    stop_and_join();
                    throw interrupted;
                }
            }
            stop_guard.done = true;
        }
        join();
        // the notices first (as apply_template's), then the log, in order, then the results: no
        // Python object of ours is alive while the handlers run (with_log_capture says why)
        notify_seen(seen.load());
        for (const auto & o : out) {
            emit_records(o.logs);
        }
        // (the prompts become Python strings with the GIL held, offered to the other threads every
        // 5 ms: 300,000 prompts of Qwen3's took ~40 ms)
        py::list result;
        gil_offer offer;
        for (size_t i = 0; i < out.size(); ++i) {
            offer(i);
            const outcome & o = out[i];
            if (refused[i]) {
                result.append(refused[i]);
            } else if (o.status == 0) {
                result.append(text_to_py(o.text));
            } else {
                result.append(make_py_error(o.status == 400 ? error_kind::request : error_kind::template_, o.status,
                                            o.text));
            }
        }
        // a large batch's prompts and slots freed without the GIL (and glibc's merge of the freed
        // chunks that a large free starts: ~20 ms for 300,000, with the GIL held at the return)
        if (n >= large_batch) {
            without_gil([&]() {
                std::vector<outcome>().swap(out);
                std::vector<body_in>().swap(bodies);
                merge_freed_chunks();
            });
        }
        return result;
    }

    // benchmarks: seconds per call of common_chat_template_direct_apply with the template and
    // generation_params this request renders with on the autoparser path (one plain execution
    // of the template: the floor of an exact prompt); None when that path is not taken
    py::object time_direct_apply(const std::string & body_text, int repeat) const {
        double seconds = -1;
        call_upstream([&]() {
            auto serial = serialize();
            json body = parse_body(body_text, max_tools_);
            handler_state st = handler_;
            st.memo = nullptr;
            st.on_generate = [&](const common_chat_template & tmpl, const autoparser::generation_params & params) {
                common_chat_template_direct_apply(tmpl, params);  // warm-up
                const auto t0 = std::chrono::steady_clock::now();
                for (int i = 0; i < repeat; ++i) {
                    common_chat_template_direct_apply(tmpl, params);
                }
                const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
                seconds = dt.count() / std::max(1, repeat);
            };
            scoped_handler in_force(st);
            apply_request(std::move(body), opt_, call_);
            return 0;
        });
        return seconds < 0 ? py::object(py::none()) : py::object(py::float_(seconds));
    }

    // the same call, everything it computes (the body as for apply_template)
    py::object apply(py::handle request, double timeout, py::handle encode) const {
        body_in body = take(request, encode);
        return with_log_capture([&]() { return apply_impl(std::move(body), timeout); });
    }

    py::object apply_impl(body_in && in, double timeout) const {
        struct out_t {
            std::string json_text;  // bad UTF-8 replaced, as llama-server's JSON responses do
            std::string prompt;     // the exact bytes
            std::string generation_prompt;
        };
        out_t out = call_upstream([&]() {
            auto serial = serialize();
            json body = parse_body(std::move(in), max_tools_);
            handler_state st = handler_;
            scoped_handler in_force(st);
            apply_result res = budgeted(limits(timeout), [&]() { return apply_request(std::move(body), opt_, call_); });
            json result = json::object();
            result["llama_params"] = res.llama_params;
            result["chat_params"] = chat_params_to_json(res.chat_params);
            // which path common_chat_templates_apply_jinja took (for describe())
            result["specialized_handler"] = st.specialized_used;
            // the specialized handler's name when it has a prompt-only stop point (lp_prompt_ready.h)
            result["prompt_stop_point"] = st.stop_point ? json(st.stop_point) : json(nullptr);
            return out_t{dump_safe(result), res.chat_params.prompt, res.chat_params.generation_prompt};
        });
        // a template can cut a multi-byte character: the prompts keep their bytes (as
        // surrogate escapes, like apply_template's) where JSON could not carry them
        py::object result = json_text_to_py(out.json_text);
        for (const char * part : {"chat_params", "llama_params"}) {
            py::dict d = result[part];
            if (d.contains("prompt")) {
                d["prompt"] = text_to_py(out.prompt);
            }
            if (d.contains("generation_prompt")) {
                d["generation_prompt"] = text_to_py(out.generation_prompt);
            }
        }
        return result;
    }

    // every render of the template this request makes (the same call as apply()): each one's Jinja
    // context as common_chat_template_direct_apply_impl hands it to the engine, which template
    // variant, and its output; plus the prompt. {"prompt", "renders": [{"context", "variant",
    // "mark_input", "output"}]}
    py::object template_inputs(const std::string & body_text, double timeout) const {
        return with_log_capture([&]() {
            struct out_t {
                std::vector<captured_render> renders;
                std::string prompt;
            };
            out_t out = call_upstream([&]() {
                auto serial = serialize();
                json body = parse_body(body_text, max_tools_);
                handler_state st = handler_;
                out_t o;
                st.renders = &o.renders;
                scoped_handler in_force(st);
                apply_result res =
                    budgeted(limits(timeout), [&]() { return apply_request(std::move(body), opt_, call_); });
                o.prompt = res.llama_params.at("prompt").get<std::string>();
                return o;
            });
            const common_chat_template * tool_use =
                use_jinja_ ? &templates_pick(opt_.tmpls.get(), true) : nullptr;
            const common_chat_template * dflt = use_jinja_ ? &templates_pick(opt_.tmpls.get(), false) : nullptr;
            py::list renders;
            for (const auto & r : out.renders) {
                py::dict d;
                d["context"] = json_text_to_py(r.context);
                d["variant"] = r.tmpl == dflt ? "default" : r.tmpl == tool_use ? "tool_use" : "other";
                d["mark_input"] = r.mark_input;
                d["output"] = r.has_output ? text_to_py(r.output) : py::object(py::none());
                renders.append(d);
            }
            py::dict result;
            result["prompt"] = text_to_py(out.prompt);
            result["renders"] = renders;
            return result;
        });
    }

    // llama.cpp's Jinja engine on a given context (no normalization, no handler, no BOS/EOS
    // stripping): variant "default" or "tool_use"
    py::object render_inputs(const std::string & context_text, const std::string & variant, bool mark_input,
                             double timeout) const {
        return with_log_capture([&]() {
            return text_to_py(call_upstream([&]() {
                if (!use_jinja_) {
                    throw std::invalid_argument("render_inputs needs a Jinja template (this one is built-in)");
                }
                auto serial = serialize();
                json context = parse_body(context_text, max_tools_);
                const common_chat_template & tmpl = templates_pick(opt_.tmpls.get(), variant == "tool_use");
                handler_state st = handler_;
                scoped_handler in_force(st);
                return budgeted(limits(timeout), [&]() { return render_context(tmpl, context, mark_input); });
            }));
        });
    }

    // what the template receives as `messages` for this request's messages
    py::object normalize(const std::string & body_text) const {
        std::string out = call_upstream([&]() {
            auto serial = serialize();
            json body = parse_body(body_text, max_tools_);
            handler_state st = handler_;
            scoped_handler in_force(st);
            return budgeted(limits_, [&]() {
                common_chat_templates_inputs inputs = request_inputs(std::move(body), opt_, call_);
                const bool with_tools = !inputs.tools.empty();
                return dump_safe(render_messages(inputs.messages, templates_pick(opt_.tmpls.get(), with_tools)));
            });
        });
        return json_text_to_py(out);
    }

  private:
    // the prompt POST /apply-template returns (on the calling thread, GIL not needed)
    // Renders of one template at a time where the tree's template execution changes the parsed
    // template (no const execute_impl: e.g. filter_statement moves its filter out of the tree);
    // nothing to wait for on trees whose execution is const. Called without the GIL.
    std::unique_lock<std::mutex> serialize() const {
#if LP_HAS_CONST_EXECUTION
        return {};
#else
        return std::unique_lock<std::mutex>(*render_mutex_);
#endif
    }

    // (`seen`: where the watch_notices keys the body has go; nullptr: not looked for)
    std::string prompt_for(body_in && in, double timeout, std::atomic<uint32_t> * seen) const {
        auto serial = serialize();
        json body = parse_body(std::move(in), max_tools_);
        if (const uint32_t bits = seen ? notices_in(body) : 0) {
            seen->fetch_or(bits, std::memory_order_relaxed);
        }
        handler_state st = handler_;
        st.prompt_only = true;
        scoped_handler in_force(st);
        apply_result res = budgeted(limits(timeout), [&]() { return apply_request(std::move(body), opt_, call_); });
        if (st.prompt_only_used) {
            prompt_only_renders_->fetch_add(1, std::memory_order_relaxed);
        }
        return res.llama_params.at("prompt").get<std::string>();
    }

    // which of the pending watch_notices keys the body has at its top level
    uint32_t notices_in(const json & body) const {
        const uint32_t pending = notice_pending_->load(std::memory_order_relaxed);
        if (pending == 0 || !body.is_object()) {
            return 0;
        }
        uint32_t bits = 0;
        for (const auto & [key, value] : body.items()) {
            for (size_t i = 0; i < notice_keys_.size(); ++i) {
                const uint32_t bit = uint32_t(1) << i;
                if ((pending & bit) && key == notice_keys_[i] &&
                    (!(notice_nonempty_ & bit) || (value.is_array() && !value.empty()))) {
                    bits |= bit;
                }
            }
        }
        return bits;
    }

    // on_seen(bits) with the GIL; what it returns is pending from then on. Its own errors are
    // reported as unraisable (they must not replace the call's result or error), as logging's
    // handlers report theirs; a KeyboardInterrupt or SystemExit goes to the caller.
    void notify_seen(uint32_t bits) const {
        if (bits == 0 || !notice_seen_) {
            return;
        }
        try {
            notice_pending_->store(notice_seen_(bits).cast<uint32_t>(), std::memory_order_relaxed);
        } catch (py::error_already_set & e) {
            if (!e.matches(PyExc_Exception)) {
                throw;  // KeyboardInterrupt, SystemExit: the caller's, not the handler's
            }
            e.discard_as_unraisable("llamaprompt notices");
        } catch (const py::cast_error &) {
        }
    }

    // the template's limits, with the time budget replaced when timeout >= 0 (0: none)
    jinja_limits limits(double timeout) const {
        jinja_limits l = limits_;
        if (timeout >= 0) {
            l.seconds = timeout;
        }
        return l;
    }

    // the options both constructors take, before anything is loaded
    void configure(const std::map<std::string, bool> & caps, bool skip_specialized, bool fast_path, double timeout,
                   size_t max_output_bytes, size_t max_tools) {
        limits_ = {timeout, max_output_bytes};
        max_tools_ = max_tools;
        caps_override_ = caps;
        handler_.skip_specialized = skip_specialized;
        set_fast_path(fast_path);
    }

    void set_fast_path(bool on) {
        if (on) {
            cache_ = make_analysis_cache();
            handler_.cache = cache_.get();
            memo_ = make_parser_memo();
            handler_.memo = memo_.get();
        }
    }

    // on the heap: common_params is large for the stack of a small thread (32 KiB), which without_gil
    // leaves for a thread of its own only once it is running
    static std::unique_ptr<common_params> parse_args(const std::vector<std::string> & server_args) {
        try {
            return without_gil([&]() { return std::make_unique<common_params>(parse_server_args(server_args)); });
        } catch (const std::exception & e) {
            throw error(error_kind::server_args, 0, e.what());
        }
    }

    template <typename F>
    void init(const common_params & params, const std::string & media_marker, bool fetch_remote_media,
              const std::string & bos, const std::string & eos, F && make_templates, const std::string & source) {
        call_.media_marker = media_marker;
        call_.fetch_remote_media = fetch_remote_media;
        bos_token_ = bos;
        eos_token_ = eos;
        use_jinja_ = params.use_jinja;
        log_capture logs;
        std::string message;
        std::string budget_message;  // a budget that stopped the load (its exception comes back sliced)
        without_gil([&]() {
            const uint64_t fired = jinja_guard_fired();
            try {
                jinja_budget budget(limits_);  // the load-time probes render the template
                common_chat_templates_ptr tmpls = make_templates();
                detected_caps_ = common_chat_templates_get_caps(tmpls.get());
                handler_state st = handler_;
                scoped_handler in_force(st);
                opt_ = make_server_chat_params(params, std::move(tmpls));
                // forced caps apply to requests; the load-time probe above (whether the
                // template supports thinking) ran with the detected ones, so forcing caps
                // never makes loading fail -- a request that breaks under them fails instead
                if (!caps_override_.empty()) {
                    templates_set_caps(opt_.tmpls.get(), caps_override_);
                }
            } catch (const std::exception & e) {
                message = e.what();
                if (jinja_guard_fired() != fired) {
                    budget_message = jinja_guard_last_message();
                }
            }
        });
        logs.emit();
        if (!opt_.tmpls) {
            if (message == "std::exception" && !budget_message.empty()) {
                // common_chat_templates_init rethrows as `throw e;` (a copy sliced to
                // std::exception): the budget's own message
                message = budget_message;
            } else if (message == "std::exception" && !source.empty()) {
                // a parse error, rethrown the same way; the parser's own message comes from
                // parsing it again
                without_gil([&]() {
                    try {
                        common_chat_template probe(source, bos, eos);
                    } catch (const std::exception & e) {
                        message = e.what();
                    }
                });
            }
            throw error(error_kind::template_, 0, message.empty() ? "failed to load the chat template" : message);
        }
    }

    server_chat_params opt_;
    call_options call_;
    handler_state handler_;
    std::shared_ptr<analysis_cache> cache_;
    std::shared_ptr<parser_memo> memo_;
    jinja_limits limits_;
    size_t max_tools_ = 0;
    std::shared_ptr<std::mutex> render_mutex_ = std::make_shared<std::mutex>();
    std::shared_ptr<std::atomic<uint64_t>> prompt_only_renders_ = std::make_shared<std::atomic<uint64_t>>(0);
    std::shared_ptr<std::atomic<uint64_t>> tree_bodies_ = std::make_shared<std::atomic<uint64_t>>(0);
    std::vector<std::string> notice_keys_;  // watch_notices
    uint32_t notice_nonempty_ = 0;
    std::shared_ptr<std::atomic<uint32_t>> notice_pending_ = std::make_shared<std::atomic<uint32_t>>(0);
    py::function notice_seen_;
    std::map<std::string, bool> caps_override_;
    std::map<std::string, bool> detected_caps_;
    std::string bos_token_;
    std::string eos_token_;
    bool use_jinja_ = true;
};

void register_template(py::module_ & m) {
    py::class_<core_template>(m, "Template")
        .def(py::init<const std::string &, const std::string &, const std::string &, bool, bool,
                      const std::vector<std::string> &, const std::string &, bool,
                      const std::map<std::string, bool> &, bool, bool, double, size_t, size_t>(),
             py::arg("source"), py::arg("bos_token"), py::arg("eos_token"), py::arg("add_bos"),
             py::arg("add_eos"), py::arg("server_args"), py::arg("media_marker"), py::arg("fetch_remote_media"),
             py::arg("caps"), py::arg("skip_specialized"), py::arg("fast_path"), py::arg("timeout"),
             py::arg("max_output_bytes"), py::arg("max_tools"))
        .def(py::init<std::shared_ptr<core_model>, const std::string &, const std::vector<std::string> &,
                      const std::string &, bool, const std::map<std::string, bool> &, bool, bool, double, size_t, size_t>(),
             py::arg("model"), py::arg("chat_template"), py::arg("server_args"), py::arg("media_marker"),
             py::arg("fetch_remote_media"), py::arg("caps"), py::arg("skip_specialized"), py::arg("fast_path"),
             py::arg("timeout"), py::arg("max_output_bytes"), py::arg("max_tools"))
        .def("detected_caps", &core_template::detected_caps)
        .def("use_jinja", &core_template::use_jinja)
        .def("prompt_only_renders", &core_template::prompt_only_renders)
        .def("tree_bodies", &core_template::tree_bodies)
        .def("caps", &core_template::caps)
        .def("source", [](const core_template & t, const std::string & variant) { return text_to_py(t.source(variant)); },
             py::arg("variant"))
        .def("enable_thinking", &core_template::enable_thinking)
        .def("set_media", &core_template::set_media, py::arg("image"), py::arg("audio"), py::arg("video"))
        .def("watch_notices", &core_template::watch_notices, py::arg("keys"), py::arg("nonempty"),
             py::arg("pending"), py::arg("on_seen"))
        .def("props", &core_template::props)
        .def("apply_template", &core_template::apply_template, py::arg("body"), py::arg("timeout") = -1.0,
             py::arg("notices") = true, py::arg("encode") = py::none())
        .def("apply_template_many", &core_template::apply_template_many, py::arg("bodies"), py::arg("threads"),
             py::arg("timeout") = -1.0, py::arg("encode") = py::none())
        .def("time_direct_apply", &core_template::time_direct_apply, py::arg("body"), py::arg("repeat"))
        .def("apply", &core_template::apply, py::arg("body"), py::arg("timeout") = -1.0,
             py::arg("encode") = py::none())
        .def("normalize", &core_template::normalize, py::arg("body"))
        .def("template_inputs", &core_template::template_inputs, py::arg("body"), py::arg("timeout") = -1.0)
        .def("render_inputs", &core_template::render_inputs, py::arg("context"), py::arg("variant"),
             py::arg("mark_input"), py::arg("timeout") = -1.0);
}

}  // namespace llamaprompt
