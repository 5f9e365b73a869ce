// Run a call on a thread of its own with a large stack. llama.cpp's output parser recurses
// once per JSON nesting level with no limit; on a 256 MiB stack (only the pages touched are
// committed) model output nested far deeper than any real output parses instead of
// overflowing the calling thread's stack (8 MiB, or less for Python threads).
#pragma once

#include <exception>
#include <string>
#include <utility>

#if !defined(_WIN32)
#include <pthread.h>
#endif

namespace llamaprompt {

constexpr size_t big_stack_bytes = size_t(256) << 20;

template <typename F>
std::string on_big_stack(F && fn) {
#if defined(_WIN32)
    return fn();
#else
    struct job {
        F * fn;
        std::string result;
        std::exception_ptr error;
    } j{&fn, {}, nullptr};
    auto entry = [](void * p) -> void * {
        job * jp = static_cast<job *>(p);
        try {
            jp->result = (*jp->fn)();
        } catch (...) {
            jp->error = std::current_exception();
        }
        return nullptr;
    };
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, big_stack_bytes);
    pthread_t thread;
    const int rc = pthread_create(&thread, &attr, entry, &j);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        return fn();  // no thread to be had: the calling thread, with its own stack
    }
    pthread_join(thread, nullptr);
    if (j.error) {
        std::rethrow_exception(j.error);
    }
    return std::move(j.result);
#endif
}

}  // namespace llamaprompt
