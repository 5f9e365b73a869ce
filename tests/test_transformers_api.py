"""apply_chat_template (transformers' names and shapes), prompt + tokens from one render, and
the footguns: a path given as template text, template variables at the top level of a request,
tools a template ignores, a GGUF without a template. Expected prompts and tokens are llama-server's
recordings (the reference fixtures), mapped the way the docs say the arguments map."""

from __future__ import annotations

import json
import logging
import sys
import types

import numpy as np
import pytest

import llamaprompt
from conftest import load_reference, mask_dates, reference_cases, template_path, vocab_gguf

# requests whose body is messages (+ tools, + chat_template_kwargs): each maps to one call
PLAIN = (
    "basic",
    "system_multi_turn",
    "typed_text_parts",
    "reasoning_only_turn",
    "reasoning_with_content",
    "developer_role",
    "unicode_and_specials",
    "empty_assistant_turn",
    "tools_question",
    "tool_call_only",
    "tool_call_with_text_json_result",
    "parallel_tool_calls",
    "typed_tool_result",
    "thinking_disabled_kwarg",
    "reasoning_effort_low",
    "err_content_number",
    "err_missing_role",
    "err_enable_thinking_string",
    "err_unknown_part_type",
)


def _variants():
    default = load_reference("apply_template.json")
    other = load_reference("apply_template_server_args.json")
    no_prefill = next(v for v in other["variants"] if v["server_args"] == ["--no-prefill-assistant"])
    return default, default["variants"][0], no_prefill


def _collect():
    _, variant, _ = _variants()
    for name in variant["templates"]:
        yield pytest.param(name, id=name)


def _call_args(request: dict) -> tuple[list, dict]:
    """apply_chat_template arguments meaning what this llama-server request body means."""
    kwargs = dict(request.get("chat_template_kwargs", {}))
    if "reasoning_effort" in request:  # llama-server copies it into chat_template_kwargs
        kwargs["reasoning_effort"] = request["reasoning_effort"]
    if "tools" in request:
        kwargs["tools"] = request["tools"]
    return request["messages"], kwargs


def _expect(t, case, rendered_on, messages, **kwargs):
    if case["status"] == 200:
        assert mask_dates(llamaprompt.apply_chat_template(t, messages, **kwargs), rendered_on) == case["prompt"]
    else:
        with pytest.raises(llamaprompt.Error) as info:
            llamaprompt.apply_chat_template(t, messages, **kwargs)
        assert (info.value.status, info.value.message) == (case["status"], case["error"]["message"])


@pytest.mark.parametrize("name", reference_cases(_collect))
def test_apply_chat_template_is_the_servers_prompt(name):
    ref, default, no_prefill = _variants()
    tok = ref["model_tokens"]
    t = llamaprompt.ChatTemplate.from_file(
        template_path(name),
        bos_token=tok["bos_token"],
        eos_token=tok["eos_token"],
        add_bos=tok["add_bos"],
        add_eos=tok["add_eos"],
        media_marker=ref["media_marker"],
    )
    cases, closed = default["templates"][name]["cases"], no_prefill["templates"][name]["cases"]
    day = ref["rendered_on"]
    for rname in PLAIN:
        messages, kwargs = _call_args(ref["requests"][rname])
        _expect(t, cases[rname], day, messages, **kwargs)
    # a final assistant message: closed (transformers' meaning, llama-server --no-prefill-assistant) ...
    for rname, extra in (("no_generation_prompt", {"add_generation_prompt": False}), ("assistant_prefill", {})):
        messages = ref["requests"][rname]["messages"]
        _expect(t, closed[rname], day, messages, **extra)
    # ... or continued (llama-server's default prefill, or its continue_final_message)
    for rname in ("assistant_prefill", "continue_final_message"):
        messages = ref["requests"][rname]["messages"]
        _expect(t, cases[rname], day, messages, continue_final_message=True)
    # a batch is the list of the single results
    batch = [ref["requests"]["basic"]["messages"], ref["requests"]["system_multi_turn"]["messages"]]
    want = [cases["basic"], cases["system_multi_turn"]]
    if all(c["status"] == 200 for c in want):
        got = llamaprompt.apply_chat_template(t, batch)
        assert [mask_dates(p, day) for p in got] == [c["prompt"] for c in want]


