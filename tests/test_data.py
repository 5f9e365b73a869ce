"""Datasets: render_table (threads), worker processes, Ray Data, the render-dataset command
and pickling. Every path must give, row by row, what sequential apply_template gives."""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys

import pytest

import llamaprompt
from conftest import load_reference, mask_dates, template_path, vocab_gguf

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
from llamaprompt import data  # noqa: E402

TEMPLATES = ["Qwen-Qwen3-0.6B.jinja", "google-gemma-2-2b-it.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def conversations(n, seed=0, bad_every=0):
    """Generated conversations; every ``bad_every``-th row is one llama-server rejects."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": f"System {i}."}] if rng.random() < 0.5 else []
        for t in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": f"Question {i}.{t} " + "ü" * rng.randint(0, 2)})
            if rng.random() < 0.7:
                msgs.append({"role": "assistant", "content": f"Answer {i}.{t}"})
        if msgs[-1]["role"] == "assistant":
            msgs.append({"role": "user", "content": "More?"})
        row = {"messages": msgs}
        if rng.random() < 0.3:
            row["tools"] = [WEATHER]
        if bad_every and i % bad_every == 0:
            row["messages"] = [{"role": "user", "content": 5}] if i % 2 else [{"content": "no role"}]
        rows.append(row)
    return rows


def sequential(template, rows):
    out = []
    for r in rows:
        try:
            out.append((template.apply_template(r), None))
        except llamaprompt.Error as e:
            out.append((None, e.message))
    return out


def as_pairs(table):
    return list(zip(table.column("prompt").to_pylist(), table.column("error").to_pylist()))


@pytest.fixture(scope="module")
def cases():
    out = []
    for k, name in enumerate(TEMPLATES):
        t = llamaprompt.ChatTemplate.from_file(template_path(name), bos_token="<s>", eos_token="</s>", add_bos=True)
        rows = conversations(400, seed=k, bad_every=37)
        out.append((t, rows, sequential(t, rows)))
    return out


def test_threads_match_sequential(cases):
    for t, rows, want in cases:
        got = as_pairs(data.render_table(t, rows, threads=2))
        assert got == want
        assert sum(1 for p, e in got if e) >= 10  # the error rows are there, with llama.cpp's message
        assert any(e == "Expected 'content' to be a string or an array" for _, e in got)


def test_processes_match_sequential(cases):
    from concurrent.futures import ProcessPoolExecutor

    t, rows, want = cases[0]
    table = data.as_arrow_table(rows)
    chunks = [table.slice(i, 100) for i in range(0, table.num_rows, 100)]
    with ProcessPoolExecutor(max_workers=2) as pool:
        parts = list(pool.map(data.RenderBatch(t), chunks))
    assert [p for part in parts for p in as_pairs(part)] == want


@pytest.mark.ray
def test_ray_matches_sequential(cases):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    from llamaprompt.ray import render_dataset

    t, rows, want = cases[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        ds = ray.data.from_arrow(data.as_arrow_table(rows))
        out = render_dataset(ds, t, workers=2, batch_size=64).to_arrow_refs()
        table = pa.concat_tables(ray.get(out))
        # Ray may reorder blocks: compare by the input messages
        got = {
            json.dumps(m, sort_keys=True): pe for m, pe in zip(table.column("messages").to_pylist(), as_pairs(table))
        }
        expected = {
            json.dumps(data._drop_nulls(m), sort_keys=True): pe
            for m, pe in zip(data.as_arrow_table(rows).column("messages").to_pylist(), want)
        }
        assert table.num_rows == len(rows) and got == expected
    finally:
        ray.shutdown()


def test_input_kinds_and_columns(cases):
    t, rows, want = cases[2]
    table = data.as_arrow_table(rows)
    assert as_pairs(data.render_table(t, table)) == want
    assert as_pairs(data.render_table(t, table.to_batches()[0])) == want[: table.to_batches()[0].num_rows]
    pd = pytest.importorskip("pandas")
    assert as_pairs(
        data.render_table(t, pd.DataFrame({"messages": [json.dumps(r["messages"]) for r in rows]}), tools=None)
    ) == sequential(t, [{"messages": r["messages"]} for r in rows])
    out = data.render_table(t, table)
    assert out.column_names[: table.num_columns] == table.column_names  # input columns kept


def test_kwargs_column_and_dict():
    t = llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"))
    rows = [
        {"messages": [{"role": "user", "content": "hi"}], "kw": json.dumps({"enable_thinking": False})},
        {"messages": [{"role": "user", "content": "hi"}], "kw": None},
    ]
    out = data.render_table(t, rows, kwargs="kw").column("prompt").to_pylist()
    assert out[0] == t.apply_template({**rows[0], "chat_template_kwargs": {"enable_thinking": False}})
    assert out[1] == t.apply_template({"messages": rows[1]["messages"]})
    same = data.render_table(t, rows, kwargs={"enable_thinking": False}).column("prompt").to_pylist()
    assert same[0] == same[1] == out[0]


def test_tokens_column():
    g = llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-phi-3.gguf"))
    rows = conversations(30, seed=5)
    out = data.render_table(g, rows, tokens=True)
    assert out.schema.field("tokens").type == pa.list_(pa.int32())
    for r, toks in zip(rows, out.column("tokens").to_pylist()):
        assert toks == g.apply_template_tokens(r).tolist()
    with pytest.raises(TypeError):
        data.render_table(llamaprompt.ChatTemplate.from_file(template_path(TEMPLATES[0])), rows, tokens=True)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_render_dataset_cli_round_trip(tmp_path, kind):
    t = llamaprompt.ChatTemplate.from_file(template_path(TEMPLATES[1]))
    rows = conversations(150, seed=9, bad_every=23)
    src = tmp_path / f"in.{kind}"
    if kind == "jsonl":
        src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken json\n")
    else:
        pq.write_table(data.as_arrow_table(rows), src)
    outs = []
    for workers in ("1", "2"):
        dst = tmp_path / f"out{workers}.parquet"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "llamaprompt.cli",
                "render-dataset",
                str(src),
                "-o",
                str(dst),
                "-t",
                str(template_path(TEMPLATES[1])),
                "--workers",
                workers,
                "--batch-rows",
                "40",
                "--no-progress",
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(pq.read_table(dst))
        # the summary names the failed rows and shows the first errors with llama.cpp's message
        n_bad = sum(1 for _, e in sequential(t, rows) if e) + (kind == "jsonl")
        assert f"rendered {len(rows) + (kind == 'jsonl')} rows into {dst}, {n_bad} failed" in proc.stderr
        assert "  row 0: " in proc.stderr and f"... and {n_bad - 5} more" in proc.stderr
    assert outs[0].equals(outs[1])
    want = sequential(t, rows)
    got = as_pairs(outs[0])
    if kind == "jsonl":
        assert got[:-1] == want and got[-1][0] is None and got[-1][1].startswith("bad row")
        assert outs[0].column("record").to_pylist()[0] == json.dumps(rows[0])
    else:
        assert got == want


def test_pickling_keeps_everything(tmp_path):
    by_file = llamaprompt.ChatTemplate.from_file(
        template_path(TEMPLATES[0]), bos_token="<s>", add_bos=True, server_args=["--reasoning", "off"]
    )
    by_gguf = llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-qwen2.gguf"))
    forced = by_file.with_caps(supports_system_role=False)
    req = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}
    for t in (by_file, by_gguf, forced, llamaprompt.ChatTemplate.builtin("llama2")):
        u = pickle.loads(pickle.dumps(t))
        assert type(u) is llamaprompt.ChatTemplate
        assert u.caps == t.caps and u.server_args == t.server_args and u.bos_token == t.bos_token
        assert u.apply_template(req) == t.apply_template(req)
    assert pickle.loads(pickle.dumps(by_gguf)).tokenize("hi").tolist() == by_gguf.tokenize("hi").tolist()


def test_typed_rows_keep_exact_json_and_bad_rows_stay_rows():
    t = llamaprompt.ChatTemplate.from_file(template_path(TEMPLATES[0]))

    def tool(props):
        return [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}]

    rows = [
        {
            "messages": [{"role": "user", "content": "a"}],
            "tools": tool({"x": {"type": "string"}, "y": {"type": "integer"}}),
        },
        {
            "messages": [{"role": "user", "content": "b"}],
            "tools": tool({"y": {"type": "integer"}, "x": {"type": "string", "default": None}}),
        },
        {"messages": '[{"role":"user","content":"x","extra":' + "[" * 50000 + "]" * 50000 + "}]"},
        {"messages": [{"role": "user", "content": 5}]},
    ]
    out = data.render_table(t, rows)
    prompts, errors = out.column("prompt").to_pylist(), out.column("error").to_pylist()
    assert prompts[:2] == [t.apply_template(r) for r in rows[:2]]  # key order and nulls kept
    assert prompts[2] is None and "nested too deeply" in errors[2]
    assert prompts[3] is None and errors[3] == "Expected 'content' to be a string or an array"
    pd = pytest.importorskip("pandas")
    again = data.render_table(t, pd.DataFrame(rows[:2] + rows[3:]))
    assert again.column("prompt").to_pylist()[:2] == prompts[:2]
    # re-rendering an output table replaces its prompt/error columns
    assert data.render_table(t, out).column_names.count("prompt") == 1


RAY_SCRIPT = """
import json, sys
import ray, pyarrow.parquet as pq
import llamaprompt
from llamaprompt.ray import render_dataset
src, dst, template = sys.argv[1:4]
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
t = llamaprompt.ChatTemplate.from_file(template)
render_dataset(ray.data.read_parquet(src), t, workers=2, batch_size=128).write_parquet(dst)
print("finished")
"""


@pytest.mark.ray
def test_ray_reads_parquet_on_a_two_cpu_cluster(tmp_path):
    """A read task, two render actors and a write task on 2 CPUs must all get scheduled (the
    actors once took every CPU and the read task waited forever). In a subprocess, so that a
    deadlock fails the test at the time bound instead of hanging the suite."""
    pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    name = TEMPLATES[0]
    rows = conversations(2000, seed=11, bad_every=97)
    src = tmp_path / "in.parquet"
    pq.write_table(data.as_arrow_table(rows), src)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", RAY_SCRIPT, str(src), str(tmp_path / "out"), str(template_path(name))],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"Ray Data did not finish within 300 s (deadlock?): {(e.stderr or b'')[-2000:]!r}")
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr[-3000:]
    assert "deprecated" not in proc.stderr.lower(), proc.stderr[-3000:]
    table = pq.read_table(tmp_path / "out")
    t = llamaprompt.ChatTemplate.from_file(template_path(name))
    got = sorted(zip(table.column("messages").to_pylist(), as_pairs(table)), key=str)
    want = sorted(zip(data.as_arrow_table(rows).column("messages").to_pylist(), sequential(t, rows)), key=str)
    assert table.num_rows == len(rows) and got == want


def test_actor_cpus_leave_room_for_reading():
    from llamaprompt.ray import actor_cpus

    for cpus in (1, 2, 3, 8, 64):
        for workers in (1, 2, 4, 16):
            each = actor_cpus(workers, cpus)
            assert 0 < each <= 1
            assert workers * each <= max(cpus - 1, workers * 0.05) + 1e-9
    assert actor_cpus(2, 8) == 1.0
    with pytest.raises(ValueError):
        actor_cpus(0, 2)


def test_a_row_with_a_lone_surrogate_is_an_error_row(tmp_path):
    # "\ud800" is valid JSON but no UTF-8: that row fails with llama.cpp's message, as the same
    # request through apply_template does, and the others render (the trial of session 55: a
    # UnicodeEncodeError for the whole file, no output written)
    t = llamaprompt.ChatTemplate("{{ messages[0].content }}")
    bad = {"messages": [{"role": "user", "content": "a\ud800"}]}
    with pytest.raises(llamaprompt.Error) as info:
        t.apply_template(bad)
    rows = [{"messages": [{"role": "user", "content": "ok \u00e9"}]}, bad]
    table = data.render_table(t, rows)
    assert table.column("prompt").to_pylist() == ["ok \u00e9", None]
    assert table.column("error").to_pylist() == [None, info.value.message]
    # the same as a dict of columns, and as JSON text holding the surrogate itself (the second
    # helper: a UnicodeEncodeError for the whole table; the text rendered with U+FFFD, no error)
    columns = {"messages": [r["messages"] for r in rows]}
    texts = [{"messages": json.dumps(r["messages"], ensure_ascii=False)} for r in rows]
    for table in (data.render_table(t, columns), data.render_table(t, texts)):
        assert table.column("prompt").to_pylist() == ["ok \u00e9", None]
        assert table.column("error").to_pylist()[0] is None
        assert table.column("error").to_pylist()[1].startswith("[json.exception.parse_error.101]")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="ascii")
    done = data.render_file(t, str(src), str(tmp_path / "out.parquet"), progress=False)
    assert (done.rows, done.failed) == (2, 1)
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("prompt").to_pylist() == ["ok \u00e9", None]
    assert out.column("error").to_pylist() == [None, info.value.message]
    assert "\u00e9" in out.column("messages").to_pylist()[0]  # non-ASCII text kept as it is


def test_training_rows_end_with_a_closed_turn():
    """Fine-tuning text: no generation prompt, a final assistant turn closed -- llama-server's
    rendering under --no-prefill-assistant (the recorded no_generation_prompt case), where the
    default serves that turn open as a prefill."""
    ref = load_reference("apply_template_server_args.json")
    closed = next(v for v in ref["variants"] if v["server_args"] == ["--no-prefill-assistant"])
    default = load_reference("apply_template.json")["variants"][0]
    tok = ref["model_tokens"]
    messages = ref["requests"]["no_generation_prompt"]["messages"]
    assert messages[-1]["role"] == "assistant"
    checked = 0
    for name in TEMPLATES:
        want = closed["templates"][name]["cases"]["no_generation_prompt"]
        served = default["templates"][name]["cases"]["no_generation_prompt"]
        t = llamaprompt.ChatTemplate.from_file(
            template_path(name), bos_token=tok["bos_token"], eos_token=tok["eos_token"], add_bos=tok["add_bos"]
        )
        rows = [{"messages": messages}, {"messages": [{"role": "user", "content": 5}]}]
        out = data.render_table(t, rows, training=True)
        day = ref["rendered_on"]
        assert mask_dates(out.column("prompt").to_pylist()[0], day) == want["prompt"] != served["prompt"]
        assert out.column("error").to_pylist()[1] == "Expected 'content' to be a string or an array"
        assert mask_dates(data.render_table(t, rows).column("prompt").to_pylist()[0], day) == served["prompt"]
        checked += 1
    assert checked == len(TEMPLATES)


def test_training_tokens_keep_bos_and_the_end_of_turn():
    g = llamaprompt.ChatTemplate.from_gguf(vocab_gguf("ggml-vocab-phi-3.gguf"))
    assert g.add_bos and g.bos_token_id is not None
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]
    out = data.render_table(g, rows, training=True, tokens=True)
    prompt, toks = out.column("prompt").to_pylist()[0], out.column("tokens").to_pylist()[0]
    assert not prompt.startswith(g.bos_token) and toks[0] == g.bos_token_id  # stripped text, BOS token back
    end = g.tokenize("<|end|>").tolist()
    assert len(end) == 1 and prompt.endswith("Hello!<|end|>\n") and end[0] in toks[-3:]


@pytest.mark.ray
def test_render_dataset_ray_cli_quiet_and_equal(tmp_path):
    """render-dataset --ray on Parquet (read by Ray's reader), --no-progress: no Ray Data
    progress lines, the rows as sequential apply_template renders them, the failures counted."""
    pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    t = llamaprompt.ChatTemplate.from_file(template_path(TEMPLATES[2]))
    rows = conversations(300, seed=13, bad_every=50)
    src, dst = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(data.as_arrow_table(rows), src)
    cmd = [sys.executable, "-m", "llamaprompt.cli", "render-dataset", str(src), "-o", str(dst)]
    cmd += ["-t", str(template_path(TEMPLATES[2])), "--ray", "--workers", "2", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "logging_progress" not in proc.stderr and "Running Dataset" not in proc.stderr, proc.stderr[-3000:]
    want = sequential(t, rows)
    assert f"{sum(1 for _, e in want if e)} failed" in proc.stderr
    table = pq.read_table(dst)
    got = sorted(zip(table.column("messages").to_pylist(), as_pairs(table)), key=str)
    expected = sorted(zip(data.as_arrow_table(rows).column("messages").to_pylist(), want), key=str)
    assert got == expected


def test_bad_kwargs_and_tokens_options_fail_at_once():
    t = llamaprompt.ChatTemplate.from_file(template_path(TEMPLATES[0]))
    rows = [{"messages": [{"role": "user", "content": "Hi"}], "kw": {"enable_thinking": False}}]
    assert data.render_table(t, rows, kwargs="kw").column("prompt").to_pylist() == [
        t.apply_template({"messages": rows[0]["messages"], "chat_template_kwargs": {"enable_thinking": False}})
    ]
    with pytest.raises(KeyError, match="kwz"):  # a typo once dropped the kwargs of every row
        data.render_table(t, rows, kwargs="kwz")
    with pytest.raises(TypeError, match="kwargs must be"):
        data.render_table(t, rows, kwargs=["kw"])
    from llamaprompt.ray import render_dataset

    with pytest.raises(TypeError, match="GGUF"):  # before Ray starts, not inside an actor
        render_dataset(object(), t, tokens=True)
