"""The fast path (fast_path=True, the default) changes no output.

For every template x request of the reference set, in both reference files (plain, and
the two llama-server flag variants), and over two rounds (the second is served from the
per-template analysis cache and the parser-input memo):
- apply() gives byte-identical ChatParams (every field, including the full llama_params,
  grammar and serialized parser) through the fast path and through the unmodified
  upstream sequence (fast_path=False), or the same error;
- apply_template() -- which takes the prompt-only path once the parser inputs are known --
  gives the same prompt or the same error, on a template that never ran apply() (so the
  memo is filled by apply_template's own full-path calls) and through
  apply_template_many() on two threads.
The fast path must actually have been taken, or these comparisons would prove nothing.
"""

from __future__ import annotations

import dataclasses

import pytest

import llamaprompt
from conftest import load_reference, reference_cases, template_path
from llamaprompt.pinned import pinned_templates

FILES = ("apply_template.json", "apply_template_server_args.json")


def _collect():
    out = []
    for file in FILES:
        ref = load_reference(file)
        for vi, variant in enumerate(ref["variants"]):
            for name in variant["templates"]:
                out.append(pytest.param(file, vi, name, id=f"{file.split('.')[0]}-{vi}-{name}"))
    return out


def _params_outcome(t, request):
    try:
        p = t.apply(request)
    except llamaprompt.Error as e:
        return ("error", type(e).__name__, e.status, e.message)
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "_origin"}
    return ("ok", fields)


def _prompt_outcome(result):
    if isinstance(result, llamaprompt.Error):
        return ("error", type(result).__name__, result.status, result.message)
    return ("ok", result)


def _prompt(t, request):
    try:
        return _prompt_outcome(t.apply_template(request))
    except llamaprompt.Error as e:
        return _prompt_outcome(e)


@pytest.mark.parametrize(("file", "variant", "name"), reference_cases(_collect, 3))
def test_fast_path_changes_nothing(file, variant, name):
    ref = load_reference(file)
    tok = ref["model_tokens"]
    opts = dict(
        bos_token=tok["bos_token"],
        eos_token=tok["eos_token"],
        add_bos=tok["add_bos"],
        add_eos=tok["add_eos"],
        server_args=ref["variants"][variant].get("server_args", []),
    )
    path = template_path(name)
    upstream = llamaprompt.ChatTemplate.from_file(path, fast_path=False, **opts)
    fast = llamaprompt.ChatTemplate.from_file(path, **opts)
    prompts_only = llamaprompt.ChatTemplate.from_file(path, **opts)
    many = llamaprompt.ChatTemplate.from_file(path, **opts)
    requests = list(ref["requests"].items())
    expected_prompts = [_prompt(upstream, request) for _, request in requests]
    for _round in range(2):
        for (rname, request), expected in zip(requests, expected_prompts):
            assert _params_outcome(fast, request) == _params_outcome(upstream, request), f"{name} / {rname}"
            assert _prompt(prompts_only, request) == expected, f"{name} / {rname} (apply_template)"
        got = many.apply_template_many([r for _, r in requests], threads=2, return_exceptions=True)
        assert [_prompt_outcome(g) for g in got] == expected_prompts, f"{name} (apply_template_many)"
    assert upstream._core.prompt_only_renders() == 0
    # every template that renders at least one request without error, on the autoparser path
    # or with a specialized handler that has a prompt-only stop point, serves its second round
    # from the memo; the other handlers always run in full
    d = prompts_only.describe()
    prompt_only = d.get("prompt_only_path", d.get("prompt_only_path_with_tools"))
    if prompt_only is not None and any(e[0] == "ok" for e in expected_prompts):
        if prompt_only:
            assert prompts_only._core.prompt_only_renders() > 0, name
            assert many._core.prompt_only_renders() > 0, name
        else:
            assert prompts_only._core.prompt_only_renders() == 0, name
    if d.get("specialized_handler"):  # the stop point passed is one the configure-time probe proved
        verdict = llamaprompt.tree_info()["prompt_only_handlers"][d["specialized_handler"]]
        assert verdict in ("prompt-only", "prompt-only after its generation prompt")


