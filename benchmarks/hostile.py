"""The hostile-input matrix: every category of bad input issue 8 names, against every entry
point, in-process (ChatTemplate), each case in a child process so that a crash is seen.

    python benchmarks/hostile.py [--out docs/benchmarks/hostile.md] [--case-timeout 120]

For each case the outcome is one of: ``prompt`` (rendered), ``RequestError`` /
``TemplateError`` / ``GGUFError`` (a typed error with llama.cpp's message), ``budget`` (a
TemplateError from a time/stack/size budget), ``other`` (any other exception: a bug),
``crash`` (the child died) or ``hang`` (no answer within --case-timeout; the child is
killed). The table counts them per category; crashes, hangs and ``other`` must be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TEMPLATES = ("Qwen-Qwen3-0.6B.jinja", "openai-gpt-oss-120b.jinja", "google-gemma-2-2b-it.jinja")
USER = {"role": "user", "content": "hi"}


def _nest(depth: int, leaf: Any = 1) -> Any:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def _nested_text(depth: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"1" + b"]" * depth + b"}]}"


def _msg(content: Any, role: str = "user") -> dict:
    return {"messages": [{"role": role, "content": content}]}


def _call(**fn: Any) -> dict:
    return {
        "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [fn.pop("raw", None) or fn]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    }


def _tools(tools: Any) -> dict:
    return {"messages": [USER], "tools": tools}


def _media(part: dict) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]}


# category -> list of (case name, kind, payload); kinds: request (rendered with each of
# TEMPLATES), template (a template source + one request), gguf (a file made by _gguf_case)
def cases() -> dict[str, list[tuple[str, str, Any]]]:
    big = "x" * (10 << 20)
    c: dict[str, list[tuple[str, str, Any]]] = {}
    c["deeply nested JSON"] = [
        *((f"text depth {d}", "request", _nested_text(d)) for d in (10, 500, 1000, 1001, 10**4, 10**5, 10**6)),
        *((f"dict depth {d}", "request", _msg(_nest(d))) for d in (10, 500, 2000, 10**5)),
        ("nested kwargs", "request", {"messages": [USER], "chat_template_kwargs": {"x": _nest(900)}}),
    ]
    c["huge strings"] = [
        ("content 10 MiB", "request", _msg(big)),
        ("content 100 MiB", "request", _msg("y" * (100 << 20))),
        ("tool arguments 10 MiB", "request", _call(type="function", function={"name": "f", "arguments": big})),
        ("system 10 MiB", "request", {"messages": [{"role": "system", "content": big}, USER]}),
        ("template 10 MiB text", "template", ("{{ messages[0].content }}" + "z" * (10 << 20), _msg("a"))),
    ]
    c["invalid UTF-8"] = [
        ("request content bytes", "request", b'{"messages":[{"role":"user","content":"\xff\xfe\xc3"}]}'),
        ("request role bytes", "request", b'{"messages":[{"role":"us\xc3er","content":"a"}]}'),
        ("request key bytes", "request", b'{"messages":[{"role":"user","content":"a","\xff":1}]}'),
        ("template bytes", "template", (b"\xff\xfe{{ messages[0].content }}\xc3", _msg("a"))),
        ("template string literal", "template", (b"{{ '\xe2\x82' }}{{ messages[0].content }}", _msg("a"))),
        ("template cuts a character", "template", ("{{ messages[0].content[:1] }}", _msg("é"))),
        ("lone surrogate escape", "request", _msg("a\udcff")),
    ]
    c["null bytes"] = [
        ("content", "request", _msg("a\x00b")),
        ("role", "request", _msg("a", role="us\x00er")),
        ("tool name", "request", _call(type="function", function={"name": "f\x00", "arguments": "{}"})),
        ("template", "template", ("a\x00{{ messages[0].content }}\x00", _msg("b"))),
        ("raw body", "request", b"\x00\x00\x00"),
    ]
    c["non-string content types"] = [
        (f"content {json.dumps(v)[:30]}", "request", _msg(v))
        for v in (
            1,
            1.5,
            True,
            None,
            {},
            {"a": 1},
            [1],
            [None],
            [{"type": "text", "text": 1}],
            [{"type": "x"}],
            [{"text": "no type"}],
            ["str"],
            [[]],
        )
    ] + [
        ("assistant content int", "request", {"messages": [USER, {"role": "assistant", "content": 5}]}),
        ("messages not a list", "request", {"messages": {"role": "user"}}),
        ("message not an object", "request", {"messages": ["hi"]}),
        ("role int", "request", {"messages": [{"role": 1, "content": "a"}]}),
    ]
    c["10^5 messages"] = [
        (
            "100000 alternating",
            "request",
            {"messages": [{"role": ("user", "assistant")[i % 2], "content": f"m{i}"} for i in range(10**5)]},
        ),
        ("100000 user", "request", {"messages": [{"role": "user", "content": "m"}] * 10**5}),
        (
            "100000 tools",
            "request",
            _tools([{"type": "function", "function": {"name": f"f{i}"}} for i in range(10**5)]),
        ),
    ]
    recursion = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}"
    c["recursive macros"] = [
        ("unbounded", "template", (recursion + "{{ f(0) }}", _msg("a"))),
        (
            "unbounded, request path",
            "template",
            (recursion + "{% if messages[0].content == 'go' %}{{ f(0) }}{% endif %}x", _msg("go")),
        ),
        (
            "mutual",
            "template",
            ("{% macro a(n) %}{{ b(n) }}{% endmacro %}{% macro b(n) %}{{ a(n) }}{% endmacro %}{{ a(0) }}", _msg("a")),
        ),
        ("inside a loop", "template", (recursion + "{% for m in messages %}{{ f(0) }}{% endfor %}", _msg("a"))),
        ("inside a filter", "template", (recursion + "{{ f(0)|upper }}", _msg("a"))),
        (
            "deep but finite (2000)",
            "template",
            ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(2000) }}", _msg("a")),
        ),
    ]
    tuples = (
        "{% set ns = namespace(t=0) %}{% for i in range(40000) %}"
        "{% set ns.t = ({'a': ns.t}.items()|first) %}{% endfor %}"
    )
    lists = "{% set ns = namespace(l=[]) %}{% for i in range(300000) %}{% set ns.l = [ns.l] %}{% endfor %}"
    c["values and syntax trees nested deep"] = [
        ("a list 3*10^5 deep, unprinted", "template", (lists + "x", _msg("a"))),
        ("a list 3*10^5 deep, tojson", "template", (lists + "{{ ns.l|tojson }}", _msg("a"))),
        ("a list nested in itself, printed", "template", ("{% set l = [] %}{{ l.append(l) }}{{ l }}", _msg("a"))),
        ("a tuple 40,000 deep, ==", "template", (tuples + "{{ ns.t == ns.t }}", _msg("a"))),
        ("a tuple 40,000 deep, a dict key", "template", (tuples + "{% set d = {ns.t: 1} %}{{ d[ns.t] }}", _msg("a"))),
        (
            "1 + 1 + ... (10^6 terms)",
            "template",
            ("{% if false %}{{ 1" + " + 1" * 10**6 + " }}{% endif %}x", _msg("a")),
        ),
        ("f()()()... (2*10^5 calls)", "template", ("{{ f" + "()" * 200000 + " }}", _msg("a"))),
    ]
    c["range(10^9) and friends"] = [
        ("range(10**9)", "template", ("{% for i in range(1000000000) %}{% endfor %}", _msg("a"))),
        ("range(2**62)", "template", ("{{ range(4611686018427387904)|length }}", _msg("a"))),
        (
            "nested loops 10^5 x 10^5",
            "template",
            ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}", _msg("a")),
        ),
        ("'x' * 10**12", "template", ("{{ 'x' * 1000000000000 }}", _msg("a"))),
        (
            "doubling concatenation",
            "template",
            (
                "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                _msg("a"),
            ),
        ),
        ("output 10^7 statements", "template", ("{% for i in range(10000000) %}{{ 'abc' }}{% endfor %}", _msg("a"))),
        ("slice step -2**63", "template", ("{{ [1][0:-1:-9223372036854775807 - 1]|length }}", _msg("a"))),
        ("indent(2*10^8)", "template", ("{{ ('a\nb'|indent(200000000))|length }}", _msg("a"))),
        (
            "split of 2 MB of commas",
            "template",
            ("{% for m in messages %}{{ m.content.split(',')|length }}{% endfor %}", _msg("," * 2_000_000)),
        ),
    ]
    c["templates that raise"] = [
        ("raise_exception", "template", ("{{ raise_exception('no') }}", _msg("a"))),
        (
            "raise on request",
            "template",
            ("{% if messages[0].content == 'r' %}{{ raise_exception('r') }}{% endif %}ok", _msg("r")),
        ),
        ("undefined attribute chain", "template", ("{{ messages[0].content }}{{ none.x.y }}", _msg("a"))),
        ("division by zero", "template", ("{{ messages[0].content }}{{ 1 / 0 }}", _msg("a"))),
        ("call a non-function", "template", ("{{ messages[0].content }}{{ messages() }}", _msg("a"))),
        ("index out of range", "template", ("{{ messages[99].content }}", _msg("a"))),
        ("syntax error", "template", ("{% for %}", _msg("a"))),
        ("unclosed block", "template", ("{% if true %}{{ messages[0].content }}", _msg("a"))),
        ("unknown filter", "template", ("{{ messages|nonexistent }}", _msg("a"))),
        ("empty template", "template", ("", _msg("a"))),
    ]
    c["unknown tool-call shapes"] = [
        ("tool_calls a string", "request", _call(raw="call it")),
        ("no function", "request", _call(type="function")),
        ("arguments a number", "request", _call(type="function", function={"name": "f", "arguments": 5})),
        ("arguments bad JSON", "request", _call(type="function", function={"name": "f", "arguments": "{not json"})),
        ("arguments an object", "request", _call(type="function", function={"name": "f", "arguments": {"a": 1}})),
        ("name not a string", "request", _call(type="function", function={"name": 5, "arguments": "{}"})),
        ("type not function", "request", _call(type="custom", function={"name": "f", "arguments": "{}"})),
        ("id an int", "request", _call(id=5, type="function", function={"name": "f", "arguments": "{}"})),
        ("tools an object", "request", _tools({"f": 1})),
        ("tool without function", "request", _tools([{"type": "function"}])),
        (
            "schema type foo",
            "request",
            _tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]),
        ),
        (
            "schema bad $ref",
            "request",
            _tools([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}]),
        ),
        (
            "schema unanchored pattern",
            "request",
            _tools(
                [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "a+"}}},
                        },
                    }
                ]
            ),
        ),
        ("tool_choice garbage", "request", {**_tools([]), "tool_choice": {"x": 1}}),
        (
            "response_format schema garbage",
            "request",
            {"messages": [USER], "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
        ),
    ]
    c["media parts with bad data URLs"] = [
        (
            "image bad base64",
            "request",
            _media({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}),
        ),
        ("image empty data URL", "request", _media({"type": "image_url", "image_url": {"url": "data:,"}})),
        ("image no comma", "request", _media({"type": "image_url", "image_url": {"url": "data:image/png;base64"}})),
        ("image http URL", "request", _media({"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}})),
        ("image url not a string", "request", _media({"type": "image_url", "image_url": {"url": 5}})),
        ("image_url missing", "request", _media({"type": "image_url"})),
        (
            "image 10 MiB data URL",
            "request",
            _media({"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * (10 << 20)}}),
        ),
        (
            "audio bad format",
            "request",
            _media({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "xyz"}}),
        ),
        (
            "audio bad base64",
            "request",
            _media({"type": "input_audio", "input_audio": {"data": "!!", "format": "wav"}}),
        ),
        ("file part", "request", _media({"type": "file", "file": {"file_data": "data:,x"}})),
    ]
    c["GGUF absurd counts / offsets / truncation"] = [
        *(
            (f"truncated at {w}", "gguf", ("truncate", w))
            for w in (0, 3, 4, 8, 16, 23, 24, 64, 1000, "1/4", "1/2", "-1")
        ),
        ("bad magic", "gguf", ("write", 0, b"GGUX")),
        ("version 0", "gguf", ("write", 4, struct.pack("<I", 0))),
        ("version 999", "gguf", ("write", 4, struct.pack("<I", 999))),
        ("tensor count 2^63", "gguf", ("write", 8, struct.pack("<Q", 2**63))),
        ("kv count 2^63", "gguf", ("write", 16, struct.pack("<Q", 2**63))),
        ("kv count 2^32", "gguf", ("write", 16, struct.pack("<Q", 2**32))),
        ("first key length 2^62", "gguf", ("write", 24, struct.pack("<Q", 2**62))),
        ("first key length 0", "gguf", ("write", 24, struct.pack("<Q", 0))),
        ("token array length 2^40", "gguf", ("array_len", "tokenizer.ggml.tokens", 2**40)),
        ("token array length +1", "gguf", ("array_len", "tokenizer.ggml.tokens", "+1")),
        ("merges array length 2^40", "gguf", ("array_len", "tokenizer.ggml.merges", 2**40)),
        ("alignment 0", "gguf", ("kv_u32", "general.alignment", 0)),
        ("chat template invalid UTF-8", "gguf", ("template", b"\xff\xfe{{ messages[0].content }}")),
        ("chat template recursive", "gguf", ("template", b"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")),
    ]
    return c


# -- the child: runs one category from a start index, reporting each case -------------


def _gguf_case(spec: tuple, tmp: Path) -> Path:
    import gguf

    src = Path(os.environ["LLAMAPROMPT_VOCAB_GGUF"])
    data = bytearray(src.read_bytes())
    kind = spec[0]
    if kind == "truncate":
        w = spec[1]
        n = {"1/4": len(data) // 4, "1/2": len(data) // 2, "-1": len(data) - 1}.get(w, w)
        data = data[:n]
    elif kind == "write":
        data[spec[1] : spec[1] + len(spec[2])] = spec[2]
    elif kind in ("array_len", "kv_u32"):
        reader = gguf.GGUFReader(src)
        field = reader.fields.get(spec[1])
        if field is None:  # add it: write a copy with the key
            return _with_kv(src, tmp, spec[1], spec[2])
        if kind == "array_len":
            # parts: key len, key, type, item type, array length, ...
            at = (
                int(field.parts[4].ctypes.data - reader.data.ctypes.data) if hasattr(field.parts[4], "ctypes") else None
            )
            old = int(field.parts[4][0])
            new = old + 1 if spec[2] == "+1" else spec[2]
            data[at : at + 8] = struct.pack("<Q", new)
        else:
            at = int(field.parts[-1].ctypes.data - reader.data.ctypes.data)
            data[at : at + 4] = struct.pack("<I", spec[2])
    elif kind == "template":
        return _with_kv(src, tmp, "tokenizer.chat_template", spec[1])
    path = tmp / "case.gguf"
    path.write_bytes(bytes(data))
    return path


def _with_kv(src: Path, tmp: Path, key: str, value: Any) -> Path:
    """A copy of the vocab GGUF with one key set (gguf's writer)."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(str(tmp / "case.gguf"), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", key):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                vals = [bytes(field.parts[i]) for i in field.data]
            else:
                vals = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(name, vals, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[-1]), vtype)
        else:
            writer.add_key_value(name, field.parts[-1].tolist()[0], vtype)
    if isinstance(value, bytes):
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING)
    else:
        writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return tmp / "case.gguf"


