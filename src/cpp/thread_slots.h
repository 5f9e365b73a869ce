#pragma once
// Per-thread objects found without a thread-local access.
//
// A shared object loaded with dlopen (a Python extension) reaches its thread-locals through a call
// of __tls_get_addr: about 15 instructions and a call, on every access. The module's allocators
// (memory.cpp's block cache, the Jinja value pool in the generated value.h) ask for their thread's
// free lists on every allocation and free, ~1,500 times per render. thread_slots<T> lets a thread
// register its object (its thread-local T) in a global table at a slot chosen by a hash of the
// thread pointer, and find it there again with a few plain instructions.
//
// Why a slot whose owner is the calling thread's thread pointer holds that thread's own object:
// a slot is claimed by a compare-and-swap from 0 (free) to the claiming thread's pointer, and only
// its owner writes its object pointer or frees it again. A thread pointer names one live thread;
// it can name another thread only after its thread has ended, and a thread gives its slot back
// when it ends (release(), from the destructor of a thread-local of its own), before its thread
// pointer can be reused. After fork() only the forking thread lives on in the child: the child
// frees every other slot (pthread_atfork). A thread whose slot is another thread's (a hash
// collision) or that has given it back finds nothing and uses its thread-local, as without this.
//
// Where the thread pointer is not available (other C libraries, other targets): find() always
// finds nothing.

#include <atomic>
#include <cstddef>
#include <cstdint>

#if defined(__linux__) && defined(__GLIBC__) && (defined(__x86_64__) || defined(__aarch64__)) && \
    defined(__has_builtin)
#if __has_builtin(__builtin_thread_pointer)
#define LP_THREAD_SLOTS 1
#endif
#endif
#ifndef LP_THREAD_SLOTS
#define LP_THREAD_SLOTS 0
#endif

#if LP_THREAD_SLOTS
#include <pthread.h>
#endif

namespace llamaprompt {

template <class T> class thread_slots {
  public:
    // the object the calling thread claimed a slot for, or null
    static T * find() noexcept {
#if LP_THREAD_SLOTS
        const std::uintptr_t tp = thread_pointer();
        slot & s = slot_of(tp);
        if (s.owner.load(std::memory_order_relaxed) == tp) {
            return s.object.load(std::memory_order_relaxed);
        }
#endif
        return nullptr;
    }

    // the calling thread's object: the one it claimed a slot for, else own()'s (its thread-local,
    // reached with a __tls_get_addr call: before its claim, after its release, on a collision)
    template <auto own> static T & get() noexcept(noexcept(own())) {
        if (T * object = find()) {
            return *object;
        }
        return own();
    }

    // the calling thread's object from now on, if its slot is free (once per thread, before any
    // find() should see it; the object must outlive the thread's release())
    static void claim(T * object) noexcept {
#if LP_THREAD_SLOTS
        (void) fork_handler_registered;  // (odr-used: registered when the module loads)
        const std::uintptr_t tp = thread_pointer();
        slot & s = slot_of(tp);
        std::uintptr_t free_slot = 0;
        if (s.owner.compare_exchange_strong(free_slot, tp, std::memory_order_relaxed)) {
            s.object.store(object, std::memory_order_relaxed);  // (read only by this thread)
        }
#else
        (void) object;
#endif
    }

    // gives the calling thread's slot back (when the thread ends); find() then finds nothing
    static void release() noexcept {
#if LP_THREAD_SLOTS
        const std::uintptr_t tp = thread_pointer();
        std::uintptr_t mine = tp;
        slot_of(tp).owner.compare_exchange_strong(mine, 0, std::memory_order_relaxed);
#endif
    }

  private:
#if LP_THREAD_SLOTS
    struct slot {
        std::atomic<std::uintptr_t> owner{0};  // the owner's thread pointer; 0: free
        std::atomic<T *> object{nullptr};
    };
    static constexpr unsigned bits = 8;
    static inline slot slots[std::size_t(1) << bits];

    static std::uintptr_t thread_pointer() noexcept {
        return reinterpret_cast<std::uintptr_t>(__builtin_thread_pointer());
    }

    static slot & slot_of(std::uintptr_t tp) noexcept {  // (thread pointers of threads lie MiBs apart)
        return slots[(std::uint64_t(tp) * 0x9E3779B97F4A7C15ull) >> (64 - bits)];
    }

    static void keep_only_the_forking_thread() noexcept {
        const std::uintptr_t tp = thread_pointer();
        for (slot & s : slots) {
            if (s.owner.load(std::memory_order_relaxed) != tp) {
                s.owner.store(0, std::memory_order_relaxed);
            }
        }
    }

    // registered while the module loads, not at a first claim: a claim can come from the first
    // allocation of a thread, which could be inside another fork handler (with glibc's handler
    // list locked)
    static inline const bool fork_handler_registered =
        pthread_atfork(nullptr, nullptr, &keep_only_the_forking_thread) == 0;
#endif
};

}  // namespace llamaprompt
