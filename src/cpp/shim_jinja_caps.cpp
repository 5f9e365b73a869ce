// common/jinja/caps.cpp (the template capability probes, rendered at load), compiled from the
// build tree's copy (see CMakeLists.txt) so that it includes the mirrored headers: printing a
// value (runtime.h gather_string_parts_recursive) passes through the stack guard there, and a
// list that contains itself raises instead of overflowing the stack (jinja_guard.h). The
// archive's copy of this object is then never linked.
#include "jinja_guard.h"

#if __has_include("jinja-caps.cpp")
#include "jinja-caps.cpp"  // the generated copy
#endif
