// common/jinja/string.cpp (the engine's strings of parts), compiled from the build tree's copy
// (see CMakeLists.txt), in which string::append inserts the other string's parts as one range
// (an engine rewrite, adapt_tree.py). The archive's copy of this object is then never linked.
#include "jinja-string.cpp"  // the generated copy
