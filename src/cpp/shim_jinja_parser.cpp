// common/jinja/parser.cpp (llama.cpp's Jinja parser, recursive descent), compiled from the
// build tree's copy (see CMakeLists.txt) in which each recursive descent first passes the
// stack guard (jinja_guard.h): a template nested deeper than half of the thread's stack
// (at most 8 MiB) allows (e.g. 5000 parentheses) raises instead of crashing. The archive's copy of this
// object is then never linked.
#include "jinja_guard.h"

#include "jinja-parser.cpp"  // the generated copy
