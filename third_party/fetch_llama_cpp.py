"""Fill a llama.cpp tree from a llama-cpp-python source distribution.

Run by CMakeLists.txt when the selected tree is absent (and usable by hand):

    python third_party/fetch_llama_cpp.py [--version VERSION] [DEST]
    python third_party/fetch_llama_cpp.py --list

Reads third_party/llama.cpp.lock, downloads the sdist of that llama-cpp-python version
(default: the pinned one) with pip, which checks the sha256 the lock lists before any
code of the download runs (``--require-hashes``); the file is kept in a cache directory
outside the clone, checked again, and the llama.cpp tree it vendors is extracted into
DEST (default: third_party/llama.cpp for the pinned version, else
``<cache>/trees/<version>``). Standard library only.
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


def load_lock() -> dict:
    return json.loads((HERE / "llama.cpp.lock").read_text())


def version_entry(lock: dict, version: str | None) -> dict:
    """The lock's record for a llama-cpp-python version: commit, date, sha256 (SystemExit if unknown)."""
    pinned = lock["source"]["version"]
    version = version or pinned
    versions = lock.get("versions", {})
    if version not in versions:
        sys.exit(f"llamaprompt: llama-cpp-python {version} is not in third_party/llama.cpp.lock "
                 f"(known: {', '.join(sorted(versions))}); use LLAMAPROMPT_LLAMA_CPP_DIR for any other tree")
    return {"version": version, "pinned": version == pinned, **versions[version]}


def default_dest(entry: dict) -> Path:
    return HERE / "llama.cpp" if entry["pinned"] else cache_dir() / "trees" / entry["version"]


def download_sdist(package: str, version: str, sha256: str) -> Path:
    """Return a verified copy of the sdist, downloading it with pip when not cached."""
    target = cache_dir() / "sdist"
    target.mkdir(parents=True, exist_ok=True)
    stem = f"{package.replace('-', '_')}-{version}"
    for candidate in (target / f"{stem}.tar.gz", target / f"{package}-{version}.tar.gz"):
        if candidate.exists() and sha256_of(candidate) == sha256:
            return candidate
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        # pip checks the hash as soon as the file is downloaded, before it prepares the
        # package's metadata (which would run the download's build backend)
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{package}=={version} --hash=sha256:{sha256}\n")
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
            "--no-build-isolation", "-r", str(req), "-d", tmp,
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
    import argparse

    ap = argparse.ArgumentParser(description="Extract the llama.cpp tree a llama-cpp-python sdist vendors.")
    ap.add_argument("dest", nargs="?", help="target folder (default: the version's usual place)")
    ap.add_argument("--version", help="llama-cpp-python version listed in llama.cpp.lock (default: the pin)")
    ap.add_argument("--list", action="store_true", help="print the known versions as JSON and exit")
    ap.add_argument("--print-dest", action="store_true", help="print the default folder and exit")
    args = ap.parse_args(argv[1:])
    lock = load_lock()
    if args.list:
        print(json.dumps(lock.get("versions", {}), indent=1))
        return 0
    entry = version_entry(lock, args.version)
    dest = Path(args.dest) if args.dest else default_dest(entry)
    if args.print_dest:
        print(dest)
        return 0
    if (dest / "CMakeLists.txt").exists():
        return 0
    src = lock["source"]
    sdist = download_sdist(src["package"], entry["version"], entry["sha256"])
    extract(sdist, src["subdir"], dest)
    (dest / ".llamaprompt-commit").write_text(entry["commit"] + "\n")
    (dest / ".llamaprompt-source").write_text(f"{src['package']} {entry['version']} sdist\n")
    print(f"llamaprompt: llama.cpp {entry['commit']} (llama-cpp-python {entry['version']}) extracted to {dest}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
