// _core.OutputParser: llama-server's reading of generated text for one request.
//
// The request's llama_params (what oaicompat_chat_params_parse returned) go through
// llama-server's own eval_llama_cmpl_schema (tools/server/server-schema.cpp) to get the
// task's common_chat_parser_params; the text goes through task_result_state::update_chat_msg
// (server-task.cpp: common_chat_parse, tool-call ids, common_chat_msg_diff::compute_diffs);
// messages and deltas are serialized by to_json_oaicompat / server_chat_msg_diff_to_json_oaicompat.
#include "big_stack.h"
#include "errors.h"
#include "logging.h"
#include "model.h"
#include "shim.h"
#include "text.h"

#include "tree.h"

#if LP_HAS_PARSE
#include "server-chat.h"
#if LP_HAS_SERVER_SCHEMA
#include "server-schema.h"
#endif
#include "server-task.h"
#endif

#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace llamaprompt {

#if LP_HAS_PARSE
namespace {

// fields of the completion schema whose handlers use a vocab (GGML_ASSERT(ctx.vocab), or
// common_tokenize on a null vocab in older trees); they only set sampling parameters, never the
// chat parser's. Read from the tree at configure time (third_party/adapt_tree.py vocab_fields):
// their names change between trees.
const char * const vocab_fields[] = {LP_VOCAB_FIELDS};

}  // namespace

class core_output_parser {
  public:
    // llama_params_text: the JSON object oaicompat_chat_params_parse returned for the request
    core_output_parser(const std::string & llama_params_text, const std::vector<std::string> & server_args,
                       std::shared_ptr<core_model> model, const std::string & reasoning_format,
                       std::optional<bool> parse_tool_calls, bool stream) {
        // (its log lines -- a schema's conversion warnings -- reach logging as a render's do)
        params_ = with_log_capture([&]() { return call_upstream([&]() {
            common_params base = parse_server_args(server_args);
            // llama-server's main() (tools/server/server.cpp) resolves an automatic slot count
            // before any request; older trees' request schema compares n_cmpl with it
            // (third_party/adapt_tree.py checks the restated lines)
            if (base.n_parallel < 0) {
                base.n_parallel = 4;
            }
            json data = json::parse(llama_params_text);
            if (!model) {
                for (const char * f : vocab_fields) {
                    data.erase(f);
                }
                // sampling only as well; older trees refuse a lazy grammar whose triggers were dropped
                if (!data.contains("grammar_triggers")) {
                    data.erase("grammar_lazy");
                }
            }
            if (!reasoning_format.empty()) {
                data["reasoning_format"] = reasoning_format;
            }
            if (parse_tool_calls.has_value()) {
                data["parse_tool_calls"] = *parse_tool_calls;
            }
            data["stream"] = stream;
            const llama_vocab * vocab = model ? model->vocab() : nullptr;
            // n_ctx_slot (older trees) only sets sampling penalties, never the chat parser's parameters
#if LP_HAS_SERVER_SCHEMA && LP_HAS_CMPL_SCHEMA_N_CTX_SLOT
            task_params tp = server_schema::eval_llama_cmpl_schema(vocab, base, base.n_ctx, {}, data);
#elif LP_HAS_SERVER_SCHEMA
            task_params tp = server_schema::eval_llama_cmpl_schema(vocab, base, {}, data);
#else
            task_params tp = server_task::params_from_json_cmpl(vocab, base, base.n_ctx, {}, data);
#endif
            return tp.chat_parser_params;
        }); });
        model_ = std::move(model);
        reset();
    }

    void reset() {
        std::lock_guard<std::mutex> lock(mutex_);
        state_ = std::make_unique<task_result_state>(params_);
        depth_ = 0;
    }

    // The output parser recurses once per JSON nesting level (tool-call arguments) and has
    // no limit: on an 8 MiB stack ~10^4 levels overflow it. It runs on a 256 MiB stack
    // (big_stack.h), and output with more than max_depth unclosed [ / { -- counted anywhere,
    // prose included, as the parser may read any of it as JSON -- is refused (llama-server
    // would crash long before).
    static constexpr long max_depth = 100000;
    static void check_depth(const std::string & text, long & depth) {
        for (char c : text) {
            if (c == '[' || c == '{') {
                if (++depth > max_depth) {
                    throw error(error_kind::template_, 500,
                                "the model output nests brackets more than " + std::to_string(max_depth) +
                                    " levels deep; llama.cpp's output parser would overflow the stack");
                }
            } else if ((c == ']' || c == '}') && depth > 0) {
                --depth;
            }
        }
    }

