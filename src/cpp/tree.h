// What the llama.cpp tree being compiled has: the feature macros third_party/adapt_tree.py
// derived from the tree's contents (generated/lp_tree.h), and the two spellings of an upstream
// interface that differ between trees. Nothing here re-implements upstream logic.
#pragma once

#include "lp_tree.h"

#include <string>

#if LP_HAS_COMMON_JSON
#include "json.h"  // common_json: llama.cpp's wrapper (newer trees)
#else
#include <nlohmann/json.hpp>
using common_json = nlohmann::ordered_json;  // what older trees' `json` is
#endif

namespace llamaprompt {

// JSON text with bad UTF-8 replaced, as llama-server's responses are written: common_json's
// dump_safe(), or (older trees) the call safe_json_to_str() makes in tools/server/server-common.cpp
inline std::string dump_safe(const common_json & j) {
#if LP_HAS_COMMON_JSON
    return j.dump_safe();
#else
    return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
#endif
}

}  // namespace llamaprompt
