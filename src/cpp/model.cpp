// _core.Model (a GGUF file, vocab only: tokenize / detokenize as POST /tokenize and
// /detokenize) and _core.gguf_metadata (the file's key/values, by ggml's gguf reader).
#include "model.h"

#include "errors.h"
#include "logging.h"
#include "shim.h"
#include "text.h"
#include "tree.h"

#include "gguf.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <bitset>
#include <cstdio>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <unordered_set>

namespace py = pybind11;

namespace llamaprompt {

namespace {

// run fn without the GIL, collecting llama.cpp's log; a failure becomes a GGUFError
// whose message is llama.cpp's (its exception text, or the error lines it logged)
template <typename F>
auto with_log(const char * what, F && fn) -> decltype(fn()) {
    log_capture logs;
    std::string message;
    try {
        return without_gil(fn);
    } catch (const std::exception & e) {
        message = e.what();
    }
    logs.emit();
    if (message.empty()) {
        message = logs.errors();
    }
    if (message.empty()) {
        message = what;
    }
    throw error(error_kind::gguf, 0, message);
}

// call_upstream for the vocab's calls: a lookup that finds no token (std::out_of_range from
// unordered_map::at / vector::at -- a token text the tokenizer needs, e.g. SPM's "<0x0A>" byte
// fallback, missing from the file) is the file's fault: a GGUFError with the lookup's message
template <typename F>
auto on_vocab(F && fn) -> decltype(fn()) {
    return call_upstream([&]() -> decltype(fn()) {
        try {
            return fn();
        } catch (const std::out_of_range & e) {
            throw error(error_kind::gguf, 500,
                        std::string("the GGUF file's vocab lacks a token its tokenizer looks up (") + e.what() + ")");
        }
    });
}

void check_file(const std::string & path) {
    FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) {
        throw error(error_kind::gguf, 0, "cannot open GGUF file: " + path);
    }
    std::fclose(f);
}

// A token's bytes as llama.cpp's RWKV tokenizer reads its text (llama_unescape_rwkv_token, restated:
// \t \n \r, \xHH with its digits read as that function reads them, \c for any other c)
std::string rwkv_token_bytes(std::string_view text) {
    std::string out;
    bool escaping = false;
    unsigned hex_remaining = 0;
    uint8_t hex = 0;
    for (const char c : text) {
        if (hex_remaining != 0) {
            hex = uint8_t((hex << 4) + uint8_t(c >= 'a' ? c - 'a' + 10 : c - '0'));
            if (--hex_remaining == 0) {
                out += char(hex);
                hex = 0;
            }
        } else if (escaping) {
            if (c == 'x') {
                hex_remaining = 2;
            } else {
                out += c == 't' ? '\t' : c == 'n' ? '\n' : c == 'r' ? '\r' : c;
            }
            escaping = false;
        } else if (c == '\\') {
            escaping = true;
        } else {
            out += c;
        }
    }
    return out;
}

// Conditions llama.cpp asserts (GGML_ASSERT aborts the process) while it loads a vocab, or under
// which its tokenizer never returns, checked first on the file's metadata so that a bad file
// raises instead.
void check_vocab_metadata(const std::string & path) {
    gguf_init_params params = {/* no_alloc */ true, /* ctx */ nullptr};
    gguf_context * ctx = gguf_init_from_file(path.c_str(), params);
    if (!ctx) {
        return;  // the loader reports why
    }
    std::string problem;
    const int64_t model_key = gguf_find_key(ctx, "tokenizer.ggml.model");
    const std::string tokenizer_model =
        model_key >= 0 && gguf_get_kv_type(ctx, model_key) == GGUF_TYPE_STRING ? gguf_get_val_str(ctx, model_key) : "";
    const int64_t key = gguf_find_key(ctx, "tokenizer.ggml.tokens");
    const bool has_tokens =
        key >= 0 && gguf_get_kv_type(ctx, key) == GGUF_TYPE_ARRAY && gguf_get_arr_type(ctx, key) == GGUF_TYPE_STRING;
    // BPE token texts are converted to bytes (llama_vocab::impl::token_to_piece) by a loop that
    // appends the whole text again for each character outside GPT-2's byte map: the result grows
    // with the square of the length and aborts at INT32_MAX bytes ("invalid token size")
    const bool bpe_text = tokenizer_model == "gpt2" || tokenizer_model == "hybriddna" || tokenizer_model == "whitespace";
    constexpr size_t max_bpe_token_bytes = 16384;
    if (has_tokens) {
        // llama_vocab::impl::load: an empty text becomes "[EMPTY_<id>]", then
        // GGML_ASSERT(id_to_token.size() == token_to_id.size()): the texts must be unique after that
        const size_t n = gguf_get_arr_n(ctx, key);
        std::unordered_set<std::string_view> seen;
        std::deque<std::string> placeholders;
        seen.reserve(n);
        // llm_tokenizer_rwkv_session::tokenize: at a byte that begins a token but is no token alone
        // it finds no token, goes back to where the last one ended and loops for ever (appending
        // token 0 until memory runs out) -- loading tokenizes "\n" too
        const bool rwkv = tokenizer_model == "rwkv";
        std::bitset<256> begins_token, is_token;
        for (size_t i = 0; i < n && problem.empty(); i++) {
            std::string_view text = gguf_get_arr_str(ctx, key, i);
            if (bpe_text && text.size() > max_bpe_token_bytes) {
                problem = "token " + std::to_string(i) + " is " + std::to_string(text.size()) +
                          " bytes long; llama.cpp's BPE token decoding grows with the square of the length (more "
                          "than " + std::to_string(max_bpe_token_bytes) + " bytes is refused)";
                break;
            }
            if (text.empty()) {
                placeholders.push_back("[EMPTY_" + std::to_string(i) + "]");
                text = placeholders.back();
            }
            if (!seen.insert(text).second) {
                problem = "tokenizer.ggml.tokens holds the same token text twice (token " + std::to_string(i) +
                          ", empty texts counting as [EMPTY_<id>]); llama.cpp requires unique token texts";
            }
            if (rwkv) {
                const std::string bytes = rwkv_token_bytes(text);
                if (!bytes.empty()) {
                    begins_token.set(uint8_t(bytes[0]));
                    is_token[uint8_t(bytes[0])] = is_token[uint8_t(bytes[0])] || bytes.size() == 1;
                }
            }
        }
        for (unsigned b = 0; rwkv && problem.empty() && b < 256; b++) {
            if (begins_token[b] && !is_token[b]) {
                char hex[8];
                std::snprintf(hex, sizeof(hex), "0x%02x", b);
                problem = std::string("this RWKV vocab has tokens that begin with the byte ") + hex +
                          " but no token of that byte alone: llama.cpp's RWKV tokenizer never returns on text "
                          "with that byte (it loops, appending token 0)";
            }
        }
    }
    // llama_vocab::impl::tokenize for the "test" tokenizer: hash % n_vocab (a division by zero)
    if (LP_HAS_VOCAB_TEST_TOKENIZER && problem.empty() && tokenizer_model == "test" &&
        (!has_tokens || gguf_get_arr_n(ctx, key) == 0)) {
        problem = "the test tokenizer needs at least one token (tokenizer.ggml.tokens is empty or missing)";
    }
    // llama_vocab::impl::token_to_byte: GGML_ABORT for a WPM (bert) vocab that holds byte tokens
    const int64_t type_key = gguf_find_key(ctx, "tokenizer.ggml.token_type");
    if (problem.empty() && tokenizer_model == "bert" && type_key >= 0 &&
        gguf_get_kv_type(ctx, type_key) == GGUF_TYPE_ARRAY && gguf_get_arr_type(ctx, type_key) == GGUF_TYPE_INT32) {
        const auto * types = static_cast<const int32_t *>(gguf_get_arr_data(ctx, type_key));
        for (size_t i = 0; i < gguf_get_arr_n(ctx, type_key); i++) {
            if (types[i] == LLAMA_TOKEN_TYPE_BYTE) {
                problem = "a bert (WPM) tokenizer with byte tokens (token " + std::to_string(i) +
                          "); llama.cpp cannot read byte tokens for this tokenizer";
                break;
            }
        }
    }
    gguf_free(ctx);
    if (!problem.empty()) {
        throw error(error_kind::gguf, 0, problem);
    }
}

}  // namespace

