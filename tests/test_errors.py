"""Bad templates, requests and server_args raise typed errors with llama.cpp's message."""

from __future__ import annotations

import logging
import pickle

import pytest

import llamaprompt


def test_unparsable_template_raises_at_construction():
    with pytest.raises(llamaprompt.TemplateError) as info:
        llamaprompt.ChatTemplate("{% for m in messages %}{{ m['content'] }")
    assert info.value.status is None
    assert str(info.value)


def test_empty_template():
    with pytest.raises(llamaprompt.TemplateError, match="empty"):
        llamaprompt.ChatTemplate("")


def test_template_that_raises():
    tmpl = llamaprompt.ChatTemplate(
        "{% for m in messages %}{% if m['role'] == 'user' and m['content'] == 'boom' %}"
        "{{ raise_exception('no boom allowed') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    assert tmpl.apply_template({"messages": [{"role": "user", "content": "fine"}]}) == "fine"
    # the render runs inside common_chat_templates_apply_jinja's autoparser block, which
    # rethrows every failure as std::invalid_argument: llama-server answers 400
    with pytest.raises(llamaprompt.RequestError) as info:
        tmpl.apply_template({"messages": [{"role": "user", "content": "boom"}]})
    assert info.value.status == 400
    assert info.value.message.startswith("Unable to generate parser for this template.")
    assert "Jinja Exception: no boom allowed" in info.value.message


def test_unparsable_messages_are_a_500(qwen3):
    with pytest.raises(llamaprompt.TemplateError) as info:
        qwen3.apply_template({"messages": [{"content": "no role"}]})
    assert info.value.status == 500
    assert info.value.message.startswith("Failed to parse messages: Missing 'role'")
    assert isinstance(info.value, RuntimeError)


def test_request_errors_are_400(qwen3):
    with pytest.raises(llamaprompt.RequestError) as info:
        qwen3.apply_template({"model": "x"})
    assert info.value.status == 400
    assert info.value.message == "'messages' is required"
    assert isinstance(info.value, ValueError)
    with pytest.raises(llamaprompt.RequestError, match="Expected 'messages' to be an array"):
        qwen3.apply_template({"messages": "hi"})
    with pytest.raises(llamaprompt.RequestError, match="Invalid tool_choice"):
        qwen3.apply_template({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"})


def test_invalid_json_body_is_a_500(qwen3):
    # llama-server's json::parse of the HTTP body throws a non-invalid_argument error
    with pytest.raises(llamaprompt.TemplateError) as info:
        qwen3.apply_template(b'{"messages": [')
    assert info.value.status == 500


def test_request_type_checked(qwen3):
    with pytest.raises(TypeError):
        qwen3.apply_template(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [b"a", {1, 2}, object(), float("nan")])
def test_a_value_json_cannot_carry_is_a_bad_request(qwen3, value):
    # as NaN: no JSON text holds it, so llama-server could never receive it (400), for every entry point
    request = {"messages": [{"role": "user", "content": value}]}
    for call in (qwen3.apply_template, qwen3.apply, qwen3.template_inputs):
        with pytest.raises(llamaprompt.RequestError, match="request is not valid JSON") as info:
            call(request)
        assert info.value.status == 400
    with pytest.raises(llamaprompt.RequestError, match="request is not valid JSON"):
        qwen3.apply_template({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {(1, 2): 3}})


@pytest.mark.parametrize(
    "args",
    [
        ["--no-such-flag"],
        ["--reasoning"],  # missing value
        ["--reasoning", "sometimes"],
        ["--chat-template-kwargs", "{not json"],
    ],
)
def test_bad_server_args(args):
    with pytest.raises(llamaprompt.ServerArgsError):
        llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template(), server_args=args)


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["--list-devices"],
        ["-cl"],
        ["-m", "model.gguf"],
        ["--mmproj", "p.gguf"],
        ["--chat-template", "chatml"],
    ],
)
def test_refused_server_args(args):
    # these would print and exit(), or load a model/template, inside llama-server
    with pytest.raises(llamaprompt.ServerArgsError):
        llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template(), server_args=args)


