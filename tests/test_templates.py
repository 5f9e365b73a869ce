"""Every template shipped in the pinned tree loads and reports caps; props and sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import llamaprompt
from conftest import REPO, load_reference

CAPS_KEYS = {
    "supports_tools",
    "supports_tool_calls",
    "supports_system_role",
    "supports_parallel_tool_calls",
    "supports_preserve_reasoning",
    "supports_reasoning_effort",
    "supports_string_content",
    "supports_typed_content",
    "supports_object_arguments",
}


def test_pinned_tree_is_shipped():
    names = [p.name for p in llamaprompt.pinned_templates()]
    assert len(names) >= 55  # 70 in the pin; 58 in the tree of llama-cpp-python 0.3.30
    assert "Qwen-Qwen3-0.6B.jinja" in names


@pytest.mark.parametrize("path", llamaprompt.pinned_templates(), ids=lambda p: p.name)
def test_every_pinned_template_loads(path):
    tmpl = llamaprompt.ChatTemplate.from_file(path)
    caps = tmpl.caps
    # trees without jinja::caps::supports_reasoning_effort report the other eight keys
    expected = CAPS_KEYS if llamaprompt.features["caps_reasoning_effort"] else CAPS_KEYS - {"supports_reasoning_effort"}
    assert set(caps) == expected
    assert all(isinstance(v, bool) for v in caps.values())
    # every template renders a plain user turn
    prompt = tmpl.apply_template({"messages": [{"role": "user", "content": "Hello from a test"}]})
    assert "Hello from a test" in prompt


def test_props_shape(qwen3):
    props = qwen3.props()
    assert set(props) == {"chat_template", "chat_template_caps", "bos_token", "eos_token", "media_marker", "modalities"}
    assert props["modalities"] == {"vision": True, "video": True, "audio": True}  # media=True, the default
    assert props["chat_template_caps"] == qwen3.caps
    assert props["media_marker"] == "<__media__>"
    assert props["chat_template"] == qwen3.source
    assert qwen3.tool_use_source is None


def test_source_is_lexer_copy():
    # /props chat_template: CRLF -> LF and one trailing newline dropped (the lexer's copy)
    tmpl = llamaprompt.ChatTemplate("{{ 'a' }}\r\n{{ 'b' }}\n")
    assert tmpl.source == "{{ 'a' }}\n{{ 'b' }}"


def test_supports_thinking_follows_reasoning_flag():
    path = llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja")
    assert llamaprompt.ChatTemplate.from_file(path).supports_thinking is True
    assert llamaprompt.ChatTemplate.from_file(path, server_args=["--reasoning", "off"]).supports_thinking is False
    plain = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("google-gemma-2-2b-it.jinja"))
    assert plain.supports_thinking is False


def test_bos_stripped_only_with_add_bos():
    # Llama 3.x templates start with {{ bos_token }}; llama-server strips it when the vocab adds BOS
    src = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{{ eos_token }}"
    req = {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}
    assert llamaprompt.ChatTemplate(src, bos_token="<s>", eos_token="</s>").apply_template(req) == "<s>[user]x</s>"
    stripped = llamaprompt.ChatTemplate(src, bos_token="<s>", eos_token="</s>", add_bos=True, add_eos=True)
    assert stripped.apply_template(req) == "[user]x"


def test_media_marker_option():
    ref = load_reference("apply_template.json")
    req = ref["requests"]["image_then_text"]
    path = llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja")
    default = llamaprompt.ChatTemplate.from_file(path).apply_template(req)
    custom = llamaprompt.ChatTemplate.from_file(path, media_marker="<image>").apply_template(req)
    assert "<__media__>" in default and "<image>" not in default
    assert custom == default.replace("<__media__>", "<image>")


def test_remote_media_is_not_fetched(qwen3):
    # no network access from a render: an http(s) image still becomes the media marker
    req = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/none.png"}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ]
    }
    assert "<__media__>What is this?" in qwen3.apply_template(req)


def test_version_and_commit():
    # the commit the lock lists for the sdist the tree came from (the pin unless chosen otherwise)
    lock = json.loads((REPO / "third_party" / "llama.cpp.lock").read_text())
    source = llamaprompt.LLAMA_CPP_SOURCE
    if source.startswith("llama-cpp-python ") and source.endswith(" sdist"):
        version = source.split()[1]
        assert lock["versions"][version]["commit"] == llamaprompt.LLAMA_CPP_COMMIT
        if version == lock["source"]["version"]:
            assert llamaprompt.LLAMA_CPP_COMMIT == lock["commit"] == "0c1e57098"
    else:
        assert llamaprompt.LLAMA_CPP_COMMIT  # a checkout: its git commit, or "unknown"
    assert llamaprompt.__version__


def test_pinned_template_by_name_or_path():
    # pinned_templates() gives paths; each is accepted back, as a name with or without .jinja
    first = llamaprompt.pinned_templates()[0]
    assert llamaprompt.pinned_template(first) == first
    assert llamaprompt.pinned_template(first.name) == first == llamaprompt.pinned_template(first.stem)
    with pytest.raises(FileNotFoundError, match="no pinned template 'nope.jinja'"):
        llamaprompt.pinned_template(Path("/elsewhere/nope.jinja"))
    with pytest.raises(TypeError, match="not NoneType"):
        llamaprompt.pinned_template(None)  # type: ignore[arg-type]
