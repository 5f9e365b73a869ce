"""What changes for a set of templates between two llama.cpp trees (``llamaprompt diff-versions``).

Each template is loaded twice, once by each core (:mod:`llamaprompt.cores`), and every request
is rendered by both (POST /apply-template's prompt or error). The report lists, per template,
the ``chat_template_caps`` that changed and, per request, how the outcome changed:

- ``prompt_changed``: both render, the prompts differ (first differing offset, an excerpt of each);
- ``error_changed``: both fail, with another status or message;
- ``now_fails``: renders on ``from``, fails on ``to``;
- ``now_renders``: fails on ``from``, renders on ``to``.

A template that loads on one side only is reported with ``load`` (the error of each side).
Both sides render in the same run, so templates that print today's date agree on it. A caps
key that only one tree has (``supports_reasoning_effort`` appeared in 0.3.35's tree) is listed
once under ``caps_keys`` (added / removed), not as a change of every template.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .cores import Core, find_core
from .errors import Error
from .fixtures import _case, _first_difference, _progress, _window, default_requests
from .template import ChatTemplate

__all__ = ["TemplateSource", "diff_versions", "format_diff"]

#: name -> a function building that template for a ``llama_cpp`` core spec
TemplateSource = Callable[[str], ChatTemplate]

CHANGE_KINDS = ("prompt_changed", "error_changed", "now_fails", "now_renders")


def _describe_core(core: Core) -> dict[str, Any]:
    return {"name": core.name, "commit": core.commit, "source": core.source, "date": core.date}


def _load(build: TemplateSource, spec: str) -> tuple[ChatTemplate | None, dict[str, Any] | None]:
    try:
        return build(spec), None
    except Error as e:
        return None, {"type": type(e).__name__, "status": e.status, "message": e.message}


def _compare(a: Mapping[str, Any], b: Mapping[str, Any], context: int) -> dict[str, Any] | None:
    ok_a, ok_b = a["status"] == 200, b["status"] == 200
    if ok_a and ok_b:
        if a["prompt"] == b["prompt"]:
            return None
        at = _first_difference(a["prompt"], b["prompt"])
        return {
            "change": "prompt_changed",
            "offset": at,
            "from": _window(a["prompt"], at, context),
            "to": _window(b["prompt"], at, context),
        }
    if not ok_a and not ok_b:
        if a["status"] == b["status"] and a["error"]["message"] == b["error"]["message"]:
            return None
        return {"change": "error_changed", "from": a["error"], "to": b["error"]}
    if ok_a:
        return {"change": "now_fails", "to": b["error"]}
    return {"change": "now_renders", "from": a["error"]}


def diff_versions(
    templates: Mapping[str, TemplateSource],
    *,
    from_core: str | None,
    to_core: str | None,
    requests: Mapping[str, Any] | None = None,
    context: int = 30,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Render every template x request with two cores and report what differs.

    Args:
        templates: name -> ``build(llama_cpp)``, a function returning the ChatTemplate for a
            core spec (e.g. ``lambda c: ChatTemplate.from_file(path, llama_cpp=c)``).
        from_core, to_core: core specs as ``ChatTemplate(llama_cpp=...)`` takes them
            (None: the in-process core).
        requests: name -> request body (default: the request set shipped with llamaprompt).
        context: characters of each prompt shown around the first difference.
        progress: a progress bar on stderr (default: when stderr is a terminal).

    Returns a dict: ``from``/``to`` (name, commit, source, date of each core), ``requests``
    (their names), ``caps_keys`` (``{"added": [...], "removed": [...]}``: keys only one tree
    reports), ``templates`` (name -> ``{"caps": {key: [from, to]}, "load": ...?,
    "cases": {request: change}}``, only templates where something changed), and ``summary``
    (``templates``, ``templates_changed``, ``cases``, ``cases_changed``, ``caps_changed``,
    ``cases_failing_both``: cases that fail identically on both, ``templates_unloadable``:
    templates neither core loads -- listed with the error under ``unloadable`` --,
    ``by_change``: counts per change kind). Raises CoreError when a core is not installed.
    """
    a_core, b_core = find_core(from_core), find_core(to_core)
    a_spec = "" if a_core.builtin else a_core.commit
    b_spec = "" if b_core.builtin else b_core.commit
    reqs = dict(default_requests() if requests is None else requests)
    out: dict[str, Any] = {}
    counts = dict.fromkeys(CHANGE_KINDS, 0)
    n_cases = n_caps = n_failing = 0
    unloadable: dict[str, Any] = {}
    keys_a: set[str] = set()
    keys_b: set[str] = set()
    items = list(templates.items())
    for name, build in _progress(items, len(items), "diff-versions", progress):
        ta, ea = _load(build, a_spec)
        tb, eb = _load(build, b_spec)
        entry: dict[str, Any] = {}
        if ta is None or tb is None:
            n_cases += len(reqs)
            if ea == eb:  # the same failure on both sides: not a change, but nothing was compared
                unloadable[name] = ea
                continue
            if ea != eb:
                entry["load"] = {"from": ea, "to": eb}
                counts["now_fails" if ta is not None else "now_renders" if tb is not None else "error_changed"] += len(
                    reqs
                )
                out[name] = entry
            continue
        caps_a, caps_b = ta.caps, tb.caps
        keys_a.update(caps_a)
        keys_b.update(caps_b)
        caps = {
            k: [caps_a.get(k), caps_b.get(k)]
            for k in sorted(set(caps_a) & set(caps_b))  # a key one tree lacks: caps_keys below
            if caps_a.get(k) != caps_b.get(k)
        }
        if caps:
            entry["caps"] = caps
            n_caps += 1
        cases = {}
        for rname, body in reqs.items():
            n_cases += 1
            ca, cb = _case(ta, body), _case(tb, body)
            change = _compare(ca, cb, context)
            if change is None and ca["status"] != 200:
                n_failing += 1
            if change is not None:
                cases[rname] = change
                counts[change["change"]] += 1
        if cases:
            entry["cases"] = cases
        if entry:
            out[name] = entry
    changed_cases = sum(counts.values())
    return {
        "from": _describe_core(a_core),
        "to": _describe_core(b_core),
        "requests": list(reqs),
        "templates": out,
        "unloadable": unloadable,
        "caps_keys": {"added": sorted(keys_b - keys_a), "removed": sorted(keys_a - keys_b)},
        "summary": {
            "templates": len(items),
            "templates_changed": sum(1 for e in out.values() if "cases" in e or "load" in e),
            "cases": n_cases,
            "cases_changed": changed_cases,
            "caps_changed": n_caps,
            "cases_failing_both": n_failing,
            "templates_unloadable": len(unloadable),
            "by_change": counts,
        },
    }


