#pragma once

#include <cstdlib>  // defines __GLIBC__ (features.h)

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
}  // namespace llamaprompt
