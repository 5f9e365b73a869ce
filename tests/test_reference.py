"""Every template x request recorded from llama-server: the same prompt byte for byte,
or the same error (status and message); the same caps."""

from __future__ import annotations

import pytest

import llamaprompt
from conftest import load_reference, mask_dates, reference_cases, reference_dir, template_path

FILES = ("apply_template.json", "apply_template_server_args.json")


def _collect():
    for fname in FILES:
        ref = load_reference(fname)
        for vi, variant in enumerate(ref["variants"]):
            for tname in variant["templates"]:
                args = " ".join(variant["server_args"]) or "default"
                yield pytest.param(fname, vi, tname, id=f"{fname.split('.')[0]}[{args}]-{tname}")


_loaded: dict = {}


def _template(fname: str, vi: int, tname: str) -> llamaprompt.ChatTemplate:
    key = (fname, vi, tname)
    if key not in _loaded:
        ref = load_reference(fname)
        tok = ref["model_tokens"]
        _loaded[key] = llamaprompt.ChatTemplate.from_file(
            template_path(tname),
            bos_token=tok["bos_token"],
            eos_token=tok["eos_token"],
            add_bos=tok["add_bos"],
            add_eos=tok["add_eos"],
            server_args=ref["variants"][vi]["server_args"],
            media_marker=ref["media_marker"],
        )
    return _loaded[key]


@pytest.mark.parametrize(("fname", "vi", "tname"), reference_cases(_collect, 3))
def test_reference_template(fname, vi, tname):
    ref = load_reference(fname)
    expected = ref["variants"][vi]["templates"][tname]
    tmpl = _template(fname, vi, tname)

    assert tmpl.caps == expected["caps"]

    mismatches = []
    for rname, case in expected["cases"].items():
        request = ref["requests"][rname]
        if case["status"] == 200:
            try:
                got = tmpl.apply_template(request)
            except llamaprompt.Error as e:
                mismatches.append(f"{rname}: expected a prompt, got {type(e).__name__}({e.status}): {e}")
                continue
            if mask_dates(got, ref["rendered_on"]) != case["prompt"]:
                mismatches.append(f"{rname}: prompt differs:\n got {got!r}\nwant {case['prompt']!r}")
        else:
            err = case["error"]
            with pytest.raises(llamaprompt.Error) as info:
                tmpl.apply_template(request)
            e = info.value
            cls = llamaprompt.RequestError if case["status"] == 400 else llamaprompt.TemplateError
            if not isinstance(e, cls) or e.status != case["status"] or e.message != err["message"]:
                mismatches.append(
                    f"{rname}: expected {cls.__name__}({case['status']}) {err['message']!r}, "
                    f"got {type(e).__name__}({e.status}) {e.message!r}"
                )
            elif e.to_json() != {"error": err}:
                mismatches.append(f"{rname}: error JSON {e.to_json()} != {err}")
    assert not mismatches, "\n".join(mismatches)


# templates recorded per llama.cpp commit (the reference READMEs): the pin, and 0.3.35's tree
RECORDED_TEMPLATES = {"0c1e57098": 50, "4df29be4f": 48}


def test_reference_counts():
    """The fixtures hold what their README says (guards against testing nothing)."""
    ref = load_reference("apply_template.json")
    templates = ref["variants"][0]["templates"]
    assert len(ref["requests"]) == 35
    assert sum(len(t["cases"]) for t in templates.values()) == len(templates) * 35
    commit = ref["llama_cpp_commit"]
    assert llamaprompt.LLAMA_CPP_COMMIT.startswith(commit[:9]) or commit.startswith(llamaprompt.LLAMA_CPP_COMMIT)
    if commit in RECORDED_TEMPLATES:
        assert len(templates) == RECORDED_TEMPLATES[commit]
    else:
        assert templates, f"no templates in {reference_dir()}"
