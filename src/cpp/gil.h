// The GIL released around C++ work, and the work's hold against fork().
//
// pybind11::gil_scoped_release takes the GIL back in a noexcept destructor; at interpreter
// shutdown CPython ends a daemon thread that asks for the GIL with pthread_exit, whose stack
// unwinding cannot pass a noexcept frame: std::terminate, and the process aborted at exit
// ("terminate called without an active exception") whenever a daemon thread was rendering.
// This guard lets that unwinding through.
//
// A fork() while another thread is inside llama.cpp's code leaves the child with that thread's
// locks taken and no thread to release them: glibc's time-zone lock (localtime_r, which every
// render calls for the date it passes to templates), a template's caches' mutexes. The child's
// first render then waited forever. So every stretch of C++ work holds a process-wide lock shared,
// and fork() (a pthread_atfork handler, gil.cpp) takes it exclusively: a fork waits for the
// renders in progress to end and new ones wait for the fork. The shared hold is taken after the
// GIL is given up and dropped before it is taken back, so the forking thread (which holds the
// GIL) never waits for a thread that waits for it. A batch (apply_template_many) holds it per
// render instead, so a fork waits for one render per thread, not for the whole batch.
#pragma once

#include <Python.h>

#include "big_stack.h"
#include "jinja_guard.h"

#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

namespace llamaprompt {

void fork_hold_enter();  // gil.cpp
void fork_hold_leave();
// from the module's init: at interpreter exit, waits for the renders in progress and keeps new
// ones from starting before the module's statics are destroyed (gil.cpp)
void hold_renders_at_exit();

// the shared hold against fork() for a stretch of C++ work (on any thread)
class fork_hold {
  public:
    fork_hold() { fork_hold_enter(); }
    fork_hold(const fork_hold &) = delete;
    fork_hold & operator=(const fork_hold &) = delete;
    ~fork_hold() { fork_hold_leave(); }
};

class gil_released {
  public:
    // the scope's work holds against fork() (fork_hold), unless it takes holds of its own
    enum holds { whole_scope, per_render };
    explicit gil_released(holds h = whole_scope) : state_(PyEval_SaveThread()), hold_(h == whole_scope) {
        if (hold_) {
            fork_hold_enter();
        }
    }
    gil_released(const gil_released &) = delete;
    gil_released & operator=(const gil_released &) = delete;
    // may "throw" the thread's forced unwinding (see above); nothing else
    ~gil_released() noexcept(false) {
        if (hold_) {
            fork_hold_leave();
        }
        PyEval_RestoreThread(state_);
    }

  private:
    PyThreadState * state_;
    bool hold_;
};

// For a long stretch of work that holds the GIL without running Python code (a batch's dicts
// read into trees: ~1 s for a million), which would keep every other thread -- the main thread
// running a Ctrl-C's handler among them -- waiting for all of it. Called once per item: every
// switch interval (5 ms, CPython's default) the GIL is let go for 20 us (a bare release and
// retake is not enough: the waiting thread, woken, finds it taken again and restarts its own 5 ms
// wait, so CPython's forced switch never comes; measured: a 0.2 s gap with it, none with 10 us+).
class gil_offer {
  public:
    void operator()(size_t item) {
        if ((item & 63) == 63 && std::chrono::steady_clock::now() - offered_ >= std::chrono::milliseconds(5)) {
            PyThreadState * state = PyEval_SaveThread();
            std::this_thread::sleep_for(std::chrono::microseconds(20));  // (0.4% of the stretch's time)
            PyEval_RestoreThread(state);
            offered_ = std::chrono::steady_clock::now();
        }
    }

