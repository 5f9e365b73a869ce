// Grammar rule names as llama.cpp makes them from tool, property and $ref names:
// regex_replace(text, "[^a-zA-Z0-9-]+", "-") (json-schema-to-grammar.cpp, peg-parser.cpp), without
// std::regex. libstdc++'s regex matcher recurses once per character of a match, so a name of
// ~30,000 characters outside [a-zA-Z0-9-] overflowed the stack (SIGSEGV; found by the fresh-user
// trial). The build-tree copies of those files call this instead: each maximal run of such bytes
// becomes one "-", as the regex replaces it.
#pragma once

#include <string>

inline std::string llamaprompt_rule_chars(const std::string & text) {
    std::string out;
    out.reserve(text.size());
    bool in_run = false;
    for (const char c : text) {
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-') {
            out += c;
            in_run = false;
        } else if (!in_run) {
            out += '-';
            in_run = true;
        }
    }
    return out;
}
