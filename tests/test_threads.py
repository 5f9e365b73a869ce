"""A ChatTemplate shared by many threads gives the same prompts as sequential calls; the threads
of apply_template_many are kept between calls (src/cpp/worker_pool.cpp)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import llamaprompt
from conftest import load_reference, mask_dates, reference_cases, template_path, vocab_gguf
from llamaprompt.text import request_body


def test_threads_give_sequential_prompts():
    ref = load_reference("apply_template.json")
    names = ["meta-llama-Llama-3.1-8B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja", "openai-gpt-oss-120b.jinja"]
    templates = [
        llamaprompt.ChatTemplate.from_file(
            llamaprompt.pinned_template(n), bos_token="<s>", eos_token="</s>", add_bos=True
        )
        for n in names
    ]
    requests = [r for k, r in ref["requests"].items() if not k.startswith("err_")]
    jobs = [(t, r) for t in templates for r in requests] * 4

    def render(job):
        t, r = job
        try:
            return t.apply_template(r)
        except llamaprompt.Error as e:
            return ("error", type(e).__name__, e.message)

    expected = [render(j) for j in jobs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(render, jobs))
    assert got == expected
    assert sum(isinstance(x, str) for x in got) > len(jobs) // 2


def test_threads_on_a_template_whose_execution_changes_it():
    # older trees' Jinja execution changes the parsed template (filter_statement moves its filter
    # out of the node: concurrent renders crashed or raised "basic_string::substr"); renders of one
    # template are serialized there (llamaprompt.features["const_execution"] is False)
    t = llamaprompt.ChatTemplate(
        "{% for m in messages %}{% filter trim %}  <{{ m['role'] }}>{{ m['content'] }}  {% endfilter %}{% endfor %}"
    )
    reqs = [{"messages": [{"role": "user", "content": f"hello {i} " * 50}]} for i in range(16)]
    expected = [("<user>" + (f"hello {i} " * 50)).strip() for i in range(16)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(t.apply_template, reqs * 25))
    assert got == expected * 25
    assert t.apply_template_many(reqs * 10, threads=4) == expected * 10


KEPT_THREADS = """
import os
import time

import llamaprompt

def threads_now():
    return len(os.listdir("/proc/self/task"))

t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
reqs = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(600)]
expected = [t.apply_template(r) for r in reqs]
counts = [threads_now()]
assert t.apply_template_many(reqs[:64], threads=3) == expected[:64]
counts.append(threads_now())
assert t.apply_template_many(reqs[:64], threads=3) == expected[:64]
counts.append(threads_now())
for _ in range(5):  # one call after another: the workers of the last one are taken again
    assert t.apply_template_many(reqs[:64], threads=4) == expected[:64]
counts.append(threads_now())
assert t.apply_template_many(reqs, threads=500) == expected
counts.append(threads_now())
time.sleep(11)
counts.append(threads_now())
print(*counts, os.cpu_count())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")
@pytest.mark.slow  # waits out the pool's idle timeout (10 s)
def test_apply_template_many_keeps_its_threads_between_calls():
    # worker_pool.cpp: the threads of a call on N threads stay for the next call (warm), no more
    # than needed, at most max(8, 4 x CPUs) render, and they leave after 10 s without work;
    # counted in a process of its own (no other test's threads)
    proc = subprocess.run([sys.executable, "-c", KEPT_THREADS], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    before, after_3, again_3, after_4, after_500, after_idle, cpus = map(int, proc.stdout.split())
    assert after_3 == before + 2
    assert again_3 == after_3  # the same two threads served the second call
    assert after_4 == before + 3
    assert after_500 == before + max(8, 4 * cpus) - 1
    assert after_idle == before


def _qwen() -> llamaprompt.ChatTemplate:
    return llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))


def _greetings(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(n)]


def _render_in_child(queue) -> None:
    t, reqs = _qwen(), _greetings(32)
    queue.put(t.apply_template_many(reqs, threads=2))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_apply_template_many_in_a_forked_child():
    # a child forked after the pool started has the pool's memory but none of its threads: its
    # calls start threads of their own instead of waiting for the parent's
    t, reqs = _qwen(), _greetings(32)
    expected = t.apply_template_many(reqs, threads=2)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_render_in_child, args=(queue,))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert got == expected == [t.apply_template(r) for r in reqs]


