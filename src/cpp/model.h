// A GGUF model opened by llama.cpp with vocab_only: the tokenizer and metadata that
// llama-server takes from the file, without reading any tensor data.
#pragma once

#include "llama.h"

#include <string>

namespace llamaprompt {

class core_model {
  public:
    // llama_model_load_from_file(path, {vocab_only = true}); throws error(gguf) on failure
    explicit core_model(const std::string & path);
    ~core_model();
    core_model(const core_model &) = delete;
    core_model & operator=(const core_model &) = delete;

    const llama_model * model() const { return model_; }
    const llama_vocab * vocab() const { return llama_model_get_vocab(model_); }
    const std::string & path() const { return path_; }

  private:
    llama_model * model_ = nullptr;
    std::string path_;
};

// What llama_vocab's tokenize / token_to_piece assert (a tokenizer; the BOS / EOS / SEP ids it adds
// with add_special), checked before calling them: error(gguf) when the vocab lacks it
void check_tokenize(const llama_vocab * vocab, bool add_special);

}  // namespace llamaprompt
