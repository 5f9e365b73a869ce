// std::localtime returns a pointer to one process-wide struct tm, so two renders that
// print a date at the same time race on it. The upstream files that call it
// (common/chat.cpp format_time, common/jinja/value.cpp strftime_now) are compiled in
// our shims with `localtime` renamed to this thread-safe equivalent (localtime_r into
// a thread-local struct). Include this header, then the upstream .cpp, in a shim.
#pragma once

#include <chrono>
#include <ctime>
#include <iomanip>
#include <sstream>
#include <string>

namespace std {
inline tm * llamaprompt_localtime(const time_t * t) {
    thread_local tm result;
#if defined(_WIN32)
    return localtime_s(&result, t) == 0 ? &result : nullptr;
#else
    return localtime_r(t, &result);
#endif
}
}  // namespace std

#define localtime llamaprompt_localtime
