// common/json-schema.cpp (llama.cpp's JSON-schema reader: a tool's or response_format's schema as the
// graph json-schema-to-grammar.cpp converts), compiled from the build tree's copy (see CMakeLists.txt)
// in which build_node checks the stack guard (jinja_guard.h): it recursed once per schema level and
// once more per $ref followed, and a chain of 6,000 $defs overflowed the stack. The archive's copy
// of this object is then never linked. A tree without the file (0.3.35) gets an empty copy.
#include "jinja_guard.h"

[[maybe_unused]] static void llamaprompt_schema_nesting() { llamaprompt::jinja_guard_stack("JSON schema"); }

#include "json-schema.cpp"  // the generated copy