def test_apply_template_many_renders_while_it_reads_the_requests():
    # template.cpp: the pool's threads render the requests already read while the calling thread
    # (GIL held) reads the next ones: renders counted before the first `encode` call returns
    t = _qwen()
    reqs = _greetings(8)
    t.apply_template(reqs[0])  # its parser inputs known good: the next renders are prompt-only
    base = t._core.prompt_only_renders()
    rendered_before_read: list[int] = []

    def encode(request):
        if not rendered_before_read:
            deadline = time.monotonic() + 5
            while t._core.prompt_only_renders() == base and time.monotonic() < deadline:
                time.sleep(0.001)
            rendered_before_read.append(t._core.prompt_only_renders() - base)
        return request_body(request)

    # the second half hold a tuple, which the core does not take as a tree: `encode` is called
    # for each of those, after the first half were taken as trees
    later = reqs[:4] + [dict(r, messages=tuple(r["messages"])) for r in reqs[4:]]
    got = t._core.apply_template_many(later, 2, -1.0, encode=encode)
    assert got == [t.apply_template(r) for r in reqs]
    assert rendered_before_read and rendered_before_read[0] >= 1


def _script_output(script: str, *args: str, timeout: float = 300, stack_kib: int | None = None) -> list[str]:
    """Run ``script`` in a fresh interpreter (signals, exits and hangs stay there); its printed words.

    Its SIGINT handler is Python's default even where this process was started with SIGINT ignored
    (a background job of a non-interactive shell: Python then leaves it ignored, and a Ctrl-C test
    would see no interruption). ``stack_kib``: the main thread's stack (``ulimit -s``; Linux)."""
    script = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n" + script
    command = [sys.executable, "-c", script, *args]
    if stack_kib:  # (a shell sets the limit: no preexec_fn in a process with threads)
        command = ["/bin/sh", "-c", f'ulimit -s {stack_kib} && exec "$0" "$@"', *command]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


INTERRUPTED_BATCH = r"""
import time
import llamaprompt
t = llamaprompt.ChatTemplate("{% for i in range(2000) %}{{ messages[0].content }}{% endfor %}")
reqs = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(400)]
later = reqs + [dict(r, messages=tuple(r["messages"])) for r in reqs]
t.apply_template(reqs[0])  # its parser inputs known good: the next renders are prompt-only
calls = []

before = t._core.prompt_only_renders()

def encode(request):
    calls.append(1)
    deadline = time.monotonic() + 10  # until the pool's thread has rendered one of the 400 read
    while t._core.prompt_only_renders() == before and time.monotonic() < deadline:
        time.sleep(0.001)
    raise KeyboardInterrupt

try:
    t._core.apply_template_many(later, 2, -1.0, encode=encode)
    print("no interruption")
except KeyboardInterrupt:
    print("interrupted", len(calls), t._core.prompt_only_renders() - before)
small = reqs[:8]
print(t.apply_template_many(small, threads=2) == [t.apply_template(r) for r in small])
"""


def test_apply_template_many_interrupted_while_reading_the_requests():
    # a KeyboardInterrupt from reading a request (here: `encode`, for the first request with a
    # tuple) reaches the caller once the pool's thread has ended the render it was in: it renders
    # none of the other requests already read (whose prompts no one would get, the caller waiting
    # with the GIL held), and does not wait for more (a hang would hang the whole process, hence a
    # process of its own); the next call works
    interrupted, encoded, rendered, next_call = _script_output(INTERRUPTED_BATCH, timeout=120)
    assert (interrupted, encoded, next_call) == ("interrupted", "1", "True")
    assert 1 <= int(rendered) < 100  # of the 400 read (~2 ms each): one or two, not all


