"""Reference fixtures for other renderers: write, re-check and diff.

A fixtures file records, for every template x request, the prompt llama-server's
POST /apply-template returns (or its error), plus each template's caps. The schema is
documented in docs/fixtures.md and shipped as ``fixtures.schema.json`` next to this module.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
import re
import secrets
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import LLAMA_CPP_COMMIT, LLAMA_CPP_SOURCE, __version__
from .errors import Error
from .options import DEFAULT_MEDIA_MARKER
from .template import ChatTemplate
from .text import json_safe

__all__ = [
    "SCHEMA_ID",
    "SCHEMA_VERSION",
    "default_requests",
    "schema",
    "render_fixtures",
    "write_fixtures",
    "load_fixtures",
    "load_other",
    "check_fixtures",
    "diff_fixtures",
    "CheckResult",
    "mask_dates",
]

SCHEMA_ID = "llamaprompt-fixtures"
SCHEMA_VERSION = 1
_RESOURCES = Path(__file__).resolve().parent / "resources"  # not "data": that is data.py


def default_requests() -> dict[str, Any]:
    """The request set shipped with llamaprompt (name -> OpenAI chat request body)."""
    return json.loads((_RESOURCES / "requests.json").read_text(encoding="utf-8"))


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a fixtures file."""
    return json.loads((_RESOURCES / "fixtures.schema.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------
# dates

_MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
_MONTHS_LONG = "January|February|March|April|May|June|July|August|September|October|November|December"
_DATE_RES = [
    re.compile(rf"\b\d{{2}} (?:{_MONTHS}) \d{{4}}\b"),  # %d %b %Y (Llama 3.x "Today Date")
    re.compile(rf"\b(?:{_MONTHS}) \d{{2}} \d{{4}}\b"),  # %b %d %Y
    re.compile(rf"\b(?:{_MONTHS_LONG}) \d{{2}}, \d{{4}}\b"),  # %B %d, %Y
    re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),  # %Y-%m-%d
]


def mask_dates(prompt: str) -> str:
    """Replace the date strings templates print (``common_chat_extra_context``'s
    ``%d %b %Y`` / ``%b %d %Y`` and the pinned templates' ``strftime_now`` formats) by
    ``<DATE>``."""
    for rx in _DATE_RES:
        prompt = rx.sub("<DATE>", prompt)
    return prompt


# ---------------------------------------------------------------------------------------
# writing


def _progress(iterable: Iterable[Any], total: int, desc: str, enabled: bool | None) -> Iterable[Any]:
    show = sys.stderr.isatty() if enabled is None else enabled
    if not show:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="template", file=sys.stderr)


def _case(template: ChatTemplate, request: Any, with_inputs: bool = False) -> dict[str, Any]:
    if not isinstance(request, (Mapping, str, bytes)):
        # a body that is not an object still goes to llama.cpp, which answers as llama-server
        request = json.dumps(request)
    try:
        case: dict[str, Any] = {"status": 200, "prompt": template.apply_template(request)}
    except Error as e:
        err = e.to_json()["error"]
        return {"status": err["code"], "error": err}
    if with_inputs:
        inputs = template.template_inputs(request)
        index = inputs["prompt_render"]
        case["template_inputs"] = {
            "context": inputs["context"],
            "variant": None if index is None else inputs["renders"][index]["variant"],
            "prompt_match": inputs["prompt_match"],
            "renders": len(inputs["renders"]),
        }
    return case


def _template_entry(template: ChatTemplate, kind: str, path: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "kind": kind,
        "path": path,
        "template_sha256": template.sha256,
        "caps": template.caps,
        "chat_template": template.source,
        "bos_token": template.bos_token,
        "eos_token": template.eos_token,
        "add_bos": template.add_bos,
        "add_eos": template.add_eos,
    }
    if template.tool_use_source:
        entry["chat_template_tool_use"] = template.tool_use_source
    return entry


