// common/peg-parser.cpp (llama.cpp's PEG parser builder, which the autoparser and the handlers use
// for tool calls), compiled from the build tree's copy (see CMakeLists.txt) in which rule names are
// made without std::regex (rule_names.h: a tool name of ~30,000 characters outside [a-zA-Z0-9-]
// overflowed the stack). The archive's copy of this object is then never linked.
#include "rule_names.h"

#include "peg-parser.cpp"  // the generated copy
