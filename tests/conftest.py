"""Shared test helpers: the reference fixtures (../shared/reference, recorded by an
unmodified llama-server from the pinned llama.cpp commit) and date masking."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path

import pytest

import llamaprompt

REPO = Path(__file__).resolve().parent.parent


def shared_reference_dir() -> Path:
    """The reference folder for the pinned tree (…/shared/reference, or $LLAMAPROMPT_REFERENCE_DIR);
    recordings of other trees are in its versions/<sdist-version>/."""
    env = os.environ.get("LLAMAPROMPT_REFERENCE_DIR")
    if env:
        return Path(env)
    # the clone sits next to shared/ (…/main and …/shared)
    for base in (REPO.parent, REPO):
        cand = base / "shared" / "reference"
        if cand.is_dir():
            return cand
    return REPO.parent / "shared" / "reference"


def reference_required() -> bool:
    """CI sets LLAMAPROMPT_REQUIRE_REFERENCE=1: then missing or empty reference fixtures fail
    the run instead of skipping (a developer without ../shared still gets skips)."""
    return os.environ.get("LLAMAPROMPT_REQUIRE_REFERENCE", "") not in ("", "0")


def _commit_of(folder: Path) -> str | None:
    path = folder / "apply_template.json"
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        head = f.read(4096)
    m = re.search(r'"llama_cpp_commit"\s*:\s*"([0-9a-f]+)"', head)
    return m.group(1) if m else json.loads(path.read_text(encoding="utf-8")).get("llama_cpp_commit")


def _same_commit(a: str, b: str) -> bool:
    n = min(len(a), len(b))
    return n >= 7 and a[:n] == b[:n]


@cache
def reference_dir() -> Path | None:
    """The folder recorded from the llama.cpp commit this module was built from: the shared
    reference itself (pinned tree) or one of its versions/<sdist-version>/; None when no
    recording of this commit exists (every other test still runs)."""
    root = shared_reference_dir()
    built = llamaprompt.LLAMA_CPP_COMMIT
    candidates = [root] + sorted(p for p in (root / "versions").glob("*") if p.is_dir())
    for folder in candidates:
        commit = _commit_of(folder)
        if commit and _same_commit(commit, built):
            return folder
    return None


def _missing(message: str):
    if reference_required():
        pytest.fail(message + " (LLAMAPROMPT_REQUIRE_REFERENCE is set)", pytrace=False)
    pytest.skip(message)


@cache
def load_reference(name: str) -> dict:
    folder = reference_dir()
    if folder is None:
        _missing(
            f"no reference fixtures recorded from llama.cpp {llamaprompt.LLAMA_CPP_COMMIT} under "
            f"{shared_reference_dir()} (set LLAMAPROMPT_REFERENCE_DIR)"
        )
    path = folder / name
    if not path.exists():
        _missing(f"reference fixtures not found: {path} (set LLAMAPROMPT_REFERENCE_DIR)")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not data.get("requests") or not (data.get("variants") or data.get("models")):
        _missing(f"reference fixtures {path} hold no cases")
    return data


def reference_cases(collect, arity: int = 1):
    """pytest params from ``collect()`` (which calls load_reference) for a parametrize of
    ``arity`` names: when the fixtures are absent and not required, one skipped case that says
    why (an empty list would show only pytest's "got empty parameter set"); a collection
    failure when required and absent or empty."""
    try:
        params = list(collect())
    except pytest.skip.Exception as e:
        return [pytest.param(*[None] * arity, marks=pytest.mark.skip(reason=str(e.msg)), id="no-reference")]
    if not params and reference_required():
        pytest.fail("the reference fixtures yielded no test cases", pytrace=False)
    return params


# The date formats templates print (common_chat_extra_context's "%b %d %Y" and
# "%d %b %Y", and the strftime_now formats used by the pinned tree's templates).
DATE_FORMATS = ("%d %b %Y", "%b %d %Y", "%Y-%m-%d", "%B %d, %Y")


def mask_dates(prompt: str, rendered_on: str) -> str:
    """Put the fixture's rendering day in place of today's date, in every format that
    templates print (the reference README's rule for date-printing templates)."""
    ref = _dt.date.fromisoformat(rendered_on)
    today = _dt.date.today()
    if today == ref:
        return prompt
    for fmt in DATE_FORMATS:
        prompt = prompt.replace(today.strftime(fmt), ref.strftime(fmt))
    return prompt


def llama_cpp_models_dir() -> Path | None:
    """models/ of the llama.cpp tree the package was built from (the vocab GGUFs live there)."""
    env = os.environ.get("LLAMAPROMPT_LLAMA_CPP_DIR")
    built = llamaprompt.tree_info().get("tree_dir")
    for base in ([Path(env)] if env else []) + ([Path(built)] if built else []) + [REPO / "third_party" / "llama.cpp"]:
        if (base / "models").is_dir():
            return base / "models"
    return None


def vocab_gguf(name: str) -> Path:
    models = llama_cpp_models_dir()
    path = models / name if models else None
    if path is None or not path.exists():
        pytest.skip(f"{name} not found (third_party/llama.cpp is filled by the build)")
    return path


def template_path(name: str) -> Path:
    return llamaprompt.pinned_template(name)


def reference_template(ref: dict, server_args: list[str], name: str, llama_cpp: str | None = None):
    """The pinned template ``name`` as the reference recording's server loaded it: its model
    tokens (BOS/EOS text, add_bos/add_eos), media marker and these server flags."""
    tok = ref["model_tokens"]
    return llamaprompt.ChatTemplate.from_file(
        template_path(name),
        bos_token=tok["bos_token"],
        eos_token=tok["eos_token"],
        add_bos=tok["add_bos"],
        add_eos=tok["add_eos"],
        server_args=server_args,
        media_marker=ref["media_marker"],
        llama_cpp=llama_cpp,
    )


@pytest.fixture(scope="session")
def qwen3() -> llamaprompt.ChatTemplate:
    return llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"))


@contextlib.contextmanager
def serving(app):
    """Run an ASGI app with uvicorn on a free loopback port in a thread; yields its base URL."""
    uvicorn = pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


# -- markers (pyproject.toml declares them): `python -m pytest -m "not slow and not ray and not server"`
# runs the core suite in minutes. Tests that start a server or a Ray cluster carry their marker
# where they are defined; a test using the `server` fixture gets it here. "slow" = over ~10 s on
# 2 cores (measured with --durations): whole files of sweeps, and single tests by name.
SLOW_FILES = {
    "test_fast_path.py",  # the fast path's proof: every template x variant against the unmodified path
    "test_cores.py",  # builds and runs cores for other trees (worker processes, CMake)
}
SLOW_TESTS = {
    "test_more_vocab_conditions_llama_cpp_asserts_raise_instead",  # ~60 s: many written GGUF files
    "test_vocab_conditions_llama_cpp_asserts_raise_instead",
    "test_time_budget_per_call_and_per_template",  # waits for time budgets to expire
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.server)
        path = Path(str(item.fspath)).name
        if path in SLOW_FILES or getattr(item, "originalname", item.name) in SLOW_TESTS or item.name in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def interrupt_next_receive(owner) -> None:
    """Make ``owner``'s next ``_receive`` (a RemoteCore's or an UntrustedTemplate's wait for the
    worker's answer) raise KeyboardInterrupt once, after the request was sent: the answer stays
    in the pipe, as when Ctrl-C or a signal handler interrupts a call."""
    receive = owner._receive

    def interrupted(*args, **kwargs):
        owner._receive = receive
        raise KeyboardInterrupt

    owner._receive = interrupted


# the start of the fork tests' scripts: wait_for_child(pid) waits up to 30 s for a forked child,
# then kills it and prints "child: hung" (the state a lock held at the fork left it in)
_WAIT_FOR_CHILD = """
import os, time
def wait_for_child(pid, seconds=30.0):
    for _ in range(int(seconds * 10)):
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("child: hung", flush=True)
"""


def run_forking_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` (which forks and calls ``wait_for_child(pid)``) in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", _WAIT_FOR_CHILD + script, *args], capture_output=True, text=True, timeout=120
    )
