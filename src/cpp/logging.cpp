#include "logging.h"

#include <cstdarg>
#include <cstdio>

#include "ggml.h"
#include "llama.h"

namespace py = pybind11;

namespace llamaprompt {

namespace {

thread_local log_capture * current_capture = nullptr;

void log_callback(ggml_log_level level, const char * text, void * /*user_data*/) {
    if (current_capture && text) {
        current_capture->add((int) level, text);
    }
    // outside a capture (no call of ours is running on this thread): dropped
}

int python_level(int level) {
    switch (level) {
        case GGML_LOG_LEVEL_DEBUG: return 10;
        case GGML_LOG_LEVEL_INFO:  return 20;
        case GGML_LOG_LEVEL_WARN:  return 30;
        case GGML_LOG_LEVEL_ERROR: return 40;
        default:                   return 20;
    }
}

}  // namespace

log_capture * current_log_capture() noexcept { return current_capture; }

log_capture * exchange_log_capture(log_capture * capture) noexcept {
    log_capture * prev = current_capture;
    current_capture = capture;
    return prev;
}

log_capture::log_capture() : prev_(current_capture) { current_capture = this; }

log_capture::~log_capture() { current_capture = prev_; }

void log_capture::add(int level, const char * text) {
    if (level == GGML_LOG_LEVEL_CONT && !records_.empty()) {
        records_.back().text += text;
        return;
    }
    records_.push_back({level, text});
}

std::string log_capture::errors() const {
    std::string out;
    for (const auto & r : records_) {
        if (r.level == GGML_LOG_LEVEL_ERROR) {
            std::string line = r.text;
            while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
                line.pop_back();
            }
            if (!out.empty()) {
                out += "; ";
            }
            out += line;
        }
    }
    return out;
}

void log_capture::emit() const { emit_records(records_); }

// Python's logging through the C API with plain references, not pybind11's objects: a handler
// runs Python code, which may give up the GIL; if CPython then ends this thread (a daemon thread
// at interpreter exit: pthread_exit unwinds the stack), pybind11's objects would release their
// references in their destructors without the GIL -- a crash at exit (seen with logging.basicConfig
// and daemon threads whose renders warned). Plain references are left as they are then.
void emit_records(const std::vector<log_record> & records) {
    if (records.empty()) {
        return;
    }
    PyObject * logging = PyImport_ImportModule("logging");
    if (!logging) {
        throw py::error_already_set();
    }
    PyObject * logger = PyObject_CallMethod(logging, "getLogger", "s", "llamaprompt.llama_cpp");
    Py_DECREF(logging);
    if (!logger) {
        throw py::error_already_set();
    }
    for (const auto & r : records) {
        std::string line = r.text;
        while (!line.empty() && line.back() == '\n') {
            line.pop_back();
        }
        const int lvl = python_level(r.level);
        PyObject * enabled = PyObject_CallMethod(logger, "isEnabledFor", "i", lvl);
        const int on = enabled ? PyObject_IsTrue(enabled) : -1;
        Py_XDECREF(enabled);
        if (on < 0) {
            Py_DECREF(logger);
            throw py::error_already_set();
        }
        if (!on) {
            continue;
        }
        PyObject * s = PyUnicode_DecodeUTF8(line.data(), (Py_ssize_t) line.size(), "replace");
        if (!s) {
            PyErr_Clear();
            continue;
        }
        // the line as the record's msg, no args: never %-formatted, and a filter reads it as it is
        PyObject * done = PyObject_CallMethod(logger, "log", "iO", lvl, s);
        Py_DECREF(s);
        if (!done) {
            Py_DECREF(logger);
            throw py::error_already_set();
        }
        Py_DECREF(done);
    }
    Py_DECREF(logger);
}

void log_vformat(int level, const char * fmt, va_list args) noexcept {
    if (!current_capture || !fmt) {
        return;
    }
    va_list sized;
    va_copy(sized, args);
    const int n = std::vsnprintf(nullptr, 0, fmt, sized);
    va_end(sized);
    if (n < 0) {
        return;
    }
    try {
        std::string text(size_t(n), '\0');
        std::vsnprintf(text.data(), size_t(n) + 1, fmt, args);
        current_capture->add(level, text.c_str());
    } catch (const std::exception &) {
    }
}

void install_log_callback() {
    llama_log_set(log_callback, nullptr);
}

}  // namespace llamaprompt

// common's LOG_* lines (src/cpp/lp_common_log.h): into the calling thread's capture
void llamaprompt_common_log(enum ggml_log_level level, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    llamaprompt::log_vformat((int) level, fmt, args);
    va_end(args);
}
