#include "worker_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <new>
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

// record a pool call's end: its error (the first one kept), one call fewer to wait for
void finish(batch & b, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(b.mutex);
    if (error && !b.error) {
        b.error = error;
    }
    if (--b.pending == 0) {
        b.done.notify_all();
    }
}

std::exception_ptr call(const std::function<void()> & fn) {
    try {
        fn();
    } catch (...) {
        return std::current_exception();
    }
    return nullptr;
}

// a worker with nothing to do for this long leaves (a process that rendered on many threads
// once does not keep them)
constexpr auto idle_timeout = std::chrono::seconds(10);

struct pool {
#if !defined(_WIN32)
    pid_t pid = getpid();  // the process whose threads these are
#endif
    std::mutex mutex;
    std::condition_variable work;
    std::deque<batch *> queue;  // one entry per pool call still to start
    size_t idle = 0;            // workers that will take the next entries: waiting, or about to
    size_t starting = 0;        // workers started that have not run yet

    void worker() {
        std::unique_lock<std::mutex> lock(mutex);
        --starting;
        ++idle;
        for (;;) {
            if (!work.wait_for(lock, idle_timeout, [&] { return !queue.empty(); })) {
                --idle;
                return;  // idle too long: this thread ends (its thread-local state is freed)
            }
            batch * b = queue.front();
            queue.pop_front();
            --idle;
            lock.unlock();
            std::exception_ptr error = call(*b->fn);
            lock.lock();
            // idle again before the batch learns that this call returned: a caller that goes
            // on to its next batch at once counts this worker as available, not one to add
            ++idle;
            lock.unlock();
            finish(*b, error);
            lock.lock();
        }
    }
};

// The process's pool, made on first use. Never destroyed: workers may still be waiting in it
// while the process exits. A forked child has the parent's pool object but none of its
// threads, and perhaps its mutex held by a thread of the parent at the fork: the child makes a
// pool of its own (no lock taken: the pointer is atomic).
std::atomic<pool *> the_pool{nullptr};

pool & process_pool() {
    pool * p = the_pool.load(std::memory_order_acquire);
#if !defined(_WIN32)
    const bool ours = p && p->pid == getpid();
#else
    const bool ours = p != nullptr;
#endif
    if (ours) {
        return *p;
    }
    pool * fresh = new pool();
    if (the_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) {
        return *fresh;  // (the parent's pool, if any, is left as it is)
    }
    delete fresh;  // another thread of this process made one first
    return *p;
}

// more threads than this add nothing but memory (a render does not wait for anything)
size_t max_threads() {
    const size_t cores = std::thread::hardware_concurrency();
    return std::max<size_t>(8, 4 * cores);
}

}  // namespace

struct thread_batch::state {
    batch b;
    pool * p = nullptr;  // none: n <= 1, the calling thread alone
    bool joined = false;

    // this call's entries that no worker has taken yet (none could be started, or all are busy
    // with other calls): run here (`run`: where they return at once, the work being done) or
    // dropped, then wait for the ones taken
    std::exception_ptr finish_entries(bool run) {
        {
            std::unique_lock<std::mutex> lock(p->mutex);
            for (auto it = p->queue.begin(); it != p->queue.end();) {
                if (*it != &b) {
                    ++it;
                    continue;
                }
                p->queue.erase(it);
                lock.unlock();
                finish(b, run ? call(*b.fn) : nullptr);
                lock.lock();
                it = p->queue.begin();
            }
        }
        std::unique_lock<std::mutex> lock(b.mutex);
        b.done.wait(lock, [&] { return b.pending == 0; });
        return b.error;
    }
};

thread_batch::thread_batch(size_t n, const std::function<void()> & fn) : state_(std::make_unique<state>()) {
    n = std::min(n, max_threads());
    state_->b.fn = &fn;
    if (n <= 1) {
        return;
    }
    state_->b.pending = n - 1;
    pool & p = process_pool();
    state_->p = &p;
    std::lock_guard<std::mutex> lock(p.mutex);
    try {
        for (size_t i = 0; i + 1 < n; ++i) {
            p.queue.push_back(&state_->b);
        }
    } catch (const std::bad_alloc &) {
        // none taken yet (the lock is held): none may point to this batch once it is gone
        p.queue.erase(std::remove(p.queue.begin(), p.queue.end(), &state_->b), p.queue.end());
        throw;
    }
    // enough workers for the entries queued (this call's, and others' not yet taken)
    const size_t available = p.idle + p.starting;
    for (size_t missing = p.queue.size() > available ? p.queue.size() - available : 0; missing > 0; --missing) {
        try {
            std::thread([&p] { p.worker(); }).detach();
            ++p.starting;
        } catch (const std::system_error &) {
            break;  // no more threads to be had: the workers there are take the entries in turn
        }
    }
    p.work.notify_all();
}

void thread_batch::join() {
    state_->joined = true;
    if (!state_->p) {
        (*state_->b.fn)();
        return;
    }
    std::exception_ptr error = call(*state_->b.fn);
    std::exception_ptr theirs = state_->finish_entries(true);
    if (!error) {
        error = theirs;
    }
    if (error) {
        std::rethrow_exception(error);
    }
}

thread_batch::~thread_batch() {
    if (!state_->joined && state_->p) {
        state_->finish_entries(false);
    }
}

void run_on_threads(size_t n, const std::function<void()> & fn) {
    thread_batch threads(n, fn);
    threads.join();
}

}  // namespace llamaprompt
