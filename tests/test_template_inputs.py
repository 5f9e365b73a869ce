"""ChatTemplate.template_inputs / render_inputs: the context llama.cpp hands its Jinja engine,
captured from its own call. Proof that the captured context is complete: llama.cpp's engine
(render_inputs) and Python's Jinja2, given it, reproduce llama-server's recorded prompts
(the reference fixtures) -- except where Jinja2 itself behaves differently, listed here and
in docs/oracle.md with the case."""

from __future__ import annotations

from pathlib import Path

import pytest

import llamaprompt
from conftest import load_reference, mask_dates, reference_cases, reference_template, template_path

FILES = ("apply_template.json", "apply_template_server_args.json")
PIN = llamaprompt.LLAMA_CPP_COMMIT.startswith("0c1e57098")  # the Jinja2 list below is the pin's
DOCS = Path(__file__).resolve().parent.parent / "docs" / "oracle.md"

#: templates plain Jinja2 cannot parse: the {% generation %} tag (transformers' extension)
JINJA2_CANNOT_PARSE = {
    "LFM2.5-8B-A1B.jinja",
    "poolside-Laguna-S-2.1.jinja",
    "poolside-Laguna-XS-2.1.jinja",
    "poolside-Laguna-XS.2.jinja",
}
TOOL_CASES = {
    "tools_question",
    "tool_call_only",
    "tool_call_with_text_json_result",
    "parallel_tool_calls",
    "tool_choice_none",
    "tool_choice_required",
    "typed_tool_result",
    "image_tool_call",
}
#: where Jinja2 renders llama.cpp's exact context differently (engine differences): the cases
JINJA2_ENGINE_DIFFERENCES = {
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": {"parallel_tool_calls", "tool_choice_required"},
    "GLM-4.6.jinja": {"typed_tool_result"},
    "GLM-4.7-Flash.jinja": {"typed_tool_result"},
    "fireworks-ai-llama-3-firefunction-v2.jinja": "all",
    "llama-cpp-deepseek-r1.jinja": TOOL_CASES,
    "meetkai-functionary-medium-v3.1.jinja": TOOL_CASES,
}


def _collect():
    for fname in FILES:
        ref = load_reference(fname)
        for vi, variant in enumerate(ref["variants"]):
            args = " ".join(variant["server_args"]) or "default"
            for name in variant["templates"]:
                yield pytest.param(fname, vi, name, id=f"{fname.split('.')[0]}[{args}]-{name}")


_template = reference_template


def _strip(out: str, tok: dict) -> str:
    """llama.cpp's BOS/EOS stripping of a render (the reference's model_tokens)."""
    if tok["add_bos"] and out.startswith(tok["bos_token"]):
        out = out[len(tok["bos_token"]) :]
    if tok["add_eos"] and out.endswith(tok["eos_token"]):
        out = out[: -len(tok["eos_token"])]
    return out


def _reproduces(out: str, inputs: dict, want: str) -> bool:
    return out == want if inputs["prompt_match"] == "exact" else want.startswith(out)


@pytest.mark.parametrize(("fname", "vi", "name"), reference_cases(_collect, 3))
def test_llama_cpp_engine_on_the_captured_context_is_the_servers_prompt(fname, vi, name):
    ref = load_reference(fname)
    variant = ref["variants"][vi]
    t = _template(ref, variant["server_args"], name)
    day, tok = ref["rendered_on"], ref["model_tokens"]
    found = 0
    for rname, case in variant["templates"][name]["cases"].items():
        request = ref["requests"][rname]
        if case["status"] != 200:
            with pytest.raises(llamaprompt.Error) as info:
                t.template_inputs(request)
            assert (info.value.status, info.value.message) == (case["status"], case["error"]["message"])
            continue
        inputs = t.template_inputs(request)
        assert mask_dates(inputs["prompt"], day) == case["prompt"], rname
        assert inputs["renders"] and all(isinstance(r["context"], dict) for r in inputs["renders"])
        if inputs["prompt_render"] is None:  # a handler rewrote the render's text
            continue
        found += 1
        render = inputs["renders"][inputs["prompt_render"]]
        assert inputs["context"] is render["context"]
        context = render["context"]
        assert context["bos_token"] == tok["bos_token"] and "messages" in context
        replay = t.render_inputs(context, variant=render["variant"], mark_input=render["mark_input"])
        assert replay == render["output"], rname
        assert _reproduces(mask_dates(_strip(replay, tok), day), inputs, case["prompt"]), rname
    assert found  # every template's prompts come from a render on most requests


def _jinja2_cases():
    ref = load_reference("apply_template.json")
    for name in ref["variants"][0]["templates"]:
        if name not in JINJA2_CANNOT_PARSE:
            yield pytest.param(name, id=name)


@pytest.mark.parametrize("name", reference_cases(_jinja2_cases))
def test_jinja2_on_the_captured_context_is_the_servers_prompt(name):
    """Jinja2 knows nothing of llama.cpp's preprocessing; given only template_inputs' context it
    must produce llama-server's prompt. Where it does not, the cause is Jinja2's own behaviour
    (listed above and in docs/oracle.md), and those cases must still differ (the list stays true)."""
    pytest.importorskip("jinja2")
    from llamaprompt.renderers import Jinja2Renderer

    jinja2 = Jinja2Renderer()
    ref = load_reference("apply_template.json")
    variant = ref["variants"][0]
    t = _template(ref, [], name)
    day, tok = ref["rendered_on"], ref["model_tokens"]
    expected_to_differ = JINJA2_ENGINE_DIFFERENCES.get(name, set())
    differing = set()
    compared = 0
    for rname, case in variant["templates"][name]["cases"].items():
        if case["status"] != 200:
            continue
        inputs = t.template_inputs(ref["requests"][rname])
        assert inputs["prompt_render"] is not None, rname
        render = inputs["renders"][inputs["prompt_render"]]
        source = t.tool_use_source if render["variant"] == "tool_use" else t.source
        compared += 1
        try:
            out = jinja2.render(source, render["context"])
        except Exception:  # noqa: BLE001 - Jinja2's errors of any kind are a difference
            differing.add(rname)
            continue
        if not _reproduces(mask_dates(_strip(out, tok), day), inputs, case["prompt"]):
            differing.add(rname)
    assert compared
    if expected_to_differ == "all":
        expected_to_differ = {r for r, c in variant["templates"][name]["cases"].items() if c["status"] == 200}
    if PIN:
        assert differing == expected_to_differ
    else:  # the list is the pin's; another tree's context may agree where the pin's does not
        assert differing <= expected_to_differ