def _classify(e: BaseException) -> str:
    import llamaprompt

    if isinstance(e, llamaprompt.TemplateError) and ("budget" in e.message or "nested too deeply" in e.message):
        return "budget"
    if isinstance(e, llamaprompt.Error):
        return type(e).__name__
    return "other"


def _child(category: str, start: int) -> None:
    import llamaprompt

    todo = cases()[category]
    tmp = Path(tempfile.mkdtemp())
    templates = {n: llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template(n)) for n in TEMPLATES}
    for i in range(start, len(todo)):
        name, kind, payload = todo[i]
        print(f"BEGIN {i}", flush=True)
        t0 = time.monotonic()
        outcomes = []
        try:
            if kind == "request":
                for t in templates.values():
                    try:
                        t.apply_template(payload)
                        t.apply(payload)
                        outcomes.append("prompt")
                    except Exception as e:
                        outcomes.append(_classify(e))
            elif kind == "template":
                source, request = payload
                try:
                    t = llamaprompt.ChatTemplate(source)
                    t.apply_template(request)
                    outcomes.append("prompt")
                except Exception as e:
                    outcomes.append(_classify(e))
            else:
                try:
                    path = _gguf_case(payload, tmp)
                    m = llamaprompt.ChatTemplate.from_gguf(path)
                    m.tokenize("Hello <|im_start|> world")
                    m.apply_template({"messages": [USER]})
                    outcomes.append("prompt")
                except Exception as e:
                    outcomes.append(_classify(e))
        except Exception as e:  # the harness itself
            outcomes.append("other:" + repr(e)[:200])
        print("END " + json.dumps({"i": i, "outcomes": outcomes, "seconds": time.monotonic() - t0}), flush=True)


