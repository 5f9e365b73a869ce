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

#include <optional>
#include <type_traits>
#include <utility>

namespace llamaprompt {

void fork_hold_enter();  // gil.cpp
void fork_hold_leave();

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

// fn() with the GIL released; its result is returned once the GIL is back. Two rules for a
// gil_released scope: no `catch (...)` around it (it would catch the forced unwinding, which
// must pass), and no `return value;` from inside it when the scope sits in a try block of the same
// function: GCC (12) then destroys the already-made return value while the forced unwinding of
// ~gil_released passes, and the caller's unwinding destroys it again (a double free at exit, seen
// with daemon threads making templates). A try block inside the scope is fine (call_upstream).
template <typename F>
auto without_gil(F && fn) -> decltype(fn()) {
    using result = decltype(fn());
    if constexpr (std::is_void_v<result>) {
        gil_released nogil;
        fn();
    } else {
        std::optional<result> out;
        {
            gil_released nogil;
            out.emplace(fn());
        }
        return std::move(*out);
    }
}

}  // namespace llamaprompt
