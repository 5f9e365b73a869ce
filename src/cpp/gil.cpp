// The process-wide lock that C++ work holds shared and fork() takes exclusively (gil.h).
#include "gil.h"

#if !defined(_WIN32)
#include <pthread.h>

#include <cstdlib>
#endif

namespace llamaprompt {

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
// the child's thread has a new id, so the parent's lock (held by it) is left as it is
void after_fork_child() { current = new_lock(); }

// made at the first C++ work (thread-safe: a function's static), never destroyed
pthread_rwlock_t & fork_lock() {
    static const bool made = [] {
        current = new_lock();
        pthread_atfork(before_fork, after_fork_parent, after_fork_child);
        return true;
    }();
    (void)made;
    return *current;
}

}  // namespace

void fork_hold_enter() { pthread_rwlock_rdlock(&fork_lock()); }
void fork_hold_leave() { pthread_rwlock_unlock(&fork_lock()); }
#else
void fork_hold_enter() {}
void fork_hold_leave() {}
#endif

}  // namespace llamaprompt
