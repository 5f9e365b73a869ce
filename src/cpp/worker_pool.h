// Threads kept between apply_template_many calls. Starting a thread per call made every call
// pay the thread's start and the cold start of its per-thread state (the engine's value free
// lists, thread-local lookup keys, a malloc arena's first blocks); with threads kept, a call on N
// threads runs as warm as a call on the calling thread alone.
#pragma once

#include <cstddef>
#include <functional>

namespace llamaprompt {

// Calls fn() on n threads at once -- the calling thread and n - 1 threads of a process-wide
// pool (started when fewer are idle, each leaving after 10 s without work); n at most
// max(8, 4 x the CPU count) -- and returns when every call has returned. An exception thrown by a call is rethrown here (the
// first one) after all calls have returned. Safe to call from several threads at once and in a
// process forked from one that used the pool (the child starts its own threads).
void run_on_threads(size_t n, const std::function<void()> & fn);

}  // namespace llamaprompt
