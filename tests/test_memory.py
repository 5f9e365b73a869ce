"""The module's operator new / delete (src/cpp/memory.cpp): a per-thread cache of freed blocks in
front of malloc, local to the module. Built where it is meant to be; and blocks that move between
threads -- a template loaded on one thread and freed on another, threads that end with blocks in
their lists, apply_template_many's pool -- leave llama-server's recorded prompts unchanged."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

from conftest import load_reference, mask_dates, reference_cases, template_path
from llamaprompt import _core

TEMPLATES = ("Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja", "Kimi-K2-Instruct.jinja")

# Each wave starts 4 threads, which load the template, render every request, and end; the
# templates are dropped by the main thread after they ended (their blocks were allocated on
# threads that are gone). The last wave renders through apply_template_many's pool instead.
WAVES = r"""
import json, sys, threading
import llamaprompt
args = json.loads(sys.argv[1])
requests = args["requests"]
results = []
loaded = []

def work(name):
    t = llamaprompt.ChatTemplate.from_file(name, **args["tokens"])
    out = {}
    for key, request in requests.items():
        try:
            out[key] = t.apply_template(request)
        except llamaprompt.Error as e:
            out[key] = ["error", e.status, e.message]
    results.append((name, out))
    loaded.append(t)

for wave in range(args["waves"]):
    threads = [threading.Thread(target=work, args=(n,)) for n in args["templates"] for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    loaded.clear()
for name in args["templates"]:
    t = llamaprompt.ChatTemplate.from_file(name, **args["tokens"])
    keys = list(requests)
    got = t.apply_template_many([requests[k] for k in keys] * 3, threads=3, return_exceptions=True)
    out = {}
    for i, k in enumerate(keys * 3):
        g = got[i]
        out.setdefault(k, []).append(g if isinstance(g, str) else ["error", g.status, g.message])
    results.append((name, {k: v[0] for k, v in out.items()}))
    assert all(v == [v[0]] * 3 for v in out.values()), "apply_template_many: repeats differ"
print(json.dumps(results))
"""


def test_block_cache_is_built_where_it_applies():
    if os.environ.get("LLAMAPROMPT_BLOCK_CACHE", "").upper() in ("OFF", "0", "FALSE", "NO"):
        pytest.skip("built with LLAMAPROMPT_BLOCK_CACHE=OFF")
    if os.environ.get("LD_PRELOAD"):
        pytest.skip("LD_PRELOAD may bring another operator new (the cache then steps aside)")
    expected = (
        sys.platform == "linux"
        and platform.libc_ver()[0] == "glibc"
        and platform.machine() in ("x86_64", "aarch64")
    )
    assert _core.BLOCK_CACHE is expected
    if expected:
        # glibc's malloc: a sized delete's size gives the block's class (no malloc_usable_size call)
        assert _core.BLOCK_CACHE_MODE == "sized"


def _glibc_usable(n: int) -> int:
    """glibc's malloc_usable_size of a fresh malloc(n) on a 64-bit target, where malloc splits a
    chunk of exactly the size n needs (16-byte chunks, an 8-byte header, at least 32 bytes)."""
    return max(32, (n + 8 + 15) // 16 * 16) - 8


@pytest.mark.skipif(not _core.BLOCK_CACHE, reason="no block cache in this build")
def test_sized_frees_need_blocks_at_least_their_class():
    sizes = [_glibc_usable(n) for n in range(537)]
    assert _core.block_sizes_fit(sizes)
    # malloc gives a whole free chunk when the rest would be too small to split off: malloc(24) may
    # get a 48-byte chunk (40 usable) instead of 32 -- still room for its class
    larger = list(sizes)
    larger[24] = 40
    larger[100] += 16
    assert _core.block_sizes_fit(larger)
    # a malloc whose block for 100 bytes is smaller than its class's 104: every free asks instead
    smaller = list(sizes)
    smaller[100] = 100
    assert not _core.block_sizes_fit(smaller)
    assert not _core.block_sizes_fit(sizes[:100])  # sizes up to the largest class (520) are checked


PRELOADED_RENDER = r"""
import json, llamaprompt
from llamaprompt import _core
t = llamaprompt.ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
prompt = t.apply_template({"messages": [{"role": "user", "content": "x" * 300}]})
print(json.dumps([_core.BLOCK_CACHE, _core.BLOCK_CACHE_MODE, prompt]))
"""


def _render_with_preloaded(tmp_path, compilers, source_name, source):
    """[BLOCK_CACHE, BLOCK_CACHE_MODE, prompt] of a render in a process that preloads ``source``
    (compiled with the first of ``compilers`` found; skips without one, or when something is
    preloaded already)."""
    compiler = next(filter(None, map(shutil.which, compilers)), None)
    if compiler is None:
        pytest.skip(f"no compiler ({' / '.join(compilers)})")
    if os.environ.get("LD_PRELOAD"):
        pytest.skip("another library is preloaded")
    src = tmp_path / source_name
    src.write_text(source)
    lib = tmp_path / "libpreloaded.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True, capture_output=True)
    env = dict(os.environ, LD_PRELOAD=str(lib))
    proc = subprocess.run(
        [sys.executable, "-c", PRELOADED_RENDER], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.skipif(not _core.BLOCK_CACHE, reason="no block cache in this build")
def test_sized_frees_with_blocks_larger_than_asked_for(tmp_path):
    # glibc's malloc hands out a whole free chunk when the rest would be too small to split off, so
    # which small mallocs get a larger block depends on the heap's state when the module loads. The
    # check that chooses sized frees had required every block to be exactly of its request's class:
    # in some processes it failed, and every free asked malloc_usable_size (~900 calls per Qwen3
    # request). Here a preloaded malloc gives every request of up to 24 bytes a 40-byte block.
    larger = (
        "#include <stddef.h>\n"
        "void * __libc_malloc(size_t n);\n"
        "void * malloc(size_t n) { return __libc_malloc(n <= 24 ? 40 : n); }\n"
    )
    got = _render_with_preloaded(tmp_path, ("cc", "gcc"), "larger.c", larger)
    assert got == [True, "sized", "<user>" + "x" * 300]


@pytest.mark.skipif(not _core.BLOCK_CACHE, reason="no block cache in this build")
def test_cache_steps_aside_for_another_operator_new(tmp_path):
    # a process whose operator new is not libstdc++'s (here: a preloaded library defining one, as
    # AddressSanitizer's runtime or valgrind's memcheck do) gets the module's allocations through it
    opnew = (
        "#include <cstdlib>\n#include <new>\n"
        "void * operator new(std::size_t n) {\n"
        "    if (void * p = std::malloc(n ? n : 1)) return p;\n"
        "    throw std::bad_alloc();\n"
        "}\n"
        "void operator delete(void * p) noexcept { std::free(p); }\n"
    )
    got = _render_with_preloaded(tmp_path, ("g++", "c++"), "opnew.cpp", opnew)
    assert got == [False, "forward", "<user>" + "x" * 300]


def _collect():
    ref = load_reference("apply_template.json")
    default = ref["variants"][0]
    assert default["server_args"] == []
    for name in TEMPLATES:
        if name in default["templates"]:
            yield pytest.param(name, id=name)


@pytest.mark.parametrize("name", reference_cases(_collect))
def test_blocks_moving_between_threads_keep_the_recorded_prompts(name):
    ref = load_reference("apply_template.json")
    cases = ref["variants"][0]["templates"][name]["cases"]
    args = {
        "requests": {k: ref["requests"][k] for k in cases},
        "tokens": ref["model_tokens"],
        "templates": [str(template_path(name))],
        "waves": 3,
    }
    proc = subprocess.run(
        [sys.executable, "-c", WAVES, json.dumps(args)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    assert len(results) == 3 * 2 + 1
    mismatches = []
    for _, out in results:
        for key, case in cases.items():
            got = out[key]
            if case["status"] == 200:
                if not isinstance(got, str) or mask_dates(got, ref["rendered_on"]) != case["prompt"]:
                    mismatches.append(f"{key}: {str(got)[:200]!r}")
            elif got != ["error", case["status"], case["error"]["message"]]:
                mismatches.append(f"{key}: expected error {case['status']}, got {str(got)[:200]!r}")
    assert not mismatches, "\n".join(mismatches[:20])
    assert sum(case["status"] == 200 for case in cases.values()) > 0


@pytest.mark.skipif(not _core.BLOCK_CACHE, reason="no block cache in this build")
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_cache_steps_aside_under_memcheck():
    # memcheck redirects libstdc++'s operator new / delete by address (the global scope still
    # names libstdc++'s): the cache freed blocks from its operator new with free() ("Mismatched
    # free()"); found by the library valgrind preloads for the tool. (memcheck's other reports,
    # on the interpreter and the dynamic loader, are not this test's.)
    proc = subprocess.run(
        ["valgrind", "--leak-check=no", sys.executable, "-c", PRELOADED_RENDER],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == [False, "forward", "<user>" + "x" * 300]
    assert "Mismatched free" not in proc.stderr



# Threads find their lists of the cache through a slot chosen by their thread pointer
# (src/cpp/thread_slots.h). Sequential threads reuse the stack, so the thread pointer, of the one
# before (each gives its slot back when it ends); in a forked child new threads reuse the stacks of
# the parent's other threads, whose slots the child frees (pthread_atfork). Each thread's answer is
# whether it found its own lists there after an allocation (a hash collision with another live
# thread's slot answers False: hence "most").
SLOTS = r"""
import json, os, threading, time
import llamaprompt
from llamaprompt import _core
t = llamaprompt.ChatTemplate("{{ messages[0].content }}")
request = {"messages": [{"role": "user", "content": "x" * 100}]}

def found():
    assert t.apply_template(request) == "x" * 100
    return _core.block_cache_slot_found()

def wave(n):
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(found())) for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(answers)

