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
from conftest import template_path, vocab_gguf

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