core_model::core_model(const std::string & path) : path_(path) {
    check_file(path);
    without_gil([&]() { check_vocab_metadata(path); });
    log_capture logs;
    std::string message;
    without_gil([&]() {
        llama_model_params mp = llama_model_default_params();
        mp.vocab_only = true;  // as the task asks: no tensor data is read
        mp.n_gpu_layers = 0;
        try {
            model_ = llama_model_load_from_file(path.c_str(), mp);
        } catch (const std::exception & e) {
            model_ = nullptr;
            message = e.what();
        }
    });
    logs.emit();
    if (!model_) {
        if (message.empty()) {
            message = logs.errors();
        }
        throw error(error_kind::gguf, 0, message.empty() ? "failed to load GGUF file: " + path : message);
    }
}

core_model::~core_model() {
    if (model_) {
        llama_model_free(model_);
    }
}

namespace {

py::object gguf_scalar(const gguf_context * ctx, int64_t i, gguf_type type) {
    switch (type) {
        case GGUF_TYPE_UINT8:   return py::int_(gguf_get_val_u8(ctx, i));
        case GGUF_TYPE_INT8:    return py::int_(gguf_get_val_i8(ctx, i));
        case GGUF_TYPE_UINT16:  return py::int_(gguf_get_val_u16(ctx, i));
        case GGUF_TYPE_INT16:   return py::int_(gguf_get_val_i16(ctx, i));
        case GGUF_TYPE_UINT32:  return py::int_(gguf_get_val_u32(ctx, i));
        case GGUF_TYPE_INT32:   return py::int_(gguf_get_val_i32(ctx, i));
        case GGUF_TYPE_UINT64:  return py::int_(gguf_get_val_u64(ctx, i));
        case GGUF_TYPE_INT64:   return py::int_(gguf_get_val_i64(ctx, i));
        case GGUF_TYPE_FLOAT32: return py::float_(gguf_get_val_f32(ctx, i));
        case GGUF_TYPE_FLOAT64: return py::float_(gguf_get_val_f64(ctx, i));
        case GGUF_TYPE_BOOL:    return py::bool_(gguf_get_val_bool(ctx, i));
        case GGUF_TYPE_STRING:  return text_to_py(gguf_get_val_str(ctx, i));
        default:                return py::none();
    }
}

py::object gguf_array_item(const gguf_context * ctx, int64_t i, gguf_type type, size_t j) {
    const void * data = type == GGUF_TYPE_STRING ? nullptr : gguf_get_arr_data(ctx, i);
    switch (type) {
        case GGUF_TYPE_UINT8:   return py::int_(((const uint8_t *) data)[j]);
        case GGUF_TYPE_INT8:    return py::int_(((const int8_t *) data)[j]);
        case GGUF_TYPE_UINT16:  return py::int_(((const uint16_t *) data)[j]);
        case GGUF_TYPE_INT16:   return py::int_(((const int16_t *) data)[j]);
        case GGUF_TYPE_UINT32:  return py::int_(((const uint32_t *) data)[j]);
        case GGUF_TYPE_INT32:   return py::int_(((const int32_t *) data)[j]);
        case GGUF_TYPE_UINT64:  return py::int_(((const uint64_t *) data)[j]);
        case GGUF_TYPE_INT64:   return py::int_(((const int64_t *) data)[j]);
        case GGUF_TYPE_FLOAT32: return py::float_(((const float *) data)[j]);
        case GGUF_TYPE_FLOAT64: return py::float_(((const double *) data)[j]);
        case GGUF_TYPE_BOOL:    return py::bool_(((const int8_t *) data)[j] != 0);
        case GGUF_TYPE_STRING:  return text_to_py(gguf_get_arr_str(ctx, i, j));
        default:                return py::none();
    }
}

// gguf_metadata(path, max_array_items): {key: value}; arrays longer than max_array_items
// are summarized as {"type": "array", "element_type": NAME, "length": N}
py::dict gguf_metadata(const std::string & path, size_t max_array_items) {
    check_file(path);
    struct ctx_deleter {
        void operator()(gguf_context * c) const { gguf_free(c); }
    };
    std::unique_ptr<gguf_context, ctx_deleter> ctx(with_log("failed to read GGUF file", [&]() {
        gguf_init_params params = {/* no_alloc */ true, /* ctx */ nullptr};
        gguf_context * c = gguf_init_from_file(path.c_str(), params);
        if (!c) {
            throw std::runtime_error("");  // the message comes from the log
        }
        return c;
    }));
    py::dict out;
    const int64_t n = gguf_get_n_kv(ctx.get());
    for (int64_t i = 0; i < n; i++) {
        py::object key = text_to_py(gguf_get_key(ctx.get(), i));
        const gguf_type type = gguf_get_kv_type(ctx.get(), i);
        if (type != GGUF_TYPE_ARRAY) {
            out[key] = gguf_scalar(ctx.get(), i, type);
            continue;
        }
        const gguf_type elem = gguf_get_arr_type(ctx.get(), i);
        const size_t len = gguf_get_arr_n(ctx.get(), i);
        if (len > max_array_items || elem == GGUF_TYPE_ARRAY) {
            py::dict summary;
            summary["type"] = "array";
            summary["element_type"] = gguf_type_name(elem);
            summary["length"] = len;
            out[key] = summary;
            continue;
        }
        py::list items;
        for (size_t j = 0; j < len; j++) {
            items.append(gguf_array_item(ctx.get(), i, elem, j));
        }
        out[key] = items;
    }
    return out;
}

}  // namespace

