// The memory of the module's own C++ code: operator new / delete, replaced inside _core only.
//
// A render allocates and frees about a thousand small blocks (strings, vectors, hash nodes,
// JSON values) and frees them in bursts -- a scope, a loop's result, a request's JSON -- which
// glibc's per-thread cache (7 blocks per size) does not absorb: its slow path (_int_malloc,
// _int_free) was a quarter of a render's instructions. Here each thread keeps freed blocks of up
// to 520 bytes in lists per size class, in front of malloc.
//
// Every block is still malloc's: a miss calls malloc (for the class's whole size), a full list
// or a thread that is ending calls free. So it makes no difference which code frees a block:
// libstdc++'s out-of-line code (streams, locales, exceptions' strings) allocates with the
// process's operator new and the module's inlined code frees those blocks here, and the reverse,
// as before. The module's symbol map (CMakeLists.txt: only PyInit__core is exported) keeps these
// definitions local, so the host process's operator new and malloc stay as they were.
//
// LLAMAPROMPT_BLOCK_CACHE=OFF (CMake define or environment variable) builds the module without
// it (the process's operator new), to measure against (docs/performance.md).

#include "memory.h"

#include <cstddef>
#include <cstdlib>
#include <new>
#include <string>

#if LP_BLOCK_CACHE_ACTIVE

#include <dlfcn.h>
#include <link.h>
#include <malloc.h>

#include <atomic>
#include <cstring>

#include "thread_slots.h"

