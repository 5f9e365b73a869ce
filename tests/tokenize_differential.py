"""Differential run of ``llamaprompt serve``'s POST /tokenize and /detokenize against a live
llama-server of the tree the module was built from: the same bodies (odd ones by design: flags
of every JSON type, content mixing strings and ids, ids past int32, floats, bodies that are no
JSON, no object, UTF-16, nested 5,000 deep ...) sent to both, with the same GGUF, and each
answer's status and JSON compared.

    python tests/tokenize_differential.py LLAMA_SERVER [--model M.gguf] [--bodies N] [--json OUT]
                                          [--llama-cpp VERSION]

llama-server is started with ``-m`` the model (default: a tiny model written by
benchmarks/tiny_model.py, whose vocab is a real one) and a pinned template; llamaprompt serves
``ChatTemplate.from_gguf(model)`` over uvicorn in this process (``--llama-cpp``: with that
installed core, for a llama-server of another tree). Exit status: 0 when no answer
differs, 1 otherwise (the first differences are printed), 2 when a server cannot start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
import tiny_model  # noqa: E402

# JSON texts for "content" / "tokens" and for the flags
VALUES = [
    '"hi"',
    '"Hello <|im_start|> world"',
    '""',
    "5",
    "-1",
    "2.7",
    "1e10",
    "-1e10",
    "true",
    "false",
    "null",
    "[]",
    "{}",
    '[5, "hi"]',
    '["hi", 5, "hi"]',
    "[true, 2.7, 4294967297, 99999]",
    "[null]",
    "[[1]]",
    '[{"a": 1}]',
    '"\\ud800"',
    '"\\u00e9\\u4e2d"',
    "[1e400]",
    "9223372036854775808",
    "[18446744073709551616]",
    "[-2147483649]",
    "[32000]",
    "[100000]",
    "[-5]",
    '["\\n\\n"]',
    "[1, 2, 3]",
]
FLAGS = ["true", "false", '"false"', "1", "0", "null", "[true]", "{}"]
FIXED = [
    b"",
    b"null",
    b"[1]",
    b'"x"',
    b"{bad",
    b'{"content": "hi"} x',
    '{"content": "hi"}'.encode("utf-16"),
    b'\xef\xbb\xbf{"content": "hi"}',
    b'{"content": NaN}',
    b'{"content": "\xff"}',
    b'{"content": "a", "content": 5}',
    b'{"content": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"tokens": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b', "content": "hi", "tokens": [1]}',
]


def bodies(n_random: int, seed: int = 7) -> list[bytes]:
    """The fixed bodies, each value as content / tokens / content with pieces, then
    ``n_random`` bodies of random fields."""
    out = list(FIXED)
    for v in VALUES:
        out += [
            f'{{"content": {v}}}'.encode(),
            f'{{"tokens": {v}}}'.encode(),
            f'{{"content": {v}, "with_pieces": true}}'.encode(),
        ]
    rng = random.Random(seed)
    for _ in range(n_random):
        fields = {}
        if rng.random() < 0.9:
            fields["content"] = rng.choice(VALUES)
        for flag in ("add_special", "parse_special", "with_pieces"):
            if rng.random() < 0.5:
                fields[flag] = rng.choice(FLAGS)
        if rng.random() < 0.3:
            fields["tokens"] = rng.choice(VALUES)
        out.append(("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode())
    return out


class _Uvicorn:
    """``app`` served by uvicorn on a free loopback port in a thread; the value is its URL."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise OSError("llamaprompt serve did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def compare(binary: str, model: Path, n_random: int, llama_cpp: str | None = None) -> dict[str, Any]:
    import llamaprompt
    from llamaprompt import bench
    from llamaprompt.server import create_app

    served = llamaprompt.ChatTemplate.from_gguf(model, llama_cpp=llama_cpp)
    app = create_app({"m": served})
    cases = bodies(n_random)
    differences = []
    with (
        bench.LlamaServerProcess(binary, str(model), llamaprompt.pinned_template()) as theirs_url,
        _Uvicorn(app) as ours_url,
    ):
        theirs, ours = bench.ServerPeer(theirs_url), bench.ServerPeer(ours_url)
        for body in cases:
            for path in ("/tokenize", "/detokenize"):
                a, b = theirs.request("POST", path, body), ours.request("POST", path, body)
                if a != b:
                    differences.append(
                        {
                            "path": path,
                            "body": body[:200].decode("utf-8", "replace"),
                            "llama-server": repr(a)[:300],
                            "llamaprompt": repr(b)[:300],
                        }
                    )
        theirs.close()
        ours.close()
    return {
        "llama_cpp_commit": served.llama_cpp_commit,
        "model": model.name,
        "bodies": len(cases),
        "answers_compared": 2 * len(cases),
        "differences": len(differences),
        "first_differences": differences[:20],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_server", help="a llama-server binary of the tree llamaprompt was built from")
    ap.add_argument("--model", type=Path, help="the GGUF both serve (default: a tiny model, written here)")
    ap.add_argument("--bodies", type=int, default=300, help="random bodies besides the fixed ones (300)")
    ap.add_argument("--json", type=Path, help="write the counts here")
    ap.add_argument("--llama-cpp", help="serve with this installed core (a llama.cpp version: `llamaprompt cores`)")
    args = ap.parse_args(argv)
    if not (os.path.isfile(args.llama_server) and os.access(args.llama_server, os.X_OK)):
        ap.error(f"{args.llama_server}: not an executable file")
    if args.model is not None and not args.model.is_file():
        ap.error(f"{args.model}: no such file")
    if args.bodies < 0:
        ap.error(f"--bodies must be >= 0, not {args.bodies}")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "tiny.gguf"
            tiny_model.write_tiny_model(model, tiny_model.default_vocab())
        try:
            result = compare(args.llama_server, model, args.bodies, args.llama_cpp)
        except (RuntimeError, OSError) as e:
            print(f"tokenize_differential: a server could not start: {e}", file=sys.stderr)
            return 2
    text = json.dumps(result, indent=1, ensure_ascii=False)
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    return 1 if result["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