INTERRUPTED_WHILE_RENDERING = r"""
import os
import signal
import sys
import threading
import time
import llamaprompt
threads = int(sys.argv[1])
t = llamaprompt.ChatTemplate("{% for i in range(2000) %}{{ messages[0].content }}{% endfor %}")
reqs = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(1000)]
t.apply_template(reqs[0])  # its parser inputs known good: the next renders are prompt-only
before = t._core.prompt_only_renders()

def interrupt():  # once a few of the 1000 have rendered (~2 ms each)
    deadline = time.monotonic() + 60
    while t._core.prompt_only_renders() - before < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt).start()
try:
    t.apply_template_many(reqs, threads=threads)
    print("no-interruption", t._core.prompt_only_renders() - before)
except KeyboardInterrupt:
    print("interrupted", t._core.prompt_only_renders() - before)
small = reqs[:8]
print(t.apply_template_many(small, threads=threads) == [t.apply_template(r) for r in small])
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_apply_template_many_interrupted_while_rendering(threads):
    # a Ctrl-C once every request is read (the calling thread renders too, without the GIL) reaches
    # the caller after the renders in progress -- the calling thread takes the GIL back between
    # slices of its renders to run Python's signal handlers -- not after the 1000 renders of the
    # batch (~2 ms each: the build before rendered them all first); the next call works
    interrupted, rendered, next_call = _script_output(INTERRUPTED_WHILE_RENDERING, str(threads))
    assert (interrupted, next_call) == ("interrupted", "True")
    assert 5 <= int(rendered) < 500


SIGNAL_WHILE_READING = r"""
import signal
import llamaprompt
from llamaprompt.text import request_body

class Alarm(Exception):
    pass

def on_alarm(signum, frame):
    raise Alarm

t = llamaprompt.ChatTemplate("{{ messages | length }}")
messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(100)]
request = {"messages": messages}
t.apply_template(request)  # its parser inputs known good: the next renders are prompt-only
batch = [request] * 5000
before = t._core.prompt_only_renders()
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.005)
try:  # (the core's own call: no Python code between the alarm and the reading)
    t._core.apply_template_many(batch, 1, -1.0, encode=request_body)
    print("no-interruption", t._core.prompt_only_renders() - before)
except Alarm:
    print("interrupted", t._core.prompt_only_renders() - before)
"""


def test_apply_template_many_signal_while_reading_the_requests():
    # a signal handler's exception while the requests are read -- dicts taken as trees, which runs
    # no Python code: the core runs the handlers between requests -- reaches the caller before any
    # render (one thread: the renders start once all are read; 5,000 requests of 100 messages take
    # ~0.1 s to read, the alarm comes after 5 ms; the build before rendered all 5,000 first)
    assert _script_output(SIGNAL_WHILE_READING) == ["interrupted", "0"]


INTERRUPTED_READING_DURING_A_SLOW_RENDER = r"""
import threading
import time
import llamaprompt
from llamaprompt.text import request_body
t = llamaprompt.ChatTemplate(
    "{% for i in range(messages[0].content | int) %}{% for j in range(1000) %}{% endfor %}{% endfor %}x", timeout=120
)
slow = {"messages": [{"role": "user", "content": "8000"}]}  # ~2 s here
t.apply_template({"messages": [{"role": "user", "content": "1"}]})
later = [slow] + [{"messages": ({"role": "user", "content": "1"},)}] * 10  # a tuple: `encode` reads it
ticks = []
done = threading.Event()

def tick():
    while not done.is_set():
        ticks.append(time.monotonic())
        time.sleep(0.005)

raised = []

def encode(request):
    time.sleep(0.3)  # the pool's thread is in the slow render
    raised.append(time.monotonic())
    raise KeyboardInterrupt

threading.Thread(target=tick).start()
start = time.monotonic()
try:
    t._core.apply_template_many(later, 2, -1.0, encode=encode)
except KeyboardInterrupt:
    pass
end = time.monotonic()
done.set()
points = [raised[0]] + [x for x in list(ticks) if raised[0] < x < end] + [end]
print(round(end - start, 3), round(max(b - a for a, b in zip(points, points[1:])), 3))
"""


def test_apply_template_many_interrupted_while_reading_waits_without_the_gil():
    # a KeyboardInterrupt while the requests are read, the pool's thread in a ~2 s render: the call
    # stops that render (its prompt would be dropped) and waits for it with the GIL released --
    # another Python thread keeps ticking every 5 ms -- not holding it
    took, longest_gap = map(float, _script_output(INTERRUPTED_READING_DURING_A_SLOW_RENDER))
    assert took < 1.0  # the slow render stopped at its next time check (the build before: ~2 s)
    assert longest_gap < 0.5


READING_FROM_ANOTHER_THREAD = r"""
import threading
import time
import llamaprompt
from llamaprompt.text import request_body
t = llamaprompt.ChatTemplate("{{ messages | length }}")
request = {"messages": [{"role": "user", "content": "hi"}]}
t.apply_template(request)
# read into trees with the GIL held (~0.3-0.5 s here); the last one holds a tuple, which the
# core hands to `encode`: when it is called, every other request has been read
batch = [request] * 300000 + [{"messages": ({"role": "user", "content": "hi"},)}]
read = []