def test_transformers_argument_rules(qwen3):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]
    with pytest.raises(ValueError, match="not compatible"):
        llamaprompt.apply_chat_template(qwen3, messages, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match="empty conversation"):
        llamaprompt.apply_chat_template(qwen3, [])
    for option in ("padding", "return_tensors", "truncation", "chat_template"):
        with pytest.raises(TypeError, match=option):
            llamaprompt.apply_chat_template(qwen3, messages, **{option: True})
    with pytest.raises(TypeError, match="GGUF"):
        llamaprompt.apply_chat_template(qwen3, messages, tokenize=True)
    with pytest.raises(TypeError, match="ChatTemplate"):
        llamaprompt.apply_chat_template("{{ x }}", messages)
    # transformers' rules that llama-server would not enforce: the user's text is not continued
    with pytest.raises(ValueError, match="final message is 'user'"):
        llamaprompt.apply_chat_template(qwen3, messages[:1], continue_final_message=True)
    for bad in ("bogus", "true", 1):
        with pytest.raises(ValueError, match="continue_final_message must be"):
            llamaprompt.apply_chat_template(qwen3, messages, continue_final_message=bad)
    with pytest.raises(TypeError, match="add_generation_prompt must be a bool"):
        llamaprompt.apply_chat_template(qwen3, messages, add_generation_prompt="false")
    with pytest.raises(TypeError, match="tools must be a list"):
        llamaprompt.apply_chat_template(qwen3, messages, tools={"type": "function"})
    assert llamaprompt.apply_chat_template(qwen3, messages[:1], add_generation_prompt=np.bool_(False)).endswith(
        "Hi<|im_end|>\n"
    )
    # documents travel as the template variable of that name
    t = llamaprompt.ChatTemplate("{% for d in documents %}[{{ d.title }}]{% endfor %}{{ messages[0].content }}")
    assert llamaprompt.apply_chat_template(t, messages[:1], documents=[{"title": "A"}, {"title": "B"}]) == "[A][B]Hi"
    # a Python function as a tool needs transformers; the OpenAI form needs nothing
    pytest.importorskip("transformers")

    def get_weather(city: str) -> str:
        """Weather of a city.

        Args:
            city: the city
        """
        return city

    t = llamaprompt.ChatTemplate("{{ tools[0].function.name }}|{{ tools[0].function.parameters.required[0] }}")
    assert llamaprompt.apply_chat_template(t, messages[:1], tools=[get_weather]) == "get_weather|city"


def _gguf_cases():
    ref = load_reference("gguf.json")
    for model, m in ref["models"].items():
        for rname, case in m["cases"].items():
            if (
                "tokens_add_special_true" in case
                and "messages" in ref["requests"][rname]
                and rname != "image_then_text"
            ):
                yield pytest.param(model, rname, id=f"{model}-{rname}")


@pytest.mark.parametrize(("model", "rname"), reference_cases(_gguf_cases, 2))
def test_tokens_from_one_render(model, rname):
    ref = load_reference("gguf.json")
    m = ref["models"][model]
    case = m["cases"][rname]
    request = ref["requests"][rname]
    t = llamaprompt.ChatTemplate.from_gguf(vocab_gguf(m["vocab_file"]), media_marker=ref["media_marker"])
    prompt, tokens = t.apply_template(request, tokens=True)
    assert mask_dates(prompt, ref["rendered_on"]) == case["prompt"]
    assert tokens.dtype == np.int32 and tokens.tolist() == case["tokens_add_special_true"]
    if set(request) <= {"messages", "tools"}:
        messages, kwargs = _call_args(request)
        ids = llamaprompt.apply_chat_template(t, messages, tokenize=True, **kwargs)
        assert ids == case["tokens_add_special_true"]
        enc = llamaprompt.apply_chat_template(t, [messages, messages], tokenize=True, return_dict=True, **kwargs)
        assert enc == {"input_ids": [ids, ids], "attention_mask": [[1] * len(ids)] * 2}


