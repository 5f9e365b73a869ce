"""Instructions per ``apply_template``, counted by valgrind's callgrind: the same count on every
run of the same build and inputs, so that one change can be measured on a machine whose
timings drift between runs (docs/performance.md, "Where it stands").

    python benchmarks/instructions.py [--reference OTHER_CORE.so] [--rounds N] [TEMPLATE ...]

For each pinned template named (default: Qwen3 0.6B, Llama 3.1 8B, Kimi K3, Gemma 4 31B), a
fresh process loads it and renders the default request set twice (the warm-up: the template
analysis and the parser-inputs memo are filled, then the first prompt-only renders run: one-time
costs such as the first C++ exception of a stop point), then N more rounds (default 10) with
Python's garbage collector off. It runs twice, with 0 and with N rounds; the difference over
N x the requests that render without error is the figure, so loading and the warm-up cancel out.
With ``--reference``, the same for a copy of the installed package whose ``_core`` is that module
(e.g. the previous build's, or one built with ``LLAMAPROMPT_ENGINE_REWRITES=OFF``), and the
installed build's count over it (< 1: the installed build runs fewer instructions). Needs
valgrind (Debian: ``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from engine_differential import _reference_package  # noqa: E402  (the differential's reference copy)

DEFAULT_TEMPLATES = (
    "Qwen-Qwen3-0.6B.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "Kimi-K3.jinja",
    "google-gemma-4-31B-it.jinja",
)


def worker(name: str, rounds: int) -> None:
    """Load ``name``, render the default request set twice (warm-up), then ``rounds`` more
    times with the garbage collector off; print how many requests render without error."""
    import llamaprompt
    from llamaprompt.fixtures import default_requests
    from llamaprompt.pinned import pinned_template

    t = llamaprompt.ChatTemplate.from_file(pinned_template(name))
    ok = []
    for request in default_requests().values():
        body = json.dumps(request, ensure_ascii=False).encode()
        try:
            t.apply_template(body)
        except llamaprompt.Error:
            continue
        ok.append(body)
    for body in ok:  # one more warm-up round: the first prompt-only renders
        t.apply_template(body)
    # Python's cyclic garbage collector runs when its allocation counters say so: a collection
    # falling in one of the two runs and not the other would be counted as rendering
    gc.collect()
    gc.disable()
    for _ in range(rounds):
        for body in ok:
            t.apply_template(body)
    print(len(ok))


def _count(pythonpath: str | None, name: str, rounds: int) -> tuple[int, int]:
    """(instructions, requests that render) of one worker process under callgrind."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # callgrind counts every thread: no BLAS/OpenMP worker threads (numpy's OpenBLAS polls),
    # one string-hash seed, so that the same build gives the same count on every run; no
    # bytecode written (the runs leave the packages as they found them)
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--worker",
            name,
            "--rounds",
            str(rounds),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{name}: the worker failed under valgrind: {last}")
    return int(found.group(1)), int(proc.stdout.split()[-1])


def per_render(pythonpath: str | None, name: str, rounds: int) -> float:
    """Instructions per apply_template of ``name`` (the N-round run minus the 0-round run)."""
    base, n = _count(pythonpath, name, 0)
    full, _ = _count(pythonpath, name, rounds)
    if n == 0:
        raise SystemExit(f"{name}: no request of the default set renders")
    return (full - base) / (rounds * n)


def _rounds(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("templates", nargs="*", help="pinned template names (default: four, see above)")
    ap.add_argument("--reference", type=Path, help="another _core module to count against")
    ap.add_argument("--rounds", type=_rounds, default=10, help="rounds over the default request set (10)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rounds)
        return 0
    if args.rounds == 0:
        ap.error("--rounds must be >= 1")
    if shutil.which("valgrind") is None:
        ap.error("valgrind is not installed (Debian: apt-get install valgrind)")
    if args.reference is not None and not args.reference.is_file():
        ap.error(f"--reference: no such module: {args.reference}")
    if args.reference is not None and not args.reference.name.startswith("_core."):
        ap.error(f"--reference: {args.reference.name} is not an extension module named _core.*")
    names = args.templates or list(DEFAULT_TEMPLATES)
    print("| template | instructions / render | reference | installed / reference |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        ref_path = str(_reference_package(args.reference, Path(tmp))) if args.reference else None
        for name in names:
            mine = per_render(None, name, args.rounds)
            theirs = per_render(ref_path, name, args.rounds) if ref_path else None
            cells = ["-", "-"] if theirs is None else [f"{theirs:,.0f}", f"{mine / theirs:.3f}"]
            print(f"| {name} | {mine:,.0f} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