# -- the parent -------------------------------------------------------------------------


def run(case_timeout: float = 120.0, only: list[str] | None = None) -> dict[str, Any]:
    import selectors

    report: dict[str, Any] = {}
    for category, todo in cases().items():
        if only and category not in only:
            continue
        counts: dict[str, int] = {}
        details: list[dict] = []
        start, worst = 0, 0.0
        while start < len(todo):
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", category, str(start)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            current = None
            deadline = time.monotonic() + case_timeout + 60  # template loading
            while True:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    proc.kill()
                    proc.wait()
                    counts["hang"] = counts.get("hang", 0) + 1
                    details.append({"case": todo[current or start][0], "outcome": "hang"})
                    start = (current if current is not None else start) + 1
                    break
                line = proc.stdout.readline()
                if not line:  # the child died (or finished)
                    proc.wait()
                    if current is not None:
                        counts["crash"] = counts.get("crash", 0) + 1
                        details.append({"case": todo[current][0], "outcome": f"crash (exit {proc.returncode})"})
                        start = current + 1
                    else:
                        start = len(todo)
                    break
                if line.startswith("BEGIN "):
                    current = int(line.split()[1])
                    deadline = time.monotonic() + case_timeout
                elif line.startswith("END "):
                    r = json.loads(line[4:])
                    worst = max(worst, r["seconds"])
                    for o in r["outcomes"]:
                        key = "other" if o.startswith("other") else o
                        counts[key] = counts.get(key, 0) + 1
                        if key == "other":
                            details.append({"case": todo[r["i"]][0], "outcome": o})
                    current = None
            sel.close()
        report[category] = {"inputs": len(todo), "outcomes": counts, "max_seconds": worst, "problems": details}
    return report