def encode(body):
    read.append(time.monotonic())
    return request_body(body)

result = []
worker = threading.Thread(target=lambda: result.append(t._core.apply_template_many(batch, 1, -1.0, encode=encode)))
start = time.monotonic()
ticks = [start]
worker.start()
while worker.is_alive():
    ticks.append(time.monotonic())
    time.sleep(0.001)
reading = [x for x in ticks if x < read[0]] + read
gaps = [b - a for a, b in zip(reading, reading[1:])]
print(round(read[0] - start, 3), round(max(gaps), 3), result[0][-1])
"""


def test_reading_a_batch_lets_other_threads_run():
    # a batch called from another thread reads its 300,000 dicts without running Python code: the
    # GIL is offered to the other threads every 5 ms meanwhile, so the main thread (which runs the
    # signal handlers, Ctrl-C's among them) keeps ticking every millisecond or so while they are
    # read -- the build before held the GIL for the whole read (the longest gap: the read's length)
    # (the bound leaves room for a loaded machine, where the main thread also waits for a core:
    # 0.067 s seen beside a build on 2 cores; the build before: the gap is the whole read)
    took, longest_gap, last = _script_output(READING_FROM_ANOTHER_THREAD)
    assert last == "1"
    assert float(took) > 0.1  # the read is long enough for the gap to tell
    assert float(longest_gap) < min(0.15, float(took) / 3)


BIG_BATCH_FROM_ANOTHER_THREAD = r"""
import threading
import time
import llamaprompt
t = llamaprompt.ChatTemplate("{{ messages[0].content * 100 }}")  # prompts of 200 bytes
request = {"messages": [{"role": "user", "content": "hi"}]}
t.apply_template(request)
batch = [request] * 400000
result = []
worker = threading.Thread(target=lambda: result.append(t.apply_template_many(batch, threads=2)))
ticks = []
worker.start()
while worker.is_alive():
    ticks.append(time.monotonic())
    time.sleep(0.001)
ticks.append(time.monotonic())
print(round(max(b - a for a, b in zip(ticks, ticks[1:])), 3), len(ticks), len(result[0]), result[0][-1] == "hi" * 100)
"""


def test_a_big_batch_from_another_thread_never_stops_the_others_long():
    # a batch of 400,000 called from another thread: the main thread, ticking every millisecond,
    # never waits long for the GIL -- while the requests are read (offered every 5 ms), rendered
    # (released), and their prompts made into Python strings (offered every 5 ms), and while the
    # batch's memory is made and freed (without the GIL). The build before stopped it 0.11-0.23 s:
    # glibc merging the hundreds of thousands of small chunks the pool's threads had freed into
    # the calling thread's arena (the request trees), at the result list's first large allocation;
    # the prompts made in one stretch; the prompts freed at the return (memory.h:
    # merge_freed_chunks). The least of up to five runs: a loaded machine's stalls come and go
    # (session 55's trial, at load 8 on 2 cores: 0.08, 0.087, 0.1), the build before's came every
    # time (0.122-0.228 s)
    gaps = []
    for _ in range(5):
        gap, ticks, n, last = _script_output(BIG_BATCH_FROM_ANOTHER_THREAD)
        assert (int(n), last) == (400000, "True") and int(ticks) > 10
        gaps.append(float(gap))
        if gaps[-1] < 0.08:
            break
    assert min(gaps) < 0.08, gaps


only_linux_stack = pytest.mark.skipif(sys.platform != "linux", reason="the main thread's stack from RLIMIT_STACK")

LONG_RENDER_INTERRUPTED = r"""
import ctypes
import os
import signal
import sys
import threading
import time
import llamaprompt

libc = ctypes.CDLL(None, use_errno=True)

def sigint_disposition():  # struct sigaction's first field: the handler's address
    buf = ctypes.create_string_buffer(256)
    assert libc.sigaction(signal.SIGINT, None, buf) == 0
    return ctypes.c_void_p.from_buffer(buf).value

