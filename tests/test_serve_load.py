"""`llamaprompt serve` under a short load (benchmarks/serve_load.py as a smoke): no valid
request fails, every malformed one gets a JSON error; and an untrusted server survives a
template that loops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytestmark = [pytest.mark.server, pytest.mark.slow]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import serve_load  # noqa: E402


def test_load_smoke():
    r = serve_load.run(seconds=4, clients=6, untrusted=False)
    assert r["valid"] > 20 and r["malformed"] > 5
    assert r["valid_failed"] == 0 and r["malformed_bad_answer"] == 0
    assert r["rss_after_mib"] < r["rss_before_mib"] + 100


def test_untrusted_server_survives_a_looping_template(tmp_path):
    tpl = tmp_path / "loop.jinja"
    tpl.write_text(
        "{% if messages[0]['content'] == 'loop' %}{% for i in range(2000000000) %}{{ '' }}{% endfor %}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    port = serve_load.free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llamaprompt.cli",
            "serve",
            "--port",
            str(port),
            "--template",
            str(tpl),
            "--untrusted",
            "--timeout",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        serve_load.wait_ready(base)
        status, body = serve_load.post(f"{base}/apply-template", b'{"messages":[{"role":"user","content":"loop"}]}')
        assert status == 500 and "budget" in json.loads(body)["error"]["message"]
        status, body = serve_load.post(f"{base}/apply-template", b'{"messages":[{"role":"user","content":"hi"}]}')
        assert status == 200 and json.loads(body)["prompt"] == "hi"
    finally:
        server.terminate()
        server.wait(10)
