"""UntrustedTemplate: hostile templates are stopped by the budgets, never hang or crash
the calling process, and ordinary results equal ChatTemplate's."""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

import llamaprompt
from conftest import interrupt_next_receive, load_reference, run_forking_script, template_path, vocab_gguf
from llamaprompt.sandbox import UntrustedTemplate

REQ = {"messages": [{"role": "user", "content": "hi"}]}


def test_results_equal_chat_template():
    ref = load_reference("apply_template.json")
    path = template_path("Qwen-Qwen3-0.6B.jinja")
    trusted = llamaprompt.ChatTemplate.from_file(path)
    with UntrustedTemplate.from_file(path) as u:
        assert u.caps == trusted.caps and u.props() == trusted.props() and u.source == trusted.source
        for name in ("basic", "tools_question", "err_content_number", "image_then_text"):
            try:
                want = trusted.apply_template(ref["requests"][name])
            except llamaprompt.Error as e:
                with pytest.raises(type(e), match="Expected"):
                    u.apply_template(ref["requests"][name])
            else:
                assert u.apply_template(ref["requests"][name]) == want
        assert u.apply(REQ).prompt == trusted.apply(REQ).prompt
        assert u.normalize(REQ["messages"]) == trusted.normalize(REQ["messages"])
        # text is refused as ChatTemplate refuses it (it was sent on as a list of its characters)
        for wrong in ('[{"role": "user", "content": "hi"}]', bytearray(b"[]")):
            with pytest.raises(TypeError, match="iterable of message mappings"):
                u.normalize(wrong)  # type: ignore[arg-type]


def test_endless_loop_is_stopped_and_the_object_recovers():
    src = (
        "{% if messages[0]['content'] == 'loop' %}{% for i in range(2000000000) %}{{ '' }}{% endfor %}{% endif %}"
        "{{ messages[0]['content'] }}"
    )
    with UntrustedTemplate(src, timeout=2) as u:
        assert u.apply_template(REQ) == "hi"
        t0 = time.monotonic()
        with pytest.raises(llamaprompt.TemplateError, match="budget"):
            u.apply_template({"messages": [{"role": "user", "content": "loop"}]})
        assert time.monotonic() - t0 < 30
        assert u.apply_template(REQ) == "hi"  # a new worker serves the next call


def test_recursion_crash_is_contained():
    src = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{% if messages[0]['content'] == 'deep' %}{{ f(0) }}{% endif %}ok"
    with UntrustedTemplate(src, timeout=20) as u:
        assert u.apply_template(REQ) == "ok"
        with pytest.raises(llamaprompt.TemplateError, match="crashed|budget|memory|nested too deeply"):
            u.apply_template({"messages": [{"role": "user", "content": "deep"}]})
        assert u.apply_template(REQ) == "ok"


def test_memory_and_output_budgets():
    src = "{% if messages[0]['content'] == 'big' %}{{ 'a' * 300000000 }}{% endif %}x"
    with UntrustedTemplate(src, max_memory_bytes=1 << 30, max_output_bytes=1 << 20, timeout=20) as u:
        # the allocation fails inside llama.cpp (reported as llama.cpp reports it)
        with pytest.raises(llamaprompt.Error, match="bad_alloc|budget|memory"):
            u.apply_template({"messages": [{"role": "user", "content": "big"}]})
        assert u.apply_template(REQ) == "x"


def test_output_budget():
    # 3 MB of prompt from many small values (none hits the in-process size budget)
    src = "{% if messages[0]['content'] == 'big' %}{% for i in range(3000) %}{{ 'a' * 1000 }}{% endfor %}{% endif %}x"
    big = {"messages": [{"role": "user", "content": "big"}]}
    try:
        llamaprompt.ChatTemplate(src, max_output_bytes=1 << 20).apply_template(big)
        in_process = None
    except llamaprompt.TemplateError as e:
        in_process = e.message  # some trees build the output by concatenation: the size budget fires first
    with UntrustedTemplate(src, max_output_bytes=1 << 20) as u:
        with pytest.raises(llamaprompt.TemplateError, match="output budget" if in_process is None else None):
            u.apply_template(big)
        assert u.apply_template(REQ) == "x"


