// The process-wide lock that C++ work holds shared and fork() takes exclusively (gil.h).
#include "gil.h"

#include <signal.h>

#include <pybind11/pybind11.h>

#include "errors.h"

#if !defined(_WIN32)
#include <pthread.h>

#include <cstdlib>
#endif

namespace llamaprompt {

namespace {
// set by init_sigint_watch (the module's init, GIL held), never released
unsigned long python_main_thread = 0;
PyObject * getsignal = nullptr;        // _signal.getsignal
PyObject * default_handler = nullptr;  // _signal.default_int_handler
PyObject * sigint_number = nullptr;    // SIGINT, as a Python int
}  // namespace

void init_sigint_watch() {
    pybind11::module_ sig = pybind11::module_::import("_signal");
    pybind11::object main = pybind11::module_::import("threading").attr("main_thread")();
    python_main_thread = main.attr("ident").cast<unsigned long>();
    getsignal = pybind11::object(sig.attr("getsignal")).release().ptr();
    default_handler = pybind11::object(sig.attr("default_int_handler")).release().ptr();
    sigint_number = pybind11::int_(SIGINT).release().ptr();
}

bool sigint_interrupts_here() {
    if (getsignal == nullptr || PyThread_get_thread_ident() != python_main_thread) {
        return false;
    }
    PyObject * handler = PyObject_CallOneArg(getsignal, sigint_number);
    if (handler == nullptr) {
        PyErr_Clear();
        return false;
    }
    const bool is_default = handler == default_handler;
    Py_DECREF(handler);
    return is_default;
}

void raise_watched_interrupt(bool stopped_execution) {
    if (PyErr_CheckSignals() != 0) {
        throw pybind11::error_already_set();
    }
    if (stopped_execution) {
        throw error(error_kind::template_, 500, "template execution interrupted (SIGINT)");
    }
}

#if !defined(_WIN32)
namespace {

pthread_rwlock_t * new_lock() {
    auto * lock = new pthread_rwlock_t;
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
#if defined(__GLIBC__)
    // glibc's default prefers readers: with renders overlapping on several threads a fork would
    // wait for as long as they keep coming
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    if (pthread_rwlock_init(lock, &attr) != 0) {
        std::abort();
    }
    pthread_rwlockattr_destroy(&attr);
    return lock;
}

// replaced in a forked child only, where the forking thread is the only one
pthread_rwlock_t * current = nullptr;

void before_fork() { pthread_rwlock_wrlock(current); }
void after_fork_parent() { pthread_rwlock_unlock(current); }
// the child's thread has a new id, so the parent's lock (held by it) is left as it is; it is the
// child's Python main thread (CPython's own after-fork makes it so), and a SIGINT watch of the
// parent's main thread (waiting for the GIL while the fork was made) is not the child's
void after_fork_child() {
    current = new_lock();
    python_main_thread = PyThread_get_thread_ident();
    sigint_watch_forget_in_child();
}

// made once (thread-safe: a function's static), never destroyed
pthread_rwlock_t & fork_lock() {
    static const bool made = [] {
        current = new_lock();
        pthread_atfork(before_fork, after_fork_parent, after_fork_child);
        return true;
    }();
    (void)made;
    return *current;
}

// ... while the module loads, not at the first C++ work: a handler registered while another
// thread is inside fork() is left out of that fork, and the child would keep a lock held by a
// thread it does not have (its next fork would wait for ever)
[[maybe_unused]] const bool made_at_load = (fork_lock(), true);

// At interpreter exit, daemon threads may still be rendering (the GIL released) while exit()
// destroys the module's statics -- llama.cpp's table of Jinja built-ins among them, which a
// render then searched after it was freed (a segfault at exit, a few runs in a hundred with
// hundreds of rendering daemon threads). So once Python has finalized (Py_AtExit: after its
// finalization, before exit()'s handlers) the lock is taken exclusively, as a fork takes it:
// exit waits for the renders in progress to end and no new one starts. Template executions are
// told to stop first (at their next time check: jinja_guard_stop_all), so that a long one -- a
// timeout=None loop -- does not hold the exit up. Never given back, unless the interpreter is
// initialized again in this process (the module's init, hold_renders_at_exit).
bool held_at_exit = false;

void hold_renders_now() {
    jinja_guard_stop_all(true);
    pthread_rwlock_wrlock(&fork_lock());
    held_at_exit = true;
}

}  // namespace

void fork_hold_enter() { pthread_rwlock_rdlock(&fork_lock()); }
void fork_hold_leave() { pthread_rwlock_unlock(&fork_lock()); }

void hold_renders_at_exit() {
    if (held_at_exit) {  // a new interpreter after Py_FinalizeEx (the same thread, the same lock)
        held_at_exit = false;
        pthread_rwlock_unlock(&fork_lock());
        jinja_guard_stop_all(false);
    }
    // (a full table of Py_AtExit's 32 functions: the C library's, later than the statics made so far)
    if (Py_AtExit(hold_renders_now) != 0) {
        std::atexit(hold_renders_now);
    }
}
#else
void fork_hold_enter() {}
void fork_hold_leave() {}
// (Windows ends the process's other threads before it destroys a module's statics)
void hold_renders_at_exit() {}
#endif

}  // namespace llamaprompt
