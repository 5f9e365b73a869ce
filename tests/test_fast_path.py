"""The analysis cache (cache_analysis=True, the default) changes no output: every template
x request of the reference set gives byte-identical ChatParams (every field, including the
full llama_params, grammar and serialized parser) through the cached path and through the
unmodified upstream sequence (cache_analysis=False), or the same error."""

from __future__ import annotations

import dataclasses

import pytest

import llamaprompt
from conftest import load_reference, template_path


def _names():
    try:
        return list(load_reference("apply_template.json")["variants"][0]["templates"])
    except pytest.skip.Exception:
        return []


def _outcome(t, request):
    try:
        p = t.apply(request)
    except llamaprompt.Error as e:
        return ("error", type(e).__name__, e.status, e.message)
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "_origin"}
    return ("ok", fields)


@pytest.mark.parametrize("name", _names())
def test_cached_analysis_changes_nothing(name):
    ref = load_reference("apply_template.json")
    tok = ref["model_tokens"]
    opts = dict(bos_token=tok["bos_token"], eos_token=tok["eos_token"], add_bos=tok["add_bos"], add_eos=tok["add_eos"])
    fast = llamaprompt.ChatTemplate.from_file(template_path(name), **opts)
    upstream = llamaprompt.ChatTemplate.from_file(template_path(name), cache_analysis=False, **opts)
    for _round in range(2):  # the second round is served from the cache
        for rname, request in ref["requests"].items():
            assert _outcome(fast, request) == _outcome(upstream, request), f"{name} / {rname}"