def test_hostile_load_fails_with_template_error():
    with pytest.raises(llamaprompt.TemplateError):
        UntrustedTemplate("{% for i in range(2000000000) %}{{ i }}{% endfor %}", timeout=1)
    with pytest.raises(llamaprompt.TemplateError):
        UntrustedTemplate("{{ foo(")


@pytest.mark.parametrize(
    "budget, says",
    [
        ({"timeout": None}, "timeout must be a finite number of seconds > 0"),
        ({"timeout": float("inf")}, "timeout must be a finite number of seconds > 0"),
        ({"timeout": 0}, "timeout must be a finite number of seconds > 0"),
        ({"timeout": "5"}, "timeout must be a finite number of seconds > 0"),
        ({"max_output_bytes": None}, "max_output_bytes must be a positive int"),
        ({"max_output_bytes": 1.5}, "max_output_bytes must be a positive int"),
        ({"max_memory_bytes": 0}, "max_memory_bytes must be an int of at least 512 MiB"),
        # (too little for the worker to start: the build before failed later, "std::bad_alloc" as
        # a ServerArgsError)
        ({"max_memory_bytes": 5}, "max_memory_bytes must be an int of at least 512 MiB"),
    ],
)
def test_a_budget_the_worker_cannot_keep_is_refused(budget, says):
    # the sandbox's budgets are kills and refusals: None, inf or a wrong type is a ValueError
    # saying so (the trial of session 54: "TypeError: '<=' not supported between instances of
    # 'NoneType' and 'int'" for timeout=None, int()'s TypeError for max_output_bytes=None)
    with pytest.raises(ValueError, match=says):
        UntrustedTemplate("{{ messages[0]['content'] }}!", **budget)


@pytest.mark.parametrize("source", [None, 5, ["{{ 1 }}"], pathlib.Path("t.jinja")])
def test_a_source_that_is_no_text_is_a_type_error(source):
    # as ChatTemplate refuses it, before a worker starts (the trial of session 55: None gave
    # "TemplateError: AssertionError: " from the worker, status 500)
    with pytest.raises(TypeError, match="from_file" if isinstance(source, pathlib.Path) else "must be str or bytes"):
        UntrustedTemplate(source)
    with pytest.raises(TypeError, match="from_file" if isinstance(source, pathlib.Path) else "must be str or bytes"):
        llamaprompt.ChatTemplate(source)


def test_a_memory_budget_past_what_rlimit_holds_is_no_limit():
    # 2**63 bytes and more do not fit RLIMIT_AS: no limit (the build before: the worker died of
    # an OverflowError traceback, "the template crashed the sandbox worker"); an int subclass is
    # sent to the worker as an int (the build before: the worker could not unpickle it)
    class Bytes(int):
        pass

    for budget in (2**63, 10**30, Bytes(1 << 30)):
        with UntrustedTemplate("{{ messages[0]['content'] }}!", max_memory_bytes=budget) as u:
            assert u.apply_template(REQ) == "hi!"


@pytest.mark.parametrize("timeout", [1e10, 1e300])
def test_a_budget_longer_than_select_takes(timeout):
    # select() takes at most a time_t's worth of seconds: budgets past ~9.2e9 s raised
    # OverflowError ("timestamp out of range for platform time_t") instead of rendering
    with UntrustedTemplate("{{ messages[0]['content'] }}!", timeout=timeout) as u:
        assert u.apply_template(REQ) == "hi!"


def test_an_interrupted_call_never_hands_its_answer_to_the_next():
    # a KeyboardInterrupt between a call's request and its answer left that answer in the pipe:
    # the next call got it; now the next call starts a fresh worker
    with UntrustedTemplate("{{ messages[0]['content'] }}") as u:
        interrupt_next_receive(u)
        with pytest.raises(KeyboardInterrupt):
            u.apply_template({"messages": [{"role": "user", "content": "first"}]})
        assert u.apply_template({"messages": [{"role": "user", "content": "second"}]}) == "second"


