"""A ChatTemplate shared by many threads gives the same prompts as sequential calls; the threads
of apply_template_many are kept between calls (src/cpp/worker_pool.cpp)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import llamaprompt
from conftest import load_reference


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
import threading
import time

import llamaprompt

t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
reqs = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(50)]
threads = int(sys.argv[1])

def forever():
    while True:
        if threads:
            t.apply_template_many(reqs, threads=threads)
        else:
            t.apply_template(reqs[0])

threading.Thread(target=forever, daemon=True).start()
time.sleep(0.5)
print("exiting")
"""


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_interpreter_exit_while_a_daemon_thread_renders(threads):
    # at shutdown CPython ends a daemon thread waiting for the GIL with pthread_exit; the GIL
    # was taken back in a noexcept destructor, so the process aborted ("terminate called
    # without an active exception", exit 134) whenever a daemon thread was rendering (gil.h)
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_RENDERING, str(threads)], capture_output=True, text=True, timeout=120
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "exiting"), proc.stderr
    assert "terminate" not in proc.stderr


@pytest.mark.parametrize(
    "threads, error",
    [(0, ValueError), (-2, ValueError), (np.int64(0), ValueError), (2.0, TypeError), (True, TypeError),
     ("2", TypeError), (np.float64(2), TypeError), (np.bool_(True), TypeError)],
)
def test_threads_argument_is_checked(threads, error):
    with pytest.raises(error, match="threads must be"):
        _qwen().apply_template_many(_greetings(2), threads=threads)


def test_threads_takes_an_integer_of_another_type():
    t = _qwen()
    assert t.apply_template_many(_greetings(3), threads=np.int64(2)) == t.apply_template_many(_greetings(3))
