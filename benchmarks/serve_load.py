"""`llamaprompt serve` under load: concurrent clients on loopback sending a mix of valid and
malformed requests for a bounded time. Checks that no valid request fails (each prompt is
compared with an in-process ChatTemplate), that every malformed one gets a 4xx/5xx JSON
error, and reports the server's RSS before and after.

    python benchmarks/serve_load.py [--seconds 30] [--clients 8] [--untrusted]

Exit status 1 when a check fails. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import llamaprompt

TEMPLATES = ["Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja", "google-gemma-2-2b-it.jinja"]
VALID = [
    {"messages": [{"role": "user", "content": "Hello"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "2+2?"},
        ]
    },
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
]
MALFORMED = [
    b'{"messages": [',
    b'{"messages": "hi"}',
    b'{"messages": [{"role": "user", "content": 5}]}',
    b'{"messages": [{"content": "no role"}]}',
    b'{"messages": [{"role": "user"}]}',
    b"\xff\xfe not json",
    b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}',
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, seconds: float = 60.0) -> None:
    """Wait until the server answers GET /health."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{base} did not start")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def post(url: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def run(seconds: float, clients: int, untrusted: bool) -> dict:
    paths = [str(llamaprompt.pinned_template(n)) for n in TEMPLATES]
    port = free_port()
    cmd = [sys.executable, "-m", "llamaprompt.cli", "serve", "--port", str(port), "--template", *paths]
    if untrusted:
        cmd.append("--untrusted")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base)
        expected = {
            (n, i): llamaprompt.ChatTemplate.from_file(p).apply_template(r)
            for n, p in zip(TEMPLATES, paths)
            for i, r in enumerate(VALID)
        }
        # warm up every route once, then measure RSS
        for n in TEMPLATES:
            post(f"{base}/apply-template?model={n}", json.dumps(VALID[0]).encode())
        rss_before = rss_mib(server.pid)
        stats = {"valid": 0, "valid_failed": 0, "malformed": 0, "malformed_bad_answer": 0}
        lock = threading.Lock()
        deadline = time.monotonic() + seconds

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                name = rng.choice(TEMPLATES)
                if rng.random() < 0.7:
                    i = rng.randrange(len(VALID))
                    status, body = post(f"{base}/apply-template?model={name}", json.dumps(VALID[i]).encode())
                    ok = status == 200 and json.loads(body).get("prompt") == expected[(name, i)]
                    with lock:
                        stats["valid"] += 1
                        stats["valid_failed"] += not ok
                else:
                    status, body = post(f"{base}/apply-template?model={name}", rng.choice(MALFORMED))
                    try:
                        good = 400 <= status < 600 and "message" in json.loads(body)["error"]
                    except (ValueError, KeyError, TypeError):
                        good = False
                    with lock:
                        stats["malformed"] += 1
                        stats["malformed_bad_answer"] += not good

        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=clients) as pool:
            list(pool.map(client, range(clients)))
        elapsed = time.monotonic() - t0
        rss_after = rss_mib(server.pid)
        return {
            **stats,
            "seconds": elapsed,
            "requests_per_s": (stats["valid"] + stats["malformed"]) / elapsed,
            "rss_before_mib": rss_before,
            "rss_after_mib": rss_after,
            "clients": clients,
            "untrusted": untrusted,
        }
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--untrusted", action="store_true")
    args = ap.parse_args()
    r = run(args.seconds, args.clients, args.untrusted)
    print(json.dumps(r, indent=2))
    ok = r["valid_failed"] == 0 and r["malformed_bad_answer"] == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