def test_pipe_connection_frames_large_and_back_to_back_messages():
    # the worker's pipe: messages larger than the pipe's buffer arrive in many reads, and several
    # small ones can arrive in one read; each recv() must return exactly one message, in order
    import threading

    from llamaprompt.sandbox import _PipeConnection

    r, w = os.pipe()
    reader, writer = os.fdopen(r, "rb", buffering=0), os.fdopen(w, "wb", buffering=0)
    sender, receiver = _PipeConnection(reader, writer), _PipeConnection(reader, writer)
    big = bytes(range(256)) * (24 << 12)  # 24 MiB, not a multiple of any read size
    messages = [("a", 1), big, ("b", ""), {"k": [big[:3]]}, "z" * 100_001]
    thread = threading.Thread(target=lambda: [sender.send(m) for m in messages])
    thread.start()
    try:
        got = [receiver.recv() for _ in messages]
    finally:
        thread.join()
    assert [type(g) for g in got] == [type(m) for m in messages]
    assert got == messages
    assert not receiver.poll(0)  # nothing left over
    sender.close()


FORK_WHILE_A_CALL_HOLDS_THE_LOCK = """
from llamaprompt.sandbox import UntrustedTemplate
u = UntrustedTemplate("{{ messages[0]['content'] }}")
u.apply_template({"messages": [{"role": "user", "content": "parent"}]})
u._lock.acquire()  # a thread of the parent in the middle of a call, at the fork
pid = os.fork()
if pid == 0:
    print("child:", u.apply_template({"messages": [{"role": "user", "content": "child"}]}), flush=True)
    os._exit(0)
u._lock.release()
wait_for_child(pid)
print("parent:", u.apply_template({"messages": [{"role": "user", "content": "parent again"}]}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_uses_a_worker_of_its_own():
    # the child inherited the template's lock held by a parent's call (it waited for good) and
    # the parent's worker and pipes (a call could reach the parent's worker)
    proc = run_forking_script(FORK_WHILE_A_CALL_HOLDS_THE_LOCK)
    assert (proc.returncode, proc.stdout.split("\n")[:2]) == (0, ["child: child", "parent: parent again"]), proc.stderr


def _logged(records) -> list[tuple[str, int, str, str, int, str]]:
    return [
        (r.name, r.levelno, r.getMessage(), r.pathname, r.lineno, r.funcName)
        for r in records
        if r.name.startswith("llamaprompt")
    ]


def test_the_workers_logs_reach_the_callers_logging(caplog, tmp_path):
    # the notices (a top-level template variable, tools a template ignores) and llama.cpp's lines
    # (a tool's schema llama.cpp cannot convert) are logged in the calling process as ChatTemplate
    # logs them, with the same origin (file, line, function); the worker's went to its own
    # NullHandler, then came back as logged by sandbox._relay
    from test_gguf import SPM, _rewrite

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "^(?=a)b$"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "enable_thinking": False}
    sources = [template_path(n).read_text() for n in ("Qwen-Qwen3-0.6B.jinja", "google-gemma-2-2b-it.jinja")]
    logged = {}
    for cls in (llamaprompt.ChatTemplate, UntrustedTemplate):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="llamaprompt"):
            for source in sources:
                t = cls(source)
                t.apply(body)
                t.apply_template(body)
                t.apply(body)  # (each notice once per template)
        logged[cls] = _logged(caplog.records)
    assert logged[UntrustedTemplate] == logged[llamaprompt.ChatTemplate]
    names = [r[0] for r in logged[UntrustedTemplate]]
    assert names.count("llamaprompt") == 3 and "llamaprompt.llama_cpp" in names
    assert any("supports_tools" in r[2] for r in logged[UntrustedTemplate])

    # the load's: a GGUF without a template falls back to chatml, and llama.cpp reads the file
    path = _rewrite(vocab_gguf(SPM), tmp_path / "t.gguf", remove=["tokenizer.chat_template"])
    for cls in (llamaprompt.ChatTemplate, UntrustedTemplate):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="llamaprompt"):
            cls.from_gguf(path)
        logged[cls] = _logged(caplog.records)
    assert logged[UntrustedTemplate] == logged[llamaprompt.ChatTemplate]
    assert any(r[0] == "llamaprompt" and "chatml" in r[2] for r in logged[UntrustedTemplate])

    # nothing below the caller's levels comes back (the worker logs at those levels)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="llamaprompt"), UntrustedTemplate(sources[0]) as u:
        u.apply(body)
    assert _logged(caplog.records) == []


def test_a_template_from_a_file_names_the_file_in_its_notices(caplog, tmp_path):
    # ChatTemplate.from_file's notices name the file; the worker rebuilt the template from its
    # text and named it "template <sha>" -- and so did a pickled or sibling ChatTemplate
    import pickle

    path = tmp_path / "qwen3.jinja"
    path.write_bytes(template_path("Qwen-Qwen3-0.6B.jinja").read_bytes())
    body = {"messages": [{"role": "user", "content": "x"}], "enable_thinking": False}
    made = {
        "ChatTemplate": lambda: llamaprompt.ChatTemplate.from_file(path),
        "UntrustedTemplate": lambda: UntrustedTemplate.from_file(path),
        "pickled": lambda: pickle.loads(pickle.dumps(llamaprompt.ChatTemplate.from_file(path))),
        "sibling": lambda: llamaprompt.ChatTemplate.from_file(path).with_server_args("--reasoning-format", "none"),
    }
    for how, make in made.items():
        t = make()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="llamaprompt"):
            t.apply_template(body)
        notices = [r.getMessage() for r in caplog.records if r.name == "llamaprompt"]
        assert len(notices) == 1 and notices[0].startswith(f"{path}: "), (how, notices)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))  # (the magic is enough: it is not read as a template)
    with pytest.raises(ValueError, match="GGUF model file"):
        UntrustedTemplate.from_file(gguf)


def test_a_failing_handler_of_the_workers_notice_is_unraisable(caplog):
    class Failing(logging.Handler):
        def emit(self, record):
            raise RuntimeError("handler failed")  # (out of logger.log: Handler.handle does not catch)

    source = template_path("google-gemma-2-2b-it.jinja").read_text()
    want = llamaprompt.ChatTemplate(source).apply_template(REQ)
    seen = []
    log = logging.getLogger("llamaprompt")
    handler = Failing()
    log.addHandler(handler)
    old = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append((type(u.exc_value), u.object))
    try:
        with UntrustedTemplate(source) as u:
            prompt = u.apply_template({**REQ, "enable_thinking": False})
    finally:
        sys.unraisablehook = old
        log.removeHandler(handler)
    assert prompt == want  # the call's result, not the handler's error
    assert seen == [(RuntimeError, "llamaprompt notices")]


def test_a_handler_of_the_workers_records_may_call_the_template_again():
    # the records are logged while the call holds the object's lock (the answer read in full):
    # a handler that renders with the same object must not wait for that lock for ever
    source = template_path("google-gemma-2-2b-it.jinja").read_text()
    rendered = []

    class Again(logging.Handler):
        def emit(self, record):
            if not rendered:
                rendered.append(u.apply_template(REQ))

    u = UntrustedTemplate(source)
    log = logging.getLogger("llamaprompt")
    handler = Again()
    log.addHandler(handler)  # (after the load: a load that raises must not leave it to the next tests)
    try:
        done = []
        thread = threading.Thread(
            target=lambda: done.append(u.apply_template({**REQ, "enable_thinking": False})), daemon=True
        )
        thread.start()
        thread.join(20)
        if thread.is_alive():
            u._proc.kill()  # (close() would wait for the lock too)
            pytest.fail("the handler's call waited for the lock")
        u.close()
        assert done == rendered == [llamaprompt.ChatTemplate(source).apply_template(REQ)]
    finally:
        log.removeHandler(handler)


EXIT_DURING_A_SANDBOXED_CALL = r"""
import threading, time
from llamaprompt.sandbox import UntrustedTemplate
loop = (
    "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}ok"
)
u = UntrustedTemplate(loop, timeout=3600)
threading.Thread(
    target=lambda: u.apply_template({"messages": [{"role": "user", "content": "loop"}]}), daemon=True
).start()
time.sleep(1)
print(u._proc.pid, flush=True)
"""


def test_the_worker_of_a_call_in_progress_is_stopped_at_exit(tmp_path):
    # a daemon thread's call was left running in its worker, an orphan, for as long as its work
    # took (here the budget is an hour). (stderr to a file: the worker inherits it, and a pipe
    # would stay open for as long as the worker runs)
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.run(
            [sys.executable, "-c", EXIT_DURING_A_SANDBOXED_CALL],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=120,
        )
        err.seek(0)
        assert proc.returncode == 0, err.read()[-2000:]
    pid = int(proc.stdout)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"the worker {pid} outlived its caller")