    // one-shot parse of the whole text, as the final (non-streamed) response computes it
    // (both: llama.cpp's log lines -- "unparsed ... output", a streamed tool call's mismatch --
    // reach logging as a render's do, from the big stack's thread too)
    py::object parse(const std::string & text, bool partial) {
        return with_log_capture([&]() { return parse_impl(text, partial); });
    }

    py::object feed(const std::string & chunk, bool is_final) {
        return with_log_capture([&]() { return feed_impl(chunk, is_final); });
    }

    py::object parse_impl(const std::string & text, bool partial) {
        long depth = 0;
        check_depth(text, depth);
        std::string out = call_upstream([&]() {
            return on_big_stack_logged([&]() {
                task_result_state st(params_);
                std::vector<common_chat_msg_diff> diffs;
                common_chat_msg msg = st.update_chat_msg(text, partial, diffs);
                if (msg.empty()) {
                    msg.role = "assistant";
                }
                return dump_safe(msg.to_json_oaicompat());  // bad UTF-8 replaced, as llama-server's responses
            }, big_stack_bytes);
        });
        return json_text_to_py(out);
    }

    // streaming: the OpenAI deltas llama-server sends for this chunk
    py::object feed_impl(const std::string & chunk, bool is_final) {
        std::string out = call_upstream([&]() {
            // one feed at a time (the state is updated with the GIL released; the lock is taken
            // and released without the GIL, so a waiting thread never holds it)
            std::lock_guard<std::mutex> lock(mutex_);
            check_depth(chunk, depth_);
            return on_big_stack_logged([&]() {
                std::vector<common_chat_msg_diff> diffs;
                state_->update_chat_msg(chunk, !is_final, diffs);
                json arr = json::array();
                for (const auto & d : diffs) {
                    arr.push_back(server_chat_msg_diff_to_json_oaicompat(d));
                }
                return dump_safe(arr);
            }, big_stack_bytes);
        });
        return json_text_to_py(out);
    }

    py::object message() const {
        std::lock_guard<std::mutex> lock(mutex_);
        common_chat_msg msg = state_->chat_msg;
        if (msg.empty()) {
            msg.role = "assistant";
        }
        return json_to_py(msg.to_json_oaicompat());
    }

    py::dict settings() const {
        py::dict d;
        d["format"] = common_chat_format_name(params_.format);
        d["reasoning_format"] = common_reasoning_format_name(params_.reasoning_format);
        d["reasoning_in_content"] = params_.reasoning_in_content;
        d["parse_tool_calls"] = params_.parse_tool_calls;
        d["is_continuation"] = params_.is_continuation;
        d["generation_prompt"] = text_to_py(params_.generation_prompt);
        return d;
    }

  private:
    common_chat_parser_params params_;
    long depth_ = 0;  // unclosed brackets of the text fed so far
    mutable std::mutex mutex_;  // feed / message / reset: one thread at a time
    std::unique_ptr<task_result_state> state_;
    std::shared_ptr<core_model> model_;
};

#endif  // LP_HAS_PARSE

// without the server's request schema and task code in the tree there is no OutputParser;
// the Python layer then raises FeatureError (llamaprompt.features["parse"] is False)
void register_parse(py::module_ & m) {
#if !LP_HAS_PARSE
    (void) m;
#else
    py::class_<core_output_parser>(m, "OutputParser")
        .def(py::init<const std::string &, const std::vector<std::string> &, std::shared_ptr<core_model>,
                      const std::string &, std::optional<bool>, bool>(),
             py::arg("llama_params"), py::arg("server_args"), py::arg("model"), py::arg("reasoning_format"),
             py::arg("parse_tool_calls"), py::arg("stream"))
        .def("parse", &core_output_parser::parse, py::arg("text"), py::arg("partial"))
        .def("feed", &core_output_parser::feed, py::arg("chunk"), py::arg("is_final"))
        .def("message", &core_output_parser::message)
        .def("reset", &core_output_parser::reset)
        .def("settings", &core_output_parser::settings);
#endif
}

}  // namespace llamaprompt