def test_one_render_for_prompt_and_tokens(monkeypatch):
    t = llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-qwen2.gguf"))
    calls = []
    core = t._core

    class Counting:
        def __getattr__(self, name):
            attr = getattr(core, name)
            if name.startswith("apply"):
                return lambda *a, **k: (calls.append(name), attr(*a, **k))[1]
            return attr

    monkeypatch.setattr(t, "_core", Counting())
    out = t.apply_template({"messages": [{"role": "user", "content": "Hi"}]}, tokens=True)
    assert isinstance(out, llamaprompt.PromptTokens) and calls == ["apply_template"]
    assert out.tokens.tolist() == t.tokenize(out.prompt, add_special=True).tolist()


def test_a_path_is_not_a_template(tmp_path):
    f = tmp_path / "Qwen3.jinja"
    f.write_text("{{ messages[0].content }}")
    for source in (str(f), str(tmp_path / "missing.jinja"), str(f) + "\n", str(tmp_path), "chat_template.json"):
        with pytest.raises(ValueError, match=r"from_file"):
            llamaprompt.ChatTemplate(source)
    with pytest.raises(ValueError, match=r"builtin\('llama3'\)"):
        llamaprompt.ChatTemplate("llama3")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(ValueError, match="from_gguf"):
        llamaprompt.ChatTemplate.from_file(gguf)
    for text in ("Say hi to file.jinja", "see https://example.com/t.jinja"):
        assert llamaprompt.ChatTemplate(text).source == text
    assert "<|im_start|>" in llamaprompt.ChatTemplate("chatml").source  # llama.cpp's own name for chatml
    with pytest.raises(TypeError, match=r"from_file"):
        llamaprompt.ChatTemplate(f)
    assert llamaprompt.ChatTemplate.from_file(f).apply_template({"messages": [{"role": "user", "content": "x"}]}) == "x"
    # template text, even a one-liner without Jinja, is still a template
    assert llamaprompt.ChatTemplate("hello").apply_template({"messages": [{"role": "user", "content": "x"}]}) == "hello"


# a tool with no parameters, for the notices tests
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _records(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "llamaprompt" and r.levelno == logging.WARNING]


def test_top_level_template_variable_is_warned_once(caplog):
    t = llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"))
    plain = {"messages": [{"role": "user", "content": "Hi"}]}
    with caplog.at_level(logging.WARNING, logger="llamaprompt"):
        a = t.apply_template({**plain, "enable_thinking": False})
        t.apply_template('{"messages": [{"role": "user", "content": "Hi"}], "enable_thinking": false}')
        t.apply({**plain, "enable_thinking": False})
        t.apply_template(plain)
    # the request still went to llama.cpp unchanged: llama-server ignores the key
    assert a == t.apply_template(plain)
    warned = _records(caplog)
    assert len(warned) == 1 and "'enable_thinking'" in warned[0] and "chat_template_kwargs" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llamaprompt"):
        t.apply_template_many(
            [{**plain, "documents": []}, {**plain, "chat_template_kwargs": {"enable_thinking": False}}]
        )
    assert len(_records(caplog)) == 1 and "'documents'" in _records(caplog)[0]


def test_tools_a_template_ignores_are_warned_once(caplog):
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [_TOOL]}
    gemma = llamaprompt.ChatTemplate.from_file(template_path("google-gemma-2-2b-it.jinja"))
    qwen = llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"))
    assert not gemma.caps["supports_tools"] and not gemma.caps["supports_tool_calls"] and qwen.caps["supports_tools"]
    with caplog.at_level(logging.WARNING, logger="llamaprompt"):
        prompt = gemma.apply_template(body)
        gemma.apply_template(body)
        qwen.apply_template(body)
    warned = _records(caplog)
    assert len(warned) == 1 and "supports_tools" in warned[0] and "google-gemma-2-2b-it.jinja" in warned[0]
    assert '"f"' not in prompt and "f" not in prompt.replace("of", "")  # the tool is indeed not in the prompt


