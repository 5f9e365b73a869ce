"""A short fuzz run (hypothesis) over request JSON: whatever the body, llama.cpp's code
answers with a prompt or a typed error -- never a crash, a hang or another exception.
A long run: LLAMAPROMPT_FUZZ_EXAMPLES=20000 python -m pytest tests/test_fuzz.py"""

from __future__ import annotations

import json
import os

import pytest

import llamaprompt
from conftest import load_reference, template_path

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
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


@settings(max_examples=max(20, EXAMPLES // 5), deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.binary(max_size=300))
def test_raw_bodies_never_crash(text):
    try:
        TEMPLATES["Qwen-Qwen3-0.6B.jinja"].apply_template(text)
    except llamaprompt.Error as e:
        assert e.status in (400, 500)
