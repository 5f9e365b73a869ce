"""Overrides on top of the unchanged llama.cpp path: forced caps, handler choice, built-in
(non-Jinja) templates, hooks and describe()."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import llamaprompt
from conftest import load_reference, mask_dates

# handles both content shapes: a string is printed, parts are printed as [text]
BOTH = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %}{% endfor %}"
)
# SmolVLM-style: iterates message['content'] as parts
TYPED_ONLY = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
)
REQ = {
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def test_forced_caps_change_the_prompt_in_the_documented_direction():
    # which shapes a tree detects for this template varies (the pin: both; 0.3.35's tree: string
    # only); the forced caps decide the normalization whatever was detected
    t = llamaprompt.ChatTemplate(BOTH)
    assert t.caps["supports_string_content"]
    both = t.with_caps(supports_string_content=True, supports_typed_content=True)
    assert both.apply_template(REQ) == "<user>hi<user>[a][b]"  # both shapes: nothing normalized
    typed = t.with_caps(supports_string_content=False, supports_typed_content=True)
    assert typed.apply_template(REQ) == "<user>[hi]<user>[a][b]"  # strings become one text part
    string = t.with_caps(supports_string_content=True, supports_typed_content=False)
    assert string.apply_template(REQ) == "<user>hi<user>a\nb"  # parts joined with a newline
    assert typed.caps["supports_string_content"] is False and typed.detected_caps == t.caps
    assert typed.props()["chat_template_caps"] == typed.caps
    # the default object is untouched: it normalizes as its detected caps say
    expected = "<user>hi<user>[a][b]" if t.caps["supports_typed_content"] else "<user>hi<user>a\nb"
    assert t.apply_template(REQ) == expected and t.caps == t.detected_caps


def test_typed_only_template_forced_to_string_only():
    t = llamaprompt.ChatTemplate(TYPED_ONLY)
    assert t.caps["supports_typed_content"] and not t.caps["supports_string_content"]
    forced = t.with_caps(supports_string_content=True, supports_typed_content=False)
    msgs = [{"role": "user", "content": "hi"}]
    assert t.normalize(msgs) == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert forced.normalize(msgs) == [{"role": "user", "content": "hi"}]
    assert t.apply_template({"messages": msgs}) == "<|user|>hi"
    # the template iterates a string now: llama.cpp's Jinja error, as llama-server would answer
    with pytest.raises(llamaprompt.Error, match="Expected iterable"):
        forced.apply_template({"messages": msgs})


def test_string_only_template_forced_to_typed_only(qwen3):
    forced = qwen3.with_caps(supports_string_content=False, supports_typed_content=True)
    msgs = [{"role": "user", "content": "hi"}]
    assert forced.normalize(msgs) == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert qwen3.normalize(msgs) == msgs
    with pytest.raises(llamaprompt.Error, match="startswith"):  # Qwen3 calls content.startswith
        forced.apply_template({"messages": msgs})
    assert qwen3.apply_template({"messages": msgs}).startswith("<|im_start|>user\nhi")


def test_caps_validation(qwen3):
    with pytest.raises(ValueError, match="unknown caps keys: supports_magic"):
        qwen3.with_caps(supports_magic=True)
    with pytest.raises(ValueError, match="must be a bool"):
        llamaprompt.ChatTemplate(BOTH, caps={"supports_tools": 1})
    with pytest.raises(ValueError, match="handler"):
        llamaprompt.ChatTemplate(BOTH, handler="fast")


def test_forced_caps_on_gguf_and_file_keep_options(tmp_path):
    path = llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja")
    t = llamaprompt.ChatTemplate.from_file(path, bos_token="<s>", add_bos=True, server_args=["--reasoning", "off"])
    f = t.with_caps(supports_system_role=False)
    assert f.bos_token == "<s>" and f.add_bos and f.server_args == ("--reasoning", "off")
    assert f.caps["supports_system_role"] is False and t.caps["supports_system_role"] is True


def test_handler_autoparser_skips_the_specialized_handler():
    # GPT-OSS has a dedicated handler in common_chat_try_specialized_template ("<|channel|>")
    path = llamaprompt.pinned_template("openai-gpt-oss-120b.jinja")
    auto = llamaprompt.ChatTemplate.from_file(path).describe()
    assert auto["autoparser"] is False and auto["autoparser_with_tools"] is False
    forced = llamaprompt.ChatTemplate.from_file(path, handler="autoparser").describe()
    assert forced["handler"] == "autoparser" and forced["autoparser"] is True
    # templates without a specialized handler take the autoparser either way
    q = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja")).describe()
    assert q["autoparser"] is True and q["thinking_start_tag"] == "<think>"


def test_handler_pure_content(qwen3):
    pc = llamaprompt.ChatTemplate.from_file(
        llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"), handler="pure_content"
    )
    req = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    # force-pure-content renders the same prompt but builds no tool-call grammar
    assert qwen3.apply(req).grammar != ""
    params = pc.apply(req)
    assert params.grammar == "" and params.parser != ""
    assert params.prompt == qwen3.apply_template(req)


@pytest.mark.parametrize("name", ["llama2", "chatml", "gemma", "phi3", "mistral-v7", "zephyr", "vicuna"])
def test_builtin_matches_llama_chat_apply_template(name):
    assert name in llamaprompt.builtin_template_names()
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Bye"},
    ]
    t = llamaprompt.ChatTemplate.builtin(name)
    assert t.apply_template({"messages": msgs}) == llamaprompt.llama_chat_apply_template(name, msgs, True)
    req = {"messages": msgs[:2], "add_generation_prompt": False}
    assert t.apply_template(req) == llamaprompt.llama_chat_apply_template(name, msgs[:2], False)


@pytest.mark.parametrize(
    "messages, says",
    [
        ([{"role": "user", "content": None}], "message 0: 'content' must be a str, not a NoneType"),
        ([{"role": "user", "content": ["a"]}], "message 0: 'content' must be a str, not a list"),
        ([{"role": 5, "content": "x"}], "message 0: 'role' must be a str, not a int"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], "message 1: 'content' must be a str, not missing"),
        (["user: x"], "message 0 must be a mapping"),
        ([{"role": "user", "content": "a\x00b"}], "message 0: 'content' holds a NUL character"),
        ([{"role": "user\ud800", "content": "x"}], "message 0: 'role' holds a lone surrogate"),
    ],
)
def test_llama_chat_apply_template_refuses_what_is_no_text(messages, says):
    # the C function takes two C strings per message; the build before rendered str() of them
    # ("[INST] None [/INST]", a list's repr, a role 5 as an assistant turn) or raised KeyError
    with pytest.raises(ValueError if "holds" in says else TypeError, match=re.escape(says)):
        llamaprompt.llama_chat_apply_template("llama2", messages)


def test_builtin_errors():
    t = llamaprompt.ChatTemplate.builtin("chatml")
    with pytest.raises(llamaprompt.TemplateError) as info:
        t.apply_template({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    assert info.value.status == 500 and info.value.message == "tools param requires --jinja flag"
    with pytest.raises(llamaprompt.TemplateError) as info:
        t.apply_template({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})
    assert info.value.message == "tool_choice param requires --jinja flag"
    with pytest.raises(llamaprompt.TemplateError, match="not supported: no-such-template"):
        llamaprompt.ChatTemplate.builtin("no-such-template")
    assert "chat_template_tool_use" not in t.props()


class Recorder:
    def __init__(self, log, name, add=None):
        self.log, self.name, self.add = log, name, add

    def before_request(self, request):
        self.log.append(("before", self.name))
        if self.add:
            request.setdefault("chat_template_kwargs", {}).update(self.add)
        return request

    def after_params(self, params):
        self.log.append(("after", self.name))
        return params


VAR_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}|{{ system_name | default('none') }}"


def test_hooks_run_in_order_and_only_for_matching_templates():
    log = []
    own = Recorder(log, "own", add={"system_name": "Ada"})
    reg_match = Recorder(log, "registered")
    reg_other = Recorder(log, "other")
    llamaprompt.register_hook(reg_match, match={"contains": "system_name"})
    llamaprompt.register_hook(reg_other, match={"sha256": "0" * 64})
    try:
        t = llamaprompt.ChatTemplate(VAR_TEMPLATE, hooks=[own])
        req = {"messages": [{"role": "user", "content": "hi"}]}
        assert t.apply_template(req) == "hi|Ada"
        assert req == {"messages": [{"role": "user", "content": "hi"}]}  # the caller's dict is not changed
        assert log == [("before", "own"), ("before", "registered"), ("after", "own"), ("after", "registered")]
        log.clear()
        plain = llamaprompt.ChatTemplate(VAR_TEMPLATE)
        assert plain.apply_template(req) == "hi|none"
        assert log == [("before", "registered"), ("after", "registered")]
        log.clear()
        llamaprompt.register_hook(reg_other, match={"sha256": plain.sha256})
        plain.apply(req)
        assert ("before", "other") in log
    finally:
        for h in (reg_match, reg_other):
            llamaprompt.unregister_hook(h)
    assert llamaprompt.registered_hooks() == []


def test_hook_predicate_and_exceptions_surface_unchanged():
    class Boom(Exception):
        pass

    class Raising:
        def before_request(self, request):
            raise Boom("from the hook")

    hook = llamaprompt.register_hook(Raising(), match=lambda t: "boom" in t.source)
    try:
        with pytest.raises(Boom, match="from the hook"):
            llamaprompt.ChatTemplate("{{ 'boom' }}").apply_template({"messages": [{"role": "user", "content": "x"}]})
        assert llamaprompt.ChatTemplate("{{ 'ok' }}").apply_template({"messages": [{"role": "user", "content": "x"}]})
    finally:
        llamaprompt.unregister_hook(hook)
    with pytest.raises(TypeError):
        llamaprompt.register_hook(object())
    with pytest.raises(ValueError):
        llamaprompt.register_hook(Raising(), match={"regex": "x"})


def test_after_params_can_change_what_the_caller_gets():
    import dataclasses

    class Stop:
        def after_params(self, params):
            return dataclasses.replace(params, additional_stops=[*params.additional_stops, "<END>"])

    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"), hooks=[Stop()])
    assert "<END>" in t.apply({"messages": [{"role": "user", "content": "x"}]}).additional_stops


def test_defaults_unchanged_by_override_machinery():
    ref = load_reference("apply_template.json")
    case = ref["variants"][0]["templates"]["openai-gpt-oss-120b.jinja"]["cases"]["tools_question"]
    t = llamaprompt.ChatTemplate.from_file(
        llamaprompt.pinned_template("openai-gpt-oss-120b.jinja"), bos_token="<s>", eos_token="</s>", add_bos=True
    )
    assert t.handler == "auto" and t.hooks == ()
    got = t.apply_template(ref["requests"]["tools_question"])
    assert mask_dates(got, ref["rendered_on"]) == case["prompt"]


def test_cli_overrides():
    cli = [sys.executable, "-m", "llamaprompt.cli"]
    proc = subprocess.run([*cli, "describe", "--builtin", "llama2"], capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["use_jinja"] is False
    proc = subprocess.run([*cli, "caps", "--caps", '{"supports_tools": false}'], capture_output=True)
    assert proc.returncode == 0 and json.loads(proc.stdout)["supports_tools"] is False
    proc = subprocess.run(
        [
            *cli,
            "describe",
            "-t",
            str(llamaprompt.pinned_template("openai-gpt-oss-120b.jinja")),
            "--handler",
            "autoparser",
        ],
        capture_output=True,
    )
    assert proc.returncode == 0 and json.loads(proc.stdout)["autoparser"] is True
    proc = subprocess.run([*cli, "caps", "--caps", '{"nope": true}'], capture_output=True)
    assert proc.returncode == 2 and b"unknown caps keys" in proc.stderr


def test_describe_reports_the_flag_pure_content_adds():
    path = llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja")
    d = llamaprompt.ChatTemplate.from_file(path, handler="pure_content", server_args=["--reasoning", "off"]).describe()
    assert d["server_args"][:2] == ["--reasoning", "off"] and "--skip-chat-parsing" in d["server_args"]
    assert "--skip-chat-parsing" not in llamaprompt.ChatTemplate.from_file(path).describe()["server_args"]
