"""Build llamaprompt against every llama.cpp tree in third_party/llama.cpp.lock and
regenerate docs/versions.md (and docs/versions.json).

    python benchmarks/versions.py                       # every version in the lock
    python benchmarks/versions.py --versions 0.3.35 0.3.36
    python benchmarks/versions.py --changes-only       # only the diffs between consecutive cores
    python benchmarks/versions.py --from-json docs/versions.json   # only rewrite the Markdown

Per version it builds the core (``llamaprompt cores add <version>``: the build directory and
the module stay in ~/.cache/llamaprompt, so a rerun is incremental; the pin is the built-in
core) and records, with that core loaded in-process (``LLAMAPROMPT_CORE``):

- the commit and date (from the lock), whether the tree configured and built (or the
  message that stopped it), the build time;
- ``llamaprompt.tree_info()``: the features present or missing, the rewrites skipped;
- a render of the embedded default (``llamaprompt render``);
- the reference suites (tests/test_reference.py, tests/test_gguf.py, tests/test_fast_path.py)
  when ../shared/reference holds a recording of that commit: pytest's counts and the number
  of recorded cases they compare.

Then, between consecutive trees that have a core, ``diff-versions`` over every shipped
template and the default request set: the "What changed between consecutive trees" section.

Nothing in docs/versions.md is edited by hand. Not run by CI (it builds seven trees, about
ten minutes each on 2 cores when nothing is cached).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LOCK = json.loads((ROOT / "third_party" / "llama.cpp.lock").read_text())
REFERENCE_SUITES = ["tests/test_reference.py", "tests/test_gguf.py", "tests/test_fast_path.py"]

sys.path.insert(0, str(ROOT / "tests"))


def run(cmd: list[str], env: dict | None = None, log: Path | None = None, timeout: float = 3600) -> tuple[int, str]:
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    if log:
        log.write_text(proc.stdout)
    return proc.returncode, proc.stdout


def configure_error(output: str) -> str:
    """The message that stopped configuration or compilation (first lines of it)."""
    m = re.search(
        r"llamaprompt: cannot build against the llama.cpp tree at [^\n]*\n(.*?)(?:\n\s*\n|CMake Error)", output, re.S
    )
    if m:
        return m.group(1).strip()
    m = re.search(r"^.*error:.*$", output, re.M)
    return m.group(0).strip() if m else output.strip().splitlines()[-1] if output.strip() else "unknown failure"


def reference_for(commit: str) -> tuple[Path | None, int]:
    """The shared reference folder recorded from this commit, and its number of cases."""
    from conftest import _commit_of, _same_commit, shared_reference_dir

    root = shared_reference_dir()
    for folder in [root, *sorted(p for p in (root / "versions").glob("*") if p.is_dir())]:
        c = _commit_of(folder)
        if c and _same_commit(c, commit):
            n = 0
            for name in ("apply_template.json", "apply_template_server_args.json", "gguf.json"):
                path = folder / name
                if path.exists():
                    data = json.loads(path.read_text())
                    for v in data.get("variants", []):
                        n += sum(len(t["cases"]) for t in v["templates"].values())
                    n += sum(len(m["cases"]) for m in data.get("models", {}).values())
            return folder, n
    return None, 0


def pytest_counts(output: str) -> dict[str, int]:
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}


def one_version(version: str) -> dict:
    """Build the core for ``version`` (``llamaprompt cores add``; the pin is the built-in core)
    and run the default render and the reference suites on it (``LLAMAPROMPT_CORE``)."""
    entry = LOCK["versions"][version]
    pinned = version == LOCK["source"]["version"]
    out: dict = {"version": version, "commit": entry["commit"], "date": entry.get("date"), "pinned": pinned}
    work = ROOT / "build" / "versions" / version
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("LLAMAPROMPT_CORE", None)
    if not pinned:
        print(f"[{version}] building the core (llama.cpp {entry['commit']}) ...", flush=True)
        t0 = time.monotonic()
        rc, log = run(
            [sys.executable, "-m", "llamaprompt.cli", "cores", "add", version, "--no-progress", "--source", str(ROOT)],
            env=env,
            log=work / "build.log",
        )
        out["build_seconds"] = round(time.monotonic() - t0)
        out["configured"] = rc == 0 or "llamaprompt: cannot build" not in log
        if rc != 0:
            out["built"] = False
            out["error"] = configure_error(log)
            print(f"[{version}] failed: {out['error']}", flush=True)
            return out
        env["LLAMAPROMPT_CORE"] = version
    out["configured"] = out["built"] = True
    rc, info = run(
        [sys.executable, "-c", "import json, llamaprompt; print(json.dumps(llamaprompt.tree_info()))"], env=env
    )
    out["tree_info"] = json.loads(info) if rc == 0 else {"error": info.strip()}
    rc, prompt = run([sys.executable, "-m", "llamaprompt.cli", "render"], env=env)
    out["render"] = {"ok": rc == 0 and bool(prompt), "bytes": len(prompt.encode())}
    folder, n_cases = reference_for(entry["commit"])
    if folder is None:
        out["reference"] = None
    else:
        print(f"[{version}] reference suites ({folder}) ...", flush=True)
        tenv = {**env, "LLAMAPROMPT_REQUIRE_REFERENCE": "1"}
        rc, log = run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *REFERENCE_SUITES],
            env=tenv,
            log=work / "reference.log",
        )
        out["reference"] = {
            "folder": str(folder.relative_to(folder.parents[1]) if "versions" in folder.parts else folder.name),
            "cases": n_cases,
            "pytest": pytest_counts(log),
            "ok": rc == 0,
        }
    print(f"[{version}] done", flush=True)
    return out


def changes(versions: list[str]) -> list[dict]:
    """diff-versions between consecutive trees that have a core (the pin's is the built-in one),
    over every template shipped with llamaprompt and the default request set."""
    import llamaprompt
    from llamaprompt import cores
    from llamaprompt import versions as lv

    have = {c.name for c in cores.installed_cores() if c.usable} | {cores.builtin_core().name}
    built = [v for v in versions if v in have]
    templates = lv.file_templates([str(p) for p in llamaprompt.pinned_templates()])
    out = []
    for a, b in zip(built, built[1:]):
        print(f"[changes] {a} -> {b} ...", flush=True)
        report = lv.diff_versions(templates, from_core=a, to_core=b, progress=False)
        per_template = {}
        for name, entry in report["templates"].items():
            kinds: dict[str, list[str]] = {}
            for rname, c in entry.get("cases", {}).items():
                kinds.setdefault(c["change"], []).append(rname)
            per_template[name] = {"caps": entry.get("caps", {}), "load": entry.get("load"), "cases": kinds}
        out.append(
            {
                "from": report["from"],
                "to": report["to"],
                "summary": report["summary"],
                "caps_keys": report["caps_keys"],
                "summary_line": lv.summary_line(report),
                "templates": per_template,
                "skipped": [v for v in versions[versions.index(a) + 1 : versions.index(b)]],
            }
        )
    return out


def probe_version(version: str) -> dict:
    """Only fetch the tree and run the configure-time probe (no compilation)."""
    entry = LOCK["versions"][version]
    out: dict = {
        "version": version,
        "commit": entry["commit"],
        "date": entry.get("date"),
        "pinned": version == LOCK["source"]["version"],
        "built": None,
    }
    fetch = ROOT / "third_party" / "fetch_llama_cpp.py"
    rc, dest = run([sys.executable, str(fetch), "--version", version, "--print-dest"])
    tree = Path(dest.strip())
    rc, log = run([sys.executable, str(fetch), "--version", version])
    if rc != 0:
        out["configured"] = False
        out["error"] = "fetch failed: " + log.strip()[-300:]
        return out
    work = ROOT / "build" / "versions" / version / "probe"
    rc, log = run([sys.executable, str(ROOT / "third_party" / "adapt_tree.py"), str(tree), str(work)])
    out["configured"] = rc == 0
    if rc != 0:
        out["error"] = configure_error(log)
        return out
    header = (work / "generated" / "lp_tree.h").read_text()
    info = json.loads(json.loads(header.split("LP_TREE_INFO_JSON ", 1)[1].strip()))
    caps_h = (tree / "common" / "jinja" / "caps.h").read_text()
    info["caps_keys"] = re.findall(r"bool\s+(supports_\w+)\s*=", caps_h)
    out["tree_info"] = info
    return out


def fmt_features(r: dict) -> tuple[str, str]:
    """(present, missing): the features whose absence loses something (tree_info's "losses";
    rows recorded before it existed: the six such features they knew)."""
    info = r.get("tree_info") or {}
    feats = info.get("features") or {}
    shown = info.get("losses") or [
        "caps_reasoning_effort",
        "thinking_end_tags",
        "message_delimiters",
        "parse",
        "server_schema",
        "const_execution",
    ]
    present = ", ".join(f for f in shown if feats.get(f))
    missing = ", ".join(f for f in shown if f in feats and not feats[f])
    return present or "—", missing or "—"


def markdown(results: list[dict], generated: str, changelog: list[dict] | None = None) -> str:
    lines = [
        "# llamaprompt against each llama.cpp tree",
        "",
        "Regenerated by `python benchmarks/versions.py` (do not edit): for each llama-cpp-python",
        "source distribution in `third_party/llama.cpp.lock`, llamaprompt's core was built against the",
        "llama.cpp tree it vendors (`llamaprompt cores add <version>`; the pin's is the built-in core), then",
        "`llamaprompt render` was run on it and, where `../shared/reference` holds a recording of that",
        "commit by an unmodified llama-server, the reference suites (`tests/test_reference.py`,",
        "`tests/test_gguf.py`, `tests/test_fast_path.py`) were run against it. Rows marked",
        "*probe only* come from `--probe-only`: the tree was fetched and the configure-time probe",
        "(`third_party/adapt_tree.py`) run, without compiling.",
        "",
        f"Generated {generated}.",
        "",
        "| llama-cpp-python | llama.cpp | date | configured | built | render | features present | missing "
        "| reference cases | reference suites |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        present, missing = fmt_features(r) if r.get("tree_info") else ("—", "—")
        ref = r.get("reference")
        if r.get("built") is None:
            refcell, cases = "not built in this run (probe only)", "—"
        elif not r.get("built"):
            refcell, cases = "—", "—"
        elif ref is None:
            refcell, cases = "no recording of this commit", "—"
        else:
            counts = ", ".join(f"{v} {k}" for k, v in ref["pytest"].items()) or "no result"
            refcell = ("✅ " if ref["ok"] else "❌ ") + counts
            cases = f"{ref['cases']:,} ({ref['folder']})"
        version = r["version"] + (" (pin)" if r.get("pinned") else "")
        lines.append(
            f"| {version} | `{r['commit']}` | {r.get('date') or 'unknown'} | {'yes' if r.get('configured') else 'no'} "
            f"| {'—' if r.get('built') is None else 'yes' if r.get('built') else 'no'} "
            f"| {'ok' if (r.get('render') or {}).get('ok') else '—'} | {present} | {missing} | {cases} | {refcell} |"
        )
    if changelog:
        lines += [
            "",
            "## What changed between consecutive trees",
            "",
            "`llamaprompt diff-versions --from A --to B` between each pair of consecutive trees that have a",
            "core, over every template shipped with llamaprompt (the pinned tree's files) and the default",
            "request set (`llamaprompt.fixtures.default_requests()`): caps that changed, and per request",
            "whether the prompt changed, the error changed, it now fails or now renders.",
            "",
            "| from → to | templates changed | cases changed | caps changed | prompt changed | error changed "
            "| now fails | now renders |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in changelog:
            s_ = c["summary"]
            k = s_["by_change"]
            skipped = f" (skipping {', '.join(c['skipped'])})" if c["skipped"] else ""
            lines.append(
                f"| {c['from']['name']} → {c['to']['name']}{skipped} | {s_['templates_changed']} of {s_['templates']} "
                f"| {s_['cases_changed']:,} of {s_['cases']:,} | {s_['caps_changed']} | {k['prompt_changed']} "
                f"| {k['error_changed']} | {k['now_fails']} | {k['now_renders']} |"
            )
        for c in changelog:
            lines += [
                "",
                f"### {c['from']['name']} (`{c['from']['commit']}`) → {c['to']['name']} (`{c['to']['commit']}`)",
                "",
                c["summary_line"] + ".",
                "",
            ]
            if not c["templates"]:
                lines.append("Nothing changed.")
            for name, t in c["templates"].items():
                parts = []
                if t.get("load"):

                    def err(e):
                        return "loads" if not e else f"fails to load ({e['message'][:80]})"

                    parts.append(f"load: {err(t['load']['from'])} → {err(t['load']['to'])}")
                parts += [f"caps {key} {old} → {new}" for key, (old, new) in t["caps"].items()]
                for kind, reqs in t["cases"].items():
                    parts.append(f"{kind.replace('_', ' ')}: {', '.join(reqs)}")
                lines.append(f"- `{name}`: " + "; ".join(parts))
    lines += ["", "## Per tree: what the build adapted to", ""]
    for r in results:
        lines.append(f"### {r['version']} (llama.cpp `{r['commit']}`)")
        lines.append("")
        if r.get("error"):
            lines.append(f"Not built: {r['error']}")
            lines.append("")
            continue
        if r.get("built") is None:
            lines.append("Configure-time probe only (`--probe-only`): not compiled in this run.")
        info = r.get("tree_info") or {}
        notes = info.get("notes") or []
        if notes:
            lines += [f"- {n}" for n in notes]
        else:
            lines.append("- every rewrite applied; every feature present")
        build = f"; build {r['build_seconds']} s" if r.get("build_seconds") else ""
        lines.append(f"- chat_template_caps keys: {len(info.get('caps_keys', []))}{build}")
        lines.append("")
    return "\n".join(lines) + "\n"


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=sorted(LOCK["versions"]), help="versions to build")
    ap.add_argument("--from-json", type=Path, help="rewrite docs/versions.md from this JSON only")
    ap.add_argument(
        "--changes-only",
        action="store_true",
        help="only recompute the changes between consecutive trees (cores already built)",
    )
    ap.add_argument(
        "--probe-only",
        action="store_true",
        help="fetch each tree and run the configure-time probe only (no compilation)",
    )
    args = ap.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        (DOCS / "versions.md").write_text(markdown(data["results"], data["generated"], data.get("changes")))
        return 0
    unknown = [v for v in args.versions if v not in LOCK["versions"]]
    if unknown:
        ap.error(f"not in third_party/llama.cpp.lock: {', '.join(unknown)}")
    previous = {}
    path = DOCS / "versions.json"
    if path.exists():
        previous = {r["version"]: r for r in json.loads(path.read_text())["results"]}
    changelog = json.loads(path.read_text()).get("changes") if path.exists() else None

    def write() -> None:
        results = [previous[k] for k in sorted(previous, key=version_key)]
        generated = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        path.write_text(json.dumps({"generated": generated, "results": results, "changes": changelog}, indent=1) + "\n")
        (DOCS / "versions.md").write_text(markdown(results, generated, changelog))

    for v in [] if args.changes_only else args.versions:
        if args.probe_only:
            if previous.get(v, {}).get("built"):
                continue  # keep the measured row
            previous[v] = probe_version(v)
        else:
            previous[v] = one_version(v)
        write()
    if not args.probe_only:
        changelog = changes(sorted(LOCK["versions"], key=version_key))
        write()
    failed = [r["version"] for r in previous.values() if r.get("reference") and not r["reference"]["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