void check_tokenize(const llama_vocab * vocab, bool add_special) {
    if (llama_vocab_type(vocab) == LLAMA_VOCAB_TYPE_NONE) {
        throw error(error_kind::gguf, 0, "this GGUF file has no tokenizer (tokenizer.ggml.model is none)");
    }
    if (add_special && llama_vocab_get_add_bos(vocab) && llama_vocab_bos(vocab) == LLAMA_TOKEN_NULL) {
        throw error(error_kind::gguf, 0, "the vocab adds BOS (add_bos_token) but has no BOS token");
    }
    if (add_special && llama_vocab_get_add_eos(vocab) && llama_vocab_eos(vocab) == LLAMA_TOKEN_NULL) {
        throw error(error_kind::gguf, 0, "the vocab adds EOS (add_eos_token) but has no EOS token");
    }
    // the WPM (bert) tokenizer adds [CLS] (BOS) and [SEP] with add_special whatever add_bos says,
    // and asserts both ids
    if (add_special && llama_vocab_type(vocab) == LLAMA_VOCAB_TYPE_WPM &&
        (llama_vocab_bos(vocab) == LLAMA_TOKEN_NULL || llama_vocab_sep(vocab) == LLAMA_TOKEN_NULL)) {
        throw error(error_kind::gguf, 0, "this bert (WPM) vocab has no BOS ([CLS]) or SEP token, which it adds");
    }
}

