"""Dataset throughput: rows/s of `llamaprompt render-dataset` with 1 and 2 worker processes
and on Ray Data, on a synthetic conversation dataset, and the peak RSS of each run.

    python benchmarks/datasets.py [--rows 100000] [--template NAME] [--skip-ray]

Each configuration runs the CLI in its own process on the same JSONL file (written here)
and is timed end to end (start-up included); peak RSS is the child's (resource.RUSAGE_CHILDREN
read in a fresh wrapper process). Prints rows/s and the ratio to one worker. A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRAPPER = r"""
import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(rc)
"""


def write_dataset(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    with path.open("w") as f:
        for i in range(rows):
            msgs = [{"role": "system", "content": f"You are assistant {i % 7}."}] if rng.random() < 0.5 else []
            for t in range(rng.randint(1, 3)):
                msgs.append({"role": "user", "content": f"Question {i}.{t}: " + "lorem ipsum " * rng.randint(1, 20)})
                if rng.random() < 0.7:
                    msgs.append({"role": "assistant", "content": f"Answer {i}.{t}."})
            if msgs[-1]["role"] == "assistant":
                msgs.append({"role": "user", "content": "Thanks!"})
            row = {"messages": msgs}
            if rng.random() < 0.2:
                row["tools"] = [tool]
            f.write(json.dumps(row) + "\n")


def run(args: list[str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{proc.stderr}")
    peak_kib = int(proc.stderr.strip().splitlines()[-1])
    return dt, peak_kib / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--template", default="Qwen-Qwen3-0.6B.jinja", help="a pinned template name")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import llamaprompt

    template = str(llamaprompt.pinned_template(args.template))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        write_dataset(src, args.rows)
        configs = [("1 process", ["--workers", "1"]), ("2 processes", ["--workers", "2"])]
        if not args.skip_ray:
            configs.append(("Ray Data (2 actors)", ["--ray", "--workers", "2"]))
        for name, extra in configs:
            cmd = [
                sys.executable,
                "-m",
                "llamaprompt.cli",
                "render-dataset",
                str(src),
                "-o",
                str(Path(tmp) / "o.parquet"),
                "-t",
                template,
                "--no-progress",
                *extra,
            ]
            dt, peak = run(cmd)
            results[name] = {"seconds": dt, "rows_per_s": args.rows / dt, "peak_rss_mib": peak}
    base = results["1 process"]["rows_per_s"]
    if args.json:
        print(json.dumps({"rows": args.rows, "template": args.template, "results": results}, indent=2))
        return
    print(f"{args.rows} rows, template {args.template}, llama.cpp {llamaprompt.LLAMA_CPP_COMMIT}")
    for name, r in results.items():
        print(
            f"  {name:22s} {r['rows_per_s']:8.0f} rows/s  ({r['rows_per_s'] / base:.2f}x)  "
            f"{r['seconds']:7.1f} s  peak RSS {r['peak_rss_mib']:.0f} MiB"
        )


if __name__ == "__main__":
    main()