def markdown(report: dict[str, Any]) -> str:
    cols = ["prompt", "RequestError", "TemplateError", "GGUFError", "budget", "other", "crash", "hang"]
    lines = [
        "| category | inputs | " + " | ".join(cols) + " | slowest case (s) |",
        "|---|---:|" + "---:|" * len(cols) + "---:|",
    ]
    for cat, r in report.items():
        o = r["outcomes"]
        lines.append(
            f"| {cat} | {r['inputs']} | " + " | ".join(str(o.get(c, 0)) for c in cols) + f" | {r['max_seconds']:.1f} |"
        )
    problems = [(cat, p) for cat, r in report.items() for p in r["problems"]]
    lines.append("")
    lines.append(
        "No crash, hang or untyped exception."
        if not problems
        else "Problems:\n" + "\n".join(f"- {cat}: {p['case']}: {p['outcome']}" for cat, p in problems)
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, metavar=("CATEGORY", "START"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help="also write the table (Markdown) to this file")
    p.add_argument("--case-timeout", type=float, default=120.0, metavar="S")
    p.add_argument("--only", nargs="+", metavar="CATEGORY", help="run only these categories")
    args = p.parse_args(argv)
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return 0
    if "LLAMAPROMPT_VOCAB_GGUF" not in os.environ:
        root = Path(__file__).resolve().parent.parent
        os.environ["LLAMAPROMPT_VOCAB_GGUF"] = str(root / "third_party/llama.cpp/models/ggml-vocab-qwen2.gguf")
    t0 = time.monotonic()
    report = run(args.case_timeout, args.only)
    table = markdown(report)
    n_cases = sum(r["inputs"] for r in report.values())
    header = (
        "# Hostile inputs (generated)\n\nGenerated by `python benchmarks/hostile.py` "
        f"({n_cases} inputs, {time.monotonic() - t0:.0f} s). Request inputs run against "
        f"{', '.join(TEMPLATES)} (apply_template and apply); template inputs are loaded and rendered; "
        "GGUF inputs are mutated copies of ggml-vocab-qwen2.gguf, opened, tokenized and rendered. "
        "Counts are per input x template. Do not edit: rerun the script.\n\n"
    )
    sys.stdout.write(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(header + table, encoding="utf-8")
    bad = sum(r["outcomes"].get(k, 0) for r in report.values() for k in ("crash", "hang", "other"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