def render_fixtures(
    templates: Mapping[str, ChatTemplate] | Sequence[tuple[str, ChatTemplate]],
    requests: Mapping[str, Any] | None = None,
    *,
    progress: bool | None = None,
    with_inputs: bool = False,
) -> dict[str, Any]:
    """Render every template x request into a fixtures document (a dict; see docs/fixtures.md).

    Args:
        templates: name -> ChatTemplate (names become the keys under ``"templates"``).
        requests: name -> request body; default :func:`default_requests`.
        progress: show a progress bar on stderr (default: when stderr is a terminal).
        with_inputs: store with each prompt the Jinja context of the render it comes from
            (``template_inputs``: :meth:`ChatTemplate.template_inputs`), so that another renderer
            can test its engine alone on llama.cpp's exact inputs.
    """
    items = list(templates.items()) if isinstance(templates, Mapping) else list(templates)
    reqs = dict(default_requests() if requests is None else requests)
    first = items[0][1] if items else None
    doc: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "schema_version": SCHEMA_VERSION,
        "llama_cpp_commit": first.llama_cpp_commit if first else LLAMA_CPP_COMMIT,
        "llama_cpp_source": first.llama_cpp_source if first else LLAMA_CPP_SOURCE,
        "llamaprompt_version": __version__,
        "rendered_on": _dt.date.today().isoformat(),
        "options": {
            "media_marker": first.media_marker if first else DEFAULT_MEDIA_MARKER,
            "server_args": list(first.server_args) if first else [],
        },
        "requests": reqs,
        "templates": {},
    }
    for name, tmpl in _progress(items, len(items), "fixtures", progress):
        entry = _template_entry(tmpl, "gguf" if tmpl.gguf_path else "file", tmpl.gguf_path)
        entry["media_marker"] = tmpl.media_marker
        entry["server_args"] = list(tmpl.server_args)
        entry["cases"] = {rname: _case(tmpl, body, with_inputs) for rname, body in reqs.items()}
        doc["templates"][name] = entry
    return doc


def fixtures_text(doc: Mapping[str, Any]) -> str:
    """A fixtures document as the text :func:`write_fixtures` writes: UTF-8-safe JSON, 2-space
    indent, non-ASCII kept (bytes that are not UTF-8, e.g. of a template file in another
    encoding, as U+FFFD, as in llama-server's JSON), ending with a newline."""
    return json_safe(json.dumps(doc, indent=2, ensure_ascii=False)) + "\n"


def write_fixtures(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a fixtures document (:func:`fixtures_text`) to ``path``. A regular file appears
    complete or not at all: written next to it, then renamed over it, keeping an existing file's
    permission bits (and owner, where allowed); through a symbolic link the file it points to is
    written (the link stays); a device, pipe or file with other hard links (``/dev/stdout``, a
    FIFO) is written in place. Raises OSError naming ``path``: IsADirectoryError for a folder
    (or a name ending in a slash), PermissionError for a file that is not writable."""
    data = fixtures_text(doc).encode("utf-8")
    name = os.fspath(path)
    try:
        st: os.stat_result | None = os.stat(name)  # (follows links)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise type(e)(e.errno, e.strerror, name) from None
    if (st is not None and stat.S_ISDIR(st.st_mode)) or (st is None and name.endswith(("/", os.sep))):
        raise IsADirectoryError(errno.EISDIR, "names a folder, not a file", name)
    if st is not None and not os.access(name, os.W_OK):
        raise PermissionError(errno.EACCES, "the file is not writable", name)
    try:
        if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1):
            with open(name, "wb") as f:
                f.write(data)
            return
        target = Path(os.path.realpath(name))
        tmp = target.with_name(f".llamaprompt-{secrets.token_hex(6)}.tmp")  # (short: any name's folder takes it)
        try:
            with open(tmp, "xb") as f:  # (a new file's mode: the umask's, as for any file written)
                f.write(data)
            if st is not None:
                os.chmod(tmp, stat.S_IMODE(st.st_mode))
                with contextlib.suppress(OSError):  # (only root may give a file to another user)
                    os.chown(tmp, st.st_uid, st.st_gid)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:  # the user's name, not the temporary file's
        raise type(e)(e.errno, e.strerror, name) from None


def json_from_bytes(data: bytes, name: str) -> Any:
    """A JSON document from a file's bytes (the encoding detected as ``json.loads`` does: UTF-8,
    a UTF-8 BOM, UTF-16 or UTF-32). Raises ValueError "NAME: not valid JSON: ..." otherwise, and
    "NAME: nested too deeply ..." past Python's recursion limit (~1,000 levels for its reader)."""
    try:
        return json.loads(data)
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are both ValueErrors
        if "integer string conversion" in str(e):  # (Python's advice to raise its limit is not the user's to take)
            raise ValueError(f"{name}: a number of more than {sys.get_int_max_str_digits()} digits") from None
        raise ValueError(f"{name}: not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{name}: nested too deeply to read as JSON (Python's recursion limit)") from None