def test_server_args_environment_is_ignored(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_THINK", "off")  # --reasoning's variable
    monkeypatch.setenv("LLAMA_ARG_REASONING", "off")
    tmpl = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    assert tmpl.supports_thinking is True


def _raised_by_the_core(tmp_path, qwen3) -> list[BaseException]:
    """One exception of each class the C++ core builds (errors.cpp make_py_error)."""
    bad_gguf = tmp_path / "x.gguf"
    bad_gguf.write_text("this is not a gguf file at all")
    calls = [
        lambda: qwen3.apply_template({"model": "x"}),  # RequestError, 400
        lambda: qwen3.apply_template(b'{"messages": ['),  # TemplateError, 500
        lambda: llamaprompt.ChatTemplate(""),  # TemplateError, no status
        lambda: llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template(), server_args=["--no-such-flag"]),
        lambda: llamaprompt.ChatTemplate.from_gguf(bad_gguf),  # GGUFError (an OSError)
    ]
    raised = []
    for call in calls:
        with pytest.raises(llamaprompt.Error) as info:
            call()
        raised.append(info.value)
    # apply_template_many(return_exceptions=True) builds its errors the same way
    raised += qwen3.apply_template_many([{"model": "x"}, b"{"], return_exceptions=True)
    return raised


def test_core_errors_are_what_their_class_constructs(tmp_path, qwen3):
    """The core builds its exceptions without running Error.__init__ (Python code there could
    let CPython end a daemon thread at exit inside the exception translation): the objects must
    be the ones the classes' own constructors make, for every class."""
    raised = _raised_by_the_core(tmp_path, qwen3)
    lp = llamaprompt
    assert {type(e) for e in raised} == {lp.RequestError, lp.TemplateError, lp.ServerArgsError, lp.GGUFError}
    for e in raised:
        assert isinstance(e, llamaprompt.Error)
        made = type(e)(e.message, e.status)
        assert e.args == made.args == (e.message,)
        assert vars(e) == vars(made)
        assert (str(e), repr(e)) == (str(made), repr(made))
        assert isinstance(e.message, str) and e.message
        if isinstance(e, OSError):
            assert (e.errno, e.strerror, e.filename) == (made.errno, made.strerror, made.filename)
        assert e.to_json() == made.to_json()
    statuses = [e.status for e in raised]
    assert statuses[:3] == [400, 500, None] and statuses[-2:] == [400, 500]


def test_errors_pickle():
    e = llamaprompt.RequestError("bad", 400)
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is llamaprompt.RequestError and e2.status == 400 and e2.message == "bad"


def test_deeply_nested_request_is_refused_not_a_crash(qwen3):
    deep = '{"messages":[{"role":"user","content":"a"}],"x":' + "[" * 150000 + "]" * 150000 + "}"
    with pytest.raises(llamaprompt.RequestError, match="nested too deeply"):
        qwen3.apply_template(deep)
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(llamaprompt.RequestError, match="nested too deeply"):
        qwen3.apply_template({"messages": [{"role": "user", "content": "a"}], "x": nested})
    # moderate nesting is an ordinary request
    ok = '{"messages":[{"role":"user","content":"a"}],"x":' + "[" * 200 + "]" * 200 + "}"
    assert qwen3.apply_template(ok).startswith("<|im_start|>user\na")


def test_echo_too_deep_for_python_is_a_request_error(qwen3):
    # apply() returns llama_params, which echo unused request fields: an accepted request
    # (<= 1000 levels) can still be deeper than json.loads reaches from inside a call
    def depth(v) -> int:
        n = 0
        while isinstance(v, list):
            v, n = (v[0] if v else None), n + 1
        return n

    outcomes = set()
    for n in range(800, 1001, 8):
        body = '{"messages":[{"role":"user","content":"a"}],"x":' + "[" * n + "]" * n + "}"
        try:
            params = qwen3.apply(body)
        except llamaprompt.RequestError as e:
            assert "nested too deeply" in e.message and e.status == 400
            outcomes.add("refused")
        else:
            assert depth(params.llama_params["x"]) == n
            outcomes.add("returned")
    assert outcomes == {"refused", "returned"}


