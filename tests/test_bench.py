"""`llamaprompt bench` as a smoke (one template, minimal timing): the report has every
peer, the Jinja2 comparison marks what the template's text says it must, the JSON and the
plot are written, and an HTTP peer (``llamaprompt serve`` standing in for llama-server)
is timed. No figure is asserted: timings are reported by the benchmark, not tested."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import template_path
from llamaprompt import bench
from llamaprompt.cli import main

pytest.importorskip("jinja2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import serve_load  # noqa: E402

QWEN3 = "Qwen-Qwen3-0.6B.jinja"


def test_bench_cli_writes_report_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("transformers")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(
        [
            "bench",
            "--pinned",
            QWEN3,
            "--min-time",
            "0",
            "--memory",
            "3",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert table.startswith("| template |") and QWEN3 in table and "Median over 1 template " in table
    report = json.loads(out.read_text())
    (row,) = report["templates"]
    assert set(row["renders_per_s"]) == {"llamaprompt", "upstream", "jinja2", "transformers", "floor"}
    for key in ("upstream", "jinja2", "transformers", "floor_ratio", "thread_scaling"):
        assert row["ratios"][key] > 0
    assert row["handler"] == "autoparser"
    reqs = row["requests"]
    # Qwen3's template prints a plain user turn exactly as llama.cpp does ...
    assert reqs["plain_chat"]["jinja2_same"] is True
    assert reqs["plain_chat"]["transformers_same"] is True
    # ... but concatenates `content` as a string, so typed content parts (a list) raise in
    # Jinja2, where llama.cpp's normalizer joins them for this string-content template
    assert "jinja2_error" in reqs["typed_text_parts"] and reqs["typed_text_parts"]["ok"]
    # a request llama.cpp rejects has no floor (nothing was rendered)
    assert not reqs["error_content_number"]["ok"] and "floor" not in reqs["error_content_number"]
    assert report["memory"]["templates"] == 3 and report["memory"]["peak_rss_mib"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.server
def test_bench_times_an_http_peer():
    pytest.importorskip("uvicorn", reason="`llamaprompt serve` needs the server extra (starlette, uvicorn)")
    pytest.importorskip("starlette", reason="`llamaprompt serve` needs the server extra (starlette, uvicorn)")
    port = serve_load.free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "llamaprompt.cli", "serve", "--port", str(port), "--pinned", QWEN3],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        serve_load.wait_ready(f"http://127.0.0.1:{port}")
        requests = {"plain": {"messages": [{"role": "user", "content": "hi"}]}}
        report = bench.run_bench(
            [template_path(QWEN3), template_path("meta-llama-Llama-3.1-8B-Instruct.jinja")],
            requests,
            min_time=0,
            peers={"server"},
            server_url=f"http://127.0.0.1:{port}",
            memory=0,
            progress=False,
        )
    finally:
        server.terminate()
        server.wait(10)
    qwen, llama = report["templates"]
    # the server serves Qwen3 only: only that template is compared with it
    assert qwen["ratios"]["server"] > 0 and "server" in qwen["requests"]["plain"]
    assert "server" not in llama["ratios"]


def test_bench_rejects_bad_server_url():
    with pytest.raises(ValueError):
        bench.ServerPeer("ftp://example")


def test_transformers_jinja2_settings():
    # trim_blocks / lstrip_blocks as transformers sets them, tojson without ASCII escapes
    t = bench.transformers_jinja2("  {% if true %}\n{{ x|tojson }}{% endif %}")
    assert t.render(x={"k": "é"}) == '{"k": "é"}'
    with pytest.raises(Exception, match="boom"):
        bench.transformers_jinja2("{{ raise_exception('boom') }}").render()


def test_transformers_renderer_is_transformers_own():
    pytest.importorskip("transformers")
    render = bench.transformers_renderer(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
        "{{ bos_token }}"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert render(messages=messages, add_generation_prompt=True, bos_token="<s>") == "<user>hi<a><s>"
    assert render(messages=messages, add_generation_prompt=False, bos_token="") == "<user>hi"
    with pytest.raises(Exception, match="boom"):
        bench.transformers_renderer("{{ raise_exception('boom') }}")(messages=[], add_generation_prompt=False)


@pytest.mark.slow  # two programs under valgrind, ~40 s
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_instruction_count_benchmark(tmp_path):
    # benchmarks/instructions.py: callgrind's count per apply_template; with the installed module
    # as its own reference the ratio is 1 (a one-off difference between the runs, e.g. in where
    # malloc finds room, is spread over 5 rounds of the requests)
    import llamaprompt

    core = next(Path(llamaprompt.__file__).parent.glob("_core*.so"))
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "instructions.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--rounds", "5", "--reference", str(core), "Qwen-Qwen3-0.6B.jinja"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| Qwen-Qwen3-0.6B.jinja |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    mine, theirs = (int(c.replace(",", "")) for c in cells[1:3])
    assert 100_000 < mine < 100_000_000
    assert abs(mine - theirs) <= mine * 0.01, row  # the same module: the same count (paths differ)
    bad = subprocess.run([sys.executable, str(script), "--rounds", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--rounds must be >= 1" in bad.stderr