def load_fixtures(path: str | os.PathLike[str], data: bytes | None = None) -> dict[str, Any]:
    """Read a fixtures file (a JSON object; UTF-8 as written, with or without a BOM, or UTF-16/32
    as ``json.loads`` detects them) into a dict (``data``: its bytes, already read; ``path`` then
    only names it in messages).

    Raises OSError when the file cannot be read, and ValueError naming the file when it is not
    valid JSON or not a fixtures file (wrong schema id/version, or contents of the wrong shape)."""
    doc = json_from_bytes(Path(path).read_bytes() if data is None else data, str(path))
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_ID:
        raise ValueError(f'{path}: not a llamaprompt fixtures file (no "schema": "{SCHEMA_ID}")')
    _check_version(doc, str(path))
    problem = _shape_problem(doc)
    if problem:
        raise ValueError(f"{path}: not a valid fixtures file: {problem} (fixtures.schema.json)")
    return doc


def _check_version(doc: Mapping[str, Any], name: str) -> None:
    """ValueError ``name: ...`` unless the document's schema_version is this schema's (a number:
    true, which equals 1, is not one)."""
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        shown = repr(version)
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        raise ValueError(f"{name}: schema_version {shown} is not {SCHEMA_VERSION!r}")


def _shape_problem(doc: Mapping[str, Any]) -> str | None:
    """What keeps ``doc`` from being read as fixtures (the parts check/diff read), or None."""
    if not isinstance(doc.get("requests"), dict):
        return '"requests" is not an object'
    for key in ("options", "load_errors"):
        if key in doc and not isinstance(doc[key], dict):
            return f'"{key}" is not an object'
    if not isinstance(doc.get("llama_cpp_commit", ""), str):
        return '"llama_cpp_commit" is not a string'
    if not all(isinstance(r, dict) for r in doc["requests"].values()):
        return 'a request in "requests" is not an object'
    if not isinstance(doc.get("templates"), dict):
        return '"templates" is not an object'
    for name, entry in doc["templates"].items():
        if not isinstance(entry, dict):
            return f'template "{name}" is not an object'
        if not isinstance(entry.get("chat_template"), str):
            return f'template "{name}" has no "chat_template" text'
        problem = _entry_problem(entry)
        if problem:
            return f'template "{name}": {problem}'
        if not isinstance(entry.get("cases"), dict) or not all(isinstance(c, dict) for c in entry["cases"].values()):
            return f'template "{name}": "cases" is not an object of objects'
        for rname, case in entry["cases"].items():
            problem = _case_problem(case)
            if problem:
                return f'template "{name}", case "{rname}": {problem}'
            if rname not in doc["requests"]:
                return f'template "{name}", case "{rname}": no request of that name in "requests"'
    return None