t = llamaprompt.ChatTemplate(
    "{% for i in range(messages[0].content | int) %}{% for j in range(1000) %}{% endfor %}{% endfor %}x", timeout=None
)
long = {"messages": [{"role": "user", "content": "20000"}]}  # 15-30 s of loops here
short = {"messages": [{"role": "user", "content": "1"}]}
before = sigint_disposition()
threading.Timer(float(sys.argv[2]), os.kill, (os.getpid(), signal.SIGINT)).start()
start = time.monotonic()
try:
    if sys.argv[1] == "batch":
        t.apply_template_many([long] * 4, threads=2)
    else:
        t.apply_template(long)
    print("no-interruption", round(time.monotonic() - start, 3))
except KeyboardInterrupt:
    print("interrupted", round(time.monotonic() - start, 3))
print(sigint_disposition() == before, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
print(t.apply_template(short), t.apply_template_many([short] * 3, threads=2) == ["x"] * 3)
"""


@pytest.mark.parametrize(
    "call, after, stack_kib",
    [
        ("apply_template", 0.5, None),
        ("batch", 0.5, None),
        ("apply_template", 0.05, None),
        pytest.param("apply_template", 0.05, 512, marks=only_linux_stack),
        pytest.param("batch", 0.05, 512, marks=only_linux_stack),
    ],
)
def test_ctrl_c_stops_a_long_render(call, after, stack_kib):
    # Ctrl-C (SIGINT, Python's default handler) 0.5 s into a render of 15-30 s (timeout=None) stops it
    # at the engine's next time check: KeyboardInterrupt within a second, not after the render (the
    # build before, with twice these loops: 36 s, and 50 s for a batch of 4 on 2 threads, whose pool
    # thread's render is stopped too); SIGINT's disposition is the one before the call; the next
    # calls work. At 50 ms
    # too: the first build let SIGINT through to Python's handler alone for the call's first 0.1 s,
    # and such a Ctrl-C waited for the whole render (the trial: 1.8-7.9 s, 246 s for a slow load)
    # With a main-thread stack of 512 KiB (`ulimit -s 512`) the work hops to a thread with a stack of
    # its own (gil.h: with_enough_stack) and the watch goes with it (the build before: ~16 s, the
    # Ctrl-C left to Python's handler alone)
    words = _script_output(LONG_RENDER_INTERRUPTED, call, str(after), timeout=120, stack_kib=stack_kib)
    assert words[0] == "interrupted", words
    assert float(words[1]) < after + 1.0
    assert words[2:] == ["True", "True", "x", "True"]


CUSTOM_SIGINT_HANDLER = r"""
import os
import signal
import threading
import time
import llamaprompt
t = llamaprompt.ChatTemplate(
    "{% for i in range(messages[0].content | int) %}{% for j in range(1000) %}{% endfor %}{% endfor %}x", timeout=None
)
request = {"messages": [{"role": "user", "content": "4000"}]}  # ~1 s here
calls = []
signal.signal(signal.SIGINT, lambda signum, frame: calls.append(time.monotonic()))
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
start = time.monotonic()
prompt = t.apply_template(request)
end = time.monotonic()
print(prompt, len(calls), round(end - start, 3), round(calls[0] - start, 3))
"""


def test_a_sigint_handler_of_the_programs_own_does_not_stop_a_render():
    # a SIGINT handler that is not Python's default may not raise: the render runs to its end and
    # returns its prompt; the handler runs once, after it (as without the watch)
    prompt, calls, took, handled = _script_output(CUSTOM_SIGINT_HANDLER, timeout=120)
    assert (prompt, calls) == ("x", "1")
    assert float(took) > 0.3 and float(handled) > float(took) - 0.05  # (the signal came at 0.2 s)


HOOKED_BATCH_INTERRUPTED = r"""
import os
import signal
import threading
import time
import llamaprompt
calls = []

class Counts:
    def before_request(self, request):
        calls.append(1)
        return request

t = llamaprompt.ChatTemplate("{{ messages[0].content }}", hooks=[Counts()])
reqs = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(200000)]

at_signal = []

