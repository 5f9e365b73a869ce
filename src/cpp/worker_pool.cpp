#include "worker_pool.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

#if !defined(_WIN32)
#include <unistd.h>
#endif

namespace llamaprompt {

namespace {

// one run_on_threads call: its function, and how many of its pool calls have not returned
struct batch {
    const std::function<void()> * fn;
    std::mutex mutex;
    std::condition_variable done;
    size_t pending = 0;
    std::exception_ptr error;
};

void run_one(batch & b, bool counted) {
    std::exception_ptr error;
    try {
        (*b.fn)();
    } catch (...) {
        error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(b.mutex);
    if (error && !b.error) {
        b.error = error;
    }
    if (counted && --b.pending == 0) {
        b.done.notify_all();
    }
}

// a worker with nothing to do for this long leaves (a process that rendered on many threads
// once does not keep them)
constexpr auto idle_timeout = std::chrono::seconds(10);

struct pool {
    std::mutex mutex;
    std::condition_variable work;
    std::deque<batch *> queue;  // one entry per pool call still to start
    size_t idle = 0;            // workers waiting for an entry

    void worker() {
        std::unique_lock<std::mutex> lock(mutex);
        for (;;) {
            ++idle;
            const bool got = work.wait_for(lock, idle_timeout, [&] { return !queue.empty(); });
            --idle;
            if (!got) {
                return;  // idle too long: this thread ends (its thread-local state is freed)
            }
            batch * b = queue.front();
            queue.pop_front();
            lock.unlock();
            run_one(*b, true);
            lock.lock();
        }
    }
};

#if !defined(_WIN32)
pid_t pool_pid = 0;
#endif
pool * the_pool = nullptr;
std::mutex pool_mutex;

// The process's pool. Never destroyed: workers may still be waiting in it while the process
// exits. A forked child has the parent's pool object but none of its threads (and perhaps a
// mutex held at the fork): it gets a pool of its own.
pool & process_pool() {
    std::lock_guard<std::mutex> lock(pool_mutex);
#if !defined(_WIN32)
    if (the_pool && pool_pid != getpid()) {
        the_pool = nullptr;  // the parent's: left as it is
    }
    pool_pid = getpid();
#endif
    if (!the_pool) {
        the_pool = new pool();
    }
    return *the_pool;
}

}  // namespace

void run_on_threads(size_t n, const std::function<void()> & fn) {
    if (n <= 1) {
        fn();
        return;
    }
    batch b;
    b.fn = &fn;
    b.pending = n - 1;
    pool & p = process_pool();
    {
        std::lock_guard<std::mutex> lock(p.mutex);
        for (size_t i = 0; i + 1 < n; ++i) {
            p.queue.push_back(&b);
        }
        // enough workers for the entries queued (this call's and others' not yet started)
        size_t missing = p.queue.size() > p.idle ? p.queue.size() - p.idle : 0;
        for (; missing > 0; --missing) {
            try {
                std::thread([&p] { p.worker(); }).detach();
            } catch (const std::system_error &) {
                break;  // no more threads to be had: the workers there are take the entries in turn
            }
        }
        p.work.notify_all();
    }
    run_one(b, false);
    {
        // the pool calls may still be queued when no worker could be started: run them here
        std::unique_lock<std::mutex> lock(p.mutex);
        for (auto it = p.queue.begin(); it != p.queue.end();) {
            if (*it != &b) {
                ++it;
                continue;
            }
            it = p.queue.erase(it);
            lock.unlock();
            run_one(b, true);
            lock.lock();
            it = p.queue.begin();
        }
    }
    std::unique_lock<std::mutex> lock(b.mutex);
    b.done.wait(lock, [&] { return b.pending == 0; });
    if (b.error) {
        std::rethrow_exception(b.error);
    }
}

}  // namespace llamaprompt
