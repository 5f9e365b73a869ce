// common/json-schema-to-grammar.cpp, compiled from the build tree's copy (see CMakeLists.txt)
// in which the one message it prints straight to stderr (an incomplete schema conversion)
// goes to llama.cpp's log instead, and from there to Python's logging ("llamaprompt.llama_cpp")
// like every other llama.cpp message, in which each rule added, each pattern converted (and every
// 256 of its characters) and each step over an object's optional properties checks the call's
// time budget, and rule names are made without std::regex (rule_names.h: a stack overflow on
// long names). The archive's copy of this object is then never linked.
#include "ggml.h"
#include "jinja_guard.h"
#include "logging.h"
#include "rule_names.h"

#include <cstdarg>
#include <cstdio>
#include <string>

// the whole line, as upstream's fprintf prints it
static void llamaprompt_log_warning(FILE * /*stderr*/, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    llamaprompt::log_vformat(GGML_LOG_LEVEL_WARN, fmt, args);
    va_end(args);
}

// each rule added and each pattern converted: the call's time budget (jinja_guard.h), which
// covers its grammar generation as it covers its template executions
static void llamaprompt_schema_step() { llamaprompt::jinja_guard_time("grammar generation"); }

// each schema visited: the stack guard (a chain of 5,000 $refs recursed through visit and
// _resolve_ref until the stack overflowed), then the time budget
static void llamaprompt_schema_visit() {
    llamaprompt::jinja_guard_stack("JSON schema");
    llamaprompt_schema_step();
}

// each character of a pattern being converted (and each trie node below): the time budget every 256
static void llamaprompt_schema_tick() {
    static thread_local unsigned ticks = 0;
    if ((++ticks & 255) == 0) {
        llamaprompt_schema_step();
    }
}

// each node of _not_strings' trie of property names (one level per character): the stack guard,
// and the time budget every 256 ticks
static void llamaprompt_schema_trie_step() {
    llamaprompt::jinja_guard_stack("JSON schema property names");
    llamaprompt_schema_tick();
}

#include "json-schema-to-grammar.cpp"  // the generated copy