namespace {

struct free_block {
    free_block * next;
};

// class k (1..classes-1) holds blocks with at least 16 k + 8 usable bytes: glibc's sizes on 64-bit
// (a chunk is a multiple of 16 bytes and 8 of them are its header), so malloc(16 k + 8) wastes
// nothing and a block's class comes from what malloc_usable_size says it has
constexpr std::size_t classes = 33;  // up to 520 bytes
constexpr std::size_t largest = 16 * (classes - 1) + 8;
constexpr std::size_t keep_bytes = 32 * 1024;  // per class and thread
constexpr unsigned keep_blocks = 512;

struct lists {  // trivial: a thread-local access without a guard
    free_block * head[classes];
    unsigned count[classes];
    unsigned char state;  // 0 not used yet, 1 in use, 2 the thread is ending
};

lists & own_lists() noexcept {
    static thread_local lists l;
    return l;
}

// the thread's lists: found through the thread pointer once the thread has claimed its slot
// (thread_slots.h: no __tls_get_addr call on the hot paths), else its thread-local
inline lists & local() noexcept { return llamaprompt::thread_slots<lists>::get<own_lists>(); }

constexpr std::size_t capacity(std::size_t k) { return 16 * k + 8; }

struct keep_table {  // how many free blocks a thread keeps per class
    unsigned blocks[classes] = {};
    constexpr keep_table() {
        for (std::size_t k = 1; k < classes; ++k) {
            const std::size_t n = keep_bytes / capacity(k);
            blocks[k] = n < keep_blocks ? unsigned(n) : keep_blocks;
        }
    }
};
constexpr keep_table keep;

struct reaper {  // gives the thread's blocks back to malloc when the thread ends
    ~reaper() {
        llamaprompt::thread_slots<lists>::release();  // (what the thread frees later: its thread-local, state 2)
        lists & l = own_lists();
        l.state = 2;
        for (std::size_t k = 0; k < classes; ++k) {
            while (free_block * b = l.head[k]) {
                l.head[k] = b->next;
                std::free(b);
            }
            l.count[k] = 0;
        }
    }
};

void start(lists & l) noexcept {
    l.state = 1;
    static thread_local reaper r;
    (void) r;
    llamaprompt::thread_slots<lists>::claim(&l);
}

// the paths off the hot ones (which find the thread's lists once and call nothing before their
// return): a thread's first use, its end, a miss, a full list, a block of another size
[[gnu::noinline]] void * allocate_slow(std::size_t n, std::size_t k) noexcept {
    lists & l = own_lists();
    if (l.state == 0) {
        start(l);
    }
    return std::malloc(k != 0 ? capacity(k) : n == 0 ? 1 : n);  // a class's whole size: reusable for any of it
}

[[gnu::noinline]] void deallocate_slow(void * p, std::size_t k) noexcept;

// the class a request of n bytes takes its block from (0: not kept). With glibc's malloc it is also
// the class of malloc(n)'s block: its usable size is 16 ceil((n + 8) / 16) - 8 (at least 24), which is
// capacity(request_class(n)) for n <= largest and over largest + 15 above
inline std::size_t request_class(std::size_t n) noexcept {
    return n > largest ? 0 : n <= 24 ? 1 : (n + 7) / 16;
}

inline std::size_t block_class(std::size_t usable) noexcept {  // 0: not kept
    return usable < capacity(1) || usable > largest + 15 ? 0 : (usable - 8) / 16;
}

inline void * allocate(std::size_t n) noexcept {
    const std::size_t k = request_class(n);
    if (k != 0) {
        lists & l = local();
        if (free_block * b = l.head[k]) {  // (lists are empty before the start and after the reaper)
            l.head[k] = b->next;
            --l.count[k];
            return b;
        }
    }
    return allocate_slow(n, k);
}

// a block of class k (0: not kept) back to the thread's list, or to free
inline void deallocate(void * p, std::size_t k) noexcept {
    lists & l = local();
    if (k != 0 && l.state == 1 && l.count[k] < keep.blocks[k]) {
        auto * b = static_cast<free_block *>(p);
        b->next = l.head[k];
        l.head[k] = b;
        ++l.count[k];
        return;
    }
    deallocate_slow(p, k);
}

void deallocate_slow(void * p, std::size_t k) noexcept {
    lists & l = own_lists();
    if (l.state == 0) {
        start(l);
        if (k != 0) {
            auto * b = static_cast<free_block *>(p);
            b->next = l.head[k];
            l.head[k] = b;
            ++l.count[k];
            return;
        }
    }
    std::free(p);
}

// operator new's contract: call the new-handler until memory comes or there is none to call
// (after allocate(n) gave nothing)
[[gnu::noinline]] void * allocate_or_throw(std::size_t n) {
    for (;;) {
        std::new_handler handler = std::get_new_handler();
        if (handler == nullptr) {
            throw std::bad_alloc();
        }
        handler();
        if (void * p = allocate(n)) {
            return p;
        }
    }
}

// The cache needs the process's operator new to be malloc's: libstdc++'s own (blocks cross between
// it and the cache). A process that defines another one where the module's libstdc++ finds it
// first -- AddressSanitizer's runtime, a C++ host with an allocator of its own -- or runs under a
// valgrind tool that redirects them (memcheck) gets the module's allocations through its
// operator new / delete instead, as without the cache (its checks then see matching calls).
struct process_allocator {
    using new_fn = void * (*) (std::size_t);
    using delete_fn = void (*)(void *);
    new_fn scalar_new = nullptr, array_new = nullptr;
    delete_fn scalar_delete = nullptr, array_delete = nullptr;
    bool cache = true;
    bool sized = false;  // a block's class follows from the size it was asked for (sized_frees_fit)
};

bool defined_in(void * symbol, const char * library) {
    Dl_info info{};
    return symbol != nullptr && dladdr(symbol, &info) != 0 && info.dli_fname && std::strstr(info.dli_fname, library);
}

// whether a sized free may file a block under the class its size asked for: every block malloc(n)
// gives, for n up to the largest class, holds at least that class's capacity. True of glibc's
// malloc, whose block for n bytes is of class request_class(n) -- or larger, when the free chunk it
// takes is too small to split (the rest would be under malloc's minimum): which happens depends on
// the heap's state, so only "at least" can be checked once for good. Checked rather than assumed,
// since the process's malloc may be another (a preloaded jemalloc or mimalloc, glibc's memory
// tagging). usable_of(n, u) sets u to the usable size of a block of malloc(n) (false: none).
template <class UsableOf> bool sized_frees_fit(UsableOf usable_of) noexcept {
    for (std::size_t n = 0; n <= largest; ++n) {
        std::size_t usable = 0;
        if (!usable_of(n, usable) || usable < capacity(request_class(n))) {
            return false;
        }
    }
    return true;
}

bool malloc_sized_frees_fit() noexcept {
    return sized_frees_fit([](std::size_t n, std::size_t & usable) {
        void * p = std::malloc(n);
        if (p == nullptr) {
            return false;
        }
        usable = malloc_usable_size(p);
        std::free(p);
        return true;
    });
}

// valgrind's tools that track the heap (memcheck, helgrind, drd, massif, dhat) preload a library
// of theirs and redirect libstdc++'s operator new / delete and malloc / free by address: the
// global scope still names libstdc++'s, so it is their preloaded library that tells
int find_tool_library(dl_phdr_info * info, std::size_t, void * found) {
    const char * name = info->dlpi_name ? std::strstr(info->dlpi_name, "vgpreload_") : nullptr;
    if (name && std::strncmp(name, "vgpreload_core", 14) != 0) {
        *static_cast<bool *>(found) = true;
        return 1;
    }
    return 0;
}

bool heap_tool_loaded() noexcept {
    bool found = false;
    dl_iterate_phdr(find_tool_library, &found);
    return found;
}

const process_allocator & process() noexcept {
    static const process_allocator a = [] {
        process_allocator r;
        void * found = dlsym(RTLD_DEFAULT, "_Znwm");  // the global scope's, if any: it wins
        if (found != nullptr && (!defined_in(found, "libstdc++") || heap_tool_loaded())) {
            r.scalar_new = reinterpret_cast<process_allocator::new_fn>(found);
            r.array_new = reinterpret_cast<process_allocator::new_fn>(dlsym(RTLD_DEFAULT, "_Znam"));
            r.scalar_delete = reinterpret_cast<process_allocator::delete_fn>(dlsym(RTLD_DEFAULT, "_ZdlPv"));
            r.array_delete = reinterpret_cast<process_allocator::delete_fn>(dlsym(RTLD_DEFAULT, "_ZdaPv"));
            r.cache = !(r.array_new && r.scalar_delete && r.array_delete);  // (all four, or none used)
        }
        r.sized = malloc_sized_frees_fit();
        return r;
    }();
    return a;
}

// What new and delete do in this process, looked up once (one byte read per call after that):
// 1 the cache, and a sized delete's size gives the block's class (a block asked for n bytes, by
// libstdc++'s operator new or this one, holds class request_class(n)'s capacity: sized_frees_fit);
// 2 the cache, the class from malloc_usable_size (a malloc whose usable sizes are its own);
// 3 the process's operator new / delete (process_allocator).
enum : unsigned char { unknown = 0, cache_sized = 1, cache_usable = 2, forward = 3 };
std::atomic<unsigned char> the_mode{unknown};

[[gnu::noinline]] unsigned char find_mode() noexcept {
    const process_allocator & a = process();
    const unsigned char m = !a.cache ? forward : a.sized ? cache_sized : cache_usable;
    the_mode.store(m, std::memory_order_relaxed);  // (the same value from every thread)
    return m;
}

inline unsigned char mode() noexcept {
    const unsigned char m = the_mode.load(std::memory_order_relaxed);
    return m != unknown ? m : find_mode();
}

inline void * new_block(std::size_t n, bool array) {
    if (mode() != forward) {
        if (void * p = allocate(n)) {
            return p;
        }
        return allocate_or_throw(n);
    }
    const process_allocator & a = process();
    return array ? a.array_new(n) : a.scalar_new(n);
}

void * new_block_or_null(std::size_t n, bool array) noexcept {
    try {
        return new_block(n, array);
    } catch (...) {
        return nullptr;
    }
}

[[gnu::noinline]] void forward_delete(void * p, bool array) noexcept {
    const process_allocator & a = process();
    (array ? a.array_delete : a.scalar_delete)(p);
}

inline void delete_block(void * p, bool array) noexcept {
    if (p == nullptr) {
        return;
    }
    if (mode() == forward) {
        forward_delete(p, array);
        return;
    }
    deallocate(p, block_class(malloc_usable_size(p)));
}

inline void delete_sized_block(void * p, std::size_t n, bool array) noexcept {
    if (p == nullptr) {
        return;
    }
    const unsigned char m = mode();
    if (m == cache_sized) {
        deallocate(p, request_class(n));
    } else if (m == cache_usable) {
        deallocate(p, block_class(malloc_usable_size(p)));
    } else {
        forward_delete(p, array);
    }
}

}  // namespace