def summary_line(report: Mapping[str, Any]) -> str:
    """``"12 of 68 templates render differently on 31 of 1,540 cases; caps changed for 15"``."""
    s = report["summary"]
    line = (
        f"{s['templates_changed']:,} of {s['templates']:,} templates render differently on "
        f"{s['cases_changed']:,} of {s['cases']:,} cases; caps changed for {s['caps_changed']:,}"
    )
    if s.get("cases_failing_both"):
        line += f"; {s['cases_failing_both']:,} cases fail the same way on both"
    if s.get("templates_unloadable"):
        line += f"; {s['templates_unloadable']:,} templates load on neither"
    keys = report.get("caps_keys") or {}
    for what in ("added", "removed"):
        if keys.get(what):
            line += f"; caps keys {what}: {', '.join(keys[what])}"
    return line


def _error_text(err: Mapping[str, Any] | None) -> str:
    if not err:
        return "loads"
    status = err.get("status") if "status" in err else err.get("code")
    return f"{status if status is not None else 'error'} {err.get('message')!r}"


def format_diff(report: Mapping[str, Any]) -> str:
    """The report as text: a header, per template its caps and case changes, the summary line."""
    a, b = report["from"], report["to"]
    lines = [f"llama.cpp {a['name']} ({a['commit']}) -> {b['name']} ({b['commit']})", ""]
    if a["commit"] == b["commit"]:
        lines[-1:] = ["(both sides are the same core: nothing can change)", ""]
    for name, err in report.get("unloadable", {}).items():
        lines.append(f"{name}: fails to load on both: {_error_text(err)}")
    for name, entry in report["templates"].items():
        lines.append(name)
        if "load" in entry:
            lines.append(f"  load: {_error_text(entry['load']['from'])} -> {_error_text(entry['load']['to'])}")
        for key, (old, new) in entry.get("caps", {}).items():
            lines.append(f"  caps {key}: {old} -> {new}")
        for rname, c in entry.get("cases", {}).items():
            kind = c["change"]
            if kind == "prompt_changed":
                lines.append(f"  {rname}: prompt changed at offset {c['offset']}: {c['from']!r} -> {c['to']!r}")
            elif kind == "error_changed":
                lines.append(f"  {rname}: error changed: {_error_text(c['from'])} -> {_error_text(c['to'])}")
            elif kind == "now_fails":
                lines.append(f"  {rname}: now fails: {_error_text(c['to'])}")
            else:
                lines.append(f"  {rname}: now renders (was {_error_text(c['from'])})")
    if report["templates"]:
        lines.append("")
    lines.append(summary_line(report))
    return "\n".join(lines) + "\n"


def file_templates(
    paths: Sequence[str], *, server_args: Sequence[str] = (), **options: Any
) -> dict[str, TemplateSource]:
    """name -> builder for template files (names: the file names, made unique)."""
    out: dict[str, TemplateSource] = {}
    for path in paths:
        name, i = str(path).rsplit("/", 1)[-1], 2
        base = name
        while name in out:
            name, i = f"{base}#{i}", i + 1
        out[name] = _builder(ChatTemplate.from_file, path, server_args, options)
    return out


def _builder(
    load: Callable[..., ChatTemplate], path: str, server_args: Sequence[str], options: dict[str, Any]
) -> TemplateSource:
    """A TemplateSource loading ``path`` with ``load`` for a core spec ("" = the built-in one)."""

    def build(spec: str) -> ChatTemplate:
        return load(path, llama_cpp=spec or None, server_args=server_args, **options)

    return build


def gguf_templates(
    paths: Sequence[str], *, server_args: Sequence[str] = (), **options: Any
) -> dict[str, TemplateSource]:
    """name -> builder for GGUF files (template, tokens and flags from each file)."""
    return {str(p).rsplit("/", 1)[-1]: _builder(ChatTemplate.from_gguf, p, server_args, options) for p in paths}
