// Limits on one template execution in llama.cpp's Jinja engine, which has none: a
// recursive macro overflows the C++ stack (the process dies) and a long loop runs for as
// long as it runs. Upstream call sites compiled from build-tree copies call jinja_guard_*
// here (see CMakeLists.txt and third_party/adapt_tree.py): statement::execute (every
// statement and expression), range() and slice() (each element), split() (each piece),
// string repetition `s * n`, concatenation `a ~ b` / `a + b`, indent(), join, replace,
// tojson, the parser's recursive rules and the recursions over values.
//
// A guard that fires throws std::runtime_error, which llama.cpp's own handling turns into
// the error of the call (a TemplateError, 500). Limits are per thread, set by a
// jinja_budget for the duration of one llamaprompt call:
// - stack: execution stops when the thread has used half of its stack;
// - time: execution stops once `seconds` have passed (checked every 64 steps and at each
//   size check), and so does llama.cpp's grammar generation for the call's JSON schemas;
// - size: a string repetition or concatenation, or a range(), may not build a value of
//   more than `max_bytes`.
// Output that many statements emit is bounded only by the time budget; memory is bounded
// only in a worker process (UntrustedTemplate, RLIMIT_AS).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace llamaprompt {

struct jinja_limits {
    double seconds = 10.0;              // <= 0: no time limit
    size_t max_bytes = size_t(64) << 20;  // 0: no size limit
};

class jinja_budget {
  public:
    explicit jinja_budget(const jinja_limits & limits);
    ~jinja_budget();
    jinja_budget(const jinja_budget &) = delete;
    jinja_budget & operator=(const jinja_budget &) = delete;

  private:
    std::chrono::steady_clock::time_point prev_deadline_;
    size_t prev_max_bytes_;
    double prev_seconds_;
};

// how many times a guard fired on this thread (so far); results computed while one fired
// (e.g. a cached template analysis, whose renders llama.cpp try/catches) are not reused
uint64_t jinja_guard_fired();

// true: every execution in progress, on any thread, stops at its next time check (as when its
// time budget is exceeded) and every later one at its first -- at interpreter exit (gil.cpp),
// so that the exit waits for no render longer than that; false: as before
void jinja_guard_stop_all(bool stop) noexcept;

// For the scope of this object, executions on the calling thread also stop at their next time
// check once `flag` is true (the message: "<activity> stopped: <why>"): a batch's renders in
// progress once the batch is interrupted. Scopes nest (the previous flag is put back).
class jinja_cancel {
  public:
    jinja_cancel(const std::atomic<bool> & flag, const char * why) noexcept;
    ~jinja_cancel();
    jinja_cancel(const jinja_cancel &) = delete;
    jinja_cancel & operator=(const jinja_cancel &) = delete;

  private:
    const std::atomic<bool> * prev_flag_;
    const char * prev_why_;
};

// The calling thread's executions stop at their next time check while `flag` is true ("<activity>
// stopped: <why>"), until the thread sets another (nullptr: none; the flag is kept alive until
// then): a Python thread that renders for a caller who may be interrupted (template.py,
// map_on_threads). A jinja_cancel scope on the thread takes its place for the scope.
void jinja_cancel_thread(std::shared_ptr<const std::atomic<bool>> flag, const char * why) noexcept;
// the calling thread's flag and its why (nullptr: none): for carrying them to another thread
// that works for this one (gil.h, on_big_stack_logged)
std::pair<const std::atomic<bool> *, const char *> jinja_cancel_current() noexcept;

// Ctrl-C during a long template execution on the calling thread (Python's main thread, the GIL
// released; gil.h arms it). Python's handler for SIGINT only notes the signal, to be acted on once
// the GIL is back, so a render holds a Ctrl-C up for as long as it runs. From `after` into the
// scope (at the execution's next time check, so never for the short renders that are nearly all
// of them) SIGINT's disposition is a handler that notes the signal here and then calls the one it
// replaced (Python's); the execution then stops at its next time check ("template execution
// interrupted (SIGINT)"), and the scope's end puts the replaced handler back. Nothing is changed
// when SIGINT has no handler function (SIG_DFL, SIG_IGN). POSIX only (elsewhere: no effect).
class sigint_watch {
  public:
    explicit sigint_watch(std::chrono::steady_clock::duration after) noexcept;
    ~sigint_watch();
    sigint_watch(const sigint_watch &) = delete;
    sigint_watch & operator=(const sigint_watch &) = delete;
    // SIGINT arrived while the watch's handler was in place (the caller runs Python's handlers)
    bool interrupted() const noexcept;
    // an execution stopped for it (the scope's results are not the request's)
    bool stopped_execution() const noexcept;
};
// the calling thread's sigint_watch has seen SIGINT (false without a watch)
bool sigint_watch_saw_signal() noexcept;
// in a forked child (gil.cpp's atfork handler): a watch's handler inherited from the parent's
// main thread, whose watch will not end here, is replaced by the disposition it had replaced
void sigint_watch_forget_in_child() noexcept;

// the message of the last guard that fired on this thread ("" if none): for a caller that gets
// only a copy of the exception sliced to std::exception (common_chat_templates_init's rethrow)
std::string jinja_guard_last_message();

// bytes of the calling thread's stack left below the caller's frame (SIZE_MAX: unknown)
size_t stack_left();

// statement::execute: stack and time
void jinja_guard_step();
// range(): time (each element; the size of the list is checked with jinja_guard_size)
void jinja_guard_tick();
// work of about `bytes` done in one step (a copy, a move of a string's rest): time, checked once
// ~1 MiB of such work has accumulated (split() moves the rest of its string once per piece)
void jinja_guard_work(size_t bytes);
// time alone, for work outside the Jinja engine under the same budget (llama.cpp's conversion of
// tool and response_format JSON schemas to grammar rules: shim_json_schema.cpp); `activity` names
// it in the message ("grammar generation exceeded the time budget (2 s)")
void jinja_guard_time(const char * activity);
// the stack guard alone, for a recursion outside the Jinja engine (llama.cpp's schema converter:
// a chain of $refs recursed once per link); `what` names it ("JSON schema nested too deeply ...")
void jinja_guard_stack(const char * what);
// size alone, before a value of at least `bytes` is built (tojson's output so far and the
// indentation it is about to write): no clock read
void jinja_guard_bytes(size_t bytes);
// `s * n`, `a ~ b`: time, and the size the result would reach (its bytes, and its
// parts -- llama.cpp's strings are lists of parts of ~40 bytes each plus their text)
void jinja_guard_size(size_t bytes, size_t parts);

}  // namespace llamaprompt
