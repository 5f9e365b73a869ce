// Threads kept between apply_template_many calls. Starting a thread per call made every call
// pay the thread's start and the cold start of its per-thread state (the engine's value free
// lists, thread-local lookup keys, a malloc arena's first blocks); with threads kept, a call on N
// threads runs as warm as a call on the calling thread alone.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

namespace llamaprompt {

// Calls fn() on n threads at once -- the calling thread and n - 1 threads of a process-wide
// pool (started when fewer are idle, each leaving after 10 s without work); n at most
// max(8, 4 x the CPU count) -- and returns when every call has returned. An exception thrown by a call is rethrown here (the
// first one) after all calls have returned. Safe to call from several threads at once and in a
// process forked from one that used the pool (the child starts its own threads).
void run_on_threads(size_t n, const std::function<void()> & fn);

// run_on_threads in two steps, for a caller with work of its own to do while the pool's calls
// already run (apply_template_many reads the requests, GIL held, while the first renders run):
// the constructor starts fn's n - 1 pool calls (fn must outlive the batch: it is not copied); join() makes the calling thread's call and
// waits for all of them, rethrowing the first exception. Without join() (an exception in
// between), the destructor takes back the calls not started and waits for the others; fn must
// then return soon on its own (a flag of the caller's).
class thread_batch {
  public:
    thread_batch(size_t n, const std::function<void()> & fn);
    thread_batch(const thread_batch &) = delete;
    thread_batch & operator=(const thread_batch &) = delete;
    ~thread_batch();
    void join();

    struct state;

  private:
    std::unique_ptr<state> state_;
};

}  // namespace llamaprompt
