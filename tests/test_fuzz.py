"""A short fuzz run (hypothesis) over request JSON: whatever the body, llama.cpp's code
answers with a prompt or a typed error -- never a crash, a hang or another exception.
A long run: LLAMAPROMPT_FUZZ_EXAMPLES=20000 python -m pytest tests/test_fuzz.py"""

from __future__ import annotations

import json
import os

import pytest

import llamaprompt
from conftest import load_reference, template_path, vocab_gguf
from fuzz_corpus import SNIPPETS, mutate_template

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("LLAMAPROMPT_FUZZ_EXAMPLES", "150"))
TEMPLATES = {
    n: llamaprompt.ChatTemplate.from_file(template_path(n))
    for n in ("Qwen-Qwen3-0.6B.jinja", "openai-gpt-oss-120b.jinja", "google-gemma-2-2b-it.jinja")
}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=20,
)
roles = st.sampled_from(["user", "assistant", "system", "tool", "developer", "", "x"])
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "file", "x"])},
    optional={"text": json_values, "image_url": json_values, "input_audio": json_values},
)
contents = st.one_of(st.text(max_size=60), st.none(), st.lists(parts, max_size=3), json_values)
calls = st.fixed_dictionaries(
    {"type": st.just("function")},
    optional={
        "id": st.text(max_size=12),
        "function": st.fixed_dictionaries(
            {}, optional={"name": st.text(max_size=12), "arguments": st.one_of(st.text(max_size=30), json_values)}
        ),
    },
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": roles,
            "content": contents,
            "tool_calls": st.lists(calls, max_size=2),
            "reasoning_content": st.one_of(st.text(max_size=30), json_values),
            "tool_call_id": st.text(max_size=8),
        },
    ),
    max_size=5,
)


def _seed_requests():
    try:
        return list(load_reference("apply_template.json")["requests"].values())
    except pytest.skip.Exception:
        return [{"messages": [{"role": "user", "content": "hi"}]}]


requests = st.one_of(
    st.sampled_from(_seed_requests()),
    st.fixed_dictionaries(
        {"messages": messages},
        optional={
            "tools": st.one_of(
                json_values,
                st.lists(
                    st.just(
                        {
                            "type": "function",
                            "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
                        }
                    )
                ),
            ),
            "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), json_values),
            "chat_template_kwargs": json_values,
            "add_generation_prompt": json_values,
            "continue_final_message": json_values,
            "reasoning_effort": json_values,
            "response_format": json_values,
            "grammar": json_values,
            "parallel_tool_calls": json_values,
        },
    ),
    json_values,
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests, name=st.sampled_from(sorted(TEMPLATES)))
def test_requests_never_crash(request, name):
    t = TEMPLATES[name]
    body = request if isinstance(request, dict) else json.dumps(request)
    try:
        out = t.apply_template(body)
        assert isinstance(out, str)
    except llamaprompt.Error as e:
        assert e.status in (400, 500) and isinstance(e.message, str)


# -- the fast path, differentially ---------------------------------------------------------
# apply_template's prompt-only path (fast_path=True, the default) against llama.cpp's unmodified
# sequence (fast_path=False), on generated requests over every template the package ships: the
# same prompt or the same error. Each request is rendered twice on the fast twin, so that the
# second render takes the prompt-only path once the first built the parser.

SHIPPED = {p.name: p for p in llamaprompt.pinned_templates()}
_twins: dict = {}


def _twin(name):
    if name not in _twins:
        try:
            _twins[name] = (
                llamaprompt.ChatTemplate.from_file(SHIPPED[name]),
                llamaprompt.ChatTemplate.from_file(SHIPPED[name], fast_path=False),
            )
        except llamaprompt.TemplateError:
            _twins[name] = None  # not loadable (the same for both paths)
    return _twins[name]


def _outcome(t, body):
    try:
        return ("prompt", t.apply_template(body))
    except llamaprompt.Error as e:
        return ("error", type(e).__name__, e.status, e.message)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests, name=st.sampled_from(sorted(SHIPPED)))
def test_fast_path_matches_unmodified_path(request, name):
    twins = _twin(name)
    if twins is None:
        return
    fast, full = twins
    body = request if isinstance(request, dict) else json.dumps(request)
    expected = _outcome(full, body)
    event(expected[0])
    assert _outcome(fast, body) == expected
    assert _outcome(fast, body) == expected  # now on the prompt-only path where it applies


