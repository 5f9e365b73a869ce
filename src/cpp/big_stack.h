// Run a call on a thread of its own with a large stack, the calling thread waiting for it.
// - llama.cpp's output parser recurses once per JSON nesting level with no limit; on a 256 MiB
//   stack (only the pages touched are committed) model output nested far deeper than any real
//   output parses instead of overflowing the calling thread's stack (parse.cpp).
// - A Python thread made with a small threading.stack_size (down to 32 KiB) has too little stack
//   for llama.cpp's recursions that no guard bounds (a request's JSON, a schema's conversion to a
//   grammar, loading a template): without_gil (gil.h) runs its work on a thread with an 8 MiB
//   stack, as the main thread has, when the caller has less than 1 MiB left.
#pragma once

#include <cstddef>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#if !defined(_WIN32)
#include <pthread.h>
#endif

namespace llamaprompt {

constexpr size_t big_stack_bytes = size_t(256) << 20;

// fn() on a thread with a stack of `stack_bytes`; its result returned, or its exception rethrown,
// here. When no thread can be made, fn() runs on the calling thread.
template <typename F>
auto on_big_stack(F && fn, size_t stack_bytes = big_stack_bytes) -> decltype(fn()) {
    using result = decltype(fn());
#if defined(_WIN32)
    return fn();
#else
    struct job {
        F * fn;
        std::optional<std::conditional_t<std::is_void_v<result>, bool, result>> out;
        std::exception_ptr error;
    } j{&fn, std::nullopt, nullptr};
    auto entry = [](void * p) -> void * {
        job * jp = static_cast<job *>(p);
        try {
            if constexpr (std::is_void_v<result>) {
                (*jp->fn)();
                jp->out.emplace(true);
            } else {
                jp->out.emplace((*jp->fn)());
            }
        } catch (...) {
            jp->error = std::current_exception();
        }
        return nullptr;
    };
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, stack_bytes);
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
    if constexpr (!std::is_void_v<result>) {
        return std::move(*j.out);
    }
#endif
}

}  // namespace llamaprompt
