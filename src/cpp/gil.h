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

#include <cstddef>
#include <exception>
#include <optional>
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

class log_capture;  // logging.h
log_capture * current_log_capture() noexcept;
log_capture * exchange_log_capture(log_capture * capture) noexcept;

// A caller with less stack than this left (a Python thread made with a small threading.stack_size)
// has its work run on a thread with hop_stack_bytes of stack (big_stack.h), logging into its capture
constexpr size_t min_stack_left = size_t(1) << 20;
constexpr size_t hop_stack_bytes = size_t(8) << 20;

// fn() on a thread with stack_bytes of stack (big_stack.h), logging into this thread's capture
template <typename F>
auto on_big_stack_logged(F && fn, size_t stack_bytes) -> decltype(fn()) {
    log_capture * logs = current_log_capture();
    return on_big_stack(
        [&]() -> decltype(fn()) {
            struct forward {
                log_capture * prev;
                ~forward() { exchange_log_capture(prev); }
            } in_force{exchange_log_capture(logs)};
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
template <typename F>
auto without_gil(F && fn, gil_released::holds holds = gil_released::whole_scope) -> decltype(fn()) {
    using result = decltype(fn());
    std::exception_ptr failure;
    if constexpr (std::is_void_v<result>) {
        {
            gil_released nogil(holds);
            try {
                with_enough_stack(fn);
            } catch (...) {
                failure = std::current_exception();
            }
        }
        if (failure) {
            std::rethrow_exception(failure);
        }
    } else {
        std::optional<result> out;
        {
            gil_released nogil(holds);
            try {
                out.emplace(with_enough_stack(fn));
            } catch (...) {
                failure = std::current_exception();
            }
        }
        if (failure) {
            std::rethrow_exception(failure);
        }
        return std::move(*out);
    }
}

}  // namespace llamaprompt
