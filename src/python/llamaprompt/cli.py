"""The ``llamaprompt`` command line.

    llamaprompt render [--template FILE | --pinned NAME] [options] [REQUEST.json | -] [-- llama-server flags]
    llamaprompt caps [--template FILE] [options]
    llamaprompt props [--template FILE] [options]
    llamaprompt normalize [--template FILE] [options] MESSAGES.json
    llamaprompt tokenize --gguf FILE [TEXT | -]
    llamaprompt inspect FILE.gguf
    llamaprompt fixtures (--template FILE... | --templates DIR | --gguf FILE... | --pinned)
                         [--requests R.json] -o OUT.json
    llamaprompt check FIXTURES.json [--mask-dates]
    llamaprompt diff REFERENCE.json OTHER.json [--format markdown|json]
    llamaprompt serve (--template FILE... | --gguf FILE...) [--host H] [--port N]
    llamaprompt bench [--template FILE... | --pinned [NAME...]] [--server-url URL] [--json OUT] [--plot OUT.png]
    llamaprompt cores (add VERSION | add --llama-cpp-dir DIR | list | remove VERSION)
    llamaprompt diff-versions --from VERSION --to VERSION [-t FILE... | --gguf FILE... | --pinned [NAME...]]
                              [--requests R.json] [--json OUT] [-- llama-server flags]

``--llama-cpp VERSION`` (render, caps, ..., fixtures, check, serve) renders with the core built
for that llama.cpp (``llamaprompt cores add VERSION``) instead of the built-in one.

``--gguf FILE`` (render, caps, props, normalize) takes the template from a model file;
``--pinned NAME`` one of the templates shipped from the pinned llama.cpp tree, by file name
(``llamaprompt render --pinned Qwen3-Coder``; an unknown name lists them).

llama-server flags go after ``--`` (or one by one with ``--server-arg=FLAG``), e.g.
``llamaprompt render --template T req.json -- --reasoning off``. Errors from llama.cpp
print its message on stderr and exit with status 2; Ctrl-C exits with status 130, and output
to a pipe whose reader has left (``| head``) stops quietly with status 141.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import LLAMA_CPP_COMMIT, LLAMA_CPP_SOURCE, __version__
from . import fixtures as fx
from .errors import Error, RequestError
from .gguf import gguf_metadata
from .options import DEFAULT_MEDIA_MARKER, DEFAULT_TIMEOUT
from .options import media_kinds as _media
from .pinned import DEFAULT_TEMPLATE, pinned_template, pinned_templates
from .samples import PLAIN_SAMPLE_REQUEST, SAMPLE_REQUEST
from .template import ChatTemplate
from .text import json_safe
from .tree import tree_info

__all__ = ["main"]


def _non_negative(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError("must be a finite number >= 0")
    return x


def _positive_seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError("must be a finite number of seconds > 0")
    return x


def _timeout(text: str) -> float | None:
    """--timeout: seconds > 0, or ``none`` (or an infinite number: ``inf``) for no budget
    (ChatTemplate's timeout=None)."""
    if text.strip().lower() == "none":
        return None
    try:
        if float(text) == float("inf"):
            return None
        return _positive_seconds(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError("must be a number of seconds > 0, or none (or inf) for no budget") from None


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (None: no upper bound)."""

    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):  # (int() takes "1_000" and other scripts' digits)
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        n = int(text)
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"must be {low}..{high}" if high is not None else f"must be >= {low}")
        return n

    return parse


def _core_and_media_options(g: Any) -> None:
    """--media / --no-media (media=) and --llama-cpp (llama_cpp=), for one or many templates."""
    g.add_argument(
        "--media",
        metavar="KINDS",
        default=None,
        help="media parts requests may carry, as llama-server with a projector supporting them: a comma list of "
        "image, audio, video (default: all three, as with a vision+audio --mmproj)",
    )
    g.add_argument(
        "--no-media",
        action="store_true",
        help="as llama-server without --mmproj: media parts are refused ('image input is not supported ...')",
    )
    g.add_argument(
        "--llama-cpp",
        metavar="VERSION",
        help="render with the core built for this llama.cpp (a llama-cpp-python version such as 0.3.33, or a "
        "commit; see: llamaprompt cores list) instead of the built-in one",
    )


def _file_token_options(g: Any) -> None:
    """BOS/EOS text and add_bos/add_eos for template files (several at once)."""
    g.add_argument("--bos-token", default="", metavar="S", help="BOS text for template files (default: empty)")
    g.add_argument("--eos-token", default="", metavar="S", help="EOS text for template files (default: empty)")
    g.add_argument("--add-bos", action="store_true", help="template files: strip one leading BOS")
    g.add_argument("--add-eos", action="store_true", help="template files: strip one trailing EOS")


def _template_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("template (as llama-server loads it)")
    g.add_argument(
        "--template",
        "-t",
        metavar="FILE",
        help=f"Jinja chat template file, as --chat-template-file (default: the pinned tree's {DEFAULT_TEMPLATE})",
    )
    g.add_argument(
        "--pinned",
        metavar="NAME",
        help="a template shipped from the pinned llama.cpp tree, by file name (.jinja optional), instead of "
        "--template FILE; an unknown name lists them",
    )
    g.add_argument(
        "--gguf",
        metavar="FILE",
        help="take the template, tool_use variant, BOS/EOS and add_bos/add_eos from a GGUF model (vocab only, as "
        "llama-server -m FILE); with --template, that file replaces the model's template",
    )
    g.add_argument("--bos-token", default="", metavar="S", help="BOS token text (default: empty)")
    g.add_argument("--eos-token", default="", metavar="S", help="EOS token text (default: empty)")
    g.add_argument("--add-bos", action="store_true", help="the vocab adds BOS: strip one leading BOS from the prompt")
    g.add_argument("--add-eos", action="store_true", help="the vocab adds EOS: strip one trailing EOS from the prompt")
    _media_marker_option(g)
    g.add_argument(
        "--builtin",
        metavar="NAME",
        help="a built-in non-Jinja template, as llama-server --no-jinja --chat-template NAME",
    )
    g.add_argument("--caps", metavar="JSON", help="force caps, e.g. '{\"supports_typed_content\": true}'")
    g.add_argument(
        "--handler",
        choices=("auto", "autoparser", "pure_content"),
        default="auto",
        help="auto: llama.cpp's choice; autoparser: skip specialized handlers; pure_content: --skip-chat-parsing",
    )
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one llama-server flag or value (repeatable; write --server-arg=--flag); "
        "flags after a bare -- are added too",
    )
    g.add_argument(
        "--timeout",
        type=_timeout,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds the template's executions of one call may take (default {DEFAULT_TIMEOUT:g}; "
        "none: no budget); past it the call fails with a TemplateError carrying llama.cpp's source excerpt",
    )
    _core_and_media_options(g)


def _media_marker_option(g: Any) -> None:
    """--media-marker, as llama-server's LLAMA_MEDIA_MARKER (what an image or audio part becomes)."""
    g.add_argument(
        "--media-marker",
        default=DEFAULT_MEDIA_MARKER,
        metavar="S",
        help=f"text that media parts become (default: {DEFAULT_MEDIA_MARKER})",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamaprompt",
        description="llama.cpp's own chat-template code: llama-server's exact prompts, caps and "
        "normalized messages, with no model and no server.",
        epilog="llama-server flags go after --, e.g.: llamaprompt render -t T.jinja req.json -- --reasoning off",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"llamaprompt {__version__} (llama.cpp {LLAMA_CPP_COMMIT}, {LLAMA_CPP_SOURCE})",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "render",
        help="print the prompt POST /apply-template returns (exact bytes)",
        description="Print the prompt llama-server's POST /apply-template returns for a request "
        "body, byte for byte, with no trailing newline added. With no request, "
        "renders a built-in sample (system, tools, a tool call and its result; with --builtin, "
        "whose templates llama.cpp gives no tools, a system, user, assistant, user chat).",
    )
    _template_options(p)
    p.add_argument(
        "request",
        nargs="?",
        metavar="REQUEST.json",
        help="request body file, or - for stdin (default: the built-in sample)",
    )
    p.add_argument(
        "--params",
        action="store_true",
        help="print everything the call computes (chat format, grammar, triggers, ...) as JSON",
    )
    p.add_argument(
        "--untrusted",
        action="store_true",
        help="run the template in a sandboxed worker process (llamaprompt.sandbox: killed past --timeout per "
        "call, or --timeout + 30 s for the load; a 4 GiB address space); for templates from unknown sources",
    )

    p = sub.add_parser("caps", help="print chat_template_caps as GET /props reports them")
    _template_options(p)

    p = sub.add_parser("props", help="print the chat-template part of GET /props")
    _template_options(p)

    p = sub.add_parser(
        "describe",
        help="print what llama.cpp decided for the template (chat format, handler, caps, thinking)",
    )
    _template_options(p)

    p = sub.add_parser(
        "normalize",
        help="print the messages the template receives",
        description="Print the messages llama.cpp hands the template (after "
        "messages_inp_normalizer for its caps) for OpenAI-form messages: "
        "a JSON list, or an object with 'messages' (and optional 'tools').",
    )
    _template_options(p)
    p.add_argument(
        "messages",
        nargs="?",
        default=None,
        metavar="MESSAGES.json",
        help="messages file, or - for stdin (default: the built-in sample request's)",
    )

    p = sub.add_parser(
        "inputs",
        help="print the context llama.cpp hands its Jinja engine for a request (every render)",
        description="Run the request as POST /apply-template does and print, captured from llama.cpp's own "
        "call, the Jinja context of every render of the template (messages after normalization, workarounds "
        "and the handler's rewrites; tools; bos/eos; enable_thinking; extra context), which render the prompt "
        "comes from, and the prompt: ChatTemplate.template_inputs as JSON.",
    )
    _template_options(p)
    p.add_argument("request", nargs="?", default=None, metavar="REQUEST.json", help="request body, or - for stdin")
    p.add_argument("--context-only", action="store_true", help="print only the prompt's render's context")

    p = sub.add_parser(
        "render-inputs",
        help="render a given Jinja context with llama.cpp's engine (no preprocessing)",
        description="Render CONTEXT.json (a JSON object of template variables, e.g. from 'llamaprompt inputs "
        "--context-only') with llama.cpp's Jinja engine only: no normalization, no handler, no BOS/EOS "
        "stripping (ChatTemplate.render_inputs). For 'is it my engine or my preprocessing?'.",
    )
    _template_options(p)
    p.add_argument("context", metavar="CONTEXT.json", help="the template context, or - for stdin")
    p.add_argument("--variant", choices=("default", "tool_use"), help="template variant (default: as llama.cpp picks)")

    p = sub.add_parser(
        "tokenize",
        help="print token ids as POST /tokenize (GGUF vocab)",
        description="Tokenize text with a GGUF file's vocab, as llama-server's POST /tokenize.",
    )
    p.add_argument("--gguf", required=True, metavar="FILE", help="GGUF model file (only the vocab is read)")
    p.add_argument("text", nargs="?", default="-", metavar="TEXT", help="text to tokenize, or - for stdin (default)")
    p.add_argument("--add-special", action="store_true", help="add BOS/EOS as the vocab says (default: off)")
    p.add_argument("--no-parse-special", action="store_true", help="treat special-token text as plain text")
    p.add_argument("--pieces", action="store_true", help="print [{id, piece}] like with_pieces")

    p = sub.add_parser(
        "parse",
        help="parse model output as llama-server does (content, reasoning_content, tool calls)",
        description="Render REQUEST with the template (as POST /apply-template), then parse OUTPUT (the text a "
        "model generated after that prompt) as llama-server parses it; prints choices[0].message as JSON, "
        "or with --stream the OpenAI delta objects, one JSON per line.",
    )
    _template_options(p)
    p.add_argument("--request", required=True, metavar="REQUEST.json", help="the request the output answers")
    p.add_argument("output", metavar="OUTPUT.txt", help="generated text, or - for stdin")
    p.add_argument(
        "--partial",
        action="store_true",
        help="parse as an unfinished generation (with --stream: stop after the last chunk, without the final parse)",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="print the streaming deltas as llama-server sends them, one line per delta, as each chunk is fed "
        "(each chunk parses the output so far again, as llama-server does per token: long outputs in small "
        "chunks take a while)",
    )
    p.add_argument(
        "--chunk",
        type=_int_in(1),
        metavar="N",
        help="with --stream: characters (code points) fed at a time, like a token's text (default 8)",
    )

    p = sub.add_parser(
        "render-dataset",
        help="render a conversation dataset (JSONL or Parquet) into Parquet, streaming",
        description="Render every row of IN (.jsonl: one object per line, of which 'messages' and the optional "
        "'tools' and 'chat_template_kwargs' are read -- other keys are kept in the 'record' column but not sent; "
        ".parquet: a 'messages' column and optional 'tools' / "
        "'chat_template_kwargs' columns) with llama.cpp's code into OUT.parquet: the input columns plus "
        "'prompt', 'error' (llama.cpp's message for a row that fails) and, with --tokens, 'tokens'. Streams "
        "in batches, so memory stays bounded.",
    )
    _template_options(p)
    p.add_argument("input", metavar="IN", help="input .jsonl or .parquet file")
    p.add_argument("-o", "--output", required=True, metavar="OUT.parquet", help="Parquet file to write")
    p.add_argument("--tokens", action="store_true", help="add prompt tokens (needs --gguf)")
    p.add_argument("--workers", type=_int_in(1), default=1, metavar="N", help="worker processes (default 1)")
    p.add_argument("--batch-rows", type=_int_in(1), default=2048, metavar="N", help="rows per batch (default 2048)")
    p.add_argument("--ray", action="store_true", help="run the batches on Ray Data (pip install 'llamaprompt[ray]')")
    p.add_argument(
        "--training",
        action="store_true",
        help="fine-tuning text: no generation prompt, and a final assistant turn closed as llama-server "
        "--no-prefill-assistant renders it (default: rows as llama-server serves them, a final assistant "
        "message being an open prefill)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (nor Ray Data's progress output)")

    p = sub.add_parser("inspect", help="print a GGUF file's metadata (llama.cpp's gguf reader)")
    p.add_argument("file", metavar="FILE", help="GGUF file")
    p.add_argument(
        "--max-array-items",
        type=_int_in(0),
        default=16,
        metavar="N",
        help="summarize arrays longer than N by type and length (default: 16)",
    )

    def _multi_options(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("templates (each as llama-server loads it)")
        g.add_argument(
            "--template",
            "-t",
            nargs="+",
            action="extend",
            default=[],
            metavar="FILE",
            help="Jinja template files (repeatable)",
        )
        g.add_argument(
            "--templates", action="append", default=[], metavar="DIR", help="every *.jinja file in DIR (repeatable)"
        )
        g.add_argument(
            "--gguf",
            nargs="+",
            action="extend",
            default=[],
            metavar="FILE",
            help="GGUF model files: template, BOS/EOS and add_bos/add_eos from each file",
        )
        g.add_argument(
            "--pinned",
            nargs="*",
            metavar="NAME",
            default=None,
            help="templates of the pinned llama.cpp tree shipped with llamaprompt: the NAMEs given "
            "(e.g. Qwen-Qwen3-0.6B.jinja), or all of them",
        )
        _file_token_options(g)
        _media_marker_option(g)
        g.add_argument(
            "--server-arg",
            action="append",
            default=[],
            metavar="ARG",
            help="one llama-server flag (repeatable); flags after a bare -- are added too",
        )
        _core_and_media_options(g)

    p = sub.add_parser(
        "fixtures",
        help="render every template x request into a fixtures JSON file",
        description="Render every template x request with llama.cpp's code and write a versioned fixtures "
        "file (docs/fixtures.md): per template its sha256 and caps, per case the prompt or the error.",
    )
    _multi_options(p)
    p.add_argument(
        "--requests",
        metavar="REQUESTS.json",
        help="JSON object name -> request body (default: the request set shipped with llamaprompt)",
    )
    p.add_argument(
        "-o", "--output", required=True, metavar="OUT.json", help="fixtures file to write (- for standard output)"
    )
    p.add_argument(
        "--with-inputs",
        action="store_true",
        help="store with each prompt the Jinja context llama.cpp rendered it from (template_inputs)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("check", help="re-render a fixtures file and report the cases that differ (exit 1)")
    p.add_argument(
        "fixtures",
        metavar="FIXTURES.json",
        help="fixtures file (llamaprompt fixtures, docs/fixtures.md), or - for stdin",
    )
    p.add_argument("--mask-dates", action="store_true", help="compare with dates printed by templates masked")
    p.add_argument("--llama-cpp", metavar="VERSION", help="re-render with the core built for this llama.cpp")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "diff",
        help="compare another renderer's prompts with reference fixtures",
        description="OTHER holds another renderer's prompts: a fixtures file, or a minimal "
        '{"template": {"request": "prompt"}} map. Prints how many templates agree, caps side by side '
        "where OTHER has them, and each difference with its first differing offset and context.",
    )
    p.add_argument(
        "reference", metavar="REFERENCE.json", help="reference fixtures file (llamaprompt fixtures), or - for stdin"
    )
    p.add_argument("other", metavar="OTHER.json", help="the other renderer's prompts (fixtures file or map), or -")
    p.add_argument(
        "--format", choices=("markdown", "json"), default="markdown", help="report format (default: markdown)"
    )
    p.add_argument("--mask-dates", action="store_true", help="compare with dates masked")
    p.add_argument("--context", type=_int_in(0), default=30, metavar="N", help="characters of context (default 30)")
    p.add_argument(
        "--explain",
        action="store_true",
        help="list every differing span and find each difference's cause by experiment with llama.cpp's own "
        "stages (leading BOS, dates, thinking default, message preprocessing, prefill, ...)",
    )
    p.add_argument("--llama-cpp", metavar="VERSION", help="the core --explain re-renders with (default: built-in)")

    p = sub.add_parser(
        "cores",
        help="build, list and remove cores for other llama.cpp trees (llama_cpp=, --llama-cpp)",
        description="A core is llamaprompt's C++ module built against one llama.cpp tree. The package has one "
        "built in; 'cores add' builds more into the per-user cache ($LLAMAPROMPT_CACHE_DIR/cores, else "
        "$XDG_CACHE_HOME/llamaprompt/cores or ~/.cache/llamaprompt/cores; a folder per commit and Python; minutes, "
        "incremental afterwards), and every command's --llama-cpp VERSION (ChatTemplate(llama_cpp=...)) then "
        "renders with it, in a worker process.",
    )
    csub = p.add_subparsers(dest="cores_command", required=True, metavar="ACTION", help="add, list or remove")
    c = csub.add_parser("add", help="build a core for a llama-cpp-python version's tree, or a llama.cpp folder")
    c.add_argument("version", nargs="?", metavar="VERSION", help="llama-cpp-python version, e.g. 0.3.33")
    c.add_argument("--llama-cpp-dir", metavar="DIR", help="a llama.cpp source tree instead of a version")
    c.add_argument("--source", metavar="DIR", help="llamaprompt's sources (default: where the package was built from)")
    c.add_argument("-j", "--jobs", type=_int_in(1), metavar="N", help="parallel compile jobs")
    c.add_argument("--force", action="store_true", help="rebuild even when a usable core is installed")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument(
        "--no-build-isolation",
        action="store_true",
        help="pip's flag: build with the build requirements installed here (scikit-build-core, pybind11, cmake, ninja)",
    )
    c = csub.add_parser("list", help="the built-in core and the installed ones: commit, date, features, size")
    c.add_argument("--json", action="store_true", help="print JSON")
    c = csub.add_parser("remove", help="delete an installed core and its build directories")
    c.add_argument("name", metavar="VERSION|COMMIT", help="an installed core's version or commit (cores list)")

    p = sub.add_parser(
        "diff-versions",
        help="what changes for templates between two llama.cpp trees (caps, prompts, errors); exit 1 if any",
        description="Load each template with two cores (llamaprompt cores list) and render every request with "
        "both: per template the chat_template_caps that changed, per request whether the prompt changed (first "
        "differing offset and both excerpts), the error changed, it now fails or now renders; then a summary "
        "line. Exit status 0 when nothing changed, 1 when something did, 2 on error.",
    )
    p.add_argument("--from", dest="from_core", required=True, metavar="VERSION", help="the old llama.cpp core")
    p.add_argument("--to", dest="to_core", required=True, metavar="VERSION", help="the new llama.cpp core")
    g = p.add_argument_group("templates (default: every template shipped with llamaprompt)")
    g.add_argument("--template", "-t", nargs="+", action="extend", default=[], metavar="FILE", help="template files")
    g.add_argument(
        "--templates", action="append", default=[], metavar="DIR", help="every *.jinja file in DIR (repeatable)"
    )
    g.add_argument("--gguf", nargs="+", action="extend", default=[], metavar="FILE", help="GGUF model files")
    g.add_argument("--pinned", nargs="*", metavar="NAME", default=None, help="shipped templates by name (or all)")
    _file_token_options(g)
    g.add_argument(
        "--server-arg",
        "--server-args",
        dest="server_arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one llama-server flag for both sides (repeatable); flags after a bare -- are added too",
    )
    p.add_argument(
        "--requests",
        metavar="REQUESTS.json",
        help="name -> request body, or a fixtures/reference file (its 'requests'); default: the shipped set",
    )
    p.add_argument("--json", metavar="OUT.json", help="also write the full report as JSON (- for stdout)")
    p.add_argument("--context", type=_int_in(0), default=30, metavar="N", help="excerpt characters (30)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "bench",
        help="renders/s of apply_template vs Jinja2, llama.cpp's uncached path, llama-server and the floor",
        description="Time apply_template for every template x request (default: every pinned template x the "
        "default request set) side by side, in the same run, with: llama.cpp's uncached upstream path "
        "(fast_path=False, what llama-server runs), transformers' own renderer (render_jinja_template) and Python "
        "Jinja2 set up as transformers' apply_chat_template (pip install 'llamaprompt[bench]'), llama-server over "
        "HTTP (--server-url), and the floor (one plain "
        "execution of the template in llama.cpp's Jinja engine). Prints a Markdown table of ratios per template "
        "and their medians: '× PEER' is llamaprompt's renders/s over the peer's (> 1: llamaprompt is faster), "
        "'time / floor' llamaprompt's time over the floor's (1.0 is the floor). docs/performance.md explains "
        "each column.",
    )
    g = p.add_argument_group("templates (default: every template of the pinned tree)")
    g.add_argument("--template", "-t", nargs="+", action="extend", default=[], metavar="FILE", help="template files")
    g.add_argument(
        "--templates", action="append", default=[], metavar="DIR", help="every *.jinja file in DIR (repeatable)"
    )
    g.add_argument("--pinned", nargs="*", metavar="NAME", default=None, help="pinned templates by name (or all)")
    p.add_argument(
        "--requests", metavar="REQUESTS.json", help="JSON object name -> request body (default: the shipped set)"
    )
    p.add_argument("--threads", type=_int_in(1), default=2, metavar="N", help="threads for the scaling figure (2)")
    p.add_argument(
        "--min-time",
        type=_non_negative,
        default=0.02,
        metavar="S",
        help="seconds timing each template x request x peer, in three windows (default 0.02; 0: one call per window)",
    )
    p.add_argument("--server-url", metavar="URL", help="a llama-server, http://HOST:PORT (its template is compared)")
    p.add_argument(
        "--llama-server",
        nargs=2,
        metavar=("BINARY", "MODEL.gguf"),
        help="start this llama-server with MODEL and each template in turn, and compare every template",
    )
    p.add_argument("--no-jinja2", action="store_true", help="skip the Jinja2 peer")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers peer (render_jinja_template)")
    p.add_argument("--no-upstream", action="store_true", help="skip llama.cpp's uncached path (the slowest peer)")
    p.add_argument("--no-floor", action="store_true", help="skip the floor")
    p.add_argument(
        "--memory",
        type=_int_in(0),
        default=100,
        metavar="N",
        help="templates loaded for the memory report (default 100; 0: skip)",
    )
    p.add_argument("--json", metavar="OUT.json", help="also write the full results as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="also draw renders/s per template (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "serve",
        help="serve llama-server's /apply-template, /props, /tokenize ... with no model",
        description="A model-free llama-server-compatible HTTP endpoint (needs starlette and uvicorn: pip install "
        "starlette uvicorn). "
        'Several templates at once: pick one with a "model" field or ?model=NAME (names: file names). '
        "The default is the first: --template, --templates and --pinned files in that order, then --gguf "
        "files, whatever their order on the command line; for /tokenize and /detokenize, the first --gguf file.",
    )
    _multi_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=_int_in(1, 65535), default=8080, help="port (default 8080)")
    p.add_argument(
        "--untrusted",
        action="store_true",
        help="run each template in a sandboxed worker process with a time budget (llamaprompt.sandbox)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=10.0,
        metavar="S",
        help="with --untrusted: seconds one render may take (default 10)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_int_in(1),
        default=16 * 1024 * 1024,
        metavar="N",
        help="refuse larger request bodies with 413 (default 16 MiB)",
    )
    return parser


def _template_dirs(dirs: list[str]) -> list[Path]:
    """The *.jinja files of every --templates DIR, in order; UsageError for a DIR that is not a
    directory or holds none (a typo must not silently mean "fewer templates")."""
    paths: list[Path] = []
    for d in dirs:
        if not Path(d).is_dir():
            raise UsageError(f"--templates {d}: not a directory")
        found = sorted(Path(d).glob("*.jinja"))
        if not found:
            raise UsageError(f"--templates {d}: no *.jinja files")
        paths += found
    return paths


def _loaded_from(args: argparse.Namespace) -> str:
    """Where the templates came from, with counts: "12 from DIR1, 8 from DIR2, 1 --template"."""
    parts = [f"{len(list(Path(d).glob('*.jinja')))} found in {d}" for d in getattr(args, "templates", [])]
    if args.template:
        parts.append(f"{len(args.template)} --template")
    if getattr(args, "gguf", None):
        parts.append(f"{len(args.gguf)} --gguf")
    if getattr(args, "pinned", None) is not None:
        parts.append(f"{len(args.pinned) if args.pinned else len(pinned_templates())} pinned")
    return ", ".join(parts)


def _load_many(
    args: argparse.Namespace,
    server_args: list[str],
    factory: Any = ChatTemplate,
    failures: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """name -> template for fixtures/serve (names: file names, made unique); ``factory`` is
    ChatTemplate or UntrustedTemplate (same constructors). With ``failures`` (a dict), a
    template that does not load is recorded there (name -> {"path", "error"}) and the others
    still load; without, its error is raised."""
    paths = [Path(p) for p in args.template]
    paths += _template_dirs(args.templates)
    if args.pinned is not None:
        paths += [pinned_template(n) for n in args.pinned] if args.pinned else pinned_templates()
    sargs = [*args.server_arg, *server_args]
    if getattr(args, "llama_cpp", None):
        extra = {"llama_cpp": args.llama_cpp, **extra}
    if hasattr(args, "media"):
        extra = {"media": _media_arg(args), **extra}
    out: dict[str, Any] = {}

    def name_for(path: Path) -> str:
        name, i = path.name, 2
        while name in out or (failures is not None and name in failures):
            name, i = f"{path.name}#{i}", i + 1
        return name

    def load(path: Path, make: Any) -> None:
        name = name_for(path)
        if failures is None:
            try:
                out[name] = make()
            except (Error, OSError, ValueError):
                print(f"llamaprompt: while loading {path}:", file=sys.stderr)  # which of the templates
                raise
            return
        try:
            out[name] = make()
        except (Error, OSError, ValueError) as e:  # llama-server would not start with this template
            message = e.message if isinstance(e, Error) else str(e)
            failures[name] = {"path": str(path), "error": {"type": type(e).__name__, "message": message}}
            print(f"llamaprompt: {path}: {type(e).__name__}: {message} (skipped)", file=sys.stderr)

    for path in paths:
        load(
            path,
            lambda path=path: factory.from_file(path, **_file_tokens(args), server_args=sargs, **extra),
        )
    for path in map(Path, args.gguf):
        load(
            path, lambda path=path: factory.from_gguf(path, media_marker=args.media_marker, server_args=sargs, **extra)
        )
    if not out and not failures:
        raise UsageError("no templates: give --template, --templates DIR, --gguf or --pinned")
    return out


def _media_arg(args: argparse.Namespace) -> Any:
    if args.no_media and args.media is not None:
        raise UsageError("--media and --no-media cannot be combined")
    if args.no_media:
        return False
    if args.media is None:
        return True
    try:
        return _media(args.media)
    except ValueError as e:
        raise UsageError(f"--media: {e}") from None


class UsageError(Exception):
    """A command line that cannot be run as given: reported by argparse (usage line, exit 2)."""


def _read_bytes(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as f:
        return f.read()


def _input_name(path: str) -> str:
    """An input's name in messages: "standard input" for -."""
    return "standard input" if path == "-" else path


def _one_stdin(*inputs: tuple[str, str]) -> None:
    """UsageError when more than one of the (option, value) inputs is - (standard input)."""
    named = [option for option, value in inputs if value == "-"]
    if len(named) > 1:
        raise UsageError(f"{' and '.join(named)} cannot both be - (standard input is read once)")


def _read_json(path: str) -> Any:
    """A JSON input of the command line (requests, messages, a Jinja context): RequestError if
    it is not JSON (or nested too deeply for Python's reader)."""
    try:
        return fx.json_from_bytes(_read_bytes(path), _input_name(path))
    except ValueError as e:
        raise RequestError(str(e)) from None


def _file_tokens(args: argparse.Namespace) -> dict[str, Any]:
    """The BOS/EOS text, add_bos/add_eos and media marker options of a template file."""
    return {
        "bos_token": args.bos_token,
        "eos_token": args.eos_token,
        "add_bos": args.add_bos,
        "add_eos": args.add_eos,
        "media_marker": args.media_marker,
    }


def _sample_request(template: Any) -> dict[str, Any]:
    """The built-in sample request for ``template``: SAMPLE_REQUEST (with tools), or
    PLAIN_SAMPLE_REQUEST for a built-in non-Jinja template, which llama.cpp's legacy path refuses
    tools ("tools param requires --jinja flag"). A sandboxed template is always Jinja."""
    core = getattr(template, "_core", None)
    return SAMPLE_REQUEST if core is None or core.use_jinja() else PLAIN_SAMPLE_REQUEST


def _load(args: argparse.Namespace, server_args: list[str]) -> Any:
    if args.pinned is not None:
        if args.template:
            raise UsageError("--pinned and --template both name a template: give one")
        try:
            args.template = str(pinned_template(args.pinned))
        except FileNotFoundError as e:
            raise UsageError(f"--pinned: {e}") from None
    caps = None
    if args.caps:
        try:
            caps = json.loads(args.caps)
        except ValueError as e:
            raise UsageError(f"--caps: not valid JSON: {e}") from None
        if not isinstance(caps, dict):
            raise UsageError("--caps must be a JSON object of caps keys to booleans")
    common = {
        "caps": caps,
        "handler": args.handler,
        "llama_cpp": args.llama_cpp,
        "media": _media_arg(args),
        "timeout": args.timeout,
    }
    factory: Any = ChatTemplate
    if getattr(args, "untrusted", False):
        if args.builtin:
            raise UsageError("--untrusted runs Jinja templates (--template, --gguf), not --builtin")
        if args.timeout is None:
            raise UsageError("--untrusted needs a --timeout in seconds: the sandbox's worker is killed past it")
        from .sandbox import UntrustedTemplate

        factory = UntrustedTemplate
    if args.builtin:
        if args.gguf or args.template:
            raise UsageError("--builtin cannot be combined with --template, --pinned or --gguf")
        return ChatTemplate.builtin(
            args.builtin,
            **_file_tokens(args),
            server_args=[*args.server_arg, *server_args],
            **common,
        )
    if args.gguf:
        if args.bos_token or args.eos_token or args.add_bos or args.add_eos:
            raise UsageError(
                "--bos-token/--eos-token/--add-bos/--add-eos do not apply with --gguf: the model file gives them"
            )
        override = None
        if args.template:
            with open(args.template, "rb") as f:
                override = f.read()
        return factory.from_gguf(
            args.gguf,
            chat_template=override,
            media_marker=args.media_marker,
            server_args=[*args.server_arg, *server_args],
            **common,
        )
    path = args.template or pinned_template(DEFAULT_TEMPLATE)
    return factory.from_file(
        path,
        **_file_tokens(args),
        server_args=[*args.server_arg, *server_args],
        **common,
    )


def _print_json(value: Any) -> None:
    sys.stdout.write(json_safe(json.dumps(value, indent=2, ensure_ascii=False)) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 llama.cpp rejected the input, 130
    interrupted: Ctrl-C, 141 the output's pipe closed by its reader)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_args = argv[:i], argv[i + 1 :]
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _refuse_empty_names(parser, args)
        return _run(args, server_args)
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's status for SIGINT
        print("llamaprompt: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:
        # the command's own usage line, as argparse prints for its own errors; exits with status 2
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices.get(args.command, parser).error(str(e))
        raise  # not reached


def _names_a_file(action: argparse.Action) -> bool:
    """Whether ``action``'s value names a file, a folder or a template (its metavar says so; a
    tuple of metavars: every one)."""
    names = action.metavar if isinstance(action.metavar, tuple) else (action.metavar,)
    return all(
        isinstance(m, str) and (m in ("FILE", "DIR", "NAME", "IN", "BINARY") or m.endswith(_FILE_KINDS)) for m in names
    )


_FILE_KINDS = (".json", ".txt", ".parquet", ".png", ".gguf")


def _refuse_empty_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Raise UsageError for an empty file, folder or template name (``-t "$UNSET"``): taken as
    absent it would render with the default template instead."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices.get(args.command)
    actions = [] if command is None else list(command._actions)
    for action in actions:
        if isinstance(action, argparse._SubParsersAction):  # cores' ACTION
            nested = action.choices.get(getattr(args, action.dest, None) or "")
            actions += [] if nested is None else nested._actions
        value = getattr(args, action.dest, None)
        if _names_a_file(action) and (value == "" or (isinstance(value, list) and "" in value)):
            name = "/".join(action.option_strings) or str(action.metavar)
            raise UsageError(f"{name}: an empty name names no file or template")


def _run(args: argparse.Namespace, server_args: list[str]) -> int:
    try:
        if args.command in ("fixtures", "check", "diff", "serve"):
            return _oracle(args, server_args)
        if args.command == "cores":
            return _cores(args)
        if args.command == "diff-versions":
            return _diff_versions(args, server_args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "inspect":
            _print_json(gguf_metadata(args.file, max_array_items=args.max_array_items))
            return 0
        if args.command == "tokenize":
            model = ChatTemplate.from_gguf(args.gguf)
            text = sys.stdin.buffer.read() if args.text == "-" else args.text
            ids = model.tokenize(text, add_special=args.add_special, parse_special=not args.no_parse_special)
            if args.pieces:
                out = []
                for t in ids.tolist():
                    piece = model.token_to_piece(t)
                    try:
                        out.append({"id": t, "piece": piece.decode("utf-8")})
                    except UnicodeDecodeError:
                        out.append({"id": t, "piece": list(piece)})
                _print_json(out)
            else:
                _print_json(ids.tolist())
            return 0
        template = _load(args, server_args)
        if args.command == "render":
            # the body goes to llama.cpp as bytes, parsed there as llama-server parses it
            request = _sample_request(template) if args.request is None else _read_bytes(args.request)
            if args.params:
                params = template.apply(request)
                _print_json({k: v for k, v in vars(params).items() if not k.startswith("_")})
            else:
                prompt = template.apply_template(request)
                sys.stdout.buffer.write(prompt.encode("utf-8", "surrogateescape"))
                sys.stdout.flush()
        elif args.command == "render-dataset":
            try:
                import pyarrow  # noqa: F401  (render_file reads and writes Arrow tables)
            except ImportError:
                raise UsageError("render-dataset needs pyarrow: pip install 'llamaprompt[datasets]'") from None
            from .data import render_file

            done = render_file(
                template,
                args.input,
                args.output,
                tokens=args.tokens,
                workers=args.workers,
                batch_rows=args.batch_rows,
                progress=False if args.no_progress else None,
                use_ray=args.ray,
                training=args.training,
            )
            failed = f", {done.failed} failed (their 'error' column holds llama.cpp's message)" if done.failed else ""
            print(f"llamaprompt: rendered {done.rows} rows into {args.output}{failed}", file=sys.stderr)
            for row, message in done.first_errors:
                print(f"  row {row}: {message}", file=sys.stderr)
            if done.failed > len(done.first_errors):
                print(f"  ... and {done.failed - len(done.first_errors)} more", file=sys.stderr)
        elif args.command == "parse":
            if args.chunk is not None and not args.stream:
                raise UsageError("--chunk sets the chunks of --stream: add --stream")
            _one_stdin(("--request", args.request), ("OUTPUT.txt", args.output))
            params = template.apply(_read_bytes(args.request))
            text = _read_bytes(args.output).decode("utf-8", "surrogateescape")
            if args.stream:
                stream = params.stream_parser()

                def emit(deltas: list[dict[str, Any]]) -> None:
                    for d in deltas:
                        sys.stdout.write(json.dumps(d, ensure_ascii=False) + "\n")
                    sys.stdout.flush()

                step = args.chunk or 8
                for i in range(0, len(text), step):
                    emit(stream.feed(text[i : i + step]))
                if not args.partial:  # the end of the generation: the final parse
                    emit(stream.finish())
            else:
                _print_json(params.parse(text, partial=args.partial))
        elif args.command == "describe":
            _print_json(template.describe())
        elif args.command == "caps":
            _print_json(template.caps)
        elif args.command == "props":
            _print_json(template.props())
        elif args.command == "inputs":
            result = template.template_inputs(
                _sample_request(template) if args.request is None else _read_bytes(args.request)
            )
            if args.context_only and result["context"] is None:
                print(
                    "llamaprompt: no render is the prompt (a handler rewrote the text); drop --context-only "
                    "to see every render",
                    file=sys.stderr,
                )
                return 1
            _print_json(result["context"] if args.context_only else result)
        elif args.command == "render-inputs":
            context = _read_json(args.context)
            if not isinstance(context, dict):
                raise UsageError(f"{args.context}: must be a JSON object of template variables")
            text = template.render_inputs(context, variant=args.variant)
            sys.stdout.buffer.write(text.encode("utf-8", "surrogateescape"))
            sys.stdout.flush()
        elif args.command == "normalize":
            data = _sample_request(template) if args.messages is None else _read_json(args.messages)
            if not isinstance(data, (dict, list)):
                template.apply_template(json.dumps(data))  # llama.cpp's own refusal of such a body
            if isinstance(data, dict):
                if not isinstance(data.get("messages"), list):  # llama.cpp's refusal, as from Python
                    template.apply_template(data)
                _print_json(template.normalize(data["messages"], tools=data.get("tools")))
            else:
                _print_json(template.normalize(data))
    except Error as e:
        status = f" (HTTP {e.status})" if e.status else ""
        print(f"llamaprompt: {type(e).__name__}{status}: {e.message}", file=sys.stderr)
        return 2
    except BrokenPipeError as e:
        if e.filename is not None:  # a named output (-o FIFO) whose reader left: an error like any
            print(f"llamaprompt: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        # the reader of standard output left (`| head`): quiet, the shell's status for SIGPIPE
        with contextlib.suppress(OSError):  # (so that the interpreter's final flush does not fail too)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (OSError, ValueError, TypeError, UnicodeError, KeyError) as e:
        print(f"llamaprompt: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except MemoryError:  # an input file without end (-t /dev/zero) under a memory limit
        print("llamaprompt: MemoryError: an input does not fit in memory", file=sys.stderr)
        return 2
    except RecursionError:  # printing a result that echoes a request nested ~1000 deep
        print("llamaprompt: the result is nested too deeply to print as JSON (recursion limit)", file=sys.stderr)
        return 2
    return 0


def _cores(args: argparse.Namespace) -> int:
    from . import cores

    if args.cores_command == "add":
        if (args.version is None) == (args.llama_cpp_dir is None):
            raise UsageError("cores add: give a VERSION or --llama-cpp-dir DIR (one of them)")
        core = cores.add_core(
            args.version,
            llama_cpp_dir=args.llama_cpp_dir,
            source_dir=args.source,
            jobs=args.jobs,
            progress=not args.no_progress,
            force=args.force,
            build_isolation=not args.no_build_isolation,
        )
        print(f"llamaprompt: installed the llama.cpp {core.label()} core ({core.source}) in {core.path}")
        return 0
    if args.cores_command == "remove":
        found = cores.installed_core(args.name)
        builds = len(cores.core_build_dirs(found)) if found else 0
        core = cores.remove_core(args.name)
        also = f" and {builds} build director{'y' if builds == 1 else 'ies'}" if builds else ""
        print(f"llamaprompt: removed the llama.cpp {core.label()} core{also}")
        return 0
    rows = [cores.builtin_core(), *cores.installed_cores()]
    if args.json:
        _print_json([{**vars(c), "usable": c.usable} for c in rows])
        return 0
    # the features whose absence loses something (the others name the shape of an upstream
    # interface); usable cores are built from these sources, so the package's list is theirs
    losses = tree_info().get("losses")
    table = [("NAME", "COMMIT", "DATE", "FEATURES", "SIZE", "WHERE")]
    for c in rows:
        shown = [k for k in c.features if losses is None or k in losses]
        missing = [k for k in shown if not c.features[k]]
        feats = f"{len(shown) - len(missing)}/{len(shown)}"
        if missing:
            feats += f" (no {', '.join(missing)})"
        if c.builtin or c.usable:
            where = "built-in" if c.builtin else c.path or ""
        elif not c.for_this_python:
            where = f"another Python's ({Path(c.path or '').name})"
        else:
            where = "stale: rebuild with cores add"
        table.append((c.name, c.commit, c.date or "?", feats, f"{c.size / 2**20:.0f} MiB", where))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    return 0


def _diff_versions(args: argparse.Namespace, server_args: list[str]) -> int:
    from . import versions

    paths = [str(p) for p in args.template]
    paths += [str(p) for p in _template_dirs(args.templates)]
    if args.pinned is not None:
        paths += [str(pinned_template(n)) for n in args.pinned] if args.pinned else [str(p) for p in pinned_templates()]
    if not paths and not args.gguf and not args.templates:
        paths = [str(p) for p in pinned_templates()]
    sargs = [*args.server_arg, *server_args]
    templates = versions.file_templates(
        paths,
        server_args=sargs,
        bos_token=args.bos_token,
        eos_token=args.eos_token,
        add_bos=args.add_bos,
        add_eos=args.add_eos,
    )
    templates.update(versions.gguf_templates(args.gguf, server_args=sargs))
    requests = None
    if args.requests is not None:
        requests = _read_json(args.requests)
        if isinstance(requests, dict) and isinstance(requests.get("requests"), dict):
            requests = requests["requests"]  # a fixtures or reference file
        if not isinstance(requests, dict):
            raise UsageError(f"{args.requests}: must be a JSON object name -> request body")
    report = versions.diff_versions(
        templates,
        from_core=args.from_core,
        to_core=args.to_core,
        requests=requests,
        context=args.context,
        progress=False if args.no_progress else None,
    )
    if args.json == "-":
        _print_json(report)
    else:
        sys.stdout.write(versions.format_diff(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if report["summary"]["templates_unloadable"]:
        # a template neither tree loads (a bad file, a rejected flag) was not compared: an error
        print(
            f"llamaprompt: {report['summary']['templates_unloadable']} template(s) load on neither llama.cpp "
            "(see 'fails to load on both' above); they were not compared",
            file=sys.stderr,
        )
        return 2
    return 1 if report["summary"]["cases_changed"] or report["summary"]["caps_changed"] else 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    paths = [Path(p) for p in args.template]
    paths += _template_dirs(args.templates)
    if args.pinned:
        paths += [pinned_template(n) for n in args.pinned]
    if not paths:
        paths = pinned_templates()
    requests = None if args.requests is None else _read_json(args.requests)
    if requests is not None and (not isinstance(requests, dict) or not requests):
        raise UsageError(f"{args.requests}: must be a non-empty JSON object name -> request body")
    peers = set(bench.PEERS)
    for flag, peer in (
        (args.no_jinja2, "jinja2"),
        (args.no_transformers, "transformers"),
        (args.no_upstream, "upstream"),
        (args.no_floor, "floor"),
    ):
        if flag:
            peers.discard(peer)
    try:
        report = bench.run_bench(
            paths,
            requests,
            threads=args.threads,
            min_time=args.min_time,
            peers=peers,
            server_url=args.server_url,
            llama_server=tuple(args.llama_server) if args.llama_server else None,
            memory=args.memory,
            progress=False if args.no_progress else None,
        )
    except ImportError as e:
        print(f"llamaprompt: {e}; install the benchmark extra: pip install 'llamaprompt[bench]'", file=sys.stderr)
        return 2
    sys.stdout.write(bench.format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        try:
            bench.plot_report(report, args.plot)
        except ImportError as e:
            print(f"llamaprompt: {e}; install the benchmark extra: pip install 'llamaprompt[bench]'", file=sys.stderr)
            return 2
    return 0


def _oracle(args: argparse.Namespace, server_args: list[str]) -> int:
    if args.command == "fixtures":
        requests = None if args.requests is None else _read_json(args.requests)
        if requests is not None and not isinstance(requests, dict):
            raise UsageError(f"{args.requests}: must be a JSON object name -> request body")
        bad = [k for k, v in (requests or {}).items() if not isinstance(v, dict)]
        if bad:
            raise UsageError(f"{args.requests}: every request must be a JSON object (not: {', '.join(bad[:5])})")
        failures: dict[str, Any] = {}
        templates = _load_many(args, server_args, failures=failures)
        doc = fx.render_fixtures(
            templates, requests, progress=False if args.no_progress else None, with_inputs=args.with_inputs
        )
        if failures:
            doc["load_errors"] = failures
        if args.output == "-":
            sys.stdout.buffer.write(fx.fixtures_text(doc).encode("utf-8"))
            sys.stdout.flush()
        else:
            fx.write_fixtures(doc, args.output)
        n = sum(len(t["cases"]) for t in doc["templates"].values())
        print(
            f"llamaprompt: loaded {len(templates)} of {len(templates) + len(failures)} templates "
            f"({_loaded_from(args)}); wrote {len(doc['templates'])} templates x {len(doc['requests'])} requests "
            f"({n} cases) to {'standard output' if args.output == '-' else args.output}",
            file=sys.stderr,
        )
        if failures:
            print(
                f"llamaprompt: {len(failures)} template{'s' if len(failures) != 1 else ''} did not load "
                "(listed under 'load_errors'): " + ", ".join(f["path"] for f in failures.values()),
                file=sys.stderr,
            )
            return 1
        return 0
    if args.command == "check":
        from .cores import find_core

        doc = fx.load_fixtures(_input_name(args.fixtures), _read_bytes(args.fixtures))
        core = find_core(args.llama_cpp)  # (CoreError, exit 2: no template is blamed for a missing core)
        made_with = str(doc.get("llama_cpp_commit") or "unknown")
        if not (made_with[:9] == core.commit[:9] and made_with != "unknown"):
            print(
                f"note: these fixtures were made with llama.cpp {made_with}; this build is llama.cpp "
                f"{core.commit} ({core.source}): differences below may be llama.cpp's own changes"
            )
        result = fx.check_fixtures(
            doc, mask=args.mask_dates, progress=False if args.no_progress else None, llama_cpp=args.llama_cpp
        )
        for line in result.describe():
            print(json_safe(line))  # (a prompt's bytes that are no UTF-8: U+FFFD in the report)
        print(
            f"{result.checked - result.mismatched} of {result.checked} cases match "
            f"(fixtures from llama.cpp {doc.get('llama_cpp_commit')}, this build {core.commit})"
        )
        return 0 if result.ok else 1
    if args.command == "diff":
        _one_stdin(("REFERENCE.json", args.reference), ("OTHER.json", args.other))
        reference = fx.load_fixtures(_input_name(args.reference), _read_bytes(args.reference))
        other = fx.load_other(_input_name(args.other), _read_bytes(args.other))  # (ValueError: exit 2)
        report = fx.diff_fixtures(
            reference, other, context=args.context, mask=args.mask_dates, explain=args.explain, llama_cpp=args.llama_cpp
        )
        if args.format == "json":
            _print_json(report)
        else:
            sys.stdout.write(json_safe(fx.diff_markdown(report)))
        return 0 if report["templates_agree"] == report["templates_total"] else 1
    # serve
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageError(
            'serve needs starlette and uvicorn (the "server" extra): pip install starlette uvicorn'
        ) from None
    from .server import serve

    if args.untrusted:
        from .sandbox import UntrustedTemplate

        templates = _load_many(args, server_args, factory=UntrustedTemplate, timeout=args.timeout)
    else:
        templates = _load_many(args, server_args)
    serve(templates, host=args.host, port=args.port, max_body_bytes=args.max_body_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