def interrupt():  # the pool's threads have rendered 500; the caller still submits the rest
    deadline = time.monotonic() + 60
    while len(calls) < 500 and time.monotonic() < deadline:
        time.sleep(0.001)
    at_signal.append(len(calls))
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt).start()
try:
    t.apply_template_many(reqs, threads=2)
    print("no-interruption", len(calls))
except KeyboardInterrupt:
    print("interrupted", len(calls) - at_signal[0])
"""


def test_apply_template_many_with_hooks_interrupted_drops_the_requests_not_started():
    # with hooks the batch runs on Python threads; a Ctrl-C while they render the 200,000 requests
    # reaches the caller after the renders in progress, without the rest rendered first (session
    # 52's build: the executor's shutdown waited for every request submitted, thousands after the
    # signal; session 53's trial: a Ctrl-C inside the executor's `with lock:` blocks sometimes
    # raised "RuntimeError: release unlocked lock" or left the lock held -- shutdown() then hung)
    interrupted, after_signal = _script_output(HOOKED_BATCH_INTERRUPTED, timeout=120)
    assert interrupted == "interrupted" and int(after_signal) < 5000


HOOKED_LONG_RENDERS_INTERRUPTED = r"""
import os
import signal
import threading
import time
import llamaprompt

class Keep:
    def before_request(self, request):
        return request

t = llamaprompt.ChatTemplate(
    "{% for i in range(messages[0].content | int) %}{% for j in range(1000) %}{% endfor %}{% endfor %}x",
    timeout=None,
    hooks=[Keep()],
)
long = {"messages": [{"role": "user", "content": "20000"}]}  # 15-30 s of loops here
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
start = time.monotonic()
try:
    t.apply_template_many([long] * 4, threads=2)
    print("no-interruption", round(time.monotonic() - start, 3))
except KeyboardInterrupt:
    print("interrupted", round(time.monotonic() - start, 3))
short = {"messages": [{"role": "user", "content": "1"}]}
print(t.apply_template_many([short] * 3, threads=2) == ["x"] * 3)
"""


@pytest.mark.parametrize("stack_kib", [None, pytest.param(512, marks=only_linux_stack)])
def test_apply_template_many_with_hooks_interrupted_stops_the_renders_in_progress(stack_kib):
    # the hooked batch's Python threads render with their own calls (no SIGINT watch off the main
    # thread): a Ctrl-C 0.5 s in stops their renders in progress too (a flag of the batch's,
    # template.map_on_threads), not after them (the build before: 15-30 s). With `ulimit -s 512`
    # the threads' calls hop to threads with a stack of their own, and the flag goes with them
    words = _script_output(HOOKED_LONG_RENDERS_INTERRUPTED, timeout=120, stack_kib=stack_kib)
    assert words[0] == "interrupted", words
    assert float(words[1]) < 1.5 and words[2] == "True", words


def test_apply_template_many_called_from_several_threads_at_once():
    # calls that share the pool: each gets its own prompts, in its order
    t = _qwen()
    batches = [[{"messages": [{"role": "user", "content": f"batch {b}, {i}"}]} for i in range(40)] for b in range(6)]
    expected = [[t.apply_template(r) for r in batch] for batch in batches]
    with ThreadPoolExecutor(max_workers=6) as pool:
        got = list(pool.map(lambda batch: t.apply_template_many(batch, threads=3), batches))
    assert got == expected


EXIT_WHILE_RENDERING = """
import sys
import time
import threading
import time

import llamaprompt

path = llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja")
t = llamaprompt.ChatTemplate.from_file(path)
reqs = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(50)]
mode = sys.argv[1]

deep = '{"messages": [{"role": "user", "content": "x"}], "u": ' + "[" * 1001 + "]" * 1001 + "}"
tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "^(?=a)b$"}}}
warns = {"messages": [{"role": "user", "content": "x"}], "tools": [tool]}  # llama.cpp warns (the schema)
if mode == "logging":
    import logging
    logging.basicConfig()
if mode.endswith("-fails"):
    sys.setswitchinterval(1e-6)  # threads hand the GIL over often: the exit meets them anywhere