  private:
    std::chrono::steady_clock::time_point offered_ = std::chrono::steady_clock::now();
};

class log_capture;  // logging.h
log_capture * current_log_capture() noexcept;
log_capture * exchange_log_capture(log_capture * capture) noexcept;

// A caller with less stack than this left (a Python thread made with a small threading.stack_size)
// has its work run on a thread with hop_stack_bytes of stack (big_stack.h), logging into its capture
constexpr size_t min_stack_left = size_t(1) << 20;
constexpr size_t hop_stack_bytes = size_t(8) << 20;

// fn() on a thread with stack_bytes of stack (big_stack.h), logging into this thread's capture
// and stopped by this thread's cancel flag (jinja_cancel_thread)
template <typename F>
auto on_big_stack_logged(F && fn, size_t stack_bytes) -> decltype(fn()) {
    log_capture * logs = current_log_capture();
    const auto cancel = jinja_cancel_current();
    return on_big_stack(
        [&]() -> decltype(fn()) {
            struct forward {
                log_capture * prev;
                ~forward() { exchange_log_capture(prev); }
            } in_force{exchange_log_capture(logs)};
            std::optional<jinja_cancel> cancelled_with_caller;
            if (cancel.first != nullptr) {
                cancelled_with_caller.emplace(*cancel.first, cancel.second);
            }
            return fn();
        },
        stack_bytes);
}

template <typename F>
auto with_enough_stack(F && fn) -> decltype(fn()) {
    if (stack_left() >= min_stack_left) {
        return fn();
    }
    return on_big_stack_logged(std::forward<F>(fn), hop_stack_bytes);
}

// Called with the GIL: true on Python's main thread while SIGINT's Python handler is
// signal.default_int_handler (the KeyboardInterrupt of Ctrl-C), the case without_gil watches for
// (sigint_watch, jinja_guard.h). A handler of the program's own is left to run after the work, as
// before: whether it would stop the work is not known, and a render stopped for nothing would fail.
bool sigint_interrupts_here();
// from the module's init (GIL held): the main thread and the handler sigint_interrupts_here compares
void init_sigint_watch();
// after a scope whose watch saw SIGINT (GIL held): Python's handlers run (PyErr_CheckSignals) and
// their KeyboardInterrupt is thrown (pybind11::error_already_set); if none is raised and an
// execution was stopped for it, a TemplateError says so
void raise_watched_interrupt(bool stopped_execution);
// how long work runs before SIGINT is watched for: calls shorter than this (nearly all renders)
// make no system call for it, and the four a longer one makes (sigaction, ~0.22 us each) are
// < 0.1% of it.
// A SIGINT within this first stretch reaches Python's handler only, and waits for the call's end
// (the trial found 0.1 s here too long: a Ctrl-C 50 ms into a 4-minute template load waited for it)
constexpr auto sigint_watch_after = std::chrono::milliseconds(1);

// fn() with the GIL released (on a thread of its own when this one's stack is small:
// with_enough_stack); its result is returned, or its exception thrown, once the GIL is
// back. The only way C++ work runs without the GIL, because of two hazards of ~gil_released when
// CPython ends the thread there (pthread_exit at interpreter exit, a forced unwinding):
// - an exception in flight through ~gil_released: the unwinding meets another one, and the
//   process aborted ("terminate called without an active exception", exit 134) -- a daemon
//   thread whose call was failing at exit (a request nested too deeply, bad server arguments);
//   so fn's exception is caught inside the scope and thrown after it;
// - a value returned from inside a gil_released scope that sits in a try block: GCC (12) destroys
//   the already-made return value during that unwinding and the caller's unwinding destroys it
//   again (a double free at exit); so the result waits outside the scope.
// And no `catch (...)` may be around it (it would catch the forced unwinding, which must pass).
// On Python's main thread a Ctrl-C stops a long template execution in fn (sigint_watch): the
// KeyboardInterrupt is thrown instead of fn's result or error. The watch is armed on the thread
// that runs fn -- the thread with_enough_stack hops to, for a caller with a small stack, where the
// engine's time checks are made -- and what it saw is carried back for the caller to act on.
template <typename F>
auto without_gil(F && fn, gil_released::holds holds = gil_released::whole_scope) -> decltype(fn()) {
    using result = decltype(fn());
    std::exception_ptr failure;
    const bool watch_here = sigint_interrupts_here();
    struct {
        bool interrupted = false;
        bool stopped_execution = false;
    } seen;
    const auto watched = [&]() -> result {
        if (!watch_here) {
            return fn();
        }
        sigint_watch watch(sigint_watch_after);
        struct note {  // (read before the watch's end puts SIGINT's disposition back)
            const sigint_watch & w;
            decltype(seen) & s;
            ~note() {
                s.interrupted = w.interrupted();
                s.stopped_execution = w.stopped_execution();
            }
        } noted{watch, seen};
        return fn();
    };
    const auto interrupted = [&]() {
        if (seen.interrupted) {
            raise_watched_interrupt(seen.stopped_execution);
        }
    };
    if constexpr (std::is_void_v<result>) {
        {
            gil_released nogil(holds);
            try {
                with_enough_stack(watched);
            } catch (...) {
                failure = std::current_exception();
            }
        }
        interrupted();
        if (failure) {
            std::rethrow_exception(failure);
        }
    } else {
        std::optional<result> out;
        {
            gil_released nogil(holds);
            try {
                out.emplace(with_enough_stack(watched));
            } catch (...) {
                failure = std::current_exception();
            }
        }
        interrupted();
        if (failure) {
            std::rethrow_exception(failure);
        }
        return std::move(*out);
    }
}

}  // namespace llamaprompt
