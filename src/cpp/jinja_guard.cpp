#include "jinja_guard.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "thread_slots.h"

#if defined(__linux__) || defined(__APPLE__)
#include <pthread.h>
#endif
#if !defined(_WIN32)
#include <signal.h>

#include <cerrno>
#endif

namespace llamaprompt {

namespace {

using clock = std::chrono::steady_clock;

// one thread's limits and counters, in one constant-initialized object: a step (every
// statement and expression) finds it once (current(): through the thread's slot), not once per
// variable
struct guard_state {
    clock::time_point deadline = clock::time_point::max();
    double budget_seconds = 0;
    size_t max_bytes = 0;
    uint64_t fired = 0;
    uintptr_t stack_floor = 1;  // 1: not computed yet; 0: unknown (no check)
    uintptr_t stack_low = 0;    // the lowest address of the thread's stack (0: unknown)
    uint32_t steps = 0;
    size_t work = 0;  // jinja_guard_work's bytes since its last clock check
    const std::atomic<bool> * cancel = nullptr;  // jinja_cancel's flag
    const char * cancel_why = nullptr;
    // sigint_watch: when its handler goes in (max: no watch, or already in), whether it is in,
    // and whether an execution stopped for it
    clock::time_point watch_at = clock::time_point::max();
    bool watch_on = false;
    bool watch_stopped = false;
};
thread_local guard_state own_state;
guard_state & own() noexcept { return own_state; }

// the thread's state: found through the thread pointer once the thread has claimed its slot
// (thread_slots.h: no __tls_get_addr call per statement), else its thread-local
guard_state & current() noexcept { return thread_slots<guard_state>::get<own>(); }

struct slot_release {  // gives the thread's slot back when the thread ends
    ~slot_release() { thread_slots<guard_state>::release(); }
};
thread_local std::string last_fired;  // the message of the last guard that fired here

// how deep execution may go below where the thread's stack begins: half of the stack, at most
// 8 MiB. The cap matters where the stack has no real limit (`ulimit -s unlimited`: the main
// thread's stack is then the whole gap below it, and runaway recursion ran into the time
// budget after ~2 GB of stack); no real template comes near it (Qwen3's uses ~30 KiB)
constexpr size_t max_stack_depth = size_t(8) << 20;

size_t usable_depth(size_t stack_size) {
    return stack_size / 2 < max_stack_depth ? stack_size / 2 : max_stack_depth;
}

// the guard's floor (the address below which the stack guard fires) and the stack's lowest address
void compute_stack_bounds(guard_state & g) {  // (once per thread: the thread claims its slot here)
    static thread_local slot_release release;
    (void) release;
    thread_slots<guard_state>::claim(&own_state);
    g.stack_floor = 0;
    g.stack_low = 0;
#if defined(__linux__)
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) != 0) {
        return;
    }
    void * addr = nullptr;
    size_t size = 0;
    const int rc = pthread_attr_getstack(&attr, &addr, &size);
    pthread_attr_destroy(&attr);
    if (rc == 0 && size > 0) {
        g.stack_low = reinterpret_cast<uintptr_t>(addr);
        g.stack_floor = g.stack_low + size - usable_depth(size);
    }
#elif defined(__APPLE__)
    const uintptr_t top = reinterpret_cast<uintptr_t>(pthread_get_stackaddr_np(pthread_self()));
    const size_t size = pthread_get_stacksize_np(pthread_self());
    g.stack_low = top - size;
    g.stack_floor = top - usable_depth(size);
#endif
}

[[noreturn]] void fire(const std::string & what) {
    ++current().fired;
    last_fired = what;
    throw std::runtime_error(what);
}

// set at interpreter exit (gil.cpp): every execution stops at its next time check
std::atomic<bool> stopping{false};

// sigint_watch's handler: notes the signal, then calls the disposition it replaced
std::atomic<bool> sigint_seen{false};
#if !defined(_WIN32)
struct sigaction replaced_sigint;  // written before the handler goes in, read by it

extern "C" void on_sigint(int sig, siginfo_t * info, void * context) {
    const int saved_errno = errno;
    sigint_seen.store(true, std::memory_order_relaxed);
    if (replaced_sigint.sa_flags & SA_SIGINFO) {
        replaced_sigint.sa_sigaction(sig, info, context);
    } else if (replaced_sigint.sa_handler != SIG_DFL && replaced_sigint.sa_handler != SIG_IGN) {
        replaced_sigint.sa_handler(sig);
    }
    errno = saved_errno;
}

