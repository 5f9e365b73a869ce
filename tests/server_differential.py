"""Differential run against a live llama-server: every template x request of the engine
differential (tests/engine_differential.py: the pinned templates x the default requests, the
reference fixtures' requests and generated ones; the template fuzz corpus x the default
requests) sent to an unmodified llama-server of the tree the module was built from, and
compared with llamaprompt's answer.

    python tests/server_differential.py LLAMA_SERVER [--requests N] [--mutants M] [--json OUT]

The server is started once per template (``-m`` a tiny model written by
benchmarks/tiny_model.py, ``--jinja --chat-template-file``, no ``--mmproj``); llamaprompt
loads the same template as that server does (``ChatTemplate.from_gguf(model,
chat_template=..., media=False)``). Compared: whether the template loads (a server that
does not start against a ChatTemplate that raises), GET /props' ``chat_template_caps``,
and per request POST /apply-template's status and prompt against ``apply_template``'s prompt
or the status of the error it raised (RequestError 400, TemplateError 500); bytes that are
not UTF-8 compared as the server's JSON carries them (U+FFFD). A request where
llamaprompt's time, stack or size budget fired (the server has none) is counted and not
compared; where the server dies (a runaway recursion overflows its stack, or memory runs out:
it runs with an 8 GiB address space; at start, in its template analysis, or on a request, which
ends that template's run) it is listed with llamaprompt's outcome; a template the server is still
loading after ``--startup-timeout`` seconds (its analysis renders run without a time budget)
is listed and not compared. Differences fail the run (exit 1), as does a run that compared no
request; a server or model that cannot serve a pinned template at all stops it first (exit 2).
Exit status: 0 when nothing differs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "benchmarks"))
import tiny_model  # noqa: E402

import engine_differential  # noqa: E402

# llamaprompt's time, stack and size budgets: llama-server has none (where one fires, the server
# runs on, allocates until its address-space cap, or crashes), so those requests are not compared
BUDGET_MARKS = (*engine_differential.BUDGET_MARKS, engine_differential.SIZE_MARK)
# the server's address space: some fuzz mutants make it allocate without end (23 GB seen, then
# the out-of-memory killer), which llamaprompt's size budget stops at 64 MiB
SERVER_MEMORY = 8 << 30


def _ours(template: Any, body: bytes) -> tuple[int, str | None, bool]:
    """(status, prompt, whether a time, stack or size budget stopped it) for apply_template; the
    prompt as llama-server's JSON answer carries it (bytes that are not UTF-8 -- a template can
    print them -- become U+FFFD there; apply_template keeps them as surrogate escapes)."""
    import llamaprompt
    from llamaprompt.text import json_safe

    try:
        return 200, json_safe(template.apply_template(body)), False
    except llamaprompt.Error as e:
        return e.status or 500, None, any(mark in e.message for mark in BUDGET_MARKS)


def _loaded(ours: Any) -> str:
    return f"raised {type(ours).__name__}" if isinstance(ours, Exception) else "loaded it"


def _theirs(server: Any, body: bytes) -> tuple[int, str | None]:
    status, data = server.request("POST", "/apply-template", body)
    prompt = data.get("prompt") if status == 200 and isinstance(data, dict) else None
    return status, prompt


class SetupError(Exception):
    """The server, the model or the core cannot run the cases at all (nothing compared)."""


def _server(binary: str, model: Path, template: Path, startup_timeout: float) -> Any:
    """llama-server for ``template`` with ``model``, its memory capped (SERVER_MEMORY)."""
    from llamaprompt import bench

    return bench.LlamaServerProcess(
        binary, str(model), template, startup_timeout=startup_timeout, max_memory=SERVER_MEMORY
    )


def preflight(binary: str, model: Path, llama_cpp: str | None, startup_timeout: float) -> None:
    """Both sides must load the model with a pinned template, else every template would count
    as "refused by both" (or as a difference): raises SetupError with the reason."""
    import llamaprompt

    path = llamaprompt.pinned_template()
    try:
        llamaprompt.ChatTemplate.from_gguf(model, chat_template=path.read_bytes(), llama_cpp=llama_cpp)
    except (llamaprompt.Error, OSError) as e:
        raise SetupError(f"llamaprompt cannot load {model} with {path.name}: {e}") from None
    try:
        with _server(binary, model, path, startup_timeout):
            pass
    except (RuntimeError, OSError) as e:
        raise SetupError(f"{binary} does not serve {path.name} with {model}: {e}") from None


def compare(
    binary: str,
    n_requests: int,
    n_mutants: int,
    model: Path | None = None,
    startup_timeout: float = 60.0,
    llama_cpp: str | None = None,
) -> dict[str, Any]:
    """Run every case against ``binary`` and count templates, requests, differences (named).
    Raises SetupError when the server or llamaprompt cannot load the model at all.
    ``llama_cpp``: the llama.cpp core llamaprompt renders with (``ChatTemplate(llama_cpp=)``;
    default the built-in one): the server must be built from that core's tree."""
    import llamaprompt
    from llamaprompt import bench

    differences: list[str] = []
    crashed: list[str] = []  # the server died at start or on a request (closed the connection)
    stuck: list[str] = []  # the server still starting after startup_timeout (llamaprompt loaded it)
    templates = loaded = refused = requests = budget = 0
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if model is None:
            model = tiny_model.write_tiny_model(tmp / "tiny.gguf", tiny_model.default_vocab())
        preflight(binary, model, llama_cpp, startup_timeout)
        for name, source, cases in engine_differential.cases(n_requests, n_mutants):
            templates += 1
            print(f"[{templates}] {name}", file=sys.stderr, flush=True)
            path = tmp / "template.jinja"
            path.write_bytes(source)
            try:
                ours: Any = llamaprompt.ChatTemplate.from_gguf(
                    model, chat_template=source, media=False, timeout=5.0, llama_cpp=llama_cpp
                )
            except llamaprompt.Error as e:
                ours = e
            try:
                with _server(binary, model, path, startup_timeout) as url:
                    server = bench.ServerPeer(url)
                    if isinstance(ours, Exception):
                        differences.append(f"{name}: llama-server loads it, llamaprompt raised {ours!r}")
                        continue
                    loaded += 1
                    if server.props.get("chat_template_caps") != ours.caps:
                        differences.append(f"{name}: chat_template_caps")
                    for key, req in cases.items():
                        body = json.dumps(req, ensure_ascii=False).encode()
                        status, prompt, stopped = _ours(ours, body)
                        if stopped:
                            budget += 1
                            continue
                        try:
                            answer = _theirs(server, body)
                        except (OSError, http.client.HTTPException):
                            crashed.append(f"{name}: {key}: llamaprompt {status}")
                            break
                        requests += 1
                        if (status, prompt) != answer:
                            differences.append(f"{name}: {key}")
            except bench.ServerExited as e:
                if e.status < 0:  # killed by a signal (a runaway recursion overflows its stack)
                    crashed.append(f"{name}: at start (signal {-e.status}): llamaprompt " + _loaded(ours))
                elif not isinstance(ours, Exception):  # it refused the template, llamaprompt did not
                    last = str(e).splitlines()[-1].strip() if "\n" in str(e) else ""
                    differences.append(f"{name}: llama-server exits at start ({last}), llamaprompt loads it")
                else:
                    refused += 1
            except TimeoutError:  # e.g. a template analysis that runs for minutes (no budget there)
                stuck.append(f"{name}: llamaprompt " + _loaded(ours))
    return {
        "llama_cpp": llama_cpp or llamaprompt.tree_info()["commit"],
        "templates": templates,
        "templates_loaded": loaded,
        "templates_refused_by_both": refused,  # the server exits at start, ChatTemplate raises
        "requests_compared": requests,
        "budget_stopped": budget,
        "differences": len(differences),
        "different": differences[:50],
        "server_died": crashed,
        "server_still_starting": stuck,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_server", help="a llama-server binary of the tree llamaprompt was built from")
    ap.add_argument("--model", type=Path, help="the GGUF to start it with (default: a tiny model, written here)")
    ap.add_argument("--requests", type=engine_differential.count, default=200, help="generated requests (200)")
    ap.add_argument("--mutants", type=engine_differential.count, default=300, help="fuzz-corpus templates (300)")
    ap.add_argument("--startup-timeout", type=float, default=60.0, help="seconds a server may take to start (60)")
    ap.add_argument("--llama-cpp", help="render with this installed core (a llama.cpp version: `llamaprompt cores`)")
    ap.add_argument("--json", type=Path, help="write the counts here")
    args = ap.parse_args(argv)
    if not (os.path.isfile(args.llama_server) and os.access(args.llama_server, os.X_OK)):
        ap.error(f"{args.llama_server}: not an executable file")
    if not args.startup_timeout > 0:
        ap.error(f"--startup-timeout must be > 0 seconds, not {args.startup_timeout}")
    if args.model is not None and not args.model.is_file():
        ap.error(f"{args.model}: no such file")
    if args.json is not None and not os.access(args.json.parent.resolve(), os.W_OK):
        ap.error(f"{args.json}: its folder is not writable")
    try:
        result = compare(
            args.llama_server, args.requests, args.mutants, args.model, args.startup_timeout, args.llama_cpp
        )
    except SetupError as e:
        print(f"server_differential: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    return 1 if result["differences"] or not result["requests_compared"] else 0


if __name__ == "__main__":
    sys.exit(main())