def test_request_text_is_decoded_only_for_pending_warnings(monkeypatch):
    # the Python check (apply(), hooks, a core in a worker) decodes request text (bytes / str)
    # only when it names a key a warning is still pending for: Qwen3 renders tools, so a body
    # with tools is not decoded for them
    from llamaprompt import notices

    decoded = []
    counting = types.SimpleNamespace(loads=lambda text: decoded.append(text) or json.loads(text))
    monkeypatch.setattr(notices, "json", counting)
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": [_TOOL]})
    qwen = llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"))
    gemma = llamaprompt.ChatTemplate.from_file(template_path("google-gemma-2-2b-it.jinja"))
    qwen.apply(body)
    assert decoded == []
    gemma.apply(body)  # gemma 2 renders no tools: the warning is pending, the text decoded
    gemma.apply(body)  # warned once: nothing pending for "tools" any more
    assert decoded == [body.encode()]
    # a misplaced template variable: decoded and warned the first time, no longer searched for after
    kwargs = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "enable_thinking": False})
    decoded.clear()
    qwen.apply(kwargs)
    qwen.apply(kwargs)
    assert decoded == [kwargs.encode()]


@pytest.mark.parametrize("form", ["bytes", "str", "dict", "many"])
def test_apply_template_warns_from_the_body_the_core_parses(form, monkeypatch, caplog):
    # apply_template(_many) with an in-process core: llama.cpp's own parse of the body shows the
    # top-level keys (Python decodes nothing), also when the render then fails
    from llamaprompt import notices

    monkeypatch.setattr(notices, "json", None)  # any decoding in Python would raise
    hi = [{"role": "user", "content": "Hi"}]
    requests = [
        {"messages": hi, "tools": []},  # an empty list: no tools to leave out
        {"messages": hi, "chat_template_kwargs": {"enable_thinking": False}},  # where it belongs
        {"messages": [{"role": "user", "content": "Hi", "documents": [], "tools": [_TOOL]}]},  # not top level
        {"messages": hi, "tools": [_TOOL], "documents": []},
        {"messages": hi, "documents": [], "model_identity": "x"},
    ]
    raising = llamaprompt.ChatTemplate("{% if messages[0].content == 'Hi' %}{{ raise_exception('no') }}{% endif %}x")
    gemma = llamaprompt.ChatTemplate.from_file(template_path("google-gemma-2-2b-it.jinja"))
    with caplog.at_level(logging.WARNING, logger="llamaprompt"):
        for t in (gemma, raising):
            assert t._notices.watching
            name = t._notices.name
            encoded = [r if form == "dict" else json.dumps(r) for r in requests]
            encoded = [e.encode() if form == "bytes" else e for e in encoded]
            if form == "many":
                t.apply_template_many(encoded, threads=2, return_exceptions=True)
                continue
            for i, request in enumerate(encoded):
                try:
                    t.apply_template(request)
                except llamaprompt.Error as e:  # (the autoparser path answers 400 for a raise)
                    assert t is raising and "Jinja Exception: no" in str(e)
                if i < 3:
                    assert not [w for w in _records(caplog) if w.startswith(name)], i
    warned = _records(caplog)
    for t in (gemma, raising):
        mine = [w for w in warned if w.startswith(t._notices.name)]
        ignores_tools = not t.caps["supports_tools"] and not t.caps["supports_tool_calls"]
        assert ignores_tools  # neither renders tools
        assert sorted(("tools" if "has tools" in w else w.split("'")[1]) for w in mine) == [
            "documents",
            "model_identity",
            "tools",
        ], mine