def _entry_problem(entry: Mapping[str, Any]) -> str | None:
    """What is wrong with a template entry's fields that check rebuilds it from, or None."""
    caps = entry.get("caps")
    if not (isinstance(caps, dict) and all(isinstance(v, bool) for v in caps.values())):
        return '"caps" is not an object of true/false'
    for key in ("bos_token", "eos_token", "media_marker"):
        if key in entry and not isinstance(entry[key], str):
            return f'"{key}" is not a string'
    for key in ("add_bos", "add_eos"):
        if key in entry and not isinstance(entry[key], bool):
            return f'"{key}" is not true/false'
    args = entry.get("server_args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return '"server_args" is not a list of strings'
    if entry.get("kind", "file") not in ("file", "gguf"):
        return f'"kind" is {entry["kind"]!r}, not "file" or "gguf"'
    if not isinstance(entry.get("path"), (str, type(None))):
        return '"path" is not a string or null'
    return None


def _case_problem(case: Mapping[str, Any], no_prompt: bool = False) -> str | None:
    """What keeps a case from being compared, or None: its "status" an int (``no_prompt``: or
    null, OTHER's "renders no prompt"), with a "prompt" string for 200 and an "error" object, if
    any, otherwise."""
    status = case.get("status")
    if status is None and no_prompt:
        return None
    if not isinstance(status, int) or isinstance(status, bool):
        return f'"status" is {status!r}, not an HTTP status number'
    if status == 200 and not isinstance(case.get("prompt"), str):
        return 'status 200 without a "prompt" string'
    error = case.get("error")
    if status != 200 and error is not None and not isinstance(error, dict):
        return '"error" is not an object'
    return None


def _is_regular_file(path: str) -> bool:
    """Whether ``path`` names a regular file (following links); False for whatever os.stat
    refuses: no such file, a name too long, a NUL in it, no permission."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def template_from_entry(entry: Mapping[str, Any], llama_cpp: str | None = None) -> ChatTemplate:
    """Rebuild the ChatTemplate a fixtures entry was rendered with: the GGUF file when the
    entry came from one and it is still a file there, else the recorded template text with
    the recorded BOS/EOS and add_bos/add_eos (``llama_cpp``: the core, as ChatTemplate's)."""
    opts = {
        "server_args": entry.get("server_args", []),
        "media_marker": entry.get("media_marker", DEFAULT_MEDIA_MARKER),
        "llama_cpp": llama_cpp,
    }
    if entry.get("kind") == "gguf" and entry.get("path") and _is_regular_file(entry["path"]):
        return ChatTemplate.from_gguf(entry["path"], **opts)
    return ChatTemplate(
        entry["chat_template"],
        bos_token=entry.get("bos_token", ""),
        eos_token=entry.get("eos_token", ""),
        add_bos=bool(entry.get("add_bos", False)),
        add_eos=bool(entry.get("add_eos", False)),
        **opts,
    )


# ---------------------------------------------------------------------------------------
# check


@dataclass
class CheckResult:
    """What :func:`check_fixtures` found: ``checked`` cases, ``differences`` as
    ``(template, request, expected_case, actual_case)`` tuples, ``caps_differences`` as
    ``(template, recorded_caps, current_caps)``, and ``load_failures`` as ``(template, cases,
    "ErrorType: message")`` for a template that no longer loads (its cases count as checked and
    not matching)."""

    checked: int = 0
    differences: list[tuple[str, str, dict, dict]] = field(default_factory=list)
    caps_differences: list[tuple[str, dict, dict]] = field(default_factory=list)
    load_failures: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every case and caps matched -- and there was a case (nothing checked is not ok)."""
        return self.checked > 0 and not (self.differences or self.caps_differences or self.load_failures)

    @property
    def mismatched(self) -> int:
        """The cases that did not match: differing, or of a template that no longer loads."""
        return len(self.differences) + sum(n for _, n, _ in self.load_failures)

    def describe(self, context: int = 30) -> list[str]:
        """One line per difference: the first differing offset with context, or the statuses;
        one per template that no longer loads; one when there was no case."""
        lines = []
        if self.checked == 0:
            lines.append("NOTHING CHECKED: the fixtures hold no case (no template, or templates without cases)")
        for tname, n, message in self.load_failures:
            first, *more = message.strip().splitlines() or [""]  # (llama.cpp's usage text after the error)
            said = first + (" ..." if more else "")
            cases = f"its {n} case{'' if n == 1 else 's'} not rendered" if n else "no case recorded"
            lines.append(f"DIFFERS {tname}: does not load now ({said}); {cases}")
        for tname, recorded, now in self.caps_differences:
            changed = {
                k: [recorded.get(k), now.get(k)]
                for k in sorted(set(recorded) | set(now))
                if recorded.get(k) != now.get(k)
            }
            lines.append(f"DIFFERS {tname}: caps {json.dumps(changed)} (recorded, now)")
        for tname, rname, want, got in self.differences:
            if want.get("status") == 200 and got.get("status") == 200:
                a, b = want["prompt"], got["prompt"]
                at = _first_difference(a, b)
                lines.append(
                    f"DIFFERS {tname} / {rname}: prompt, first difference at offset {at}: "
                    f"recorded {json.dumps(_window(a, at, context), ensure_ascii=False)}, "
                    f"now {json.dumps(_window(b, at, context), ensure_ascii=False)}"
                )
            else:

                def show(c: Mapping[str, Any]) -> str:
                    if c.get("status") == 200:
                        return "a prompt"
                    return f"error {c.get('status')} {json.dumps((c.get('error') or {}).get('message'))}"

                lines.append(f"DIFFERS {tname} / {rname}: recorded {show(want)}, now {show(got)}")
        return lines


def _same(a: Mapping[str, Any], b: Mapping[str, Any], masked: bool) -> bool:
    """Whether two cases agree: status, then the prompt or the error's message, each as a
    fixtures file holds it (bytes that are not UTF-8 as U+FFFD: write_fixtures, llama-server's
    JSON), so that a case re-rendered agrees with its own recording."""
    if a.get("status") != b.get("status"):
        return False
    if a.get("status") == 200:
        pa, pb = _as_stored(a.get("prompt", "")), _as_stored(b.get("prompt", ""))
        return (mask_dates(pa) == mask_dates(pb)) if masked else pa == pb
    return _as_stored((a.get("error") or {}).get("message")) == _as_stored((b.get("error") or {}).get("message"))


def _as_stored(text: Any) -> Any:
    """Text as a fixtures file holds it (:func:`~llamaprompt.text.json_safe`; most text is
    returned as it is, without a copy); anything else unchanged."""
    if not isinstance(text, str) or text.isascii():
        return text
    return json_safe(text)


def check_fixtures(
    doc: Mapping[str, Any], *, mask: bool = False, progress: bool | None = None, llama_cpp: str | None = None
) -> CheckResult:
    """Re-render every case of a fixtures document with this build of llama.cpp (or the
    ``llama_cpp`` core) and report the cases whose prompt or error differs (``mask``
    compares with dates masked). Raises CoreError when the ``llama_cpp`` core is not installed
    or was built from other sources (before any template: no template is blamed for it)."""
    from .cores import find_core

    find_core(llama_cpp)
    result = CheckResult()
    requests = doc["requests"]
    entries = list(doc["templates"].items())
    for name, entry in _progress(entries, len(entries), "check", progress):
        try:
            tmpl = template_from_entry(entry, llama_cpp)
        except Error as e:
            result.checked += len(entry["cases"])
            result.load_failures.append((name, len(entry["cases"]), f"{type(e).__name__}: {e.message}"))
            continue
        if tmpl.caps != entry.get("caps", tmpl.caps):
            result.caps_differences.append((name, entry["caps"], tmpl.caps))
        for rname, case in entry["cases"].items():
            result.checked += 1
            got = _case(tmpl, requests[rname])
            if not _same(case, got, mask):
                result.differences.append((name, rname, case, got))
    return result


# ---------------------------------------------------------------------------------------
# diff


def _other_cases(other: Mapping[str, Any], name: str = "OTHER") -> tuple[dict[str, dict[str, Any]], dict[str, dict]]:
    """(cases, caps) per template from an OTHER file: the fixtures schema, or a minimal
    ``{template: {request: prompt | null | {"status":..., "error":...}}}`` map. Raises ValueError
    starting with ``name`` when it is neither."""
    cases: dict[str, dict[str, Any]]
    if other.get("schema") == SCHEMA_ID:
        _check_version(other, name)
        templates = other.get("templates")
        if not isinstance(templates, Mapping):
            raise ValueError(f'{name}: "templates" is not an object (fixtures.schema.json)')
        cases = {}
        for t, e in templates.items():
            if not isinstance(e, Mapping) or not isinstance(e.get("cases", {}), Mapping):
                raise ValueError(f'{name}: template "{t}" is not an object with its "cases" an object')
            cases[t] = {r: _other_case(c, f"{name}: template {t!r}, case {r!r}") for r, c in e.get("cases", {}).items()}
        caps = {t: e["caps"] for t, e in templates.items() if isinstance(e.get("caps"), dict)}
        return cases, caps
    if "schema" in other or "schema_version" in other:
        raise ValueError(
            f'{name}: "schema" is {other.get("schema")!r}, not "{SCHEMA_ID}" '
            "(nor is it a {template: {request: prompt}} map)"
        )
    cases = {}
    for tname, reqs in other.items():
        if not isinstance(reqs, Mapping):
            raise ValueError(f"{name}: template {tname!r} must map request names to prompts")
        cases[tname] = {r: _other_case(v, f"{name}: {tname}/{r}") for r, v in reqs.items()}
    return cases, {}


def _other_case(value: Any, where: str) -> dict[str, Any]:
    """An OTHER case as a case dict: a prompt string (status 200), null ("no prompt": status None)
    or a case object with its "status". Raises ValueError ``where: ...`` for anything else, or a
    case object that cannot be compared (no "status": its prompt would be silently taken as
    "no prompt")."""
    if isinstance(value, str):
        return {"status": 200, "prompt": value}
    if value is None:
        return {"status": None}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a prompt string, null or a case object")
    if "status" not in value:
        raise ValueError(f'{where}: a case object needs its "status" (200 with a "prompt", or an error\'s)')
    problem = _case_problem(value, no_prompt=True)
    if problem:
        raise ValueError(f"{where}: {problem}")
    return dict(value)


def load_other(path: str | os.PathLike[str], data: bytes | None = None) -> dict[str, Any]:
    """Read the OTHER file of :func:`diff_fixtures` (``data``: its bytes, already read): a fixtures
    file or a minimal ``{template: {request: prompt}}`` map, in any encoding :func:`json_from_bytes`
    reads. Raises OSError when it cannot be read, and ValueError naming the file when it is
    neither (not JSON, not an object, a fixtures file of another schema_version or shape)."""
    doc = json_from_bytes(Path(path).read_bytes() if data is None else data, str(path))
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: must be a JSON object (a fixtures file or a {{template: {{request: prompt}}}} map)")
    _other_cases(doc, str(path))
    return doc


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _window(s: str, at: int, width: int) -> str:
    start = max(0, at - width)
    return ("…" if start else "") + s[start : at + width] + ("…" if at + width < len(s) else "")


def diff_fixtures(
    reference: Mapping[str, Any],
    other: Mapping[str, Any],
    *,
    context: int = 30,
    mask: bool = False,
    explain: bool = False,
    llama_cpp: str | None = None,
) -> dict[str, Any]:
    """Compare another renderer's prompts with a reference fixtures document.

    Returns a report dict: ``summary`` ("N of M templates agree"), ``templates_agree``,
    ``templates_total``, and per template (of the reference) the cases compared and
    agreeing, caps side by side when OTHER has them, and each difference with the first
    differing character offset and a context window from both sides. Cases OTHER lacks are
    listed as ``missing``; templates and cases OTHER has but the reference lacks (not
    compared) as ``only_in_other`` (report level: template names; per template: request names).

    With ``explain``, each prompt difference also gets ``spans`` (every differing span, not
    only the first: :func:`llamaprompt.explain.spans`) and ``causes`` (found by experiment with
    llama.cpp's own stages: :func:`llamaprompt.explain.explain`; the template is rebuilt from
    its entry, with the ``llama_cpp`` core), and the report ``causes`` (cause -> count).
    """
    from collections import Counter

    from . import explain as ex

    cause_counts: Counter[str] = Counter()
    other_cases, other_caps = _other_cases(other)
    built: dict[str, ChatTemplate] = {}
    report: dict[str, Any] = {"templates": {}}
    agree_templates = 0
    compared_templates = 0
    for tname, entry in reference["templates"].items():
        mine = other_cases.get(tname)
        t: dict[str, Any] = {"compared": 0, "agree": 0, "differences": [], "missing": []}
        if mine is None:
            t["missing_template"] = True
            report["templates"][tname] = t
            continue
        compared_templates += 1
        if tname in other_caps:
            caps_diff = {
                k: {"reference": v, "other": other_caps[tname].get(k)}
                for k, v in entry["caps"].items()
                if other_caps[tname].get(k) != v
            }
            t["caps"] = {"reference": entry["caps"], "other": other_caps[tname], "differ": caps_diff}
        extra = [r for r in mine if r not in entry["cases"]]
        if extra:
            t["only_in_other"] = extra
        for rname, ref_case in entry["cases"].items():
            if rname not in mine:
                t["missing"].append(rname)
                continue
            got = mine[rname]
            t["compared"] += 1
            if got.get("status") is None and ref_case.get("status") != 200:
                t["agree"] += 1  # OTHER says "no prompt" where llama-server errors
                continue
            if _same(ref_case, got, mask):
                t["agree"] += 1
                continue
            d: dict[str, Any] = {
                "request": rname,
                "reference_status": ref_case.get("status"),
                "other_status": got.get("status"),
            }
            if ref_case.get("status") == 200 and got.get("status") == 200:
                a, b = ref_case["prompt"], got["prompt"]
                if mask:
                    a, b = mask_dates(a), mask_dates(b)
                at = _first_difference(a, b)
                d.update(
                    offset=at,
                    reference=_window(a, at, context),
                    other=_window(b, at, context),
                    reference_length=len(a),
                    other_length=len(b),
                )
                if explain:
                    d["spans"] = ex.spans(ref_case["prompt"], got["prompt"], context=context)
                    if tname not in built:
                        built[tname] = template_from_entry(entry, llama_cpp)
                    request = reference.get("requests", {}).get(rname)
                    causes = (
                        ex.explain(built[tname], request, ref_case["prompt"], got["prompt"])
                        if isinstance(request, Mapping)
                        else ["unknown"]
                    )
                    d["causes"] = causes
                    cause_counts.update(causes)
            else:

                def brief(c: Mapping[str, Any]) -> Any:
                    if c.get("status") == 200:
                        p = c.get("prompt", "")
                        return p if len(p) <= 4 * context else p[: 4 * context] + "…"
                    return (c.get("error") or {}).get("message")

                d["reference"] = brief(ref_case)
                d["other"] = brief(got)
            t["differences"].append(d)
        if t["compared"] and t["agree"] == t["compared"] and not t.get("caps", {}).get("differ"):
            agree_templates += 1
        report["templates"][tname] = t
    report["only_in_other"] = [name for name in other_cases if name not in reference["templates"]]
    if explain:
        report["causes"] = dict(cause_counts.most_common())
    report["templates_agree"] = agree_templates
    report["templates_total"] = len(reference["templates"])
    report["templates_compared"] = compared_templates
    report["summary"] = f"{agree_templates} of {len(reference['templates'])} templates agree"
    report["llama_cpp_commit"] = reference.get("llama_cpp_commit")
    return report


def _md_code(s: Any) -> str:
    text = json.dumps(s, ensure_ascii=False)
    return "`" + text.replace("`", "\\u0060") + "`"


def _status_text(status: Any) -> str:
    return "no prompt (null)" if status is None else ("a prompt" if status == 200 else f"error {status}")


def diff_markdown(report: Mapping[str, Any]) -> str:
    """The diff report as Markdown: the table a renderer author pastes into a bug report."""
    lines = [f"**{report['summary']}** (reference: llama.cpp {report.get('llama_cpp_commit')})", ""]
    if report.get("causes"):
        lines += [
            "Causes of the differences (found by experiment): "
            + ", ".join(f"{c} {n}" for c, n in report["causes"].items()),
            "",
        ]
    lines += ["| template | cases agree | caps |", "|---|---|---|"]
    for tname, t in report["templates"].items():
        if t.get("missing_template"):
            lines.append(f"| {tname} | not in OTHER | |")
            continue
        caps = t.get("caps")
        caps_cell = (
            ""
            if caps is None
            else (
                "same"
                if not caps["differ"]
                else ", ".join(
                    f"{k}: {json.dumps(v['reference'])} vs {json.dumps(v['other'])}" for k, v in caps["differ"].items()
                )
            )
        )
        lines.append(f"| {tname} | {t['agree']} of {t['compared']} | {caps_cell} |")
    if report.get("only_in_other"):
        lines += ["", f"Not compared, in OTHER only (no reference): {', '.join(report['only_in_other'])}"]
    for tname, t in report["templates"].items():
        if not t.get("differences") and not t.get("missing") and not t.get("only_in_other"):
            continue
        lines += ["", f"### {tname}"]
        for d in t["differences"]:
            if "offset" in d:
                cause = f" — cause: {', '.join(d['causes'])}" if d.get("causes") else ""
                lines.append(f"- `{d['request']}`: first difference at offset {d['offset']}{cause}")
                lines.append(f"  - reference: {_md_code(d['reference'])}")
                lines.append(f"  - other:     {_md_code(d['other'])}")
                for sp in d.get("spans", [])[1:]:
                    if "omitted" in sp:
                        lines.append(f"  - and {sp['omitted']} more spans")
                        continue
                    lines.append(
                        f"  - then at {sp['reference_offset']}/{sp['other_offset']} ({sp['op']}): "
                        f"{_md_code(sp['reference'])} vs {_md_code(sp['other'])}"
                    )
            else:
                lines.append(
                    f"- `{d['request']}`: reference gives {_status_text(d['reference_status'])}, "
                    f"other gives {_status_text(d['other_status'])}"
                )
                lines.append(f"  - reference: {_md_code(d['reference'])}")
                lines.append(f"  - other:     {_md_code(d['other'])}")
        if t.get("missing"):
            lines.append(f"- missing in OTHER: {', '.join(t['missing'])}")
        if t.get("only_in_other"):
            lines.append(f"- in OTHER only (not in the reference, not compared): {', '.join(t['only_in_other'])}")
    return "\n".join(lines) + "\n"
