// common/json-schema-to-grammar.cpp, compiled from the build tree's copy (see CMakeLists.txt)
// in which the one message it prints straight to stderr (an incomplete schema conversion)
// goes to llama.cpp's log instead, and from there to Python's logging ("llamaprompt.llama_cpp")
// like every other llama.cpp message. The archive's copy of this object is then never linked.
#include "logging.h"

#include <cstdarg>
#include <cstdio>
#include <string>

static void llamaprompt_log_warning(FILE * /*stderr*/, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    char buf[1024];
    const int n = vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    if (n >= 0) {
        llamaprompt::log_warning(buf);
    }
}

#include "json-schema-to-grammar.cpp"  // the generated copy
