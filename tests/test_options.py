"""One options object for every way of making a template (constructors, with_caps, pickling,
the sandbox), defaults defined once, text helpers without import cycles, the resources folder."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from importlib import resources

import pytest

import llamaprompt
from conftest import template_path, vocab_gguf
from llamaprompt import options as opts_mod
from llamaprompt.options import Options
from llamaprompt.sandbox import UntrustedTemplate

TOKENS = {"bos_token", "eos_token", "add_bos", "add_eos"}
NON_DEFAULT = {
    "server_args": ("--reasoning", "off"),
    "media_marker": "<m>",
    "fetch_remote_media": True,
    "caps": {"supports_typed_content": True},
    "handler": "autoparser",
    "fast_path": False,
    "timeout": 7.5,
    "max_output_bytes": 1 << 20,
    "max_tools": 12,
    "media": ("image",),
}


def _keywords(fn) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


def test_constructors_take_exactly_the_options():
    names = set(Options.names())
    assert _keywords(llamaprompt.ChatTemplate.__init__) == names | TOKENS
    assert _keywords(llamaprompt.ChatTemplate.from_gguf) == names | {"chat_template"}
    # and the defaults are the Options defaults, not restated ones
    for fn in (llamaprompt.ChatTemplate.__init__, llamaprompt.ChatTemplate.from_gguf):
        params = inspect.signature(fn).parameters
        for f in dataclasses.fields(Options):
            default = f.default if f.default is not dataclasses.MISSING else None
            want = True if f.name == "media" else default
            assert params[f.name].default == want, (fn.__name__, f.name)


def test_every_option_survives_pickling_with_caps_and_the_sandbox():
    t = llamaprompt.ChatTemplate.from_file(
        template_path("Qwen-Qwen3-0.6B.jinja"), bos_token="<s>", add_bos=True, **NON_DEFAULT
    )
    want = Options.make(None, **NON_DEFAULT)
    assert t._opts == want
    again = pickle.loads(pickle.dumps(t))
    assert again._opts == want and again._tokens == t._tokens == ("<s>", "", True, False)
    forced = t.with_caps(supports_system_role=False)
    assert forced._opts == want.replace(None, caps={"supports_typed_content": True, "supports_system_role": False})
    assert forced._tokens == t._tokens
    request = {"messages": [{"role": "user", "content": "Hi"}]}
    with UntrustedTemplate.from_file(
        template_path("Qwen-Qwen3-0.6B.jinja"), bos_token="<s>", add_bos=True, **NON_DEFAULT
    ) as u:
        assert u._build[3] == want  # the sandbox ships the same object to its worker
        assert u.apply_template(request) == t.apply_template(request)
        assert u.props()["modalities"] == t.props()["modalities"] == {"vision": True, "video": False, "audio": False}


def test_gguf_options_survive_pickling():
    t = llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-phi-3.gguf"), media=False, max_tools=3)
    again = pickle.loads(pickle.dumps(t))
    assert again._opts == t._opts and again.gguf_path == t.gguf_path and again.bos_token == t.bos_token


def test_bad_options_are_refused_once_for_all_paths():
    for bad, exc in (
        ({"handler": "x"}, ValueError),
        ({"timeout": 0}, ValueError),
        ({"max_tools": -1}, ValueError),
        ({"server_args": "--jinja"}, TypeError),
        ({"media_marker": 1}, TypeError),
        ({"no_such_option": 1}, TypeError),
        ({"media": ["smell"]}, ValueError),
    ):
        with pytest.raises(exc):
            Options.make(None, **bad)
        with pytest.raises(exc):
            llamaprompt.ChatTemplate("{{ 'x' }}", **bad)
        with pytest.raises(exc):
            UntrustedTemplate("{{ 'x' }}", **bad)


def test_defaults_are_defined_once():
    from llamaprompt import sandbox, template

    assert sandbox.DEFAULT_TIMEOUT is opts_mod.DEFAULT_TIMEOUT
    assert sandbox.DEFAULT_MAX_OUTPUT_BYTES is opts_mod.DEFAULT_MAX_OUTPUT_BYTES
    assert llamaprompt.DEFAULT_MEDIA_MARKER is opts_mod.DEFAULT_MEDIA_MARKER
    assert tuple(llamaprompt._core.CAPS_KEYS) == template._CAPS_KEYS


def test_text_helpers_have_their_own_module():
    """utf8/fspath/request_body live in llamaprompt.text, which imports neither template nor
    params nor parse (the old template -> params -> parse -> template cycle is gone)."""
    import llamaprompt.gguf as gguf
    import llamaprompt.parse as parse
    import llamaprompt.text as text

    assert parse._utf8 is text.utf8 and gguf.__name__
    for module in (text, opts_mod):
        src = inspect.getsource(module)
        for other in ("template", "params", "parse", "sandbox"):
            assert f"from .{other} import" not in src and f"from . import {other}" not in src, (module, other)


def test_resources_folder_is_not_shadowed():
    import llamaprompt.data

    assert inspect.ismodule(llamaprompt.data) and hasattr(llamaprompt.data, "render_file")
    folder = resources.files("llamaprompt") / "resources"
    assert (folder / "requests.json").is_file() and (folder / "fixtures.schema.json").is_file()
    from llamaprompt.fixtures import default_requests

    assert default_requests()