void * operator new(std::size_t n) { return new_block(n, false); }
void * operator new[](std::size_t n) { return new_block(n, true); }
void * operator new(std::size_t n, const std::nothrow_t &) noexcept { return new_block_or_null(n, false); }
void * operator new[](std::size_t n, const std::nothrow_t &) noexcept { return new_block_or_null(n, true); }
void operator delete(void * p) noexcept { delete_block(p, false); }
void operator delete[](void * p) noexcept { delete_block(p, true); }
void operator delete(void * p, std::size_t n) noexcept { delete_sized_block(p, n, false); }
void operator delete[](void * p, std::size_t n) noexcept { delete_sized_block(p, n, true); }
void operator delete(void * p, const std::nothrow_t &) noexcept { delete_block(p, false); }
void operator delete[](void * p, const std::nothrow_t &) noexcept { delete_block(p, true); }

bool llamaprompt::block_cache_active() noexcept { return process().cache; }

const char * llamaprompt::block_cache_mode() noexcept {
    switch (mode()) {
        case cache_sized: return "sized";
        case cache_usable: return "usable";
        default: return "forward";
    }
}

bool llamaprompt::block_sizes_fit(const std::vector<std::size_t> & usable) noexcept {
    return sized_frees_fit([&](std::size_t n, std::size_t & u) {
        if (n >= usable.size()) {
            return false;
        }
        u = usable[n];
        return true;
    });
}

bool llamaprompt::block_cache_slot_found() noexcept {
    return llamaprompt::thread_slots<lists>::find() == &own_lists();
}

// std::string's out-of-line members (_M_create, _M_mutate, reserve, ...): libstdc++ declares them
// an explicit instantiation of its own (extern template), so the module's strings grew through
// libstdc++'s copies and their operator new. Instantiated here too (the same code, from the same
// headers; local to the module like everything but PyInit__core), the module's strings take their
// memory from the cache as well.
template class std::basic_string<char>;

#else

bool llamaprompt::block_cache_active() noexcept { return false; }
const char * llamaprompt::block_cache_mode() noexcept { return "off"; }
bool llamaprompt::block_sizes_fit(const std::vector<std::size_t> &) noexcept { return false; }
bool llamaprompt::block_cache_slot_found() noexcept { return false; }

#endif

void llamaprompt::merge_freed_chunks() noexcept {
#if defined(__GLIBC__)
    // above the sizes of glibc's per-thread cache (1,032 bytes): _int_malloc's large-bin path,
    // which merges the arena's fast bins first; `volatile`: the pair is not optimized away
    void * volatile block = std::malloc(4096);
    std::free(block);
#endif
}