def test_a_failing_notice_callback_changes_no_result(monkeypatch):
    # the core's call back into Python (watch_notices) reports its own error as unraisable: the
    # call's prompt, or its own error, is what the caller gets
    t = llamaprompt.ChatTemplate("{% if messages[0].content == 'boom' %}{{ raise_exception('no') }}{% endif %}x")
    seen, unraisable = [], []

    def failing(bits):
        seen.append(bits)
        raise RuntimeError("a handler failed")

    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))
    t._core.watch_notices(["documents", "tools"], 0b10, 0b11, failing)
    assert t.apply_template({"messages": [{"role": "user", "content": "hi"}], "documents": []}) == "x"
    with pytest.raises(llamaprompt.Error, match="Jinja Exception: no"):
        t.apply_template({"messages": [{"role": "user", "content": "boom"}], "tools": [_TOOL]})
    assert t.apply_template_many([{"messages": [{"role": "user", "content": "hi"}], "documents": 1}]) == ["x"]
    assert seen == [0b01, 0b10, 0b01] and [str(e) for e in unraisable] == ["a handler failed"] * 3


def test_a_keyboard_interrupt_in_a_notice_reaches_the_caller():
    t = llamaprompt.ChatTemplate("x")

    def interrupted(bits):
        raise KeyboardInterrupt

    t._core.watch_notices(["documents"], 0, 1, interrupted)
    with pytest.raises(KeyboardInterrupt):
        t.apply_template({"messages": [{"role": "user", "content": "hi"}], "documents": []})
    assert t.apply_template({"messages": [{"role": "user", "content": "hi"}]}) == "x"


class _FailingHandler(logging.Handler):
    def handle(self, record):  # (not emit: logging's handleError would catch that)
        raise RuntimeError("a handler failed")


@pytest.mark.parametrize("path", ["core", "apply", "hooks"])
def test_a_failing_log_handler_changes_no_result_on_either_path(path, monkeypatch):
    # the core's call back (apply_template) and the Python check (apply(), hooks) report an error
    # of a warning's logging alike: unraisable, with the same context; the result is the call's
    class Hook:
        def before_request(self, request):
            return request

    hooks = {"hooks": [Hook()]} if path == "hooks" else {}
    source = "{% if messages[0].content == 'boom' %}{{ raise_exception('no') }}{% endif %}x"
    t = llamaprompt.ChatTemplate(source, **hooks)
    assert t._notices.watching
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append((str(u.exc_value), u.object)))
    handler = _FailingHandler()
    logging.getLogger("llamaprompt").addHandler(handler)
    call = t.apply if path == "apply" else t.apply_template
    try:
        out = call({"messages": [{"role": "user", "content": "hi"}], "documents": []})
        assert (out.prompt if path == "apply" else out) == "x"
        with pytest.raises(llamaprompt.Error, match="Jinja Exception: no"):
            call({"messages": [{"role": "user", "content": "boom"}], "model_identity": "m"})
    finally:
        logging.getLogger("llamaprompt").removeHandler(handler)
    assert unraisable == [("a handler failed", "llamaprompt notices")] * 2