bool is_watch_handler(const struct sigaction & sa) {
    return (sa.sa_flags & SA_SIGINFO) && sa.sa_sigaction == on_sigint;
}
#endif

// the disposition the watch's handler replaced, if the watch's is still in place (nothing else on
// this process changed it meanwhile)
void put_back_sigint() noexcept {
#if !defined(_WIN32)
    struct sigaction current_action;
    if (sigaction(SIGINT, nullptr, &current_action) == 0 && is_watch_handler(current_action)) {
        sigaction(SIGINT, &replaced_sigint, nullptr);
    }
#endif
}

// the watch's handler in place of SIGINT's handler function, if it has one
void install_sigint_watch(guard_state & g) {
    g.watch_at = clock::time_point::max();
#if !defined(_WIN32)
    struct sigaction current_action;
    if (sigaction(SIGINT, nullptr, &current_action) != 0 || is_watch_handler(current_action)) {
        return;
    }
    const bool has_function = (current_action.sa_flags & SA_SIGINFO)
                                  ? current_action.sa_sigaction != nullptr
                                  : current_action.sa_handler != SIG_DFL && current_action.sa_handler != SIG_IGN;
    if (!has_function) {
        return;
    }
    replaced_sigint = current_action;
    sigint_seen.store(false, std::memory_order_relaxed);
    struct sigaction watch = current_action;
    watch.sa_flags |= SA_SIGINFO;
    watch.sa_sigaction = on_sigint;
    g.watch_on = sigaction(SIGINT, &watch, nullptr) == 0;
#else
    (void) g;
#endif
}

// `activity`: what the message names ("template execution", "grammar generation")
void check_time(const char * activity = "template execution") {
    if (stopping.load(std::memory_order_relaxed)) {
        fire(std::string(activity) + " stopped: the interpreter is exiting");
    }
    guard_state & g = current();
    const clock::time_point now = clock::now();
    if (now >= g.watch_at) {
        install_sigint_watch(g);
    }
    if (g.watch_on && sigint_seen.load(std::memory_order_relaxed)) {
        g.watch_stopped = true;
        fire(std::string(activity) + " interrupted (SIGINT)");
    }
    if (g.cancel != nullptr && g.cancel->load(std::memory_order_relaxed)) {
        fire(std::string(activity) + " stopped: " + g.cancel_why);
    }
    if (now > g.deadline) {
        char buf[64];
        snprintf(buf, sizeof(buf), "%g", g.budget_seconds);
        fire(std::string(activity) + " exceeded the time budget (" + buf + " s)");
    }
}

}  // namespace

jinja_budget::jinja_budget(const jinja_limits & limits)
    : prev_deadline_(current().deadline), prev_max_bytes_(current().max_bytes),
      prev_seconds_(current().budget_seconds) {
    guard_state & g = current();
    g.budget_seconds = limits.seconds;
    // more than ~30 years (or inf) would overflow the clock: no deadline
    g.deadline = limits.seconds > 0 && limits.seconds < 1e9
                     ? clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(limits.seconds))
                     : clock::time_point::max();
    g.max_bytes = limits.max_bytes;
}

jinja_budget::~jinja_budget() {
    guard_state & g = current();
    g.deadline = prev_deadline_;
    g.max_bytes = prev_max_bytes_;
    g.budget_seconds = prev_seconds_;
}

jinja_cancel::jinja_cancel(const std::atomic<bool> & flag, const char * why) noexcept
    : prev_flag_(current().cancel), prev_why_(current().cancel_why) {
    current().cancel = &flag;
    current().cancel_why = why;
}

jinja_cancel::~jinja_cancel() {
    current().cancel = prev_flag_;
    current().cancel_why = prev_why_;
}

void jinja_cancel_thread(std::shared_ptr<const std::atomic<bool>> flag, const char * why) noexcept {
    static thread_local std::shared_ptr<const std::atomic<bool>> kept;
    kept = std::move(flag);
    current().cancel = kept.get();
    current().cancel_why = kept ? why : nullptr;
}

std::pair<const std::atomic<bool> *, const char *> jinja_cancel_current() noexcept {
    return {current().cancel, current().cancel_why};
}