def forever():
    while True:
        try:
            if mode == "load":
                llamaprompt.ChatTemplate.from_file(path, server_args=["--reasoning-budget", "0"])
            elif mode == "load-fails":
                llamaprompt.ChatTemplate.from_file(path, server_args=["--no-such-flag"])
            elif mode == "request-fails":
                t.apply_template(deep)
            elif mode == "many-fails":
                failed = t.apply_template_many([deep] * 4, threads=2, return_exceptions=True)
                assert isinstance(failed[0], llamaprompt.Error)
            elif mode == "logging":
                t.apply(warns)
            elif mode == "0":
                t.apply_template(reqs[0])
            else:
                t.apply_template_many(reqs, threads=int(mode))
        except llamaprompt.Error:
            pass

for _ in range(8 if mode == "logging" else 4 if mode.endswith("-fails") else 2):
    threading.Thread(target=forever, daemon=True).start()
time.sleep(0.5)
print("exiting")
"""


@pytest.mark.parametrize("mode", ["0", "1", "3", "load", "load-fails", "request-fails", "many-fails", "logging"])
def test_interpreter_exit_while_daemon_threads_work(mode):
    # at shutdown CPython ends a daemon thread waiting for the GIL with pthread_exit; the GIL
    # was taken back in a noexcept destructor, so the process aborted ("terminate called
    # without an active exception", exit 134) whenever a daemon thread was rendering (gil.h);
    # "load": the server arguments' parse returned its result from inside the GIL-released scope
    # of a try block, and that forced unwinding destroyed it twice (double free, gil.h);
    # "*-fails": the call's error was in flight through that destructor (abort, exit 134, nearly
    # every run); "logging": llama.cpp's warnings went to a logging handler through pybind11
    # objects, released without the GIL by that unwinding (a crash, exit 139, every other run);
    # "*-fails" again, later: the failed call's exception object was built by Python code
    # (Error.__init__) inside pybind11's exception translation, where the thread could be ended
    # too (exit 134; apply_template_many: 139) -- about 1 exit in 10 at this switch interval
    # (errors.cpp builds it with C calls only now)
    for _ in range(8 if mode.endswith("-fails") else 3):
        proc = subprocess.run(
            [sys.executable, "-c", EXIT_WHILE_RENDERING, mode], capture_output=True, text=True, timeout=120
        )
        assert (proc.returncode, proc.stdout.strip()) == (0, "exiting"), proc.stderr[-2000:]
        assert "terminate" not in proc.stderr


# A thread renders a template that asks for the local time 300,000 times (seconds of work, much
# of it in localtime_r); the main thread forks in the middle of it, the child renders a recorded
# request and exits. The fork must wait for the render (so it takes a good part of the render's
# time, not milliseconds) and the child must end with the recorded prompt.
FORK_DURING_A_RENDER = r"""
import json, os, signal, sys, threading, time
import llamaprompt
args = json.loads(sys.argv[1])
t = llamaprompt.ChatTemplate.from_file(args["template"], **args["tokens"])
slow = llamaprompt.ChatTemplate(
    "{% for i in range(300000) %}{{ strftime_now('%H') }}{% endfor %}", timeout=None
)
hello = {"messages": [{"role": "user", "content": "hi"}]}
slow.apply_template(hello)
start = time.monotonic()
slow.apply_template(hello)
alone = time.monotonic() - start
started = threading.Event()

def render():
    started.set()
    slow.apply_template(hello)

thread = threading.Thread(target=render)
thread.start()
started.wait()
time.sleep(alone / 4)
start = time.monotonic()
pid = os.fork()
if pid == 0:
    try:
        ok = t.apply_template(args["request"]) == args["expected"]
    except BaseException:
        ok = False
    os._exit(0 if ok else 1)
fork_took = time.monotonic() - start
deadline = time.monotonic() + 60
while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
    time.sleep(0.01)
if not done[0]:
    os.kill(pid, signal.SIGKILL)
thread.join()
print(json.dumps({"alone": alone, "fork_took": fork_took,
                  "child": os.waitstatus_to_exitcode(done[1]) if done[0] else "hung"}))