def test_a_keyboard_interrupt_in_a_log_handler_reaches_the_caller_of_apply():
    class Interrupting(logging.Handler):
        def handle(self, record):
            raise KeyboardInterrupt

    t = llamaprompt.ChatTemplate("x")
    handler = Interrupting()
    logging.getLogger("llamaprompt").addHandler(handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            t.apply({"messages": [{"role": "user", "content": "hi"}], "documents": []})
    finally:
        logging.getLogger("llamaprompt").removeHandler(handler)


@pytest.mark.parametrize("key", ["custom\\u005ftools", "\\u0064ocuments", "model\\u005Fidentity"])
def test_a_key_written_with_json_escapes_is_warned_on_the_python_path(key, caplog):
    # llama.cpp's parser (the core path) decodes the escapes; the Python check finds the key too
    t = llamaprompt.ChatTemplate("x")
    body = '{"messages": [{"role": "user", "content": "hi"}], "' + key + '": 1}'
    decoded = json.loads(body)
    [name] = [k for k in decoded if k != "messages"]
    with caplog.at_level(logging.WARNING, logger="llamaprompt"):
        t.apply(body)
        assert len(_records(caplog)) == 1 and repr(name) in _records(caplog)[0], _records(caplog)
        t.apply_template(body.replace(key, name))  # warned once: not again on the other path
    assert len(_records(caplog)) == 1


def test_hooks_get_the_notices_of_the_callers_request(caplog):
    # a hook's additions are not the caller's keys: apply_template, _many and apply() warn alike
    class Adds:
        def before_request(self, request):
            return {**request, "documents": []}

    t = llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"), hooks=[Adds()])
    request = {"messages": [{"role": "user", "content": "Hi"}], "model_identity": "x"}
    with caplog.at_level(logging.WARNING, logger="llamaprompt"):
        t.apply_template(request)
        t.apply_template_many([request, json.dumps(request)], threads=2)
        t.apply(request)
    warned = _records(caplog)
    assert len(warned) == 1 and "'model_identity'" in warned[0], warned


def test_chatml_fallback_is_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="llamaprompt"):
        t = llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-llama-spm.gguf"))
        llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-qwen2.gguf"))  # has its own template
        llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-llama-spm.gguf"), chat_template="{{ 'x' }}")
    warned = _records(caplog)
    assert len(warned) == 1 and "chatml" in warned[0] and "ggml-vocab-llama-spm.gguf" in warned[0]
    assert t.apply_template({"messages": [{"role": "user", "content": "Hi"}]}).startswith("<|im_start|>user\nHi")


def test_the_documented_differences_hold_for_transformers():
    """docs/transformers.md says what transformers renders where llama-server differs; check
    those claims against transformers' own renderer (the llamaprompt side is run by test_docs)."""
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    def hf(name, conversation, **kwargs):
        source = template_path(name).read_text(encoding="utf-8") if name.endswith(".jinja") else name
        kwargs.setdefault("add_generation_prompt", True)
        return render_jinja_template(conversations=[conversation], chat_template=source, **kwargs)[0][0]

    hello = [{"role": "user", "content": "Hello"}]
    llama = "meta-llama-Llama-3.1-8B-Instruct.jinja"
    assert hf(llama, hello, bos_token="<|begin_of_text|>").startswith("<|begin_of_text|><|start_header_id|>system")
    assert "Today Date: 26 Jul 2024" in hf(llama, hello, bos_token="")
    assert "<|think|>" not in hf("google-gemma-4-31B-it.jinja", hello, bos_token="")
    probe = "{% for m in messages %}[{{ m.content is defined }}:{{ m.content }}]{% endfor %}"
    # render_jinja_template passes None; apply_chat_template (v5) first drops None-valued keys
    assert hf(probe, [{"role": "assistant", "content": None}]) == "[True:None]"
    assert hf(probe, [{"role": "assistant"}]) == "[False:]"
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert '"parameters": "{\\"city\\": \\"Paris\\"}"' in hf(llama, turn, bos_token="", add_generation_prompt=False)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    with pytest.raises(Exception, match="System role not supported"):
        hf("google-gemma-2-2b-it.jinja", system, bos_token="")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    qwen = "Qwen-Qwen3-0.6B.jinja"
    assert hf(qwen, turns, add_generation_prompt=False).endswith("Hello!<|im_end|>\n")
    assert hf(qwen, turns, add_generation_prompt=False, continue_final_message=True).endswith("Hello!")
    r1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
    assert hf(r1, turns, add_generation_prompt=False, continue_final_message=True).endswith("<｜Assistant｜>Hello!")
    oss = "openai-gpt-oss-120b.jinja"
    assert hf(oss, turns, add_generation_prompt=False).endswith("<|message|>Hello!<|return|>")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]}]
    with pytest.raises(Exception, match="list object"):  # Qwen3 rejects a list where llama.cpp joins the text
        hf(qwen, parts)


@pytest.mark.parametrize("args", [(ValueError("x"), None), (ValueError, "c"), (None, "c"), (42, "c")])
def test_write_unraisable_refuses_what_it_cannot_report(args):
    # (a None context was a null pointer: the process died)
    from llamaprompt import _core

    with pytest.raises(TypeError):
        _core.write_unraisable(*args)
