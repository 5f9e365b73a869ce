"""The llamaprompt command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import llamaprompt
from conftest import load_reference
from llamaprompt.cli import _parser

CLI = [sys.executable, "-m", "llamaprompt.cli"]


def run(*args, input=None):
    return subprocess.run([*CLI, *args], input=input, capture_output=True)


def test_render_default_sample():
    proc = run("render")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.decode()
    assert out.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert "get_weather" in out
    assert out.endswith("<|im_start|>assistant\n")  # exact bytes: no newline added


@pytest.mark.parametrize("extra", [[], ["--untrusted", "--timeout", "30"]], ids=["in-process", "untrusted"])
def test_render_matches_reference(tmp_path, extra):
    # in process, and the same bytes from the sandboxed worker process
    ref = load_reference("apply_template.json")
    case = ref["variants"][0]["templates"]["Qwen-Qwen3-0.6B.jinja"]["cases"]["tools_question"]
    req = tmp_path / "req.json"
    req.write_text(json.dumps(ref["requests"]["tools_question"]))
    template = str(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    tokens = ["--bos-token", "<s>", "--eos-token", "</s>", "--add-bos"]
    proc = run("render", *extra, "--template", template, *tokens, str(req))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode() == case["prompt"]


def test_render_timeout(tmp_path):
    # a loop of ten million iterations takes seconds; a 0.3 s budget stops it with the budget's
    # message (jinja_guard.h) in llama.cpp's source excerpt, in process and in the sandbox
    slow = tmp_path / "slow.jinja"
    slow.write_text("{% for m in messages %}{% for i in range(10000000) %}{{ i }}{% endfor %}{% endfor %}")
    for extra in ([], ["--untrusted"]):
        proc = run("render", "--template", str(slow), "--timeout", "0.3", *extra)
        assert proc.returncode == 2, proc.stderr
        assert b"TemplateError" in proc.stderr and b"exceeded the time budget (0.3 s)" in proc.stderr
    for bad in ("0", "-1", "nan", "soon"):
        proc = run("render", "--timeout", bad)
        assert proc.returncode == 2 and b"--timeout" in proc.stderr
    # no budget: ChatTemplate's timeout=None (the sandbox needs one: it kills its worker past it)
    spellings = ("none", "inf", "+inf", "1e400", "2.5")
    assert [_parser().parse_args(["render", "--timeout", t]).timeout for t in spellings] == [None] * 4 + [2.5]
    proc = run("render", "--timeout", "none")
    assert proc.returncode == 0 and proc.stdout.endswith(b"<|im_start|>assistant\n"), proc.stderr
    proc = run("render", "--untrusted", "--timeout", "none")
    assert proc.returncode == 2 and b"--untrusted needs a --timeout" in proc.stderr
    proc = run("serve", "--pinned", "--untrusted", "--timeout", "-1")
    assert proc.returncode == 2 and b"argument --timeout" in proc.stderr
    proc = run("render", "--untrusted", "--builtin", "chatml")
    assert proc.returncode == 2 and b"--untrusted" in proc.stderr
    # the command's usage line, as argparse's own errors print (not the top-level one)
    assert b"llamaprompt render: error:" in proc.stderr and proc.stderr.startswith(b"usage: llamaprompt render ")


def test_render_dataset_without_pyarrow_says_what_to_install(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"  # import pyarrow now raises ImportError
        "from llamaprompt.cli import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "render-dataset", str(rows), "-o", str(tmp_path / "out.parquet")],
        capture_output=True,
    )
    assert proc.returncode == 2
    assert b"pip install 'llamaprompt[datasets]'" in proc.stderr and b"Traceback" not in proc.stderr


def test_render_stdin_and_server_args_after_dashes():
    ref = load_reference("apply_template_server_args.json")
    variant = next(v for v in ref["variants"] if v["server_args"] == ["--reasoning", "off"])
    case = variant["templates"]["Qwen-Qwen3-0.6B.jinja"]["cases"]["basic"]
    template = str(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    body = json.dumps(ref["requests"]["basic"]).encode()
    proc = run("render", "-t", template, "-", "--", "--reasoning", "off", input=body)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode() == case["prompt"]


def test_caps_and_props():
    ref = load_reference("apply_template.json")
    template = str(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    proc = run("caps", "--template", template)
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == ref["variants"][0]["templates"]["Qwen-Qwen3-0.6B.jinja"]["caps"]
    proc = run("props", "--template", template, "--bos-token", "<s>")
    assert json.loads(proc.stdout)["bos_token"] == "<s>"


def test_normalize(tmp_path):
    msgs = tmp_path / "m.json"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs.write_text(json.dumps([{"role": "user", "content": parts}]))
    proc = run("normalize", "--template", str(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja")), str(msgs))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [{"role": "user", "content": "a\nb"}]


def test_errors_exit_2(tmp_path):
    req = tmp_path / "bad.json"
    req.write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}))
    proc = run("render", str(req))
    assert proc.returncode == 2
    assert b"Expected 'content' to be a string or an array" in proc.stderr
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    proc = run("render", "--template", str(bad))
    assert proc.returncode == 2 and b"TemplateError" in proc.stderr
    proc = run("render", "--", "--no-such-flag")
    assert proc.returncode == 2 and b"invalid argument" in proc.stderr
    proc = run("render", "--template", str(tmp_path / "missing.jinja"))
    assert proc.returncode == 2


def test_render_a_pinned_template_by_name():
    # --pinned NAME is --template with that shipped file's path
    path = llamaprompt.pinned_template("Qwen3-Coder.jinja")
    by_name = run("render", "--pinned", "Qwen3-Coder")
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == run("render", "--template", str(path)).stdout
    assert b"<tools>" in by_name.stdout  # the sample's tools, as Qwen3-Coder's template writes them
    unknown = run("render", "--pinned", "no-such-template")
    assert unknown.returncode == 2 and b"no pinned template" in unknown.stderr
    assert b"Qwen3-Coder.jinja" in unknown.stderr  # the names it lists
    both = run("render", "--pinned", "Qwen3-Coder", "--template", str(path))
    assert both.returncode == 2 and b"give one" in both.stderr


def test_help_and_version():
    assert run("--help").returncode == 0
    proc = run("--version")
    assert proc.returncode == 0 and llamaprompt.LLAMA_CPP_COMMIT.encode() in proc.stdout


def test_render_params_prints_json(tmp_path):
    proc = run("render", "--params")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt"].startswith("<|im_start|>system") and out["format"] and "llama_params" in out


def test_normalize_needs_messages(tmp_path):
    """A request body without 'messages' is refused with llama.cpp's message, as from Python
    (it once printed [] and exited 0)."""
    body = tmp_path / "b.json"
    body.write_text(json.dumps({"message": [{"role": "user", "content": "a"}]}))
    proc = run("normalize", "--template", str(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja")), str(body))
    assert proc.returncode == 2 and proc.stdout == b""
    assert b"'messages' is required" in proc.stderr
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    try:
        t.apply_template({"message": []})
    except llamaprompt.RequestError as e:
        assert e.message.encode() in proc.stderr
    else:
        raise AssertionError("llama.cpp accepted a body without messages")


def test_normalize_without_a_file_takes_the_sample(tmp_path):
    # as render and inputs do: the built-in sample request's messages, one per message in its order
    from llamaprompt.samples import SAMPLE_REQUEST

    proc = run("normalize")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [m["role"] for m in out] == [m["role"] for m in SAMPLE_REQUEST["messages"]]
    assert out[0]["content"] == SAMPLE_REQUEST["messages"][0]["content"]


def test_builtin_templates_without_a_request_take_the_sample_without_tools():
    # llama.cpp's legacy path refuses tools ("tools param requires --jinja flag"), so --builtin
    # renders the plain sample; chatml's layout from reading llama-chat.cpp (LLM_CHAT_TEMPLATE_CHATML):
    # "<|im_start|>" role "\n" content "<|im_end|>\n" per message, then the assistant's header
    from llamaprompt.samples import PLAIN_SAMPLE_REQUEST

    messages = PLAIN_SAMPLE_REQUEST["messages"]
    proc = run("render", "--builtin", "chatml")
    assert proc.returncode == 0, proc.stderr
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert proc.stdout.decode() == expected + "<|im_start|>assistant\n"
    for name in ("llama2", "gemma"):
        proc = run("render", "--builtin", name)
        assert proc.returncode == 0 and messages[-1]["content"].encode() in proc.stdout, proc.stderr
    proc = run("normalize", "--builtin", "llama2")
    assert proc.returncode == 0, proc.stderr
    assert [(m["role"], m["content"]) for m in json.loads(proc.stdout)] == [(m["role"], m["content"]) for m in messages]


def test_normalize_bodies_llama_cpp_rejects(tmp_path):
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    for body in ('"x"', '{"messages": null}'):
        f = tmp_path / "b.json"
        f.write_text(body)
        proc = run("normalize", "--template", str(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja")), str(f))
        try:
            t.apply_template(body)
        except llamaprompt.RequestError as e:
            want = e.message
        assert proc.returncode == 2 and want.encode() in proc.stderr, (body, proc.stderr)


def test_an_input_nested_too_deeply_to_read_is_named(tmp_path):
    # 100,000 brackets: Python's JSON reader stops at its recursion limit; the message names the
    # file and says so (the build before: "the result is nested too deeply to print", for an input
    # never read); render hands the bytes to llama.cpp, which refuses them as llama-server does
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    said = f"{deep}: nested too deeply to read as JSON"
    proc = run("normalize", str(deep))
    assert proc.returncode == 2 and proc.stderr.decode().splitlines() == [
        f"llamaprompt: RequestError: {said} (Python's recursion limit)"
    ]
    proc = run("diff", str(deep), str(deep))
    assert proc.returncode == 2 and said in proc.stderr.decode(), proc.stderr
    proc = run("render", str(deep))
    assert proc.returncode == 2 and b"RequestError (HTTP 400): request is nested too deeply" in proc.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="/dev/zero and RLIMIT_AS")
def test_a_template_file_without_end_exits_2(tmp_path):
    # `-t /dev/zero` reads until memory runs out: under a memory limit that was a MemoryError
    # traceback (exit 1); a directory is an OSError. Both: the message, exit 2
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    proc = subprocess.run([*CLI, "render", "-t", "/dev/zero"], capture_output=True, preexec_fn=limit, timeout=300)
    assert proc.returncode == 2 and b"MemoryError" in proc.stderr and b"Traceback" not in proc.stderr, proc.stderr
    proc = run("render", "-t", str(tmp_path))
    assert proc.returncode == 2 and b"IsADirectoryError" in proc.stderr and b"Traceback" not in proc.stderr


def test_ctrl_c_prints_one_line_and_exits_130():
    # a KeyboardInterrupt inside a command (here raised by the command itself, in place of a
    # Ctrl-C) ends the CLI with one line on stderr, no traceback, and the shell's status for SIGINT
    code = (
        "import sys, llamaprompt.cli as cli\n"
        "def interrupted(*args):\n"
        "    raise KeyboardInterrupt\n"
        "cli._run = interrupted\n"
        "sys.exit(cli.main(['render']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 130
    assert proc.stderr == "llamaprompt: interrupted\n"


def test_every_command_option_and_argument_has_help():
    # `llamaprompt CMD --help` explains every option and positional argument (the build before:
    # serve's and fixtures' --media-marker, render-dataset's --output, check's and diff's files,
    # diff's --format and cores' ACTION had none)
    import argparse

    def missing(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                if action.help is None and path:
                    yield f"{path} {action.metavar or action.dest}"
                for name, sub in action.choices.items():
                    yield from missing(sub, f"{path} {name}".strip())
            elif action.help is None:
                yield f"{path} {'/'.join(action.option_strings) or action.dest}"

    assert list(missing(_parser(), "")) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["render", "-t", ""],
        ["render", "--template="],
        ["render", "--gguf", ""],
        ["render", "--builtin", ""],
        ["caps", "-t", ""],
        ["render", "--pinned", ""],
        ["serve", "-t", ""],
        ["fixtures", "--pinned", "", "-o", "out.json"],
        ["render", ""],
        ["bench", "--llama-server", "", ""],
    ],
)
def test_an_empty_file_or_template_name_is_refused(argv):
    # `-t "$UNSET"`: the build before took the empty name as absent and rendered with the default
    # template (exit 0, a prompt of another template), or said "Is a directory: '.'"
    proc = run(*argv)
    assert proc.returncode == 2 and not proc.stdout, proc.stdout[-300:]
    assert proc.stderr.decode().splitlines()[-1].endswith(": an empty name names no file or template")


def test_serve_refuses_a_port_or_body_limit_out_of_range():
    # argparse's one line, exit 2 (the build before: uvicorn's OverflowError traceback for the
    # port; a negative body limit answered every request with 413)
    for args in (["--port", "99999"], ["--port", "-5"], ["--max-body-bytes", "-1"], ["--max-body-bytes", "0"]):
        proc = run("serve", "--pinned", *args)
        assert proc.returncode == 2 and b"Traceback" not in proc.stderr, proc.stderr[-500:]
        assert f"argument {args[0]}: must be".encode() in proc.stderr


def test_serve_without_its_extra_is_a_usage_error():
    # starlette / uvicorn missing: exit 2 with what to install, before any template loads (the
    # trial of session 57: exit 1, after loading, naming an extra PyPI does not have for a clone)
    code = (
        "import sys; sys.modules['uvicorn'] = None; from llamaprompt.cli import main; "
        "sys.exit(main(['serve', '--templates', '/nonexistent-folder']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2 and "pip install starlette uvicorn" in proc.stderr, proc.stderr[-500:]
    assert "nonexistent-folder" not in proc.stderr


@pytest.mark.parametrize(
    "argv, says",
    [
        (["serve", "--port", "1_000"], "argument --port: not an integer: '1_000'"),
        (["serve", "--port", "\uff18\uff18"], "argument --port: not an integer"),  # full-width digits
        (["diff", "a.json", "b.json", "--context", "-1"], "argument --context: must be >= 0"),
        (["render-dataset", "in.jsonl", "-o", "o.parquet", "--batch-rows", "0"], "argument --batch-rows: must be >= 1"),
        (["inspect", "m.gguf", "--max-array-items", "-1"], "argument --max-array-items: must be >= 0"),
    ],
)
def test_integer_options_take_plain_integers_in_range(argv, says, capsys):
    # (the second helper of session 55: --context -1 and --batch-rows 0 were taken, and int()'s
    # "1_000" or full-width digits for a port)
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2 and says in capsys.readouterr().err
