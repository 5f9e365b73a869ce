"""Put the part of the pinned llama.cpp tree that the build reads into an sdist, so that
``pip install llamaprompt-*.tar.gz`` builds with no network.

    python -m build --sdist
    python third_party/sdist_tree.py dist/llamaprompt-X.tar.gz [--build-dir build/<wheel_tag>]

The files are the ones a build of the pinned tree (the build directory given, default the only
``build/*/`` holding a ``build.ninja``) read, from the build's own records, not from a list kept
here:

- every CMake input of the tree (``build.ninja``'s re-run rule: CMakeLists.txt, *.cmake, *.in);
- every source compiled (``compile_commands.json``) and every header those compilations
  included (``ninja -t deps``);
- every file of the tree that ``adapt_tree.py`` probed or read (``generated/lp_tree_inputs.txt``:
  a probe finding a file absent would build something else);
- the tree's LICENSE, its ``.llamaprompt-commit``/``.llamaprompt-source`` markers, the shipped
  templates (``models/templates/*.jinja``), and ``ggml/src/ggml-cpu`` whole (its per-architecture
  files, which a build on another CPU compiles instead of the x86 ones).

The sdist's ``third_party/llama.cpp/`` then holds that subset (``.llamaprompt-subset`` lists it);
CMake finds ``third_party/llama.cpp/CMakeLists.txt`` and fetches nothing. The tree must be the
pin (its ``.llamaprompt-commit`` is the lock's commit). Standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TREE = HERE / "llama.cpp"
WHOLE_DIRS = ("ggml/src/ggml-cpu",)


def _under_tree(path: str, base: Path) -> str | None:
    """``path`` relative to the tree, when it is inside it (else None)."""
    p = Path(path)
    if not p.is_absolute():
        p = base / p
    p = Path(os.path.normpath(p))
    try:
        rel = p.relative_to(TREE)
    except ValueError:
        return None
    return rel.as_posix() if (TREE / rel).is_file() else None


def build_inputs(build_dir: Path) -> set[str]:
    """The tree's files a configured and built build directory read."""
    ninja_file = (build_dir / "build.ninja").read_text()
    # "build build.ninja[ <other outputs>]: RERUN_CMAKE <inputs>" (CMake 4 lists more outputs)
    m = re.search(r"^build build\.ninja(?: [^:\n]*)?: RERUN_CMAKE (.*)$", ninja_file, re.M)
    if m is None:
        sys.exit(f"{build_dir}/build.ninja: no RERUN_CMAKE rule (not a CMake/Ninja build directory?)")
    files = {r for r in (_under_tree(p, build_dir) for p in m.group(1).replace("|", " ").split()) if r}
    for entry in json.loads((build_dir / "compile_commands.json").read_text()):
        rel = _under_tree(entry["file"], Path(entry["directory"]))
        if rel:
            files.add(rel)
    deps = subprocess.run(["ninja", "-C", str(build_dir), "-t", "deps"], capture_output=True, text=True, check=True)
    for line in deps.stdout.splitlines():
        if line.startswith("    "):
            rel = _under_tree(line.strip(), build_dir)
            if rel:
                files.add(rel)
    probed = build_dir / "generated" / "lp_tree_inputs.txt"
    if not probed.is_file():
        sys.exit(f"{probed}: missing (configure the build directory with this checkout's CMakeLists.txt)")
    files |= {r for r in probed.read_text().split() if (TREE / r).is_file()}
    return files


def subset(build_dir: Path) -> list[str]:
    lock = json.loads((HERE / "llama.cpp.lock").read_text())
    marker = TREE / ".llamaprompt-commit"
    commit = marker.read_text().strip() if marker.is_file() else None
    if commit != lock["commit"]:
        sys.exit(f"{TREE} holds llama.cpp {commit}, the lock pins {lock['commit']}: "
                 "remove the folder and build again (the build fetches the pin)")
    cache = build_dir / "CMakeCache.txt"
    configured = re.search(r"^LP_CONFIGURED_TREE:INTERNAL=(.*)$", cache.read_text(), re.M) if cache.is_file() else None
    if configured is None or Path(configured.group(1)).resolve() != TREE.resolve():
        sys.exit(f"{build_dir} was not configured for the pinned tree {TREE}")
    files = build_inputs(build_dir)
    files |= {p.relative_to(TREE).as_posix() for p in (TREE / "models" / "templates").glob("*.jinja")}
    for d in WHOLE_DIRS:
        files |= {p.relative_to(TREE).as_posix() for p in (TREE / d).rglob("*") if p.is_file()}
    files |= {name for name in ("LICENSE", ".llamaprompt-commit", ".llamaprompt-source") if (TREE / name).is_file()}
    return sorted(files)


def add_to_sdist(sdist: Path, files: list[str]) -> tuple[int, int]:
    """Rewrite the sdist with ``third_party/llama.cpp/<file>`` added; returns (files, bytes)."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    top = members[0][0].name.split("/", 1)[0]
    prefix = f"{top}/third_party/llama.cpp/"
    if any(m.name.startswith(prefix) for m, _ in members):
        sys.exit(f"{sdist} already carries {prefix}")
    template = next(m for m, _ in members if m.isfile())
    listing = "".join(f"{f}\n" for f in files).encode()
    added = [(f, (TREE / f).read_bytes()) for f in files] + [(".llamaprompt-subset", listing)]
    size = 0
    buf = io.BytesIO()
    # the same gzip/tar settings for every member: a reproducible archive, as the backend writes
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w",
                                                                           format=tarfile.PAX_FORMAT) as out:
        for m, data in members:
            out.addfile(m, io.BytesIO(data) if data is not None else None)
        for rel, data in added:
            info = tarfile.TarInfo(prefix + rel)
            info.size, info.mtime, info.mode = len(data), template.mtime, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            out.addfile(info, io.BytesIO(data))
            size += len(data)
    with tempfile.NamedTemporaryFile(dir=sdist.parent, delete=False) as tmp:
        tmp.write(buf.getvalue())
    os.chmod(tmp.name, sdist.stat().st_mode & 0o777)
    os.replace(tmp.name, sdist)
    return len(added), size


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("sdist", type=Path, help="the sdist written by `python -m build --sdist`")
    ap.add_argument("--build-dir", type=Path, help="a build directory of the pinned tree (default: the only build/*/)")
    ap.add_argument("--list", action="store_true", help="print the files and change nothing")
    args = ap.parse_args(argv[1:])
    if not args.list:
        try:
            with tarfile.open(args.sdist, "r:gz") as tar:
                tar.getmembers()
        except (OSError, EOFError, tarfile.TarError) as e:
            sys.exit(f"{args.sdist}: not a readable .tar.gz sdist ({e})")
    build_dir = args.build_dir
    if build_dir is not None and not (build_dir / "build.ninja").is_file():
        sys.exit(f"{build_dir}: not a build directory (no build.ninja; `pip install .` makes one under build/)")
    if build_dir is None:
        found = [p.parent for p in (ROOT / "build").glob("*/build.ninja")]
        if len(found) != 1:
            sys.exit(f"give --build-dir: {len(found)} build directories under {ROOT / 'build'}"
                     + (f" ({', '.join(map(str, found))})" if found else " (run `pip install .` first)"))
        build_dir = found[0]
    files = subset(build_dir.resolve())
    if args.list:
        print("\n".join(files))
        return 0
    n, size = add_to_sdist(args.sdist, files)
    print(f"sdist_tree: {args.sdist}: added {n} files of the pinned llama.cpp tree ({size / 1e6:.1f} MB) "
          f"from {shlex.quote(str(build_dir))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
