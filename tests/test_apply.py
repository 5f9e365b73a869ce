"""ChatParams (apply) and normalize(): values derived from the templates and from
upstream's documented behaviour, and consistency with apply_template."""

from __future__ import annotations

import llamaprompt
from conftest import load_reference

TYPED_ONLY = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<img>{% endif %}"
    "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_apply_prompt_equals_apply_template(qwen3):
    ref = load_reference("apply_template.json")
    for name in ("basic", "tools_question", "reasoning_with_content", "assistant_prefill"):
        req = ref["requests"][name]
        assert qwen3.apply(req).prompt == qwen3.apply_template(req)


def test_apply_with_tools_has_grammar_and_triggers(qwen3):
    ref = load_reference("apply_template.json")
    params = qwen3.apply(ref["requests"]["tools_question"])
    assert params.format.startswith("peg")
    assert params.grammar  # tools make a grammar
    assert params.grammar_lazy is True
    assert any("<tool_call>" in t["value"] for t in params.grammar_triggers)
    assert "<tool_call>" in params.preserved_tokens
    assert params.parser
    # Qwen3 thinks: its generation prompt opens <think>, closed by </think>
    assert params.supports_thinking is True
    assert params.thinking_start_tag == "<think>"
    assert params.thinking_end_tags == ["</think>"]


def test_apply_plain_request_without_tools(qwen3):
    params = qwen3.apply({"messages": [{"role": "user", "content": "hi"}]})
    assert params.grammar == ""
    assert params.grammar_triggers == []
    assert params.prompt.endswith("<|im_start|>assistant\n")
    assert params.llama_params["prompt"] == params.prompt


def test_normalize_string_only_template_joins_parts(qwen3):
    # Qwen3 prints message.content as a string: typed parts are joined with "\n"
    assert qwen3.caps["supports_string_content"] and not qwen3.caps["supports_typed_content"]
    parts = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]
    msgs = [{"role": "user", "content": parts}]
    out = qwen3.normalize(msgs)
    assert out == [{"role": "user", "content": "First part.\nSecond part."}]


def test_normalize_media_marker_joins_without_newline(qwen3):
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "text", "text": "Describe"},
            ],
        }
    ]
    assert qwen3.normalize(msgs) == [{"role": "user", "content": "<__media__>Describe"}]


def test_normalize_typed_only_template_wraps_strings():
    tmpl = llamaprompt.ChatTemplate(TYPED_ONLY)
    assert tmpl.caps["supports_typed_content"] and not tmpl.caps["supports_string_content"]
    out = tmpl.normalize([{"role": "user", "content": "Hello"}])
    assert out == [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    # the prompt then carries the text (the SmolVLM failure: text-only chats lost their text)
    assert tmpl.apply_template({"messages": [{"role": "user", "content": "Hello"}]}) == "<|user|>Hello\n<|assistant|>"


def test_normalize_keeps_tool_calls_and_reasoning(qwen3):
    msgs = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "think",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    out = qwen3.normalize(msgs)
    assert [m["role"] for m in out] == ["user", "assistant", "tool"]
    assert out[1]["reasoning_content"] == "think"
    assert out[1]["tool_calls"][0]["function"]["name"] == "f"
    assert out[2]["tool_call_id"] == "c1"
