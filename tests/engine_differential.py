"""Differential run: llama.cpp's Jinja engine with llamaprompt's speed rewrites against the
same engine unmodified, over the pinned templates x generated requests and the template
fuzz corpus. A rewrite that changes one byte anywhere is dropped (docs/performance.md).

    python tests/engine_differential.py --reference REF_CORE.so [--json OUT] [--requests N] [--mutants M]

``REF_CORE.so`` is a ``_core`` module built with ``LLAMAPROMPT_ENGINE_REWRITES=OFF`` (``.ci/run``'s
offline sdist build is one, also with ``LLAMAPROMPT_BLOCK_CACHE=OFF``: the process's own operator new, as
upstream's engine runs, and ``LLAMAPROMPT_LTO=OFF``: each file compiled on its own; neither
changes an output); by hand, in a build folder of its own:

    pip wheel --no-deps --no-build-isolation -Cbuild-dir=build/upstream-engine \\
        -Ccmake.define.LLAMAPROMPT_ENGINE_REWRITES=OFF -Ccmake.define.LLAMAPROMPT_BLOCK_CACHE=OFF \\
        -Ccmake.define.LLAMAPROMPT_LTO=OFF -w build/upstream-engine-dist .

Both modules run the same cases, each in its own process (the installed llamaprompt
package, and a copy of it whose ``_core`` is the reference): for each template, its load
(``caps`` and ``detected_caps``, or the error), and for each request the fast-path prompt
(``apply_template``), the full path (``apply``: prompt, grammar, parser ... as JSON) and the
template's inputs (``template_inputs``: the Jinja context as the engine holds it), each an
answer or the typed error. Outcomes are compared by SHA-256 of their canonical JSON, dates masked (``_digest``). An
error from llamaprompt's execution budgets (src/cpp/jinja_guard.cpp) is compared by its kind
only -- time or stack: the rewritten engine is faster and its C++ frames differ in size, so
a runaway recursion reaches half of the stack at another statement -- and counted apart.
Exit status: 0 when nothing differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fuzz_corpus import mutate_template, random_edits  # noqa: E402

SEED = 20261202
# llamaprompt's execution-budget messages whose point of firing depends on speed or frame sizes
# (src/cpp/jinja_guard.cpp); the size budget is deterministic and compared as it is
# (the time budget also stops grammar generation: "grammar generation exceeded the time budget")
BUDGET_MARKS = ("exceeded the time budget", "template nested too deeply")
TIME_MARK, SIZE_MARK = BUDGET_MARKS[0], "template execution exceeded the size budget"


def _stopped_by(outcomes: list[Any]) -> list[str]:
    """The budgets (time, stack, size) that stopped any of these outcomes."""
    kinds = set()
    for v in outcomes:
        if "budget" in v:
            kinds.add("time" if v["budget"] == TIME_MARK else "stack")
        elif SIZE_MARK in (v.get("message") or ""):
            kinds.add("size")
    return sorted(kinds)


def _budget_race(a: list[str], b: list[str]) -> bool:
    """Both builds were stopped by a budget, and one of them by the time budget: which budget
    fires first (a 5 s limit, or a size or stack limit reached after a few seconds) depends on
    the machine's speed and load, not on the engine's behaviour."""
    return bool(a) and bool(b) and "time" in a + b


# -- the cases (the same in both processes: a fixed seed) ---------------------------------


def _text(rng: random.Random) -> str:
    pool = ["Hello", "What is 2+2?", "", " ", "<tool_call>", "{{ x }}", "\n\n", "Ünïcødé ✓", "a" * 40, "{%",
            'say "hi" to C:\\dir', "tab\there\r\x00\x08\x0c\x1f\x7f", "\u2028 \U0001f600 end"]
    return rng.choice(pool) + (rng.choice(pool) if rng.random() < 0.3 else "")


def _content(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.6:
        return _text(rng)
    if r < 0.8:
        return [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]
    return None if r < 0.9 else ""


# regex patterns for string properties (llama.cpp converts them to grammar rules): supported, and
# unsupported (the property then accepts any string) or invalid (an error) after the conversion
# added rules (`.`: the rule `dot`; a repeated group: a rule of its own) -- which it takes back
PATTERNS = ["^[a-z]+$", "^\\d{2,3}-.+$", "^.*$", "^(x|y)+z?$", "^.{1,4}$", "[a-z]+", "^(x|y)+\\Q$",
            "^a.b(?=c)$", "^x.{2,3}(?<n>y)$", "^(ab){2,3}\\Q$", "^[a-z]{2}.\\b$", "^(a.){2}\\Q$",
            "^[a-z]+(ab)*[$", "^a.(b$"]


def _property(rng: random.Random) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": rng.choice(["string", "integer", "boolean", "number"])}
    if prop["type"] == "string" and rng.random() < 0.5:
        prop["pattern"] = rng.choice(PATTERNS)
    return prop


def _tool(rng: random.Random, i: int) -> dict[str, Any]:
    props = {f"p{j}": _property(rng) for j in range(rng.randint(0, 3))}
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": _text(rng),
            "parameters": {"type": "object", "properties": props, "required": sorted(props)[:1]},
        },
    }


def _call(rng: random.Random, i: int) -> dict[str, Any]:
    args = json.dumps({"p0": _text(rng)}) if rng.random() < 0.8 else "{}"
    return {"id": f"call_{i}", "type": "function", "function": {"name": f"tool_{i % 2}", "arguments": args}}


def generated_requests(n: int, seed: int = SEED) -> dict[str, dict[str, Any]]:
    """``n`` chat requests drawn from a seeded generator: roles, string and typed content,
    tool calls and results, reasoning, tools (string properties with regex patterns among them),
    a ``response_format`` schema, and the request flags llama-server reads."""
    rng = random.Random(seed)
    out = {}
    for k in range(n):
        msgs: list[dict[str, Any]] = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": _content(rng)})
        for _turn in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": _content(rng)})
            if rng.random() < 0.6:
                m: dict[str, Any] = {"role": "assistant", "content": _content(rng)}
                if rng.random() < 0.3:
                    m["reasoning_content"] = _text(rng)
                if rng.random() < 0.3:
                    m["tool_calls"] = [_call(rng, i) for i in range(rng.randint(1, 2))]
                msgs.append(m)
                if "tool_calls" in m:
                    for c in m["tool_calls"]:
                        msgs.append({"role": "tool", "tool_call_id": c["id"], "content": _text(rng)})
        if rng.random() < 0.1:
            msgs.append({"role": "assistant", "content": _text(rng)})
        req: dict[str, Any] = {"messages": msgs}
        if rng.random() < 0.4:
            req["tools"] = [_tool(rng, i) for i in range(rng.randint(1, 3))]
            if rng.random() < 0.3:
                req["tool_choice"] = rng.choice(["auto", "none", "required"])
            if rng.random() < 0.2:
                req["parallel_tool_calls"] = rng.random() < 0.5
        if rng.random() < 0.15:
            req["add_generation_prompt"] = False
        if rng.random() < 0.2:
            req["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
        if rng.random() < 0.1:
            req["reasoning_effort"] = rng.choice(["low", "medium", "high"])
        if rng.random() < 0.1:
            req["response_format"] = {"type": "json_object"}
        elif rng.random() < 0.15:
            # optional properties (each suffix of them a rule), some required, extra properties
            props = {f"r{j}": _property(rng) for j in range(rng.randint(1, 6))}
            schema = {"type": "object", "properties": props}
            if rng.random() < 0.3:
                schema["required"] = sorted(props)[: rng.randint(0, 2)]
            if rng.random() < 0.3:
                schema["additionalProperties"] = rng.choice([True, {"type": "integer"}])
            req["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
        out[f"generated_{k}"] = req
    return out


def _fixture_requests() -> dict[str, dict[str, Any]]:
    out = {}
    ref = Path(os.environ.get("LLAMAPROMPT_REFERENCE_DIR", HERE.parent.parent / "shared" / "reference"))
    for name in ("apply_template.json", "apply_template_server_args.json"):
        path = ref / name
        if path.is_file():
            for key, req in json.loads(path.read_text(encoding="utf-8"))["requests"].items():
                out[f"{path.stem}:{key}"] = req
    return out


def cases(n_requests: int, n_mutants: int) -> Iterator[tuple[str, bytes, dict[str, dict[str, Any]]]]:
    """(name, template source, requests): every pinned template with the default request set,
    the reference fixtures' requests and ``n_requests`` generated ones; then ``n_mutants``
    templates of the fuzz corpus with the default request set."""
    from importlib.resources import files

    from llamaprompt.pinned import pinned_templates

    default = json.loads((files("llamaprompt") / "resources" / "requests.json").read_text(encoding="utf-8"))
    everything = {**default, **_fixture_requests(), **generated_requests(n_requests)}
    pinned = pinned_templates()
    for path in pinned:
        yield path.name, path.read_bytes(), everything
    rng = random.Random(SEED + 1)
    for k in range(n_mutants):
        base = rng.choice(pinned)
        yield f"mutant_{k}({base.name})", mutate_template(base.read_bytes(), random_edits(rng)), default


# -- one process: every case's outcomes -----------------------------------------------------


def _outcome(fn: Any) -> Any:
    import llamaprompt

    try:
        return {"ok": fn()}
    except llamaprompt.Error as e:
        message = e.message
        for mark in BUDGET_MARKS:
            if mark in message:
                return {"error": type(e).__name__, "status": getattr(e, "status", None), "budget": mark}
        return {"error": type(e).__name__, "status": getattr(e, "status", None), "message": message}


def _params(p: Any) -> dict[str, Any]:
    return {k: getattr(p, k) for k in p.__dataclass_fields__ if not k.startswith("_")}


def run_worker(out: Path, n_requests: int, n_mutants: int) -> None:
    """Write one JSON line per template: its name, the load's digest, and per request the
    digests of the three outcomes (whether a time or stack budget stopped one, and which
    budgets did)."""
    import llamaprompt

    with out.open("w", encoding="utf-8") as f:
        for name, source, requests in cases(n_requests, n_mutants):
            row: dict[str, Any] = {"template": name, "requests": {}}
            with tempfile.NamedTemporaryFile(suffix=".jinja", delete=False) as tmp:
                tmp.write(source)
            try:
                loaded = _outcome(lambda: llamaprompt.ChatTemplate.from_file(tmp.name, timeout=5.0))
            finally:
                os.unlink(tmp.name)
            t = loaded.get("ok")
            load = {"caps": t.caps, "detected": t.detected_caps, "handler": t.handler} if t else loaded
            row["load"] = _digest(load)
            row["budget"] = "budget" in loaded
            row["stopped_by"] = _stopped_by([loaded])
            if t is not None:
                for key, req in requests.items():
                    body = json.dumps(req, ensure_ascii=False).encode()
                    got = {
                        "apply_template": _outcome(partial(t.apply_template, body)),
                        "apply": _outcome(lambda b=body: _params(t.apply(b))),  # noqa: B023 (called here)
                        "template_inputs": _outcome(partial(t.template_inputs, body)),
                    }
                    outcomes = list(got.values())
                    row["requests"][key] = [_digest(got), any("budget" in v for v in outcomes), _stopped_by(outcomes)]
            f.write(json.dumps(row) + "\n")


def _digest(value: Any) -> str:
    """SHA-256 of the value's canonical JSON with its dates masked (llamaprompt.fixtures.mask_dates):
    the two processes run a case at different times, and llama.cpp gives every template today's
    date (chat.cpp's format_time: in every template's inputs, in many prompts), so a run across
    midnight rendered the cases that one process reached after it with another day (a CI run that
    ended at 00:05 found 6 "differences", the last requests of one template)."""
    from llamaprompt.fixtures import mask_dates

    text = mask_dates(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# -- the comparison -------------------------------------------------------------------------


def _reference_package(reference: Path, into: Path) -> Path:
    """A copy of the installed llamaprompt package whose _core is ``reference``."""
    import llamaprompt

    pkg = Path(llamaprompt.__file__).resolve().parent
    dest = into / "llamaprompt"
    shutil.copytree(pkg, dest, ignore=shutil.ignore_patterns("_core*.so", "_core*.pyd", "__pycache__"))
    shutil.copy2(reference, dest / reference.name)
    return into


def _engine_rewrites(pythonpath: str | None) -> list[str]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    code = (
        "import json, llamaprompt.tree as t; "
        "print(json.dumps([r['engine'] for r in t.tree_info()['rewrites'] if r.get('engine') and r['applied']]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"cannot load llamaprompt with that module ({pythonpath or 'installed'}): {last}")
    return json.loads(proc.stdout)


def compare(reference: Path, n_requests: int, n_mutants: int) -> dict[str, Any]:
    """Run both builds over the cases and count: templates, requests, outcomes compared,
    differences (each named), and calls a time budget stopped (not compared)."""
    mine = check_reference(reference)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        ref_path = str(_reference_package(reference, tmp / "ref"))
        procs = []
        for label, pythonpath in (("rewritten", None), ("upstream", ref_path)):
            env = dict(os.environ)
            if pythonpath:
                env["PYTHONPATH"] = pythonpath
            out = tmp / f"{label}.jsonl"
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                str(out),
                "--requests",
                str(n_requests),
                "--mutants",
                str(n_mutants),
            ]
            procs.append((label, out, subprocess.Popen(cmd, env=env)))
        for label, _, p in procs:
            if p.wait() != 0:
                raise SystemExit(f"the {label} worker failed (exit {p.returncode})")
        rows = [[json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] for _, out, _ in procs]
    differences: list[str] = []
    compared = budget = requests = races = 0
    for a, b in zip(*rows, strict=True):
        name = a["template"]
        budget += a["budget"] or b["budget"]
        if a["load"] != b["load"]:
            if _budget_race(a["stopped_by"], b["stopped_by"]):
                races += 1
            else:
                differences.append(f"{name}: load")
            continue
        compared += 1
        if a["requests"].keys() != b["requests"].keys():
            differences.append(f"{name}: request set")
            continue
        for key, (da, ba, ka) in a["requests"].items():
            db, bb, kb = b["requests"][key]
            requests += 1
            budget += ba or bb
            if da != db:
                if _budget_race(ka, kb):
                    races += 1
                else:
                    differences.append(f"{name}: {key}")
    pinned = sum(1 for r in rows[0] if not r["template"].startswith("mutant_"))
    return {
        "engine_rewrites": mine,
        "templates": len(rows[0]),
        "pinned_templates": pinned,
        "mutant_templates": len(rows[0]) - pinned,
        "templates_compared": compared,
        "requests_compared": requests,
        "outcomes_compared": requests * 3 + compared,
        "budget_stopped": budget,  # loads and requests where a time or stack budget fired (compared by kind)
        # loads and requests that differ only in which budget stopped them, one the time budget (not compared)
        "budget_races": races,
        "differences": len(differences),
        "different": differences[:50],
    }


def count(text: str) -> int:
    """A count >= 0 (an argparse type; its name is argparse's "invalid count value")."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return n


def check_reference(reference: Path) -> list[str]:
    """The engine rewrites the installed build applied; raises SystemExit unless ``reference``
    loads as a llamaprompt module built with none (LLAMAPROMPT_ENGINE_REWRITES=OFF)."""
    with tempfile.TemporaryDirectory() as tmp_dir:
        ref_path = str(_reference_package(reference, Path(tmp_dir)))
        mine, theirs = _engine_rewrites(None), _engine_rewrites(ref_path)
    if not mine:
        raise SystemExit("the installed llamaprompt has no engine rewrite applied: nothing to compare")
    if theirs:
        raise SystemExit(
            f"{reference} was built with engine rewrites ({theirs}): build it with LLAMAPROMPT_ENGINE_REWRITES=OFF"
        )
    return mine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, help="_core module built with LLAMAPROMPT_ENGINE_REWRITES=OFF")
    ap.add_argument("--requests", type=count, default=200, help="generated requests per pinned template (200)")
    ap.add_argument("--mutants", type=count, default=300, help="fuzz-corpus templates (300)")
    ap.add_argument("--json", type=Path, help="write the counts here")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.requests, args.mutants)
        return 0
    if args.reference is None or not args.reference.is_file():
        ap.error("--reference: the path of a _core module built with LLAMAPROMPT_ENGINE_REWRITES=OFF")
    report = compare(args.reference, args.requests, args.mutants)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    return 1 if report["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