"""


def _fork_case():
    ref = load_reference("apply_template.json")
    name = "meta-llama-Llama-3.1-8B-Instruct.jinja"
    for key, case in ref["variants"][0]["templates"].get(name, {}).get("cases", {}).items():
        if case["status"] == 200:
            yield pytest.param(name, key, id=f"{name}:{key}")
            return


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("name, key", reference_cases(_fork_case, 2))
def test_fork_waits_for_the_renders_in_progress(name, key):
    # a fork while another thread was inside llama.cpp's code left the child with that thread's
    # locks taken -- glibc's time-zone lock (every render formats today's date), a template's
    # caches' mutexes -- and the child's first render waited forever (4 forks in 1,000 while two
    # threads rendered); now fork() waits for the renders in progress (gil.h)
    ref = load_reference("apply_template.json")
    case = ref["variants"][0]["templates"][name]["cases"][key]
    t = llamaprompt.ChatTemplate.from_file(template_path(name), **ref["model_tokens"])
    now = t.apply_template(ref["requests"][key])
    assert mask_dates(now, ref["rendered_on"]) == case["prompt"]
    args = {
        "template": str(template_path(name)),
        "tokens": ref["model_tokens"],
        "request": ref["requests"][key],
        "expected": now,  # the recorded prompt, with today's date where the template prints it
    }
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", FORK_DURING_A_RENDER, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["child"] == 0
    # the render had about three quarters of its time left when fork() was called (a fork that
    # does not wait takes milliseconds)
    assert out["fork_took"] > out["alone"] / 8, out


@pytest.mark.parametrize(
    "threads, error",
    [
        (0, ValueError),
        (-2, ValueError),
        (np.int64(0), ValueError),
        (2.0, TypeError),
        (True, TypeError),
        ("2", TypeError),
        (np.float64(2), TypeError),
        (np.bool_(True), TypeError),
    ],
)
def test_threads_argument_is_checked(threads, error):
    with pytest.raises(error, match="threads must be"):
        _qwen().apply_template_many(_greetings(2), threads=threads)


def test_threads_takes_an_integer_of_another_type():
    t = _qwen()
    assert t.apply_template_many(_greetings(3), threads=np.int64(2)) == t.apply_template_many(_greetings(3))


# A daemon thread tokenizes ~2 MB of text (a second or more of C++ work outside the template
# engine); the main thread returns while it does. The process's exit must wait for that work, so
# it takes a good part of its time after the main thread's last line.
EXIT_DURING_WORK = r"""
import sys, threading, time
import llamaprompt
t = llamaprompt.ChatTemplate.from_gguf(sys.argv[1])
text = "hello world, " * 150_000
start = time.monotonic()
t.tokenize(text)
alone = time.monotonic() - start
started = threading.Event()

def work():
    started.set()
    t.tokenize(text)

threading.Thread(target=work, daemon=True).start()
started.wait()
time.sleep(alone / 4)
print(alone, time.monotonic(), flush=True)
"""

# A daemon thread runs a template loop of 10^10 iterations without a time budget; the exit must
# not wait for it (the executions in progress are stopped at exit).
EXIT_DURING_AN_ENDLESS_RENDER = r"""
import threading, time
import llamaprompt
loop = llamaprompt.ChatTemplate(
    "{% if messages[0].content == 'go' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}", timeout=None
)
started = threading.Event()

def render():
    started.set()
    loop.apply_template({"messages": [{"role": "user", "content": "go"}]})

threading.Thread(target=render, daemon=True).start()
started.wait()
time.sleep(0.2)
print(time.monotonic(), flush=True)
"""


def test_exit_waits_for_the_cpp_work_in_progress():
    # exit() destroyed the module's statics while daemon threads still rendered: a render
    # searched llama.cpp's table of Jinja built-ins after it was freed (exit 139, ~1 exit in 20
    # with 300 daemon threads looping apply_template_many). Now, once Python has finalized, exit
    # waits for the C++ work in progress and starts no new one (gil.cpp, hold_renders_at_exit)
    path = vocab_gguf("ggml-vocab-llama-spm.gguf")
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_WORK, str(path)], capture_output=True, text=True, timeout=300
    )
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr[-2000:]
    alone, last_line = map(float, proc.stdout.split())
    # the work had about three quarters of its time left (an exit that does not wait takes
    # milliseconds: the interpreter's finalization)
    assert ended - last_line > alone / 4, (alone, ended - last_line)


def test_exit_stops_template_executions_in_progress():
    # the exit's wait is not as long as a template execution without a budget: executions stop
    # at their next time check (jinja_guard_stop_all); the loop alone would run for hours
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_AN_ENDLESS_RENDER], capture_output=True, text=True, timeout=120
    )
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ended - float(proc.stdout) < 30