def test_normalize_takes_messages_not_a_request(qwen3):
    # a JSON string is iterable (its characters): it was read as messages and refused for content
    wrong_ones = ('[{"role": "user", "content": "hi"}]', b"[]", bytearray(b"[]"), memoryview(b"[]"), {"messages": []})
    for wrong in wrong_ones:
        with pytest.raises(TypeError, match="iterable of message mappings"):
            qwen3.normalize(wrong)  # type: ignore[arg-type]
    assert qwen3.normalize([{"role": "user", "content": "hi"}])[0]["content"] == "hi"


def test_llama_cpp_config_files_are_ignored(tmp_path, monkeypatch):
    cfg = tmp_path / "llama.cpp"
    cfg.mkdir()
    (cfg / "config.ini").write_text("[*]\nreasoning = off\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    assert t.supports_thinking is True


def test_template_parse_error_carries_the_parser_message():
    with pytest.raises(llamaprompt.TemplateError) as info:
        llamaprompt.ChatTemplate("{{ foo(")
    assert "Unexpected EOF" in info.value.message


def test_argument_validation(qwen3):
    with pytest.raises(TypeError, match="bos_token"):
        llamaprompt.ChatTemplate("x", bos_token=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NUL"):
        llamaprompt.ChatTemplate.from_file(str(llamaprompt.pinned_template()) + "\x00junk")
    with pytest.raises(llamaprompt.RequestError, match="not valid JSON"):
        qwen3.apply_template({"messages": [{"role": "user", "content": float("nan")}]})
    with pytest.raises(llamaprompt.ServerArgsError, match="process-wide log"):
        llamaprompt.ChatTemplate("x", server_args=["--log-file", "/tmp/never"])
    # a message quoting bytes that are not UTF-8 still arrives as text
    with pytest.raises(llamaprompt.TemplateError) as info:
        qwen3.apply_template(b'{"messages": [{"role": "user", "content": "\xff"}]}')
    assert info.value.status == 500 and isinstance(info.value.message, str)


def test_schema_conversion_warning_goes_to_logging_not_stderr(caplog, capfd):
    # json-schema-to-grammar prints this warning with fprintf(stderr) upstream; a lookahead in
    # a `pattern` cannot be converted (llama.cpp accepts more than the pattern does)
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=a)a+$"}}}
    req = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
    }
    with caplog.at_level("WARNING", logger="llamaprompt.llama_cpp"):
        t.apply(req)
    assert any("JSON schema conversion was incomplete" in r.getMessage() for r in caplog.records)
    assert "JSON schema conversion" not in capfd.readouterr().err


# common/chat.cpp's specialized-handler chain logs this (LOG_WRN) for a template with gemma4's
# tool-call marker text '<|tool_call>call:' but without the newer template's comment
# "{#- OpenAI Chat Completions:"; llama-server prints it for every such request
OUTDATED_GEMMA4_WARNING = "detected an outdated gemma4 chat template"
MARKED = "{#- '<|tool_call>call:' -#}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def test_chat_code_warnings_go_to_logging_not_stderr(caplog, capfd):
    # common's log (LOG_WRN in chat.cpp) delivered as llama_log_set's lines: on the
    # llamaprompt.llama_cpp logger, at its level, once per request that logs it, never on stderr
    assert llamaprompt.features["common_log"]
    req = {"messages": [{"role": "user", "content": "hi"}]}

    def warnings() -> list:
        return [r for r in caplog.records if OUTDATED_GEMMA4_WARNING in r.getMessage()]

    with caplog.at_level("WARNING", logger="llamaprompt.llama_cpp"):
        # loading renders the template once through the handler chain (as llama-server's load)
        outdated = llamaprompt.ChatTemplate(MARKED)
        assert len(warnings()) == 1
        current = llamaprompt.ChatTemplate("{#- OpenAI Chat Completions: -#}" + MARKED)
        assert len(warnings()) == 1
        caplog.clear()
        for _ in range(3):
            assert outdated.apply_template(req) == "user: hi\n"
        outdated.apply_template_many([req, req], threads=2)
        assert current.apply_template(req) == "user: hi\n"
    assert len(warnings()) == 5
    assert all(r.name == "llamaprompt.llama_cpp" and r.levelname == "WARNING" for r in warnings())
    assert all(not r.getMessage().endswith("\n") for r in warnings())
    # the line is the record's msg (no %-formatting args): a filter reading record.msg sees it
    assert all(r.msg == r.getMessage() and not r.args for r in warnings())
    captured = capfd.readouterr()
    assert OUTDATED_GEMMA4_WARNING not in captured.err + captured.out


