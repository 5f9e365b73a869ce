"""Load cost of a multi-GB GGUF model: ChatTemplate.from_gguf (llama.cpp, vocab only)
against the gguf package's GGUFReader (the peer: llama.cpp's own Python reader, which
memory-maps the file and parses every tensor record).

    python benchmarks/gguf_load.py [--size-gb 8] [--repeat 5] [--vocab PATH]

The model is written here: the metadata (tokenizer, template) of a vocab GGUF from the
pinned tree plus N large F16 tensors whose data is a sparse hole, so a multi-GB file costs
no disk writes. Each load runs in a fresh process so peak RSS is that load's alone.
Prints time and peak-RSS ratios; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

# peak RSS from /proc (VmHWM starts anew at exec; ru_maxrss would inherit the parent's)
CHILD = r"""
import json, sys, time
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
kind, path = sys.argv[1], sys.argv[2]
if kind == "llamaprompt":
    import llamaprompt
    base = status("VmRSS")
    t0 = time.perf_counter()
    t = llamaprompt.ChatTemplate.from_gguf(path)
    t.apply_template({"messages": [{"role": "user", "content": "hi"}]})
else:
    import gguf
    base = status("VmRSS")
    t0 = time.perf_counter()
    r = gguf.GGUFReader(path, "r")
    r.get_field("tokenizer.chat_template")
dt = time.perf_counter() - t0
peak = status("VmHWM")
print(json.dumps({"seconds": dt, "peak_rss_mib": peak, "rss_growth_mib": peak - base}))
"""


def default_vocab() -> Path:
    env = os.environ.get("LLAMAPROMPT_LLAMA_CPP_DIR")
    base = Path(env) if env else HERE.parent / "third_party" / "llama.cpp"
    return base / "models" / "ggml-vocab-llama-spm.gguf"


def write_big_gguf(vocab: Path, out: Path, size_gb: float) -> int:
    """Copy vocab's metadata, add sparse F16 tensors up to ~size_gb; returns the file size."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(vocab, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(out, arch=arch)
    rows, cols = 32000, 4096  # one embedding-sized tensor: 250 MiB in F16
    per = rows * cols * 2
    n = max(1, int(size_gb * (1 << 30) // per))
    # copy_with_new_metadata writes header + kv + tensor infos; add our tensor infos first
    for i in range(n):
        writer.add_tensor_info(f"blk.{i}.ffn_up.weight", (rows, cols), np.dtype(np.float16), per)
    copy_with_new_metadata(reader, writer, {}, [])  # writes header, kv, ti and closes
    # tensor data: a sparse hole (the loader never reads it with vocab_only)
    with open(out, "r+b") as f:
        f.seek(0, os.SEEK_END)
        aligned = (f.tell() + 31) // 32 * 32
        f.truncate(aligned + n * per)
    return out.stat().st_size


def measure(kind: str, path: Path, repeat: int) -> dict:
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", CHILD, kind, str(path)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{kind} failed:\n{out.stderr}")
        runs.append(json.loads(out.stdout))
    return {
        "seconds_median": statistics.median(r["seconds"] for r in runs),
        "peak_rss_mib_median": statistics.median(r["peak_rss_mib"] for r in runs),
        "rss_growth_mib_median": statistics.median(r["rss_growth_mib"] for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=8.0, help="model size to write (default 8)")
    ap.add_argument("--repeat", type=int, default=5, help="loads per reader (default 5)")
    ap.add_argument("--vocab", type=Path, default=default_vocab(), help="vocab GGUF to take metadata from")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.gguf"
        size = write_big_gguf(args.vocab, path, args.size_gb)
        ours = measure("llamaprompt", path, args.repeat)
        peer = measure("gguf-py", path, args.repeat)
    result = {
        "file_gib": size / (1 << 30),
        "llamaprompt.from_gguf": ours,
        "gguf.GGUFReader": peer,
        "time_ratio_peer_over_ours": peer["seconds_median"] / ours["seconds_median"],
        "rss_growth_ratio_peer_over_ours": peer["rss_growth_mib_median"] / max(ours["rss_growth_mib_median"], 1e-9),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"GGUF file: {result['file_gib']:.2f} GiB (sparse tensor data), {args.repeat} loads each, "
        "fresh process per load"
    )
    for name in ("llamaprompt.from_gguf", "gguf.GGUFReader"):
        r = result[name]
        print(
            f"  {name:24s} {r['seconds_median'] * 1000:8.1f} ms   peak RSS {r['peak_rss_mib_median']:7.1f} MiB"
            f"   (+{r['rss_growth_mib_median']:.1f} MiB for the load)"
        )
    print(f"  ratio (GGUFReader / from_gguf): time {result['time_ratio_peer_over_ours']:.2f}x")


if __name__ == "__main__":
    main()
