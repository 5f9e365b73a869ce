// common/jinja/value.cpp, compiled here only to make strftime_now thread-safe (see
// thread_safe_time.h); the archive's copy of this object is then never linked.
#include "thread_safe_time.h"
#include "jinja/value.cpp"
#undef localtime