def test_a_raising_log_handler_sees_each_line_once(caplog):
    # a handler whose emit raises ends the call with its exception (as a logging call in Python
    # would); the line is not handed to it a second time on the way out
    calls = []

    class Raising(logging.Handler):
        def emit(self, record):
            calls.append(record.getMessage())
            raise ValueError("handler failed")

    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=a)a+$"}}}
    req = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
    }
    handler = Raising()
    logger = logging.getLogger("llamaprompt.llama_cpp")
    logger.addHandler(handler)
    try:
        with caplog.at_level("WARNING", logger="llamaprompt.llama_cpp"), pytest.raises(ValueError):
            t.apply(req)
    finally:
        logger.removeHandler(handler)
    assert len(calls) == 1 and "JSON schema conversion was incomplete" in calls[0]


def test_schema_conversion_warning_is_logged_whole(caplog):
    # upstream prints the warnings of every unsupported pattern in one line, "; "-joined
    # (json-schema-to-grammar.cpp); sixty of them make a line of thousands of bytes, with "é"s
    # in it where the tree's warning quotes the pattern: it must come whole, no character cut
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    properties = {f"p{i}": {"type": "string", "pattern": "^(?=é)é+$"} for i in range(60)}
    parameters = {"type": "object", "properties": properties}
    req = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
    }
    with caplog.at_level("WARNING", logger="llamaprompt.llama_cpp"):
        t.apply(req)
    lines = [r.getMessage() for r in caplog.records if "JSON schema conversion was incomplete" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].count("; ") == 59 and "\ufffd" not in lines[0] and len(lines[0].encode()) > 1024


def test_output_parse_warnings_go_to_logging(caplog):
    # common_chat_peg_parse (chat.cpp) logs what it could not parse (LOG_WRN) before it throws
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen3-Coder"))
    params = t.apply({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"})
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\nafter'
    with caplog.at_level("WARNING", logger="llamaprompt.llama_cpp"), pytest.raises(llamaprompt.TemplateError):
        params.parse(text)
    unparsed = [r.getMessage() for r in caplog.records if "unparsed" in r.getMessage()]
    assert len(unparsed) == 1 and unparsed[0].endswith("</tool_call>\nafter")


def test_prompt_bytes_that_are_not_utf8_survive_apply():
    # the template cuts "é" (2 bytes) after its first byte: the prompt is that byte
    t = llamaprompt.ChatTemplate("{{ messages[0].content[:1] }}")
    req = {"messages": [{"role": "user", "content": "é"}]}
    assert t.apply_template(req) == "\udcc3"
    p = t.apply(req)
    assert p.prompt == "\udcc3" and p.llama_params["prompt"] == "\udcc3"
    assert p.prompt.encode("utf-8", "surrogateescape") == b"\xc3"


def test_lone_surrogates_are_typed_or_replaced():
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    params = t.apply({"messages": [{"role": "user", "content": "hi"}]})
    # not UTF-8: llama-server's JSON replaces such bytes (U+FFFD) in what it returns
    assert params.parse("a\ud800b", partial=True)["content"] == "a\ufffd\ufffd\ufffdb"
    with pytest.raises(llamaprompt.Error):
        t.apply_template({"messages": [{"role": "user", "content": "a\ud800"}]})


def test_batch_renders_log_like_single_ones(caplog):
    # apply_template_many renders on C++ threads; each render's llama.cpp log lines still reach
    # logging (the same warning as above, once per request that causes it)
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=a)a+$"}}}
    req = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
    }
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    with caplog.at_level("WARNING", logger="llamaprompt.llama_cpp"):
        out = t.apply_template_many([req, plain, req], threads=2)
    assert all(isinstance(o, str) for o in out)
    warnings = [r for r in caplog.records if "JSON schema conversion was incomplete" in r.getMessage()]
    # the first render of these parser inputs generates the grammar (and warns); the fast path
    # may then skip generation for the repeat, as apply_template does
    assert len(warnings) >= 1