sigint_watch::sigint_watch(clock::duration after) noexcept {
    guard_state & g = current();
    g.watch_at = clock::now() + after;
    g.watch_on = false;
    g.watch_stopped = false;
}

sigint_watch::~sigint_watch() {
    guard_state & g = current();
    g.watch_at = clock::time_point::max();
    if (g.watch_on) {
        put_back_sigint();
    }
    g.watch_on = false;
    g.watch_stopped = false;
}

bool sigint_watch_saw_signal() noexcept {
    return current().watch_on && sigint_seen.load(std::memory_order_relaxed);
}

void sigint_watch_forget_in_child() noexcept { put_back_sigint(); }

bool sigint_watch::interrupted() const noexcept { return sigint_watch_saw_signal(); }

bool sigint_watch::stopped_execution() const noexcept { return current().watch_stopped; }

uint64_t jinja_guard_fired() { return current().fired; }

void jinja_guard_stop_all(bool stop) noexcept { stopping.store(stop, std::memory_order_relaxed); }

std::string jinja_guard_last_message() { return last_fired; }

size_t stack_left() {
    guard_state & g = current();
    if (g.stack_floor == 1) {
        compute_stack_bounds(g);
    }
    char probe;
    const uintptr_t here = reinterpret_cast<uintptr_t>(&probe);
    return g.stack_low == 0 ? SIZE_MAX : here > g.stack_low ? here - g.stack_low : 0;
}

void jinja_guard_step() {
    guard_state & g = current();
    const uint32_t steps = ++g.steps;
    if (g.stack_floor == 1) {
        compute_stack_bounds(g);
    }
    const uintptr_t floor = g.stack_floor;
    char probe;
    if (floor != 0 && reinterpret_cast<uintptr_t>(&probe) < floor) {
        fire("template nested too deeply (half of the thread's stack, or 8 MiB, used)");
    }
    if ((steps & 63) == 0) {
        check_time();
    }
}

void jinja_guard_tick() {
    if ((++current().steps & 4095) == 0) {
        check_time();
    }
}

void jinja_guard_time(const char * activity) { check_time(activity); }

void jinja_guard_stack(const char * what) {
    guard_state & g = current();
    if (g.stack_floor == 1) {
        compute_stack_bounds(g);
    }
    char probe;
    if (g.stack_floor != 0 && reinterpret_cast<uintptr_t>(&probe) < g.stack_floor) {
        fire(std::string(what) + " nested too deeply (half of the thread's stack, or 8 MiB, used)");
    }
}

void jinja_guard_bytes(size_t bytes) {
    const size_t max_bytes = current().max_bytes;
    if (max_bytes != 0 && bytes > max_bytes) {
        fire("template execution exceeded the size budget (a value of at least " + std::to_string(bytes) +
             " bytes > " + std::to_string(max_bytes) + " bytes)");
    }
}

void jinja_guard_work(size_t bytes) {
    guard_state & g = current();
    g.work += bytes + 256;  // a call costs something of its own: 4096 small ones are ~1 MiB
    if (g.work >= (size_t(1) << 20)) {
        g.work = 0;
        check_time();
    }
}

void jinja_guard_size(size_t bytes, size_t parts) {
    // a part costs ~40 bytes of memory besides its text: count it as 32
    const size_t cost = (bytes > SIZE_MAX / 2 || parts > SIZE_MAX / 64) ? SIZE_MAX : bytes + parts * 32;
    const size_t max_bytes = current().max_bytes;
    if (max_bytes != 0 && cost > max_bytes) {
        // (the bytes as counted: a value of many small parts -- `'x' * n` is n parts of 1 byte --
        // costs far more memory than its text, and the message says so rather than "3000000 > 67108864")
        const std::string counted = parts == 0 ? std::string()
                                    : cost == SIZE_MAX ? std::string(", with 32 per part: too many to count")
                                                       : ", counted as " + std::to_string(cost) + " with 32 per part";
        const std::string in_parts = parts == 0 ? std::string() : " in " + std::to_string(parts) + " parts";
        fire("template execution exceeded the size budget (a value of " + std::to_string(bytes) + " bytes" + in_parts +
             counted + " > " + std::to_string(max_bytes) + " bytes)");
    }
    check_time();  // string building can be slow without many steps between clock checks
}

}  // namespace llamaprompt
