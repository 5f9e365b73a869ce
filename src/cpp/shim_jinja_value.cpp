// common/jinja/value.cpp (llama.cpp's Jinja values and built-in functions), compiled from
// the build tree's copy (see CMakeLists.txt) in which range() pushes each element through
// llamaprompt_range_push (the time guard, jinja_guard.h), with `localtime` made thread-safe
// for strftime_now (thread_safe_time.h). The archive's copy of this object is then never
// linked.
#include "jinja/value.h"
#include "jinja_guard.h"

#include <sstream>

// one more element of a list being built (it holds n, of element_bytes each): the time guard,
// and every 4096 elements the size guard
static void llamaprompt_element_step(size_t n, size_t element_bytes) {
    if ((n & 4095) == 4095) {
        llamaprompt::jinja_guard_size(n * element_bytes, 0);
    }
    llamaprompt::jinja_guard_tick();
}

// range(): each element (~48 bytes: its shared_ptr and the value)
template <typename Array>
static void llamaprompt_range_push(Array & out, int64_t i) {
    llamaprompt_element_step(out->val_arr.size(), 48);
    out->push_back(jinja::mk_val<jinja::value_int>(i));
}

// slice() (a filter, and `[a:b:c]`): each step of its loop, the time guard, and every 4096
// elements the size guard on what it has taken (a step of -2**63 overflows its index: upstream's
// loop never ends, appending the same element until memory runs out)
template <typename T>
static void llamaprompt_slice_step(const T & result) {
    llamaprompt_element_step(result.size(), sizeof(typename T::value_type));
}

// indent(): the size guard on the indentation a width asks for (a negative width is left to
// upstream's own error)
static int64_t llamaprompt_indent_width(int64_t width) {
    if (width > 0) {
        llamaprompt::jinja_guard_size(static_cast<size_t>(width), 0);
    }
    return width;
}

// join / replace / tojson: the size guard on the string being built (the text, or the
// size a reserve() asks for), then the value as upstream uses it
static const std::string & llamaprompt_sized(size_t current, const std::string & piece) {
    llamaprompt::jinja_guard_size(current + piece.size(), 0);
    return piece;
}
static size_t llamaprompt_sized(size_t current, size_t bytes) {
    llamaprompt::jinja_guard_size(current + bytes, 0);
    return bytes;
}

// tojson's value_to_json_internal, at each value: with indent > 0, the size guard on the output so
// far plus the indentation of the value's own lines (`indent` per level), before it is written
static void llamaprompt_json_indent_guard(std::ostringstream & oss, int curr_lvl, int indent) {
    if (indent > 0) {
        const std::streamoff at = oss.tellp();
        const size_t levels = static_cast<size_t>(curr_lvl > 0 ? curr_lvl : 0) + 1;
        llamaprompt::jinja_guard_bytes(static_cast<size_t>(at > 0 ? at : 0) + static_cast<size_t>(indent) * levels);
    }
}

#include "thread_safe_time.h"
#include "jinja-value.cpp"  // the generated copy
#undef localtime
