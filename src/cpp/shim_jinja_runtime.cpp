// common/jinja/runtime.cpp (llama.cpp's Jinja interpreter), compiled from the build tree's
// copy (see CMakeLists.txt) in which statement::execute passes through the stack and time
// guard, string repetition and concatenation through the size guard (jinja_guard.h). The archive's copy
// of this object is then never linked.
#include "jinja_guard.h"
#include "jinja/value.h"

#include <cstdint>

namespace llamaprompt {
// bytes and parts of a Jinja string (a value or a jinja::string), without copying it
inline size_t jinja_bytes(const jinja::string & s) { return s.length(); }
inline size_t jinja_parts(const jinja::string & s) { return s.parts.size(); }
inline size_t jinja_bytes(const jinja::value & v) {
    return jinja::is_val<jinja::value_string>(v) ? jinja::cast_val<jinja::value_string>(v)->val_str.length() : 32;
}
inline size_t jinja_parts(const jinja::value & v) {
    return jinja::is_val<jinja::value_string>(v) ? jinja::cast_val<jinja::value_string>(v)->val_str.parts.size() : 1;
}
}  // namespace llamaprompt

// `s * n` appends `s` n times: the size guard on what the result will be, then upstream's append
static size_t llamaprompt_saturating_mul(size_t a, size_t b) {
    return (a != 0 && b > SIZE_MAX / a) ? SIZE_MAX / 64 : a * b;
}

// (returns what upstream's append returns: older trees assign its result, `s = s.append(t)`)
static decltype(auto) llamaprompt_repeat_append(jinja::string & dst, const jinja::string & src, int64_t repeat) {
    const size_t n = static_cast<size_t>(repeat);
    llamaprompt::jinja_guard_size(llamaprompt_saturating_mul(src.length(), n),
                                  llamaprompt_saturating_mul(src.parts.size(), n));
    return dst.append(src);
}

// `a ~ b` / `a + b` on strings: the size guard on the result, before upstream copies anything
template <typename A, typename B>
static void llamaprompt_concat_guard(const A & left, const B & right) {
    using namespace llamaprompt;
    jinja_guard_size(jinja_bytes(left) + jinja_bytes(right), jinja_parts(left) + jinja_parts(right));
}

// `list + list`: the size guard on the result (~48 bytes per element)
template <typename A>
static void llamaprompt_list_concat_guard(const A & left, const A & right) {
    llamaprompt::jinja_guard_size((left.size() + right.size()) * 48, 0);
}

#include "jinja-runtime.cpp"  // the generated copy
