"""The media switch: llama-server with and without a multimodal projector (media=, --no-media).

Expected behaviour comes from llama.cpp's own code: tools/server/server-common.cpp refuses a
media part whose kind the projector does not support with "<kind> input is not supported -
hint: if this is unexpected, you may need to provide the mmproj" (a std::runtime_error, so
HTTP 500), and GET /props reports ``modalities`` from the same flags."""

from __future__ import annotations

import json
import pickle
import urllib.error
import urllib.request

import pytest

import llamaprompt
from conftest import load_reference, serving, template_path
from llamaprompt.cli import main

HINT = "input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
KINDS = {"image_then_text": "image", "audio_then_text": "audio", "video_then_text": "video"}


@pytest.fixture(scope="module")
def requests() -> dict:
    return load_reference("apply_template.json")["requests"]


def _qwen(**options) -> llamaprompt.ChatTemplate:
    return llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"), **options)


def test_default_is_a_vision_audio_projector(requests):
    t = _qwen()
    assert t.media == ("image", "audio", "video")
    assert t.props()["modalities"] == {"vision": True, "audio": True, "video": True}
    for name in KINDS:
        assert "<__media__>" in t.apply_template(requests[name])


@pytest.mark.parametrize("media", [False, ()])
def test_text_only_server_refuses_every_media_part(requests, media):
    t = _qwen(media=media)
    assert t.media == ()
    assert t.props()["modalities"] == {"vision": False, "audio": False, "video": False}
    for name, kind in KINDS.items():
        with pytest.raises(llamaprompt.TemplateError) as info:
            t.apply_template(requests[name])
        assert info.value.status == 500
        assert info.value.message == f"{kind} {HINT}"
    # text is unaffected
    assert t.apply_template({"messages": [{"role": "user", "content": "Hi"}]}) == _qwen().apply_template(
        {"messages": [{"role": "user", "content": "Hi"}]}
    )


def test_some_kinds(requests):
    t = _qwen(media="vision, audio")
    assert t.media == ("image", "audio")
    assert t.props()["modalities"] == {"vision": True, "audio": True, "video": False}
    assert "<__media__>" in t.apply_template(requests["image_then_text"])
    with pytest.raises(llamaprompt.TemplateError, match=f"^video {HINT}$"):
        t.apply_template(requests["video_then_text"])
    again = pickle.loads(pickle.dumps(t))
    assert again.media == ("image", "audio")
    with pytest.raises(llamaprompt.TemplateError, match="^video"):
        again.apply(requests["video_then_text"])
    assert t.with_caps(supports_typed_content=True).media == ("image", "audio")


def test_bad_media_names():
    with pytest.raises(ValueError, match="unknown media kind 'pictures'"):
        _qwen(media=["pictures"])
    with pytest.raises(TypeError):
        _qwen(media=[1])
    for bad in (None, 1, b"image"):
        with pytest.raises(TypeError, match="media must be True, False or media names"):
            _qwen(media=bad)


def test_cli_no_media(tmp_path, capsys, requests):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(requests["image_then_text"]))
    assert main(["render", "--no-media", str(req)]) == 2
    assert f"image {HINT}" in capsys.readouterr().err
    assert main(["render", "--media", "audio", str(req)]) == 2
    capsys.readouterr()
    assert main(["render", "--media", "image", str(req)]) == 0
    assert "<__media__>" in capsys.readouterr().out
    assert main(["props", "--no-media"]) == 0
    assert json.loads(capsys.readouterr().out)["modalities"] == {"vision": False, "audio": False, "video": False}
    with pytest.raises(SystemExit) as info:
        main(["render", "--media", "smell", str(req)])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["render", "--media", "image", "--no-media", str(req)])


@pytest.mark.server
def test_serve_props_follow_the_switch():
    pytest.importorskip("starlette")
    from llamaprompt.server import create_app

    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with serving(create_app({"qwen": _qwen(media=False)})) as url:
        with urllib.request.urlopen(f"{url}/props", timeout=30) as r:
            assert json.loads(r.read())["modalities"] == {"vision": False, "audio": False, "video": False}
        req = urllib.request.Request(
            f"{url}/apply-template", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 500
        assert json.loads(info.value.read())["error"]["message"] == f"image {HINT}"