@settings(max_examples=max(20, EXAMPLES // 5), deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.binary(max_size=300))
def test_raw_bodies_never_crash(text):
    try:
        TEMPLATES["Qwen-Qwen3-0.6B.jinja"].apply_template(text)
    except llamaprompt.Error as e:
        assert e.status in (400, 500)


# -- template text ---------------------------------------------------------------------
# Pinned templates mutated by insertions of hostile or broken Jinja, deletions and
# truncations, loaded and rendered in-process with small budgets: a prompt or a typed
# error, never a crash (a recursion would kill this process) and never unbounded work.
# The edits and snippets: tests/fuzz_corpus.py.


template_sources = st.sampled_from(
    [
        "Qwen-Qwen3-0.6B.jinja",
        "openai-gpt-oss-120b.jinja",
        "google-gemma-2-2b-it.jinja",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
    ]
)
edits = st.lists(
    st.tuples(
        st.sampled_from(["insert", "delete", "truncate", "bytes"]),
        st.floats(0, 1),
        st.integers(0, len(SNIPPETS) - 1),
        st.binary(min_size=1, max_size=8),
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=max(20, EXAMPLES // 5), deadline=None, suppress_health_check=list(HealthCheck))
@given(name=template_sources, ops=edits)
def test_mutated_templates_never_crash(name, ops):
    src = mutate_template(template_path(name).read_bytes(), ops)
    try:
        t = llamaprompt.ChatTemplate(src, timeout=0.5, max_output_bytes=1 << 20)
    except llamaprompt.TemplateError as e:
        event("load refused: " + ("budget" if "budget" in e.message or "deeply" in e.message else "other"))
        return
    event("loaded")
    for request in _seed_requests()[:4]:
        try:
            assert isinstance(t.apply_template(request), str)
            event("rendered")
        except llamaprompt.Error as e:
            assert e.status in (400, 500)
            event("render error: " + ("budget" if "budget" in e.message or "deeply" in e.message else "other"))


# -- GGUF bytes ------------------------------------------------------------------------
# Vocab GGUF files truncated, with bytes overwritten in the header / metadata region, and
# with 8-byte counts set to absurd values. Each file is opened (vocab only) and, when it
# loads, used to tokenize -- in a child process, so that an abort is reported with the
# file that caused it instead of killing the test run.

GGUF_FILES = int(os.environ.get("LLAMAPROMPT_FUZZ_GGUF", "40"))

_GGUF_CHILD = """
import sys, llamaprompt
for i, path in enumerate(sys.argv[1:]):
    print(i, path, flush=True)
    try:
        t = llamaprompt.ChatTemplate.from_gguf(path)
        t.tokenize("Hello world <|im_start|> 123")
        t.apply_template({"messages": [{"role": "user", "content": "hi"}]})
    except llamaprompt.Error:
        pass
print("done", flush=True)
"""


def _gguf_mutants(tmp_path, n: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    sources = [
        vocab_gguf(f) for f in ("ggml-vocab-qwen2.gguf", "ggml-vocab-llama-spm.gguf", "ggml-vocab-bert-bge.gguf")
    ]
    out = []
    for i in range(n):
        src = sources[i % len(sources)]
        data = bytearray(src.read_bytes())
        kind = ("truncate", "overwrite", "count")[i % 3]
        if kind == "truncate":
            data = data[: rng.randrange(len(data))]
        elif kind == "overwrite":
            for _ in range(rng.randint(1, 8)):
                at = rng.randrange(min(len(data), 65536))
                data[at] = rng.randrange(256)
        else:
            at = rng.randrange(8, min(len(data), 4096) - 8)
            data[at : at + 8] = rng.choice(
                [b"\xff" * 8, b"\x00\x00\x00\x80" + b"\x00" * 4, (2**40).to_bytes(8, "little")]
            )
        path = tmp_path / f"mutant-{i:04d}-{kind}-{src.stem}.gguf"
        path.write_bytes(bytes(data))
        out.append(path)
    return out


def test_mutated_gguf_files_never_crash(tmp_path):
    import subprocess
    import sys

    files = _gguf_mutants(tmp_path, GGUF_FILES)
    proc = subprocess.run(
        [sys.executable, "-c", _GGUF_CHILD, *map(str, files)], capture_output=True, text=True, timeout=900
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "(nothing)"
    assert proc.returncode == 0 and last == "done", f"crashed at: {last}\n{proc.stderr[-2000:]}"
