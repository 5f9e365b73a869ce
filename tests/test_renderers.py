"""The third-party renderer adapters (llamaprompt.renderers) and diff --explain's causes.
Each adapter test skips, with the reason, when its renderer is not installed; CI installs all four."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import llamaprompt
from conftest import load_reference, template_path
from llamaprompt import explain as ex
from llamaprompt import fixtures as fx
from llamaprompt import renderers

ADAPTERS = [
    renderers.TransformersRenderer,
    renderers.Jinja2Renderer,
    renderers.MinijinjaRenderer,
    renderers.HFJinjaRenderer,
]


def _adapter(cls):
    try:
        return cls()
    except ImportError as e:
        if os.environ.get("LLAMAPROMPT_REQUIRE_RENDERERS"):  # CI installs all four
            pytest.fail(f"{e} (LLAMAPROMPT_REQUIRE_RENDERERS is set)", pytrace=False)
        pytest.skip(str(e))


@pytest.mark.parametrize("cls", ADAPTERS, ids=lambda c: c.name)
def test_adapter_renders_a_plain_chat_as_llama_server(cls):
    """A plain chat on Qwen3 has nothing llama.cpp changes: each renderer must give llama-server's
    recorded prompt; a broken template or context is an exception in its place, not a crash."""
    r = _adapter(cls)
    ref = load_reference("apply_template.json")
    case = ref["variants"][0]["templates"]["Qwen-Qwen3-0.6B.jinja"]["cases"]["system_multi_turn"]
    source = template_path("Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    request = ref["requests"]["system_multi_turn"]
    assert r.render_request(source, request, bos_token="<s>", eos_token="</s>") == case["prompt"]
    out = r.render_many([("{{ x", {}), (source, renderers.request_context(request))])
    assert isinstance(out[0], Exception) and out[1] == case["prompt"]
    assert r.version


def _t(name):
    return llamaprompt.ChatTemplate.from_file(template_path(name), bos_token="<s>", eos_token="</s>", add_bos=True)


HELLO = {"messages": [{"role": "user", "content": "Hello"}]}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_TURN = {
    "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
}


@pytest.mark.parametrize(
    ("name", "request_", "causes"),
    [
        # the template writes bos_token (kept by Jinja2) and thinking is off when undefined
        ("google-gemma-4-31B-it.jinja", HELLO, ["leading BOS", "thinking default"]),
        # bos_token, and "Today Date" from the template's fallback instead of llama.cpp's date_string
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", HELLO, ["leading BOS", "dates"]),
        # ... and `arguments | tojson` of the JSON text instead of the parsed object
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", TOOL_TURN, ["leading BOS", "object arguments", "dates"]),
        # a final assistant message: closed by Jinja2, open (prefill) by llama-server
        (
            "Qwen-Qwen3-0.6B.jinja",
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
            ["assistant prefill"],
        ),
        # developer -> system is llama.cpp's message preprocessing
        (
            "Qwen-Qwen3-0.6B.jinja",
            {"messages": [{"role": "developer", "content": "Be brief"}, {"role": "user", "content": "Hi"}]},
            ["message preprocessing"],
        ),
    ],
)
def test_explain_finds_the_cause_of_jinja2_differences(name, request_, causes):
    pytest.importorskip("jinja2")
    t = _t(name)
    reference = t.apply_template(request_)
    other = renderers.Jinja2Renderer().render_request(t.source, request_, bos_token="<s>", eos_token="</s>")
    assert other != reference
    assert ex.explain(t, request_, reference, other) == causes
    assert ex.spans(reference, other)


def test_explain_planted():
    t = _t("Qwen-Qwen3-0.6B.jinja")
    reference = t.apply_template(HELLO)
    assert ex.explain(t, HELLO, reference, "<s>" + reference) == ["leading BOS"]
    assert ex.explain(t, HELLO, reference, reference + "garbage") == ["unknown"]
    spans = ex.spans("abcdefghij", "abXdefghiYj", context=1)
    assert [
        (s["op"], s["reference_offset"], s["other_offset"], s["reference_text"], s["other_text"]) for s in spans
    ] == [
        ("replace", 2, 2, "c", "X"),
        ("insert", 9, 9, "", "Y"),
    ]
    # a changed date is one span, with exactly what changed
    one = ex.spans("Today Date: 01 Dec 2026\n", "Today Date: 26 Jul 2024\n")
    assert [(s["reference_text"], s["other_text"]) for s in one] == [("01 Dec 2026", "26 Jul 2024")]
    many = ex.spans("e" * 300, "E" + "e" * 9 + "E" + ("e" * 9 + "E") * 200, limit=5)
    assert many[-1]["omitted"] > 0 and len(many) == 6


def test_diff_explain_cli(tmp_path):
    pytest.importorskip("jinja2")
    names = ["Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja"]
    doc = fx.render_fixtures({n: _t(n) for n in names}, {"hello": HELLO, "tool_turn": TOOL_TURN}, progress=False)
    j = renderers.Jinja2Renderer()
    other: dict = {}
    for n, e in doc["templates"].items():
        jobs = [(e["chat_template"], renderers.request_context(doc["requests"][r], "<s>")) for r in e["cases"]]
        for r, out in zip(e["cases"], j.render_many(jobs)):
            other.setdefault(n, {})[r] = None if isinstance(out, Exception) else out  # null: "my renderer fails"
    ref_path, other_path = tmp_path / "ref.json", tmp_path / "other.json"
    fx.write_fixtures(doc, ref_path)
    other_path.write_text(json.dumps(other))
    cli = [sys.executable, "-m", "llamaprompt.cli", "diff", str(ref_path), str(other_path), "--explain"]
    proc = subprocess.run([*cli, "--format", "json"], capture_output=True)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    llama = report["templates"]["meta-llama-Llama-3.1-8B-Instruct.jinja"]["differences"]
    assert {d["request"]: d["causes"] for d in llama} == {
        "hello": ["leading BOS", "dates"],
        "tool_turn": ["leading BOS", "object arguments", "dates"],
    }
    assert all(len(d["spans"]) >= 2 for d in llama)  # every span, not only the first
    assert report["causes"] == {"leading BOS": 2, "dates": 2, "object arguments": 1}
    md = subprocess.run(cli, capture_output=True, text=True).stdout
    assert "cause: leading BOS, object arguments, dates" in md and "Causes of the differences" in md
