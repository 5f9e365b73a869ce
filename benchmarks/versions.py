"""Build llamaprompt against every llama.cpp tree in third_party/llama.cpp.lock and
regenerate docs/versions.md (and docs/versions.json).

    python benchmarks/versions.py                       # every version in the lock
    python benchmarks/versions.py --versions 0.3.35 0.3.36
    python benchmarks/versions.py --from-json docs/versions.json   # only rewrite the Markdown

Per version it builds a wheel from this checkout with ``LLAMAPROMPT_LLAMA_CPP=<version>``
in its own build directory (``build/llama.cpp-<version>``, as .ci/run; ccache, when installed,
shares objects between runs), installs it into its own virtual environment
(``build/ci-venv-<version>``, which sees this interpreter's packages, so only llamaprompt differs), and records:

- the commit and date (from the lock), whether the tree configured and built (or the
  message that stopped it), the build time;
- ``llamaprompt.tree_info()``: the features present or missing, the rewrites skipped;
- a render of the embedded default (``llamaprompt render``);
- the reference suites (tests/test_reference.py, tests/test_gguf.py, tests/test_fast_path.py)
  when ../shared/reference holds a recording of that commit: pytest's counts and the number
  of recorded cases they compare.

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
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LOCK = json.loads((ROOT / "third_party" / "llama.cpp.lock").read_text())
REFERENCE_SUITES = ["tests/test_reference.py", "tests/test_gguf.py", "tests/test_fast_path.py"]

sys.path.insert(0, str(ROOT / "tests"))


def run(cmd: list[str], env: dict | None = None, log: Path | None = None, timeout: float = 3600) -> tuple[int, str]:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if log:
        log.write_text(proc.stdout)
    return proc.returncode, proc.stdout


def configure_error(output: str) -> str:
    """The message that stopped configuration or compilation (first lines of it)."""
    m = re.search(r"llamaprompt: cannot build against the llama.cpp tree at [^\n]*\n(.*?)(?:\n\s*\n|CMake Error)",
                  output, re.S)
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
    entry = LOCK["versions"][version]
    out: dict = {"version": version, "commit": entry["commit"], "date": entry.get("date"),
                 "pinned": version == LOCK["source"]["version"]}
    work = ROOT / "build" / "versions" / version
    work.mkdir(parents=True, exist_ok=True)
    # the same build directory and venv as .ci/run uses for a tree other than the pin
    build_dir = ROOT / "build" / f"llama.cpp-{version}"
    env = {**os.environ, "LLAMAPROMPT_LLAMA_CPP": version, "SKBUILD_BUILD_DIR": str(build_dir)}
    env.pop("LLAMAPROMPT_LLAMA_CPP_DIR", None)
    wheels = work / "wheel"
    for old in wheels.glob("*.whl"):
        old.unlink()
    print(f"[{version}] building the wheel (llama.cpp {entry['commit']}) ...", flush=True)
    t0 = time.monotonic()
    rc, log = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), "."], env=env,
                  log=work / "build.log")
    out["build_seconds"] = round(time.monotonic() - t0)
    # pip hides CMake's output unless the build fails: a wheel means configuration succeeded
    out["configured"] = rc == 0 or "Build files have been written" in log or "-- Generating done" in log
    if rc != 0:
        out["built"] = False
        out["error"] = configure_error(log)
        print(f"[{version}] failed: {out['error']}", flush=True)
        return out
    out["built"] = True
    env_dir = ROOT / "build" / f"ci-venv-{version}"
    if not (env_dir / "bin" / "python").exists():
        venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    wheel = next(wheels.glob("*.whl"))
    rc, log = run([py, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--quiet", str(wheel)])
    if rc != 0:
        out["error"] = "install failed: " + log.strip().splitlines()[-1]
        return out
    rc, info = run([py, "-c", "import json, llamaprompt; print(json.dumps(llamaprompt.tree_info()))"])
    out["tree_info"] = json.loads(info) if rc == 0 else {"error": info.strip()}
    rc, prompt = run([str(env_dir / "bin" / "llamaprompt"), "render"])
    out["render"] = {"ok": rc == 0 and bool(prompt), "bytes": len(prompt.encode())}
    folder, n_cases = reference_for(entry["commit"])
    if folder is None:
        out["reference"] = None
    else:
        print(f"[{version}] reference suites ({folder}) ...", flush=True)
        tenv = {**os.environ, "LLAMAPROMPT_REQUIRE_REFERENCE": "1"}
        rc, log = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *REFERENCE_SUITES], env=tenv,
                      log=work / "reference.log")
        out["reference"] = {"folder": str(folder.relative_to(folder.parents[1]) if "versions" in folder.parts
                                          else folder.name),
                            "cases": n_cases, "pytest": pytest_counts(log), "ok": rc == 0}
    print(f"[{version}] done", flush=True)
    return out


def probe_version(version: str) -> dict:
    """Only fetch the tree and run the configure-time probe (no compilation)."""
    entry = LOCK["versions"][version]
    out: dict = {"version": version, "commit": entry["commit"], "date": entry.get("date"),
                 "pinned": version == LOCK["source"]["version"], "built": None}
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
    info = r.get("tree_info") or {}
    feats = info.get("features") or {}
    shown = ["caps_reasoning_effort", "thinking_end_tags", "message_delimiters", "parse", "server_schema",
             "const_execution"]
    present = ", ".join(f for f in shown if feats.get(f))
    missing = ", ".join(f for f in shown if f in feats and not feats[f])
    return present or "—", missing or "—"


def markdown(results: list[dict], generated: str) -> str:
    lines = [
        "# llamaprompt against each llama.cpp tree",
        "",
        "Regenerated by `python benchmarks/versions.py` (do not edit): for each llama-cpp-python",
        "source distribution in `third_party/llama.cpp.lock`, llamaprompt was built with",
        "`LLAMAPROMPT_LLAMA_CPP=<version> pip install .` against the llama.cpp tree it vendors, then",
        "`llamaprompt render` was run and, where `../shared/reference` holds a recording of that",
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=sorted(LOCK["versions"]), help="versions to build")
    ap.add_argument("--from-json", type=Path, help="rewrite docs/versions.md from this JSON only")
    ap.add_argument("--probe-only", action="store_true",
                    help="fetch each tree and run the configure-time probe only (no compilation)")
    args = ap.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        (DOCS / "versions.md").write_text(markdown(data["results"], data["generated"]))
        return 0
    unknown = [v for v in args.versions if v not in LOCK["versions"]]
    if unknown:
        ap.error(f"not in third_party/llama.cpp.lock: {', '.join(unknown)}")
    previous = {}
    path = DOCS / "versions.json"
    if path.exists():
        previous = {r["version"]: r for r in json.loads(path.read_text())["results"]}
    for v in args.versions:
        if args.probe_only:
            if previous.get(v, {}).get("built"):
                continue  # keep the measured row
            previous[v] = probe_version(v)
        else:
            previous[v] = one_version(v)
        results = [previous[k] for k in sorted(previous, key=lambda s: tuple(int(x) for x in s.split(".")))]
        generated = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        path.write_text(json.dumps({"generated": generated, "results": results}, indent=1) + "\n")
        (DOCS / "versions.md").write_text(markdown(results, generated))
    failed = [r["version"] for r in previous.values() if r.get("reference") and not r["reference"]["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