void register_model(py::module_ & m) {
    py::class_<core_model, std::shared_ptr<core_model>>(m, "Model")
        .def(py::init<const std::string &>(), py::arg("path"))
        .def_property_readonly("path", &core_model::path)
        .def_property_readonly("vocab_size", [](const core_model & mdl) { return llama_vocab_n_tokens(mdl.vocab()); })
        .def_property_readonly("bos_token_id", [](const core_model & mdl) { return llama_vocab_bos(mdl.vocab()); })
        .def_property_readonly("eos_token_id", [](const core_model & mdl) { return llama_vocab_eos(mdl.vocab()); })
        .def_property_readonly("add_bos", [](const core_model & mdl) { return llama_vocab_get_add_bos(mdl.vocab()); })
        .def_property_readonly("add_eos", [](const core_model & mdl) { return llama_vocab_get_add_eos(mdl.vocab()); })
        // POST /tokenize: tokenize_mixed(vocab, content, add_special, parse_special)
        .def("tokenize", [](const core_model & mdl, const std::string & text, bool add_special, bool parse_special) {
            check_tokenize(mdl.vocab(), add_special);
            llama_tokens tokens = on_vocab([&]() {
                return tokenize_mixed(mdl.vocab(), json(text), add_special, parse_special);
            });
            py::array_t<int32_t> out((py::ssize_t) tokens.size());
            std::copy(tokens.begin(), tokens.end(), out.mutable_data());
            return out;
        }, py::arg("text"), py::arg("add_special"), py::arg("parse_special"))
        // POST /detokenize: tokens_to_str(vocab, tokens)
        .def("detokenize", [](const core_model & mdl, const std::vector<llama_token> & tokens) {
            check_tokenize(mdl.vocab(), false);
            std::string text = on_vocab([&]() { return tokens_to_str(mdl.vocab(), tokens); });
            return text_to_py(text);
        }, py::arg("tokens"))
        // POST /tokenize with_pieces: common_token_to_piece(vocab, token) (special tokens rendered)
        .def("token_to_piece", [](const core_model & mdl, llama_token token, bool special) {
            check_tokenize(mdl.vocab(), false);  // token_to_piece asserts a tokenizer too
            std::string piece = on_vocab([&]() { return common_token_to_piece(mdl.vocab(), token, special); });
            return py::bytes(piece);
        }, py::arg("token"), py::arg("special") = true);

    m.def("gguf_metadata", &gguf_metadata, py::arg("path"), py::arg("max_array_items") = 16);
}

}  // namespace llamaprompt
