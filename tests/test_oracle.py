"""The reference oracle: fixtures -> check round trip, diff against planted differences,
and the model-free llama-server-compatible HTTP endpoint."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

import llamaprompt
from conftest import load_reference, mask_dates, serving, template_path, vocab_gguf
from llamaprompt import fixtures as fx

CLI = [sys.executable, "-m", "llamaprompt.cli"]
FEW = [
    "Qwen-Qwen3-0.6B.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "google-gemma-2-2b-it.jinja",
    "openai-gpt-oss-120b.jinja",
    "moonshotai-Kimi-K2.jinja",
]


@pytest.fixture(scope="module")
def few_doc():
    templates = {
        n: llamaprompt.ChatTemplate.from_file(template_path(n), bos_token="<s>", eos_token="</s>", add_bos=True)
        for n in FEW
    }
    return fx.render_fixtures(templates, progress=False)


def test_default_requests_cover_the_list():
    names = set(fx.default_requests())
    for want in (
        "plain_chat",
        "system",
        "multi_turn",
        "typed_text_parts",
        "tools",
        "tool_call_only",
        "tool_result_string",
        "tool_result_json",
        "parallel_tool_calls",
        "reasoning_only_turn",
        "reasoning_and_content",
        "enable_thinking_off",
        "reasoning_effort",
        "assistant_prefill",
        "developer_role",
        "empty_assistant_turn",
        "unicode_and_special_tokens",
        "image",
        "audio",
        "text_image_text",
    ):
        assert want in names


def test_fixtures_document_shape(few_doc):
    assert few_doc["schema"] == "llamaprompt-fixtures" and few_doc["schema_version"] == 1
    assert few_doc["llama_cpp_commit"] == llamaprompt.LLAMA_CPP_COMMIT
    entry = few_doc["templates"]["Qwen-Qwen3-0.6B.jinja"]
    assert entry["template_sha256"] == llamaprompt.ChatTemplate.from_file(template_path(FEW[0])).sha256
    assert entry["cases"]["plain_chat"]["status"] == 200
    err = entry["cases"]["error_content_number"]
    assert err == {
        "status": 400,
        "error": {
            "code": 400,
            "type": "invalid_request_error",
            "message": "Expected 'content' to be a string or an array",
        },
    }
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(few_doc, fx.schema())


def test_fixture_prompts_match_the_reference_server(few_doc):
    # the same template x request rendered by llama-server (fixtures of ../shared/reference)
    ref = load_reference("apply_template.json")
    req = ref["requests"]["system_multi_turn"]
    t = fx.template_from_entry(few_doc["templates"]["meta-llama-Llama-3.1-8B-Instruct.jinja"])
    want = ref["variants"][0]["templates"]["meta-llama-Llama-3.1-8B-Instruct.jinja"]["cases"]["system_multi_turn"]
    assert mask_dates(t.apply_template(req), ref["rendered_on"]) == want["prompt"]


def test_check_round_trip_and_planted_change(tmp_path, few_doc):
    path = tmp_path / "fx.json"
    fx.write_fixtures(few_doc, path)
    proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = sum(len(t["cases"]) for t in few_doc["templates"].values())
    assert f"{n} of {n} cases match" in proc.stdout
    bad = copy.deepcopy(few_doc)
    bad["templates"]["google-gemma-2-2b-it.jinja"]["cases"]["system"]["prompt"] += "!"
    fx.write_fixtures(bad, path)
    proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stdout.count("DIFFERS") == 1 and "google-gemma-2-2b-it.jinja / system" in proc.stdout


def test_check_names_the_file_that_is_not_json(tmp_path):
    # not JSON, and not UTF-8: one line naming the file, exit 2 (no traceback, no bare decoder message)
    for name, content in (("bad.json", b"{not json"), ("latin1.json", b'{"a": "\xe9"}')):
        path = tmp_path / name
        path.write_bytes(content)
        proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert f"{path}: not valid JSON" in proc.stderr, proc.stderr


def test_diff_reads_both_files_alike(tmp_path, few_doc):
    # REFERENCE and OTHER: a UTF-8 BOM and UTF-16 (PowerShell's `>`) read as json.loads reads them
    # on either side, and a file that is not JSON named in one line with exit 2, on either side
    # (the build before: the REFERENCE side refused what the OTHER side read, and OTHER's error was
    # labelled RequestError)
    plain = tmp_path / "plain.json"
    fx.write_fixtures(few_doc, plain)
    text = plain.read_text(encoding="utf-8")
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    utf16 = tmp_path / "utf16.json"
    utf16.write_bytes(text.encode("utf-16"))
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"{not json")
    n = len(few_doc["templates"])
    for ref, other in ((bom, plain), (plain, bom), (utf16, plain), (plain, utf16)):
        proc = subprocess.run([*CLI, "diff", str(ref), str(other), "--format", "json"], capture_output=True)
        assert proc.returncode == 0, (ref.name, other.name, proc.stderr[-2000:])
        report = json.loads(proc.stdout)
        assert report["templates_agree"] == report["templates_total"] == n
    for ref, other in ((bad, plain), (plain, bad)):
        proc = subprocess.run([*CLI, "diff", str(ref), str(other)], capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"llamaprompt: ValueError: {bad}: not valid JSON: Expecting "
            "property name enclosed in double quotes: line 1 column 2 (char 1)"
        ]


def test_diff_refuses_an_other_file_it_cannot_read(tmp_path, few_doc):
    # OTHER as a fixtures file of the wrong shape or schema_version, or not an object: one line
    # naming the file and what is wrong, exit 2 (the trial of session 54: AttributeError
    # tracebacks with exit 1, argparse's usage for a JSON array, and schema_version 999 compared
    # as if it were 1, where check refuses it)
    ref = tmp_path / "ref.json"
    fx.write_fixtures(few_doc, ref)
    name = next(iter(few_doc["templates"]))
    mutants = {
        "templates_int": (lambda d: d.update(templates=5), '"templates" is not an object'),
        "cases_text": (lambda d: d["templates"][name].update(cases="x"), f'template "{name}" is not an object'),
        "entry_null": (lambda d: d["templates"].update({name: None}), f'template "{name}" is not an object'),
        "version_999": (lambda d: d.update(schema_version=999), "schema_version 999 is not 1"),
        "array": (lambda d: d.clear(), "must be a JSON object"),
        "minimal_not_a_map": (lambda d: d.clear() or d.update(a=5), "template 'a' must map request names"),
        # a case: its error a number, no prompt for a 200, a status as text (session 54's second
        # helper: AttributeError tracebacks with exit 1, or a KeyError / TypeError not naming the file)
        "error_number": (lambda d: d["templates"][name]["cases"].update(x={"status": 500, "error": 5}), '"error" is'),
        "no_prompt": (lambda d: d["templates"][name]["cases"].update(x={"status": 200}), 'without a "prompt"'),
        "status_text": (lambda d: d["templates"][name]["cases"].update(x={"status": "200", "prompt": ""}), '"status"'),
        "schema_missing": (lambda d: d.pop("schema"), '"schema" is None'),
        # a case object without its status, or a case that is a number (the build before took
        # both as "no prompt", silently: a prompt it held was never compared)
        "no_status": (lambda d: d["templates"][name]["cases"].update(x={"prompt": "p"}), 'needs its "status"'),
        "case_number": (lambda d: d["templates"][name]["cases"].update(x=5), "expected a prompt string, null"),
        "minimal_no_status": (lambda d: d.clear() or d.update(a={"b": {"prompt": "p"}}), 'a/b: a case object needs'),
    }
    for label, (mutate, says) in mutants.items():
        doc: object = copy.deepcopy(few_doc)
        mutate(doc)
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps([] if label == "array" else doc), encoding="utf-8")
        proc = subprocess.run([*CLI, "diff", str(ref), str(path)], capture_output=True, text=True)
        assert proc.returncode == 2, (label, proc.stdout[-500:], proc.stderr[-2000:])
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"llamaprompt: ValueError: {path}: "), (label, lines)
        assert says in lines[0], (label, lines)


def test_diff_reports_a_prompt_with_a_lone_surrogate(tmp_path, few_doc):
    # a lone surrogate is valid JSON ("\ud800") but no UTF-8: the markdown report shows it as
    # U+FFFD and the difference is reported, exit 1 (the build before: UnicodeEncodeError, exit 2,
    # nothing printed)
    ref = tmp_path / "ref.json"
    fx.write_fixtures(few_doc, ref)
    name = next(iter(few_doc["templates"]))
    case = next(iter(few_doc["templates"][name]["cases"]))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({name: {case: "\ud800"}}), encoding="utf-8")
    proc = subprocess.run([*CLI, "diff", str(ref), str(other)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "\ufffd" in proc.stdout and case in proc.stdout


def test_check_refuses_a_fixtures_file_of_the_wrong_shape(tmp_path, few_doc):
    # the right "schema" with contents check cannot read: one line naming the file and what is
    # wrong, exit 2 (the build before: an AttributeError traceback and exit 1, check's "differs")
    name = next(iter(few_doc["templates"]))
    mutants = {
        "templates_list": lambda d: d.update(templates=[]),
        "requests_missing": lambda d: d.pop("requests"),
        "entry_not_object": lambda d: d["templates"].update({name: 1}),
        "cases_list": lambda d: d["templates"][name].update(cases=[]),
        "no_chat_template": lambda d: d["templates"][name].pop("chat_template"),
        "version_text": lambda d: d.update(schema_version=str(d["schema_version"])),
        "caps_null": lambda d: d["templates"][name].update(caps=None),
        "bos_number": lambda d: d["templates"][name].update(bos_token=5),
        "server_args_text": lambda d: d["templates"][name].update(server_args="x"),
        # the GGUF an entry came from (the build before: kind unread unless "gguf", then a
        # TypeError about os.PathLike for a numeric path, not naming the file)
        "kind_unknown": lambda d: d["templates"][name].update(kind="safetensors"),
        "path_number": lambda d: d["templates"][name].update(kind="gguf", path=5),
        # fields check prints or passes on (the trial of session 57: accepted, or printed as read)
        "options_number": lambda d: d.update(options=5),
        "load_errors_number": lambda d: d.update(load_errors=5),
        "commit_list": lambda d: d.update(llama_cpp_commit=[1]),
        "error_number": lambda d: d["templates"][name]["cases"].update(x={"status": 500, "error": 5}),
        "prompt_null": lambda d: d["templates"][name]["cases"].update(x={"status": 200, "prompt": None}),
        # a case whose request is not in "requests" (the trial of session 55: "KeyError: 'x'",
        # not naming the file)
        "no_request": lambda d: d["templates"][name]["cases"].update(x={"status": 200, "prompt": "p"}),
    }
    for label, mutate in mutants.items():
        doc = copy.deepcopy(few_doc)
        mutate(doc)
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(doc), encoding="utf-8")
        proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
        assert proc.returncode == 2, (label, proc.stdout[-500:], proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and str(path) in proc.stderr, (label, proc.stderr)
    # numbers past Python's limit for reading integers, and a long schema_version, said briefly
    # (the trial of session 57: Python's advice to call sys.set_int_max_str_digits(); the
    # version echoed whole)
    text = json.dumps(few_doc)
    for label, mutated in (
        ("digits", text.replace('"status": 200', '"status": ' + "9" * 5000, 1)),
        ("long_version", text.replace('"schema_version": 1', '"schema_version": ' + "7" * 400, 1)),
    ):
        path = tmp_path / f"{label}.json"
        path.write_text(mutated, encoding="utf-8")
        proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
        assert proc.returncode == 2 and str(path) in proc.stderr, (label, proc.stderr[-500:])
        assert "set_int_max_str_digits" not in proc.stderr and len(proc.stderr) < 300, (label, proc.stderr[-500:])


def test_check_names_another_commit_first(tmp_path, few_doc):
    path = tmp_path / "fx.json"
    fx.write_fixtures(few_doc, path)
    proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
    assert not proc.stdout.startswith("note:")  # made with this very build
    assert few_doc["llama_cpp_commit"] == llamaprompt.LLAMA_CPP_COMMIT
    assert few_doc["llama_cpp_source"] == llamaprompt.LLAMA_CPP_SOURCE
    other = copy.deepcopy(few_doc)
    other["llama_cpp_commit"] = "deadbeef0"
    fx.write_fixtures(other, path)
    proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
    first = proc.stdout.splitlines()[0]
    assert first.startswith("note: these fixtures were made with llama.cpp deadbeef0")
    assert llamaprompt.LLAMA_CPP_COMMIT in first


def test_fixtures_output_through_links_devices_and_stdout(tmp_path):
    # -o writes through a symbolic link (the link stays), into a FIFO or device in place, and -
    # is standard output; errors name the user's path (the trial of session 57: the file was
    # renamed over the link -- over /dev/stdout, run as root -- and errors named the temporary file)
    import os
    import threading

    fixtures = [*CLI, "fixtures", "--pinned", "Qwen-Qwen3-0.6B.jinja", "--no-progress", "-o"]
    (tmp_path / "real").mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "real" / "target.json")  # dangling: the target is created
    for _ in range(2):  # then replaced
        proc = subprocess.run([*fixtures, str(link)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert link.is_symlink() and fx.load_fixtures(tmp_path / "real" / "target.json")["templates"]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    proc = subprocess.run([*fixtures, str(fifo)], capture_output=True, text=True, timeout=120)
    reader.join(30)
    assert proc.returncode == 0, proc.stderr
    assert got and json.loads(got[0])["templates"] and fifo.is_fifo()
    proc = subprocess.run([*fixtures, "-"], capture_output=True, cwd=tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["schema"] == "llamaprompt-fixtures"
    assert not (tmp_path / "-").exists() and b"to standard output" in proc.stderr
    for name in ("nodir/x.json", "real", "nosuch/"):
        proc = subprocess.run([*fixtures, name], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 2 and f"'{name}'" in proc.stderr and ".tmp" not in proc.stderr, proc.stderr
    assert not (tmp_path / "nosuch").exists()
    # (the second trial of session 57) a name as long as a folder takes (the temporary file's
    # was longer); an existing file keeps its permission bits, and one with other hard links is
    # written in place, so every name sees the new text; a FIFO whose reader leaves early is an
    # error naming it (was: status 141, quietly, as for standard output)
    long_name = tmp_path / ("b" * 250)
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    kept.chmod(0o600)
    twin = tmp_path / "twin.json"
    os.link(kept, twin)
    for target in (long_name, kept):
        proc = subprocess.run([*fixtures, str(target)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    assert fx.load_fixtures(long_name)["templates"] and fx.load_fixtures(twin)["templates"]
    assert kept.stat().st_mode & 0o777 == 0o600
    early = tmp_path / "early"
    os.mkfifo(early)

    def read_a_little():
        with open(early, "rb") as f:
            got.append(f.read(10))

    got.clear()
    reader = threading.Thread(target=read_a_little, daemon=True)
    reader.start()
    more = [*CLI, "fixtures", "--pinned", *FEW[:3], "--with-inputs", "--no-progress", "-o"]  # (past a pipe's buffer)
    proc = subprocess.run([*more, str(early)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "BrokenPipeError" in proc.stderr and str(early) in proc.stderr, proc.stderr


def test_check_reports_a_template_that_no_longer_loads_once(tmp_path, few_doc):
    # one line per template that does not load now, its cases counted as not matching (the trial
    # of session 57: 22 lines of "now error 500" for one template); nothing to check is no pass;
    # a GGUF path that is no file (a FIFO) is not opened, the recorded text is rendered
    import os

    name = next(iter(few_doc["templates"]))
    n = len(few_doc["templates"][name]["cases"])
    total = sum(len(e["cases"]) for e in few_doc["templates"].values())
    doc = copy.deepcopy(few_doc)
    doc["templates"][name]["server_args"] = ["--no-such-flag"]
    path = tmp_path / "fx.json"
    fx.write_fixtures(doc, path)
    proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
    differs = [line for line in proc.stdout.splitlines() if line.startswith("DIFFERS")]
    assert proc.returncode == 1 and len(differs) == 1, proc.stdout[-2000:]
    assert f"DIFFERS {name}: does not load now (ServerArgsError: " in differs[0] and f"its {n} cases" in differs[0]
    assert f"{total - n} of {total} cases match" in proc.stdout
    result = fx.check_fixtures(doc, progress=False)
    assert not result.ok and result.mismatched == n and result.checked == total

    empty = copy.deepcopy(few_doc)
    empty["templates"] = {}
    fx.write_fixtures(empty, path)
    proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 1 and "NOTHING CHECKED" in proc.stdout and "0 of 0 cases match" in proc.stdout

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for odd in (str(fifo), "/" + "x" * 5000):  # no file to open: the recorded text is rendered
        doc = copy.deepcopy(few_doc)
        doc["templates"][name].update(kind="gguf", path=odd)
        fx.write_fixtures(doc, path)
        proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    # llama.cpp's usage text after an argument's error stays off the line; a core that is not
    # installed is check's error, not every template's (the second trial of session 57)
    doc = copy.deepcopy(few_doc)
    doc["templates"][name]["server_args"] = ["--ctx-size", "abc"]
    fx.write_fixtures(doc, path)
    proc = subprocess.run([*CLI, "check", str(path), "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 1 and len(proc.stdout.splitlines()) == 2, proc.stdout[-3000:]
    fx.write_fixtures(few_doc, path)
    proc = subprocess.run(
        [*CLI, "check", str(path), "--no-progress", "--llama-cpp", "0.3.99"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "DIFFERS" not in proc.stdout and "CoreError" in proc.stderr


def test_check_and_diff_read_standard_input(tmp_path, few_doc):
    path = tmp_path / "fx.json"
    fx.write_fixtures(few_doc, path)
    total = sum(len(e["cases"]) for e in few_doc["templates"].values())
    data = path.read_bytes()
    proc = subprocess.run([*CLI, "check", "-", "--no-progress"], input=data, capture_output=True)
    assert proc.returncode == 0 and f"{total} of {total} cases match".encode() in proc.stdout, proc.stderr
    proc = subprocess.run([*CLI, "diff", "-", str(path)], input=data, capture_output=True)
    assert proc.returncode == 0 and b"templates agree" in proc.stdout, proc.stderr
    proc = subprocess.run([*CLI, "diff", "-", "-"], input=data, capture_output=True, text=False)
    assert proc.returncode == 2 and b"cannot both be -" in proc.stderr
    proc = subprocess.run([*CLI, "check", "-"], input=b"{bad", capture_output=True)
    assert proc.returncode == 2 and b"ValueError: standard input: not valid JSON" in proc.stderr


def test_check_mask_dates(few_doc):
    doc = copy.deepcopy(few_doc)
    case = doc["templates"]["meta-llama-Llama-3.1-8B-Instruct.jinja"]["cases"]["plain_chat"]
    assert "Today Date: " in case["prompt"]
    import re

    case["prompt"] = re.sub(r"Today Date: [^\n]*", "Today Date: 01 Jan 2001", case["prompt"])
    assert not fx.check_fixtures(doc, progress=False).ok
    assert fx.check_fixtures(doc, mask=True, progress=False).ok


def test_diff_names_exactly_the_planted_differences(few_doc):
    other = {t: {r: c.get("prompt") for r, c in e["cases"].items()} for t, e in few_doc["templates"].items()}
    other["Qwen-Qwen3-0.6B.jinja"]["tools"] = other["Qwen-Qwen3-0.6B.jinja"]["tools"].replace("<tools>", "<TOOLS>", 1)
    p = other["google-gemma-2-2b-it.jinja"]["multi_turn"]
    other["google-gemma-2-2b-it.jinja"]["multi_turn"] = p[:10] + "X" + p[11:]
    del other["moonshotai-Kimi-K2.jinja"]["audio"]
    report = fx.diff_fixtures(few_doc, other, context=5)
    assert report["summary"] == "3 of 5 templates agree"
    diffs = {(t, d["request"]) for t, e in report["templates"].items() for d in e["differences"]}
    assert diffs == {("Qwen-Qwen3-0.6B.jinja", "tools"), ("google-gemma-2-2b-it.jinja", "multi_turn")}
    gemma = report["templates"]["google-gemma-2-2b-it.jinja"]["differences"][0]
    assert gemma["offset"] == 10 and "X" in gemma["other"]
    qwen = report["templates"]["Qwen-Qwen3-0.6B.jinja"]["differences"][0]
    ref_prompt = few_doc["templates"]["Qwen-Qwen3-0.6B.jinja"]["cases"]["tools"]["prompt"]
    assert qwen["offset"] == ref_prompt.index("<tools>") + 1
    assert report["templates"]["moonshotai-Kimi-K2.jinja"]["missing"] == ["audio"]
    md = fx.diff_markdown(report)
    assert md.startswith("**3 of 5 templates agree**") and "first difference at offset 10" in md


def test_diff_caps_side_by_side(tmp_path, few_doc):
    other = copy.deepcopy(few_doc)
    other["templates"]["Qwen-Qwen3-0.6B.jinja"]["caps"]["supports_typed_content"] = True
    report = fx.diff_fixtures(few_doc, other)
    assert report["summary"] == "4 of 5 templates agree"
    caps = report["templates"]["Qwen-Qwen3-0.6B.jinja"]["caps"]
    assert caps["differ"] == {"supports_typed_content": {"reference": False, "other": True}}
    ref_path, other_path = tmp_path / "ref.json", tmp_path / "other.json"
    fx.write_fixtures(few_doc, ref_path)
    fx.write_fixtures(other, other_path)
    proc = subprocess.run([*CLI, "diff", str(ref_path), str(other_path), "--format", "json"], capture_output=True)
    assert proc.returncode == 1 and json.loads(proc.stdout)["templates_agree"] == 4


def test_fixtures_cli(tmp_path):
    reqs = tmp_path / "r.json"
    reqs.write_text(json.dumps({"hi": {"messages": [{"role": "user", "content": "hi"}]}}))
    out = tmp_path / "o.json"
    proc = subprocess.run(
        [
            *CLI,
            "fixtures",
            "-t",
            str(template_path(FEW[0])),
            str(template_path(FEW[2])),
            "--gguf",
            str(vocab_gguf("ggml-vocab-phi-3.gguf")),
            "--requests",
            str(reqs),
            "-o",
            str(out),
            "--",
            "--reasoning",
            "off",
        ],
        capture_output=True,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert list(doc["templates"]) == [FEW[0], FEW[2], "ggml-vocab-phi-3.gguf"]
    assert doc["templates"]["ggml-vocab-phi-3.gguf"]["kind"] == "gguf"
    assert doc["options"]["server_args"] == ["--reasoning", "off"]
    assert doc["templates"][FEW[0]]["cases"]["hi"]["prompt"].endswith("<think>\n\n</think>\n\n")


# ---------------------------------------------------------------------------------------
# HTTP endpoint


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("starlette", reason="the HTTP server tests need the server extra (starlette, uvicorn)")
    pytest.importorskip("uvicorn", reason="the HTTP server tests need the server extra (starlette, uvicorn)")
    from llamaprompt.server import create_app

    ref = load_reference("apply_template.json")
    tok = ref["model_tokens"]
    templates = {
        name: llamaprompt.ChatTemplate.from_file(
            template_path(name),
            bos_token=tok["bos_token"],
            eos_token=tok["eos_token"],
            add_bos=tok["add_bos"],
            add_eos=tok["add_eos"],
        )
        for name in ref["variants"][0]["templates"]
    }
    templates["phi3.gguf"] = llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-phi-3.gguf"))
    with serving(create_app(templates, max_body_bytes=64 * 1024)) as url:
        yield url


def _http(url, body=None, raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_reference_requests(server):
    ref = load_reference("apply_template.json")
    jobs = [(t, r, c) for t, e in ref["variants"][0]["templates"].items() for r, c in e["cases"].items()]

    def one(job):
        tname, rname, case = job
        status, body = _http(f"{server}/apply-template?model={tname}", ref["requests"][rname])
        if status != case["status"]:
            return f"{tname}/{rname}: status {status} != {case['status']}"
        if status == 200 and mask_dates(body["prompt"], ref["rendered_on"]) != case["prompt"]:
            return f"{tname}/{rname}: prompt differs"
        if status != 200 and body != {"error": case["error"]}:
            return f"{tname}/{rname}: error {body} != {case['error']}"
        return None

    with ThreadPoolExecutor(max_workers=8) as pool:  # concurrent requests
        problems = [p for p in pool.map(one, jobs) if p]
    assert not problems, "\n".join(problems[:20])
    assert len(jobs) == len(ref["variants"][0]["templates"]) * 35 and len(jobs) >= 40 * 35


def test_server_model_field_props_health_and_errors(server):
    ref = load_reference("apply_template.json")
    body = dict(ref["requests"]["basic"], model="google-gemma-2-2b-it.jinja")
    status, out = _http(f"{server}/apply-template", body)
    assert status == 200
    assert out["prompt"] == ref["variants"][0]["templates"]["google-gemma-2-2b-it.jinja"]["cases"]["basic"]["prompt"]
    status, props = _http(f"{server}/props?model=Qwen-Qwen3-0.6B.jinja")
    assert (
        status == 200
        and props["chat_template_caps"] == ref["variants"][0]["templates"]["Qwen-Qwen3-0.6B.jinja"]["caps"]
    )
    assert props["bos_token"] == "<s>" and props["media_marker"] == "<__media__>"
    assert _http(f"{server}/health") == (200, {"status": "ok"})
    status, models = _http(f"{server}/v1/models")
    # the recorded templates, and the GGUF one this fixture serves
    assert status == 200 and len(models["data"]) == len(ref["variants"][0]["templates"]) + 1
    status, err = _http(f"{server}/apply-template?model=nope", ref["requests"]["basic"])
    assert status == 404 and err["error"]["type"] == "not_found_error"
    status, err = _http(f"{server}/apply-template", raw=b'{"messages": [')
    assert status == 500 and "parse error" in err["error"]["message"]
    status, err = _http(f"{server}/apply-template", raw=b'{"messages": "' + b"x" * 100_000 + b'"}')
    assert status == 413


def test_server_tokenize(server):
    t = llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-phi-3.gguf"))
    status, out = _http(f"{server}/tokenize?model=phi3.gguf", {"content": "Hello <|user|>", "add_special": True})
    assert status == 200 and out["tokens"] == t.tokenize("Hello <|user|>", add_special=True).tolist()
    status, back = _http(f"{server}/detokenize?model=phi3.gguf", {"tokens": out["tokens"]})
    assert status == 200 and "Hello" in back["content"]
    status, pieces = _http(f"{server}/tokenize?model=phi3.gguf", {"content": "Hi", "with_pieces": True})
    assert status == 200 and all({"id", "piece"} <= set(p) for p in pieces["tokens"])
    status, err = _http(f"{server}/tokenize?model=Qwen-Qwen3-0.6B.jinja", {"content": "x"})
    assert status == 501
    # no model named (or a body whose "model" is unread: no JSON): the first GGUF-served model,
    # not the first model, which has no vocab (the trial of session 57: 501 for such bodies)
    assert _http(f"{server}/tokenize", {"content": "Hi"}) == (200, {"tokens": t.tokenize("Hi").tolist()})
    status, err = _http(f"{server}/detokenize", raw=b"{bad")
    assert status == 500 and err["error"]["message"].startswith("[json.exception.parse_error.101] parse error")


def test_server_tokenize_without_the_handlers_in_the_tree(server, monkeypatch):
    # a tree without post_tokenize / post_detokenize (adapt_tree.py: the feature absent): 501,
    # saying what the tree lacks
    from llamaprompt import tree

    monkeypatch.setitem(tree.features, "serve_tokenize", False)
    for path in ("tokenize", "detokenize"):
        status, err = _http(f"{server}/{path}?model=phi3.gguf", {"content": "hi", "tokens": [1]})
        assert status == 501 and f"POST /{path} is not available" in err["error"]["message"]
        assert "post_tokenize and post_detokenize" in err["error"]["message"]


def test_server_tokenize_reads_bodies_as_llama_server(server):
    # llama-server's post_tokenize / post_detokenize (server-context.cpp): flags of the wrong type
    # take their defaults (json_value), content may mix strings and ids (tokenize_mixed: BOS only
    # for a first string), a body that is no object has no content, nlohmann's exceptions are
    # 500s with its message; each checked against the pinned tree's llama-server in session 55
    # (the build before: BOS added for "add_special": "false", 400 for mixed content, 500 for [1],
    # 400 for bad tokens, a lone surrogate tokenized)
    t = llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-phi-3.gguf"))
    hi = t.tokenize("hi", add_special=False).tolist()
    bos = t.tokenize("", add_special=True).tolist()
    assert len(bos) == 1

    def tok(body=None, raw=None):
        return _http(f"{server}/tokenize?model=phi3.gguf", body, raw)

    for flag in ("false", 1, None, [True]):
        assert tok({"content": "hi", "add_special": flag}) == (200, {"tokens": hi})
    assert tok({"content": "hi", "add_special": True}) == (200, {"tokens": bos + hi})
    assert tok({"content": "hi", "with_pieces": "no"}) == (200, {"tokens": hi})
    assert tok({"content": [5, "hi"], "add_special": True}) == (200, {"tokens": [5, *hi]})
    assert tok({"content": ["hi", 5, "hi"], "add_special": True}) == (200, {"tokens": bos + hi + [5] + hi})
    assert tok({"content": [True, 2.7, 2**32 + 1, 99999]}) == (200, {"tokens": [1, 2, 1, 99999]})  # unchecked ids
    for body in ([1], "x", {}):
        assert tok(body) == (200, {"tokens": []})
    for content, says in ((5, "string, but is number"), (None, "string, but is null"), ([None], "number, but is null")):
        status, err = tok({"content": content})
        assert status == 500 and err["error"]["message"] == f"[json.exception.type_error.302] type must be {says}"
    utf16 = '{"content": "hi"}'.encode("utf-16")  # Python's reader takes it; nlohmann's does not
    for raw in (b'{"content": "\\ud800"}', b'{"content": NaN}', b"{bad", utf16, b'{"content": "hi"} x'):
        status, err = tok(raw=raw)
        assert status == 500 and err["error"]["message"].startswith("[json.exception.parse_error.101] parse error")
    for number in ("1e400", "1" + "0" * 400):  # past a double (the second, an integer, read as one)
        status, err = tok(raw=b'{"content": [%s]}' % number.encode())
        assert status == 500 and err["error"]["message"] == (
            f"[json.exception.out_of_range.406] number overflow parsing '{number}'"
        )
    assert tok(raw=b'\xef\xbb\xbf{"content": "hi"}') == (200, {"tokens": hi})  # a UTF-8 BOM is skipped
    assert tok({"content": [1e10, -1e10, 3.9]}) == (200, {"tokens": [-(2**31), -(2**31), 3]})  # x86-64's cast

    def detok(body):
        return _http(f"{server}/detokenize?model=phi3.gguf", body)

    assert detok([1]) == detok({}) == (200, {"content": ""})
    assert detok({"tokens": [*hi, 2.7]}) == detok({"tokens": [*hi, 2]})
    n = t.vocab_size
    for bad, shown in ((n, n), (-1, 2**64 - 1)):
        status, err = detok({"tokens": [*hi, bad]})
        assert (status, err) == tok({"content": [bad], "with_pieces": True})  # the same lookup
        assert status == 500 and err["error"]["message"] == (
            f"vector::_M_range_check: __n (which is {shown}) >= this->size() (which is {n})"
        )
    for tokens, says in ((None, "array, but is null"), (["a"], "number, but is string")):
        status, err = detok({"tokens": tokens})
        assert status == 500 and err["error"]["message"] == f"[json.exception.type_error.302] type must be {says}"
    # bodies deeper than Python's JSON reader are read by llama.cpp's, as llama-server reads them
    # (observed on the pinned llama-server in session 56; the build before answered 400 "request
    # is nested too deeply" to each)
    deep = b"[" * 5000 + b"]" * 5000
    status, err = tok(raw=b'{"content": %s}' % deep)
    assert status == 500
    assert err["error"]["message"] == "[json.exception.type_error.302] type must be number, but is array"
    assert tok(raw=b'{"tokens": %s}' % deep) == (200, {"tokens": []})
    assert tok(raw=b'{"x": %s, "content": "hi"}' % deep) == (200, {"tokens": hi})
    assert _http(f"{server}/detokenize?model=phi3.gguf", raw=b'{"x": %s}' % deep) == (200, {"content": ""})


def test_new_user_findings(tmp_path, few_doc, server):
    # a null case in a schema-form OTHER means "my renderer rejects it"
    other = copy.deepcopy(few_doc)
    other["templates"]["Qwen-Qwen3-0.6B.jinja"]["cases"]["error_content_number"] = None
    other["templates"]["Qwen-Qwen3-0.6B.jinja"]["cases"]["plain_chat"] = None
    report = fx.diff_fixtures(few_doc, other)
    diffs = [d["request"] for d in report["templates"]["Qwen-Qwen3-0.6B.jinja"]["differences"]]
    assert diffs == ["plain_chat"]
    assert "no prompt (null)" in fx.diff_markdown(report)
    # a request body that is not an object goes to llama.cpp, which answers as llama-server
    t = llamaprompt.ChatTemplate.from_file(template_path(FEW[0]))
    doc = fx.render_fixtures({"q": t}, {"num": 5, "list": [1]}, progress=False)
    assert {c["status"] for c in doc["templates"]["q"]["cases"].values()} <= {400, 500}
    # check reports caps changes and where a prompt changed
    bad = copy.deepcopy(few_doc)
    bad["templates"][FEW[0]]["caps"]["supports_tools"] = False
    bad["templates"][FEW[0]]["cases"]["system"]["prompt"] = "X" + bad["templates"][FEW[0]]["cases"]["system"]["prompt"]
    lines = fx.check_fixtures(bad, progress=False).describe()
    assert any("caps" in line and "supports_tools" in line for line in lines)
    assert any("first difference at offset 0" in line for line in lines)
    # --pinned NAME...
    out = tmp_path / "p.json"
    proc = subprocess.run([*CLI, "fixtures", "--pinned", FEW[0], FEW[2], "-o", str(out)], capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert list(json.loads(out.read_text())["templates"]) == [FEW[0], FEW[2]]
    # the endpoint answers unknown paths, methods and models with llama-server's error JSON
    assert _http(f"{server}/nope")[0] == 404 and "error" in _http(f"{server}/nope")[1]
    req = urllib.request.Request(f"{server}/apply-template")
    try:
        urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as e:
        assert e.code == 405 and json.loads(e.read())["error"]["code"] == 405
    status, err = _http(f"{server}/props?model=nope")
    assert status == 404 and "Qwen-Qwen3-0.6B.jinja" in err["error"]["message"]


def test_fixtures_cli_several_dirs_and_a_broken_template(tmp_path):
    """--templates twice keeps both folders (it once kept the last); a template llama.cpp cannot
    load becomes a load_errors entry naming its file, the others are still rendered, exit 1."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "one.jinja").write_text(template_path(FEW[0]).read_text())
    (b / "two.jinja").write_text(template_path(FEW[2]).read_text())
    (b / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    reqs = tmp_path / "r.json"
    reqs.write_text(json.dumps({"hi": {"messages": [{"role": "user", "content": "hi"}]}}))
    out = tmp_path / "o.json"
    cmd = [*CLI, "fixtures", "--templates", str(a), "--templates", str(b), "--requests", str(reqs), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(out.read_text())
    assert sorted(doc["templates"]) == ["one.jinja", "two.jinja"]
    err = doc["load_errors"]["broken.jinja"]
    assert (
        err["path"] == str(b / "broken.jinja") and err["error"]["type"] == "TemplateError" and err["error"]["message"]
    )
    assert str(b / "broken.jinja") in proc.stderr and "loaded 2 of 3 templates (1 found in" in proc.stderr
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, fx.schema())
    missing = subprocess.run(
        [*CLI, "fixtures", "--templates", str(tmp_path / "nope"), "-o", str(out)], capture_output=True
    )
    assert missing.returncode == 2 and b"not a directory" in missing.stderr


def test_diff_lists_what_only_other_has(few_doc):
    other = {t: {r: c.get("prompt") for r, c in e["cases"].items()} for t, e in few_doc["templates"].items()}
    other["my-own.jinja"] = {"plain_chat": "x"}
    other[FEW[0]]["my_request"] = "y"
    report = fx.diff_fixtures(few_doc, other)
    assert report["summary"] == "5 of 5 templates agree"
    assert report["only_in_other"] == ["my-own.jinja"] and report["templates"][FEW[0]]["only_in_other"] == [
        "my_request"
    ]
    md = fx.diff_markdown(report)
    assert "in OTHER only (no reference): my-own.jinja" in md and "my_request" in md


def test_fixtures_cli_non_utf8_and_same_named_failures(tmp_path):
    """A template file in another encoding loads (llama.cpp takes bytes) and is written with
    U+FFFD where JSON cannot hold its bytes, as llama-server's JSON; two failed files of one
    name get two entries; the output file is written whole or not at all."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "latin1.jinja").write_bytes(b'{{ "caf\xe9" }}{% for m in messages %}{{ m.content }}{% endfor %}')
    (a / "broken.jinja").write_text("{% if %}")
    (b / "broken.jinja").write_text("{{ x")
    out = tmp_path / "o.json"
    out.write_text("previous")
    proc = subprocess.run(
        [*CLI, "fixtures", "--templates", str(a), "--templates", str(b), "-o", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert sorted(doc["load_errors"]) == ["broken.jinja", "broken.jinja#2"]
    assert "loaded 1 of 3 templates" in proc.stderr
    prompt = doc["templates"]["latin1.jinja"]["cases"]["plain_chat"]["prompt"]
    assert prompt.startswith("caf\ufffd")
    # a run that fails before writing leaves the previous file as it was
    bad = tmp_path / "bad-requests.json"
    bad.write_text('{"x": 5}')
    proc = subprocess.run([*CLI, "fixtures", "--templates", str(a), "--requests", str(bad), "-o", str(out)])
    assert proc.returncode == 2 and json.loads(out.read_text(encoding="utf-8")) == doc


def test_check_agrees_with_its_own_recording_of_a_prompt_that_is_no_utf8(tmp_path):
    # slicing "é" (two bytes) by byte gives a prompt of one byte that is no UTF-8: the fixtures
    # file holds U+FFFD for it (as llama-server's JSON does), and check compares the re-rendered
    # prompt as the file holds it (the trial of session 55: "0 of 1 cases match")
    t = llamaprompt.ChatTemplate("{{ messages[0].content[1:2] }}")
    request = {"messages": [{"role": "user", "content": "h\u00e9llo"}]}
    assert t.apply_template(request).encode("utf-8", "surrogateescape") == "\u00e9".encode()[:1]
    path = tmp_path / "fx.json"
    fx.write_fixtures(fx.render_fixtures({"slice": t}, {"r": request}, progress=False), path)
    doc = fx.load_fixtures(path)
    assert doc["templates"]["slice"]["cases"]["r"]["prompt"] == "\ufffd"
    result = fx.check_fixtures(doc, progress=False)
    assert result.checked == 1 and result.ok, result.describe()
    doc["templates"]["slice"]["cases"]["r"]["prompt"] = "?"  # and a recording that differs still differs
    assert not fx.check_fixtures(doc, progress=False).ok