def tasks():
    return len(os.listdir("/proc/self/task"))

alone = tasks()

def after_the_last_ended():
    # a joined Python thread may still be ending (its slot is given back by a thread-local's
    # destructor after join() returned): a thread started before that can find its slot taken,
    # which a loaded machine showed (20 of 40 found); so wait until the thread is gone
    deadline = time.monotonic() + 10
    while tasks() > alone and time.monotonic() < deadline:
        time.sleep(0.001)
    return wave(1)

out = {"main": found(), "concurrent": wave(8), "sequential": sum(after_the_last_ended() for _ in range(40))}
release = threading.Event()
held = threading.Barrier(5)

def holder():
    found()
    held.wait()
    release.wait()

holders = [threading.Thread(target=holder) for _ in range(4)]
for th in holders:
    th.start()
held.wait()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    child = {"main": found(), "threads": wave(4)}
    os.write(w, json.dumps(child).encode())
    os._exit(0)
os.close(w)
out["child"] = json.loads(os.read(r, 1000))
os.waitpid(pid, 0)
release.set()
for th in holders:
    th.join()
print(json.dumps(out))
"""


@pytest.mark.skipif(_core.BLOCK_CACHE_MODE not in ("sized", "usable"), reason="no block cache in this process")
@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")),
                    reason="thread slots are built for Linux on x86-64 and aarch64")
def test_threads_find_their_lists_through_their_thread_pointer():
    proc = subprocess.run([sys.executable, "-c", SLOTS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["main"] and out["child"]["main"], out
    assert out["concurrent"] >= 4 and out["sequential"] >= 36 and out["child"]["threads"] >= 3, out
