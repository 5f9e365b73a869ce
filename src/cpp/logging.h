// llama.cpp / ggml log messages, collected per call and handed to Python's logging
// (logger "llamaprompt.llama_cpp") once the GIL is held again. Nothing is printed to
// stderr; a failed load's last error lines become the exception message.
#pragma once

#include <pybind11/pybind11.h>

#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

#include <cstdarg>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace llamaprompt {

struct log_record {
    int level;  // ggml_log_level
    std::string text;
};

// Collects the records logged on this thread while it is alive.
class log_capture {
  public:
    log_capture();
    ~log_capture();
    log_capture(const log_capture &) = delete;
    log_capture & operator=(const log_capture &) = delete;

    const std::vector<log_record> & records() const { return records_; }
    // the text of the error-level records, joined (empty when none)
    std::string errors() const;
    // emit the records to logging.getLogger("llamaprompt.llama_cpp"); needs the GIL
    void emit() const;

    void add(int level, const char * text);

  private:
    std::vector<log_record> records_;
    log_capture * prev_;
};

// the capture active on this thread (nullptr: none), and making one active on this thread (returns
// the one it replaces): a call that runs on a thread of its own (gil.h) logs into its caller's
log_capture * current_log_capture() noexcept;
log_capture * exchange_log_capture(log_capture * capture) noexcept;

// emit records (collected on any thread) to logging.getLogger("llamaprompt.llama_cpp"); needs the GIL
void emit_records(const std::vector<log_record> & records);

// a printf-formatted line (whole, however long) at ggml_log_level `level` for the capture active
// on this thread: dropped when there is none, or when there is no memory for it (never thrown
// into the upstream code that logs)
void log_vformat(int level, const char * fmt, va_list args) noexcept;

// Runs fn (which must hold the GIL when it returns) with a capture of the llama.cpp log
// lines it causes on this thread, then emits them to Python's logging, also when fn throws
// (once: a handler's exception ends the emission and replaces the result, as a raising
// handler's exception propagates from a logging call in Python).
// While the handlers run (Python code, which may give up the GIL), fn's Python result is held as
// a plain reference: if CPython ends the thread there (a daemon thread at interpreter exit), the
// forced unwinding must not release it without the GIL (a crash at exit); it is left instead.
template <typename F>
auto with_log_capture(F && fn) -> decltype(fn()) {
    using result_t = decltype(fn());
    log_capture logs;
    bool emitted = false;  // a handler that raised has had its records: not emitted again below
    try {
        result_t result = fn();
        emitted = true;
        if constexpr (std::is_base_of_v<pybind11::handle, result_t>) {
            PyObject * held = result.release().ptr();
            try {
                logs.emit();
#if defined(__GLIBCXX__)
            } catch (abi::__forced_unwind &) {
                throw;
#endif
            } catch (...) {
                Py_XDECREF(held);
                throw;
            }
            return pybind11::reinterpret_steal<result_t>(held);
        } else {
            logs.emit();
            return result;
        }
#if defined(__GLIBCXX__)
    } catch (abi::__forced_unwind &) {
        throw;  // a thread CPython ends at shutdown (gil.h): it holds no GIL to log with
#endif
    } catch (...) {
        if (!emitted) {
            logs.emit();
        }
        throw;
    }
}

// installs the process-wide llama_log_set callback (once, at import)
void install_log_callback();

}  // namespace llamaprompt