def test_the_jinja2_differences_are_documented():
    text = DOCS.read_text(encoding="utf-8")
    for name in [*JINJA2_ENGINE_DIFFERENCES, *JINJA2_CANNOT_PARSE]:
        assert f"`{name}`" in text, name


def test_render_inputs_and_template_inputs_errors(qwen3):
    inputs = qwen3.template_inputs({"messages": [{"role": "user", "content": "Hi"}]})
    context = inputs["context"]
    # the context is the engine's: llama.cpp's extra context and, on trees whose server adds the
    # preserve_reasoning default kwarg (the pin's), the variables it sets
    assert context["enable_thinking"] is True and context["add_generation_prompt"] is True
    if PIN:
        assert context["preserve_reasoning"] is True and context["preserve_thinking"] is True
    assert qwen3.render_inputs({**context, "messages": [{"role": "user", "content": "Yo"}]}).startswith(
        "<|im_start|>user\nYo<|im_end|>"
    )
    with pytest.raises(llamaprompt.TemplateError):
        qwen3.render_inputs({"messages": 5})
    with pytest.raises(TypeError):
        qwen3.render_inputs([1])
    with pytest.raises(ValueError, match="variant"):
        qwen3.render_inputs(context, variant="x")
    with pytest.raises(llamaprompt.TemplateError, match="built-in"):
        llamaprompt.ChatTemplate.builtin("llama2").template_inputs({"messages": [{"role": "user", "content": "x"}]})
    # the template analysis' own probe renders are not this request's: a fresh template's first
    # call (analysis not cached) and its second give the same renders
    fresh = llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"))
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    assert fresh.template_inputs(body)["renders"] == fresh.template_inputs(body)["renders"]


@pytest.mark.server
def test_inputs_cli_fixtures_and_http(tmp_path):
    import json
    import subprocess
    import sys

    cli = [sys.executable, "-m", "llamaprompt.cli"]
    qwen = str(template_path("Qwen-Qwen3-0.6B.jinja"))
    t = llamaprompt.ChatTemplate.from_file(qwen)
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    req = tmp_path / "req.json"
    req.write_text(json.dumps(body))
    proc = subprocess.run([*cli, "inputs", "-t", qwen, str(req)], capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == t.template_inputs(body)
    proc = subprocess.run([*cli, "inputs", "-t", qwen, str(req), "--context-only"], capture_output=True)
    context = json.loads(proc.stdout)
    assert context == t.template_inputs(body)["context"]
    ctx = tmp_path / "ctx.json"
    ctx.write_text(json.dumps(context))
    proc = subprocess.run([*cli, "render-inputs", "-t", qwen, str(ctx)], capture_output=True)
    assert proc.returncode == 0 and proc.stdout.decode() == t.apply_template(body)
    # fixtures --with-inputs: the context next to each prompt, valid against the schema
    out = tmp_path / "f.json"
    reqs = tmp_path / "reqs.json"
    reqs.write_text(json.dumps({"hi": body, "bad": {"messages": [{"role": "user", "content": 5}]}}))
    proc = subprocess.run(
        [*cli, "fixtures", "-t", qwen, "--requests", str(reqs), "-o", str(out), "--with-inputs"], capture_output=True
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    cases = doc["templates"]["Qwen-Qwen3-0.6B.jinja"]["cases"]
    assert cases["hi"]["template_inputs"]["context"] == context and "template_inputs" not in cases["bad"]
    jsonschema = pytest.importorskip("jsonschema")
    from llamaprompt import fixtures as fx

    jsonschema.validate(doc, fx.schema())
    # HTTP: llamaprompt's own endpoints
    pytest.importorskip("starlette")
    import urllib.request

    from conftest import serving
    from llamaprompt.server import create_app

    with serving(create_app({"qwen": t})) as url:
        data = json.dumps(body).encode()
        with urllib.request.urlopen(urllib.request.Request(url + "/llamaprompt/template-inputs", data=data)) as r:
            assert json.loads(r.read())["context"] == context
        data = json.dumps({"context": context}).encode()
        with urllib.request.urlopen(urllib.request.Request(url + "/llamaprompt/render-inputs", data=data)) as r:
            assert json.loads(r.read()) == {"text": t.apply_template(body)}


def test_prompt_render_is_the_prompts_own_when_outputs_tie():
    """Ministral 3's generation prompt is empty, so with add_generation_prompt false the prompt
    and the generation-prompt render have one output: the prompt's render (the first) is chosen."""
    t = llamaprompt.ChatTemplate.from_file(template_path("mistralai-Ministral-3-14B-Reasoning-2512.jinja"))
    inputs = t.template_inputs({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False})
    assert inputs["prompt_match"] == "exact"
    assert "add_generation_prompt" not in inputs["context"]  # llama.cpp sets it only when true
