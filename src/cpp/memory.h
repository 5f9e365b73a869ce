#pragma once

#include <cstddef>
#include <cstdlib>  // defines __GLIBC__ (features.h)
#include <vector>

// Whether memory.cpp replaces the module's operator new / delete with its per-thread block cache:
// asked for (LLAMAPROMPT_BLOCK_CACHE, CMakeLists.txt) and glibc on a 64-bit target whose chunk
// sizes it assumes (16-byte multiples with an 8-byte header)
#if defined(LLAMAPROMPT_BLOCK_CACHE) && defined(__GLIBC__) && (defined(__x86_64__) || defined(__aarch64__))
#define LP_BLOCK_CACHE_ACTIVE 1
#else
#define LP_BLOCK_CACHE_ACTIVE 0
#endif

namespace llamaprompt {
// whether the module's allocations go through the block cache in this process: built with it, and
// the process's operator new is libstdc++'s (not a sanitizer's, valgrind's or a host's own)
bool block_cache_active() noexcept;
// how the module's operator new / delete work in this process: "sized" (the block cache; a sized
// delete's size gives the block's class), "usable" (the block cache; every delete asks
// malloc_usable_size for the class), "forward" (the process's operator new / delete), "off" (a
// build without the cache)
const char * block_cache_mode() noexcept;
// the check that chooses "sized" (memory.cpp sized_frees_fit) on given sizes instead of malloc's:
// usable[n] is the usable size of malloc(n)'s block, n = 0 .. usable.size() - 1 (for tests; false
// in a build without the cache)
bool block_sizes_fit(const std::vector<std::size_t> & usable) noexcept;
// whether the calling thread finds its block cache lists through its thread-pointer slot
// (thread_slots.h) and they are its own (for tests; false before the thread's first allocation,
// when its slot is another thread's, and in a build without the cache or the slots)
bool block_cache_slot_found() noexcept;
// glibc keeps small freed chunks in its arenas' "fast bins" until a request for a large chunk
// from the same arena merges them all (malloc_consolidate). A batch's request trees are built on
// the calling thread and freed on the pool's threads into that thread's arena: hundreds of
// thousands of chunks, whose merging took ~0.1 s (300,000 requests) at the first large allocation
// after the batch -- the growth of its result list, with the GIL held (every other Python thread
// stopped). Called without the GIL, this makes that request now (elsewhere: nothing).
void merge_freed_chunks() noexcept;
}  // namespace llamaprompt
