"""The cost of UntrustedTemplate: renders/s in-process (ChatTemplate) vs in the sandbox
worker (one IPC round trip per call), and the worker's start-up time.

    python benchmarks/sandbox.py [--template NAME] [--calls 300]
"""

from __future__ import annotations

import argparse
import time

import llamaprompt
from llamaprompt.sandbox import UntrustedTemplate

REQ = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]}


def rate(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--template", default="Qwen-Qwen3-0.6B.jinja")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    path = llamaprompt.pinned_template(args.template)
    trusted = llamaprompt.ChatTemplate.from_file(path)
    t0 = time.perf_counter()
    sandboxed = UntrustedTemplate.from_file(path)
    start = time.perf_counter() - t0
    a = rate(lambda: trusted.apply_template(REQ), args.calls)
    b = rate(lambda: sandboxed.apply_template(REQ), args.calls)
    sandboxed.close()
    print(f"template {args.template}, {args.calls} calls each")
    print(f"  ChatTemplate (in-process)   {a:8.0f} renders/s")
    print(f"  UntrustedTemplate (worker)  {b:8.0f} renders/s   ({b / a:.2f}x of in-process)")
    print(f"  worker start-up             {start * 1000:8.0f} ms")


if __name__ == "__main__":
    main()
