"""The cost of UntrustedTemplate: renders/s in-process (ChatTemplate) vs in the sandbox
worker (one IPC round trip per call), and the worker's start-up time.

    python benchmarks/sandbox.py [--template NAME] [--calls 300] [--large-mib 8 32 64]

With --large-mib, also the time of one call whose message (and so prompt) is that many MiB,
in-process and through the worker (the pipe carries the request and the answer).
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
    ap.add_argument("--large-mib", type=int, nargs="*", default=[], metavar="MIB")
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
    if args.large_mib:
        large(args.large_mib)


def large(sizes: list[int]) -> None:
    source = "{{ messages[0]['content'] }}"
    trusted = llamaprompt.ChatTemplate(source, max_output_bytes=1 << 40)
    sandboxed = UntrustedTemplate(source, max_output_bytes=1 << 40, max_memory_bytes=None, timeout=600)
    print("one call with a large message (template: the message's content)")
    for mib in sizes:
        request = {"messages": [{"role": "user", "content": "x" * (mib << 20)}]}
        times = []
        for t in (trusted, sandboxed):
            t0 = time.perf_counter()
            t.apply_template(request)
            times.append(time.perf_counter() - t0)
        ratio = times[0] / times[1]
        print(f"  {mib:5d} MiB   in-process {times[0]:7.2f} s   worker {times[1]:7.2f} s   ({ratio:.2f}x)")
    sandboxed.close()


if __name__ == "__main__":
    main()
