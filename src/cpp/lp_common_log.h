// llama.cpp's common log -- LOG_INF / LOG_WRN / LOG_ERR in chat.cpp, the specialized handlers,
// the autoparser, the server's chat code -- delivered as llama_log_set's lines are: into the
// calling thread's log capture (src/cpp/logging.cpp), emitted to Python's logging (logger
// "llamaprompt.llama_cpp") when the call returns. Outside a call of ours (no capture) a line
// is dropped; common's own log (its worker thread, stdout / stderr) is never started.
//
// CMakeLists.txt force-includes this header (-include) into every llama.cpp file compiled into
// llama-common and _core, but only when third_party/adapt_tree.py found common/log.h's LOG_TMPL
// exactly as below with common_log_add(common_log_main(), ...) as its call (the feature
// "common_log"); otherwise common's log stays silent, as llama-server's would with -lv -1.
// LOG_TMPL is the one macro every LOG_* expands to: after log.h itself (#pragma once: a file's
// own #include "log.h" then adds nothing), the same macro with only its call replaced.
#pragma once

#include "log.h"

// lines up to this verbosity: LOG_INF, LOG_WRN, LOG_ERR, LOG (llama-server's default threshold,
// LOG_DEFAULT_LLAMA); LOG_DBG and LOG_TRC are never formatted
constexpr int llamaprompt_common_log_verbosity = LOG_LEVEL_INFO;

LOG_ATTRIBUTE_FORMAT(2, 3)
void llamaprompt_common_log(enum ggml_log_level level, const char * fmt, ...);

#undef LOG_TMPL
#define LOG_TMPL(level, verbosity, ...)                              \
    do {                                                             \
        if ((verbosity) <= llamaprompt_common_log_verbosity) {       \
            llamaprompt_common_log((level), __VA_ARGS__);            \
        }                                                            \
    } while (0)
