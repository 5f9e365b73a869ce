"""The engine rewrites' gain: the same llamaprompt with llama.cpp's Jinja engine as upstream
wrote it (a ``_core`` built with ``LLAMAPROMPT_ENGINE_REWRITES=OFF``) and with the rewrites
(the installed one), measured one after the other on this machine.

    python benchmarks/engine_rewrites.py --reference REF_CORE.so [--min-time S] [--json OUT] [--markdown MD]

For every pinned template x the default request set, two figures per build: the floor
(one direct template execution in llama.cpp's engine, ``common_chat_template_direct_apply``
timed in C++ -- autoparser-path templates only) and ``apply_template`` (the fast path,
what a user calls). Prints, per template and as medians, the rewritten build's renders/s
over the unmodified one's (> 1: the rewrites are faster). How to build REF_CORE.so:
tests/engine_differential.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llamaprompt.bench import _per_call

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from engine_differential import _reference_package, check_reference  # noqa: E402  (the same reference)


def worker(min_time: float) -> dict[str, Any]:
    """Seconds per call, per template: ``floor`` and ``apply_template`` summed over the
    requests each renders without error."""
    import llamaprompt
    from llamaprompt.fixtures import default_requests
    from llamaprompt.pinned import pinned_templates

    bodies = [json.dumps(r, ensure_ascii=False).encode() for r in default_requests().values()]
    out: dict[str, Any] = {}
    for path in pinned_templates():
        t = llamaprompt.ChatTemplate.from_file(path)
        apply_s = floor_s = 0.0
        floored = True
        for body in bodies:
            try:
                t.apply_template(body)
            except llamaprompt.Error:
                continue
            apply_s += _per_call(lambda t=t, b=body: t.apply_template(b), min_time)
            per = max(1, int(min_time / max(apply_s / 20, 1e-6)))
            floor = t._core.time_direct_apply(body, per)
            if floor is None:
                floored = False
            else:
                floor_s += floor
        out[path.name] = {"apply_template": apply_s, "floor": floor_s if floored and floor_s else None}
    return out


def _run(pythonpath: str | None, min_time: float) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", "--min-time", str(min_time)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(proc.stdout)


def _seconds(text: str) -> float:
    x = float(text)
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError("must be a finite number >= 0")
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, help="_core module built with LLAMAPROMPT_ENGINE_REWRITES=OFF")
    ap.add_argument(
        "--min-time", type=_seconds, default=0.02, help="seconds of timing per template x request (0.02)"
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--markdown", type=Path, help="write the table here, with how it was produced")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.min_time)))
        return 0
    if args.reference is None or not args.reference.is_file():
        ap.error("--reference: the path of a _core module built with LLAMAPROMPT_ENGINE_REWRITES=OFF")
    check_reference(args.reference)
    with tempfile.TemporaryDirectory() as tmp:
        upstream = _run(str(_reference_package(args.reference, Path(tmp))), args.min_time)
        rewritten = _run(None, args.min_time)
    rows = {}
    for name, mine in rewritten.items():
        theirs = upstream[name]
        rows[name] = {
            key: theirs[key] / mine[key] if mine[key] and theirs[key] else None for key in ("floor", "apply_template")
        }
    medians = {
        key: statistics.median(v for r in rows.values() if (v := r[key]) is not None)
        for key in ("floor", "apply_template")
    }
    lines = ["| template | floor × | apply_template × |", "|---|---:|---:|"]
    for name, r in rows.items():
        cells = ["-" if r[k] is None else f"{r[k]:.2f}" for k in ("floor", "apply_template")]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    lines.append(
        f"\nMedian over templates: floor × {medians['floor']:.2f}, apply_template × {medians['apply_template']:.2f}"
    )
    table = "\n".join(lines) + "\n"
    print(table, end="")
    if args.markdown:
        import llamaprompt

        header = (
            "# Engine rewrites: measured gain (generated)\n\n"
            "Generated by `python benchmarks/engine_rewrites.py --reference REF_CORE.so --markdown "
            f"{args.markdown.name}` on {time.strftime('%Y-%m-%d')}: llama.cpp {llamaprompt.LLAMA_CPP_COMMIT}, "
            f"{os.cpu_count()} CPUs, "
            f"{args.min_time} s of timing per template x request, the default request set. Each figure is the "
            "rewritten build's renders/s over the same build's with `LLAMAPROMPT_ENGINE_REWRITES=OFF` "
            "(llama.cpp's Jinja engine as upstream wrote it), measured one after the other; `-`: no floor (a "
            "specialized handler renders the template). The rewrites: [../performance.md](../performance.md).\n\n"
        )
        args.markdown.write_text(header + table, encoding="utf-8")
    if args.json:
        args.json.write_text(
            json.dumps({"templates": rows, "median": medians, "upstream": upstream, "rewritten": rewritten}, indent=1)
            + "\n",
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