def test_fast_path_covers_the_specialized_handlers():
    """Which pinned templates take the prompt-only path: every autoparser-path template,
    and those whose specialized handler the probe proved -- all of the pinned tree's: ling3 and
    minimax-m3, which read the generation prompt after computing it, stop right after it."""
    covered, full, handlers = [], [], {}
    for path in pinned_templates():
        d = llamaprompt.ChatTemplate.from_file(path).describe()
        if "prompt_only_path" in d:
            (covered if d["prompt_only_path"] else full).append(path.name)
            handlers[path.name] = d.get("specialized_handler")
            if not llamaprompt.tree_info()["prompt_only_handlers"]:
                # a tree whose handlers are not in common/parsers (0.3.35 and older): no stop points
                assert d["prompt_only_path"] == d["autoparser"], path.name
    assert len(covered) + len(full) >= 65
    if not llamaprompt.tree_info()["prompt_only_handlers"]:
        return
    assert not full, full
    assert handlers["inclusionai-ling-3.0-flash.jinja"] == "common_chat_params_init_ling3"
    assert handlers["MiniMax-M3.jinja"] == "common_chat_params_init_minimax_m3"
    assert sum("gemma-4" in n for n in covered) == 2, covered  # after its prompt fix-up


def test_the_prompt_fix_up_of_a_handler_runs_on_the_prompt_only_path():
    """gemma4 appends "<|turn>model\\n" to a prompt that ends with "<turn|>\\n", right after its
    generation prompt (adapt_tree.py _prompt_fixup); its prompt-only path runs a copy of that
    block, then stops. llama-server's prompts for the interleaved Gemma 4 template (the reference
    file) where the block fired, and where it did not, come back byte for byte from that path."""
    verdict = llamaprompt.tree_info()["prompt_only_handlers"].get("common_chat_params_init_gemma4")
    if verdict is None:
        pytest.skip("this tree has no gemma4 handler file")
    assert verdict == "prompt-only"
    name = "google-gemma-4-31B-it-interleaved.jinja"
    ref = load_reference("apply_template.json")
    tok = ref["model_tokens"]
    t = llamaprompt.ChatTemplate.from_file(
        template_path(name), bos_token=tok["bos_token"], eos_token=tok["eos_token"], add_bos=tok["add_bos"],
        add_eos=tok["add_eos"],
    )
    cases = ref["variants"][0]["templates"][name]["cases"]
    fired = {
        key: c["prompt"]
        for key, c in cases.items()
        if c["status"] == 200 and c["prompt"].endswith("<turn|>\n<|turn>model\n")
    }
    plain = {key: c["prompt"] for key, c in cases.items() if c["status"] == 200 and key not in fired}
    assert len(fired) >= 5 and plain, (sorted(fired), sorted(plain))
    served = 0
    for key, expected in [*fired.items(), *plain.items()]:
        request = ref["requests"][key]
        messages = request.get("messages") or [{}]
        if not request.get("add_generation_prompt", True) or messages[-1].get("role") == "assistant":
            continue  # a continuation (the final assistant message is prefilled) runs the handler in full
        t.apply_template(request)  # fills the memo for these non-message inputs
        before = t._core.prompt_only_renders()
        assert t.apply_template(request) == expected, key
        served += t._core.prompt_only_renders() - before
        assert t._core.prompt_only_renders() == before + 1, key
    assert served >= len(fired)


# requests the autoparser path serves from generate_parser's stop point (adapt_tree.py
# generator_rewrite): a continued final message, and add_generation_prompt turned off
STOP_POINT_REQUESTS = [
    # (first request, a second one with other messages and the same non-message inputs)
    (
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "The first prime is"},
            ]
        },
    ),
    (
        {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"},
            ],
            "add_generation_prompt": False,
        },
    ),
]


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja"])
@pytest.mark.parametrize(("first", "second"), STOP_POINT_REQUESTS)
def test_continuation_and_no_generation_prompt_stop_before_the_parser(name, first, second):
    if llamaprompt.tree_info().get("prompt_only_generator") != "prompt-only":
        pytest.skip("this tree's generate_parser has no stop point: these requests run in full")
    path = template_path(name)
    fast = llamaprompt.ChatTemplate.from_file(path)
    upstream = llamaprompt.ChatTemplate.from_file(path, fast_path=False)
    assert fast.apply_template(first) == upstream.apply_template(first)  # the full path: the inputs learned
    before = fast._core.prompt_only_renders()
    assert fast.apply_template(second) == upstream.apply_template(second)
    assert fast._core.prompt_only_renders() == before + 1
    # apply() still runs in full: the parser and grammar are there
    assert fast.apply(second).parser == upstream.apply(second).parser != ""
