"""Several llama.cpp trees side by side: cores built for other trees, and how they are run.

A *core* is llamaprompt's extension module (``_core``) compiled against one llama.cpp tree.
The one installed with the package is the *built-in* core (:data:`llamaprompt.LLAMA_CPP_COMMIT`).
``llamaprompt cores add 0.3.33`` (or :func:`add_core`) builds the same sources against another
tree -- any llama-cpp-python sdist version listed in ``third_party/llama.cpp.lock``, or a
llama.cpp checkout -- into the per-user cache::

    ~/.cache/llamaprompt/cores/<commit>-<python>/_core.<ext>            the module
    ~/.cache/llamaprompt/cores/<commit>-<python>/core.json              name, commit, source, date, ...
    ~/.cache/llamaprompt/core-builds/<name>-<source>-<python>/          its build directory (reused)

(``<python>``: ``sys.implementation.cache_tag``, e.g. ``cpython-311``, so that each Python of the
user keeps its own build of a tree; ``$LLAMAPROMPT_CACHE_DIR``, else
``$XDG_CACHE_HOME/llamaprompt``, replaces ``~/.cache/llamaprompt``.) ``ChatTemplate(...,
llama_cpp="0.3.33")`` then renders with that core.

Where the other core runs: in a **worker process**, one per core per process, started on first
use. Each core links its own copy of llama.cpp, ggml and common (its module exports only
``PyInit__core``), but every core is the same extension module -- one import name, the same
pybind11 types -- so one interpreter holds one; the worker loads only its own. Results, errors
and exactness are the core's own; the cost is
an IPC round trip per call (tens of microseconds). Setting ``LLAMAPROMPT_CORE=<name|commit|path>``
before importing llamaprompt makes that core the in-process one instead (this is what the
worker does, and how a test suite runs against another tree).

A core is used only by a package whose built-in core was built from the same llamaprompt
sources (:func:`source_hash`): after upgrading llamaprompt, ``cores add`` rebuilds.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CoreError

__all__ = [
    "CORE_ENV",
    "Core",
    "add_core",
    "builtin_core",
    "cache_dir",
    "cores_dir",
    "find_core",
    "installed_cores",
    "remove_core",
    "source_hash",
]

#: Environment variable naming the core to load in-process (a name, commit or file).
CORE_ENV = "LLAMAPROMPT_CORE"

_PKG = Path(__file__).resolve().parent
_HASH_FILE = "_core.source-hash"


def cache_dir() -> Path:
    """The per-user cache: ``$LLAMAPROMPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/llamaprompt``,
    else ``~/.cache/llamaprompt`` (the same folder the build keeps llama.cpp trees in)."""
    env = os.environ.get("LLAMAPROMPT_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llamaprompt"


def cores_dir() -> Path:
    """Where installed cores live: ``cache_dir() / "cores"``."""
    return cache_dir() / "cores"


def _python_tag() -> str:
    """This interpreter's tag in the cache's folder names (``cpython-311``)."""
    return sys.implementation.cache_tag or sys.implementation.name


def source_hash(root: str | os.PathLike[str]) -> str:
    """sha256 (hex) of llamaprompt's build inputs under ``root`` (a source checkout):
    ``src/cpp/*``, ``CMakeLists.txt`` and ``third_party/adapt_tree.py``, as one line
    ``"<relative path> <sha256>\\n"`` per file in sorted order -- the digest CMakeLists.txt
    compiles into the module (``_core.SOURCE_HASH``)."""
    base = Path(root)
    rels = [f"src/cpp/{p.name}" for p in (base / "src" / "cpp").iterdir() if p.is_file()]
    rels += ["CMakeLists.txt", "third_party/adapt_tree.py"]
    text = "".join(f"{rel} {hashlib.sha256((base / rel).read_bytes()).hexdigest()}\n" for rel in sorted(rels))
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _installed_hash() -> str | None:
    """The source hash of the package's built-in core, read without loading it."""
    with contextlib.suppress(OSError):
        return (_PKG / _HASH_FILE).read_text().strip()
    return None


def _version_of(source: str) -> str | None:
    m = re.search(r"llama-cpp-python (\S+) sdist", source)
    return m.group(1) if m else None


@dataclass(frozen=True)
class Core:
    """One llamaprompt core: the extension module built against one llama.cpp tree.

    Attributes:
        name: the llama-cpp-python version whose tree it was built from (``"0.3.35"``), or the
            commit for a llama.cpp checkout.
        commit: the llama.cpp commit (abbreviated, as in the lock).
        source: where the tree came from, e.g. ``"llama-cpp-python 0.3.35 sdist"``.
        date: the commit's date (``YYYY-MM-DD``) when the lock knows it, else None.
        features: ``{feature: present}`` as :data:`llamaprompt.features` reports on that core.
        path: the module file (None for the built-in core: the package's own).
        size: the module's size in bytes.
        source_hash: :func:`source_hash` of the llamaprompt sources it was built from.
        builtin: True for the core installed with the package (runs in-process).
        built_at: when ``cores add`` built it (ISO 8601, UTC), None for the built-in core.
        build_key: the first part of its build directories' names under
            ``cache_dir()/core-builds`` (the version, or ``dir-<hash>`` for a llama.cpp folder);
            None for the built-in core and for cores installed before it was recorded.
    """

    name: str
    commit: str
    source: str
    date: str | None = None
    features: dict[str, bool] = field(default_factory=dict)
    path: str | None = None
    size: int = 0
    source_hash: str = ""
    builtin: bool = False
    built_at: str | None = None
    build_key: str | None = None

    @property
    def usable(self) -> bool:
        """Whether this package can load it: built from the same llamaprompt sources, for this
        Python (its module's ABI tag, e.g. ``cpython-311``, is this interpreter's)."""
        return self.builtin or (self.source_hash == _installed_hash() and self.for_this_python)

    @property
    def for_this_python(self) -> bool:
        """Whether this interpreter imports the module file: its ABI tag
        (``_core.cpython-311-x86_64-linux-gnu.so``, ``.abi3.so``) is one of this interpreter's
        extension suffixes, or it has none (a core built by another Python -- another version,
        PyPy -- in the shared cache does not load here)."""
        name = Path(self.path or "").name
        if not name:
            return True
        suffixes = importlib.machinery.EXTENSION_SUFFIXES
        if any(name.endswith(s) for s in suffixes if s.count(".") > 1):
            return True
        return name.count(".") == 1 and any(name.endswith(s) for s in suffixes)

    def matches(self, spec: str) -> bool:
        """Whether ``spec`` names this core: its name, or a prefix (7+ hex digits) of its commit."""
        spec = spec.strip()
        if spec == self.name:
            return True
        return bool(re.fullmatch(r"[0-9a-f]{7,40}", spec)) and (
            spec.startswith(self.commit) or self.commit.startswith(spec)
        )

    def label(self) -> str:
        return f"{self.name} ({self.commit})" if self.name != self.commit else self.commit


@functools.cache
def builtin_core() -> Core:
    """The core this process runs in-process (the package's, or the one ``LLAMAPROMPT_CORE`` chose);
    fixed for the life of the process, so computed once."""
    from . import _core

    info = json.loads(_core.TREE_INFO_JSON)
    path = getattr(_core, "__file__", None)
    meta = _read_meta(Path(path).parent) if path and Path(path).parent.parent == cores_dir() else None
    name = (meta or {}).get("name") or _version_of(_core.LLAMA_CPP_SOURCE) or _core.LLAMA_CPP_COMMIT
    date = (meta or {}).get("date") or (_versions(Path(_core.SOURCE_DIR)).get(name) or {}).get("date")
    return Core(
        name=name,
        commit=_core.LLAMA_CPP_COMMIT,
        source=_core.LLAMA_CPP_SOURCE,
        date=date,
        features=dict(info["features"]),
        path=None,
        size=os.path.getsize(path) if path else 0,
        source_hash=_core.SOURCE_HASH,
        builtin=True,
    )


def _read_meta(folder: Path) -> dict[str, Any] | None:
    """A core folder's core.json, or None when it cannot be read or is no JSON object."""
    try:
        meta = json.loads((folder / "core.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return meta if isinstance(meta, dict) else None


def _core_from_meta(folder: Path, meta: dict[str, Any]) -> Core | None:
    """The Core a core.json describes, its module file taken in ``folder`` whatever folder the
    file names (a cache that moved; a relative or foreign path never points elsewhere); None
    when a field has the wrong type (a core.json edited by hand or damaged: not listed)."""
    text = ("name", "commit", "source", "path")
    if not all(isinstance(meta.get(k), str) and meta[k] for k in text):
        return None
    optional = {"date": str, "source_hash": str, "built_at": str, "build_key": str, "size": int, "features": dict}
    if any(meta.get(k) is not None and not isinstance(meta[k], t) for k, t in optional.items()):
        return None
    known = {f for f in Core.__dataclass_fields__}
    fields = {k: v for k, v in meta.items() if k in known and k != "builtin"}
    fields["path"] = str(folder / Path(meta["path"]).name)
    return Core(**fields)


def installed_cores() -> list[Core]:
    """The cores in :func:`cores_dir`, oldest commit date first (unknown dates last).

    A core built from other llamaprompt sources is listed with ``usable`` False."""
    out = []
    root = cores_dir()
    if root.is_dir():
        for folder in sorted(root.iterdir()):
            meta = _read_meta(folder)
            core = None if meta is None else _core_from_meta(folder, meta)
            if core is not None:
                out.append(core)
    return sorted(out, key=lambda c: (c.date is None, c.date or "", c.name))


def find_core(spec: str | None) -> Core:
    """The core ``spec`` names: None, ``""`` or ``"builtin"`` for the in-process one, a
    llama-cpp-python version (``"0.3.35"``) or a llama.cpp commit prefix (7+ hex digits).

    Raises CoreError when no installed core matches, or when the match was built from other
    llamaprompt sources (the message says how to build or rebuild it)."""
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"llama_cpp must be a str (a version or commit), not {type(spec).__name__}")
    here = builtin_core()
    if not spec or spec == "builtin" or here.matches(spec):
        return here
    cores = installed_cores()
    # one version may be installed for several Pythons (each its own folder): this one's first
    for core in sorted(cores, key=lambda c: (not c.usable, not c.for_this_python)):
        if core.matches(spec):
            if not core.usable:
                why = (
                    "from other llamaprompt sources than this package"
                    if core.source_hash != _installed_hash()
                    else f"for another Python ({Path(core.path or '').name}; this is {_python_tag()})"
                )
                raise CoreError(
                    f"the llama.cpp {core.label()} core in {Path(core.path or '').parent} was built {why}; "
                    f"rebuild it with `llamaprompt cores add {core.name}` (run by this Python)"
                )
            return core
    have = ", ".join([here.label() + " (built-in)"] + [c.label() for c in cores]) or "none"
    hint = (
        f"build it with `llamaprompt cores add {spec}`"
        if re.fullmatch(r"\d+\.\d+\.\d+", spec)
        else "name a core by llama-cpp-python version (e.g. 0.3.35) or llama.cpp commit; build one with "
        "`llamaprompt cores add VERSION`"
    )
    raise CoreError(f"no llama.cpp core {spec!r} is installed; {hint} (installed: {have})")


# -- building -------------------------------------------------------------------------------


def _source_dir(source_dir: str | os.PathLike[str] | None) -> Path:
    """The llamaprompt sources to build from: the argument, $LLAMAPROMPT_SOURCE_DIR, or the
    folder the built-in core was built from when it is still there."""
    candidates: list[Any] = [source_dir, os.environ.get("LLAMAPROMPT_SOURCE_DIR")]
    if source_dir is None:
        from . import _core

        candidates.append(_core.SOURCE_DIR)
    for cand in candidates:
        if not cand:
            continue
        root = Path(cand).resolve()
        if (root / "CMakeLists.txt").is_file() and (root / "third_party" / "adapt_tree.py").is_file():
            return root
        if cand is source_dir:
            raise CoreError(f"{root} is not a llamaprompt source tree (no CMakeLists.txt / third_party/adapt_tree.py)")
    raise CoreError(
        "building a core needs llamaprompt's sources (a clone or an unpacked sdist): pass --source DIR "
        "or set LLAMAPROMPT_SOURCE_DIR"
    )


def _versions(src: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        lock = json.loads((src / "third_party" / "llama.cpp.lock").read_text())
        return dict(lock.get("versions", {}))
    return {}


_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]")  # ninja's "[12/313] Building CXX object ..." (pip indents)


def _build_errors(log: str) -> str:
    """The part of a failed build's output that says why: adapt_tree's message (the file and
    the text of the upstream change), CMake's errors, else the compiler's first errors."""
    lines = [ln[2:] if ln.startswith("  ") else ln for ln in log.splitlines()]  # pip indents by 2
    keep: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("llamaprompt: cannot build") or line.startswith("CMake Error"):
            block = [line]
            i += 1
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("CMake Error", "-- ")):
                block.append(lines[i])
                i += 1
            keep.append("\n".join(block))
            continue
        i += 1
    if not keep:
        keep = [ln for ln in lines if " error: " in ln or ln.startswith("error:")][:10]
    return "\n".join(dict.fromkeys(keep)) or "\n".join(lines[-30:])


def add_core(
    version: str | None = None,
    *,
    llama_cpp_dir: str | os.PathLike[str] | None = None,
    source_dir: str | os.PathLike[str] | None = None,
    jobs: int | None = None,
    progress: bool | Callable[[int, int], None] = True,
    force: bool = False,
    build_isolation: bool = True,
) -> Core:
    """Build llamaprompt's core against another llama.cpp tree and install it in :func:`cores_dir`.

    Args:
        version: a llama-cpp-python version listed in ``third_party/llama.cpp.lock``
            (``"0.3.33"``): its sdist is downloaded (sha256-checked) unless cached.
        llama_cpp_dir: a llama.cpp source tree instead (a checkout or an unpacked tree).
        source_dir: llamaprompt's sources (default: ``$LLAMAPROMPT_SOURCE_DIR``, or where the
            built-in core was built from). They must be the sources of the installed package.
        jobs: parallel compile jobs (``CMAKE_BUILD_PARALLEL_LEVEL``; default: the build's).
        progress: True draws a progress bar on stderr (tqdm), False is silent, or a callable
            ``(done, total)`` receives the compile steps.
        force: build even when a usable core for that version is installed (else it is returned).
        build_isolation: False builds with the build requirements already installed in this
            environment (``pip wheel --no-build-isolation``: scikit-build-core, pybind11, cmake,
            ninja) -- no downloads, and ccache hits for llamaprompt's own files too, since their
            include paths no longer change with every temporary build environment.

    The build is ``pip wheel`` of those sources with ``LLAMAPROMPT_LLAMA_CPP`` (or
    ``_DIR``) set, in a build directory kept under ``cache_dir()/core-builds`` so that a rebuild
    is incremental (ccache, when installed, is used as by any build). Takes minutes cold.

    Returns the installed :class:`Core`. Raises CoreError when the build fails -- with the
    configure step's message when an upstream change stopped it (adapt_tree names the file
    and the text) -- or when the sources are not the installed package's; ValueError when
    neither or both of ``version`` and ``llama_cpp_dir`` are given.
    """
    if (version is None) == (llama_cpp_dir is None):
        raise ValueError("give a llama-cpp-python version or a llama.cpp directory (one of them)")
    if version is not None and not force:
        here = builtin_core()
        if here.name == version:
            raise CoreError(f"{version} ({here.commit}) is this package's built-in core: there is nothing to build")
        for core in installed_cores():
            if core.name == version and core.usable:
                return core  # already built from these sources (force=True rebuilds)
    src = _source_dir(source_dir)
    want = _installed_hash()
    have = source_hash(src)
    if want is not None and have != want:
        raise CoreError(
            f"the llamaprompt sources in {src} are not the ones this package was built from "
            "(reinstall the package from them first, or pass --source with the matching sources)"
        )
    env = dict(os.environ)
    if version is not None:
        versions = _versions(src)
        if versions and version not in versions:
            raise CoreError(f"unknown llama-cpp-python version {version!r}; known: {', '.join(versions)}")
        key = version
        env["LLAMAPROMPT_LLAMA_CPP"] = version
        env.pop("LLAMAPROMPT_LLAMA_CPP_DIR", None)
    else:
        tree = Path(llama_cpp_dir).resolve()  # type: ignore[arg-type]
        if not (tree / "common" / "chat.cpp").is_file():
            raise CoreError(f"{tree} is not a llama.cpp source tree (no common/chat.cpp)")
        key = "dir-" + hashlib.sha256(str(tree).encode()).hexdigest()[:12]
        env["LLAMAPROMPT_LLAMA_CPP_DIR"] = str(tree)
        env.pop("LLAMAPROMPT_LLAMA_CPP", None)
    # one build directory per tree, source checkout and Python (CMake refuses a build directory
    # configured from another source folder, and keeps the Python it found in its cache)
    checkout = hashlib.sha256(str(src).encode()).hexdigest()[:8]
    build_dir = cache_dir() / "core-builds" / f"{key}-{checkout}-{_python_tag()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    env["SKBUILD_BUILD_DIR"] = str(build_dir)
    env.pop(CORE_ENV, None)
    env.setdefault("CCACHE_DIR", str(cache_dir() / "ccache"))
    if jobs:
        env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(int(jobs))
    log_path = build_dir / "build.log"
    with tempfile.TemporaryDirectory(prefix="llamaprompt-core-") as tmp:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", tmp, str(src)]
        if not build_isolation:
            cmd.insert(4, "--no-build-isolation")
        rc, log = _run_build(cmd, env, log_path, progress, f"llama.cpp {version or llama_cpp_dir}")
        if rc != 0:
            raise CoreError(
                f"building the llamaprompt core for llama.cpp {version or llama_cpp_dir} failed "
                f"(full log: {log_path}):\n{_build_errors(log)}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise CoreError(f"the build produced no wheel (full log: {log_path})")
        return _install(wheels[0], version, src, build_key=key)


def _run_build(cmd: list[str], env: dict[str, str], log_path: Path, progress: Any, what: str) -> tuple[int, str]:
    bar = None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=0, desc=f"building the core for {what}", unit="step", file=sys.stderr, dynamic_ncols=True)
    chunks: list[str] = []
    with open(log_path, "w", encoding="utf-8", errors="replace", buffering=1) as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                chunks.append(line)
                m = _STEP.match(line)
                if m:
                    done, total = int(m.group(1)), int(m.group(2))
                    if bar is not None:
                        bar.total = total
                        bar.n = done
                        bar.refresh()
                    elif callable(progress):
                        progress(done, total)
                elif bar is not None and line.lstrip().startswith(("*** ", "-- llamaprompt:", "llamaprompt:")):
                    bar.set_postfix_str(line.strip().lstrip("*- ")[:60])
        except BaseException:
            proc.kill()
            raise
        finally:
            rc = proc.wait()
            if bar is not None:
                bar.close()
    return rc, "".join(chunks)


def _install(wheel: Path, version: str | None, src: Path, build_key: str | None = None) -> Core:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if re.fullmatch(r"llamaprompt/_core\.[^/]*(so|pyd)", n)]
        if not names:
            raise CoreError(f"{wheel.name} has no llamaprompt/_core module")
        cores_dir().mkdir(parents=True, exist_ok=True)  # staged next to its place: os.replace is atomic
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cores_dir()))
        try:
            ext = staging / Path(names[0]).name
            ext.write_bytes(zf.read(names[0]))
            info = _probe(ext)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    commit = info["commit"]
    versions = _versions(src)
    name = version or next((v for v, e in versions.items() if e.get("commit") == commit), None) or commit
    date = (versions.get(name) or {}).get("date")
    # a folder per commit and Python (the cache is shared by every interpreter of the user: a 3.9
    # and a 3.11 each keep their build of a version)
    base = commit if commit != "unknown" else "unknown-" + info["source_hash"][:12]
    folder = cores_dir() / f"{base}-{_python_tag()}"
    core = Core(
        name=name,
        commit=commit,
        source=info["source"],
        date=date,
        features=info["features"],
        path=str(folder / ext.name),
        size=ext.stat().st_size,
        source_hash=info["source_hash"],
        built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        build_key=build_key or version,
    )
    (staging / "core.json").write_text(json.dumps(asdict(core), indent=2) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(staging, folder)
    # the build it replaces for this Python in another folder (the layout before: one per commit)
    for old in installed_cores():
        old_folder = Path(old.path or "").parent
        if old.commit == commit and old.for_this_python and old_folder != folder and old_folder.parent == cores_dir():
            shutil.rmtree(old_folder, ignore_errors=True)
    return core


def _probe(ext: Path) -> dict[str, Any]:
    """Load a freshly built module in a child process (never in this one) and read what it is."""
    code = (
        "import json, llamaprompt as lp, llamaprompt._core as c;"
        "print(json.dumps({'commit': c.LLAMA_CPP_COMMIT, 'source': c.LLAMA_CPP_SOURCE,"
        "'features': lp.features, 'source_hash': c.SOURCE_HASH}))"
    )
    env = {**os.environ, CORE_ENV: str(ext)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise CoreError(f"the built core does not load: {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def core_build_dirs(core: Core) -> list[Path]:
    """The build directories of an installed core under ``cache_dir()/core-builds``:
    ``<build key>-<checkout>-<python>`` for any source checkout (its Python's, the one of its
    folder ``<commit>-<python>``), and the untagged ``<build key>-<checkout>`` of the layout
    before cores per Python. Empty for the built-in core."""
    if core.builtin or not core.path:
        return []
    key, core_folder = core.build_key or core.name, Path(core.path).parent.name
    root = cache_dir() / "core-builds"
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = re.fullmatch(re.escape(key) + r"-[0-9a-f]{8}(?:-(.+))?", d.name)
        if m and d.is_dir() and (m.group(1) is None or core_folder.endswith("-" + m.group(1))):
            found.append(d)
    return sorted(found)


def installed_core(spec: str) -> Core | None:
    """The installed core ``spec`` (a name or commit prefix) names, usable or not: this Python's
    build of it, else the first other one; None when none matches."""
    return next((c for c in sorted(installed_cores(), key=lambda c: not c.for_this_python) if c.matches(spec)), None)


def remove_core(spec: str) -> Core:
    """Delete an installed core (by name or commit prefix): this Python's build of it, else the
    first other one, with its build directories (``cache_dir()/core-builds``: the ones for its
    tree and Python, from every source checkout, and the untagged ones of the layout before
    cores per Python). Returns what was removed.
    Raises CoreError when none matches; the built-in core cannot be removed."""
    core = installed_core(spec)
    if core is not None:
        builds = core_build_dirs(core)
        shutil.rmtree(Path(core.path or "").parent, ignore_errors=True)  # (in cores_dir(): _core_from_meta)
        for build in builds:
            shutil.rmtree(build, ignore_errors=True)
        return core
    if builtin_core().matches(spec):
        raise CoreError(f"{spec} is the built-in core (the package's own); it cannot be removed")
    raise CoreError(f"no installed core matches {spec!r}")


# -- loading --------------------------------------------------------------------------------


def _resolve_env(spec: str) -> Path:
    """The module file LLAMAPROMPT_CORE names (a file, a core folder, a name or a commit)."""
    p = Path(spec)
    if p.is_file():
        return p
    if p.is_dir():
        meta = _read_meta(p)
        if meta and isinstance(meta.get("path"), str) and meta["path"]:
            return p / Path(meta["path"]).name  # (the module in that folder, as installed_cores takes it)
        found = sorted(p.glob("_core.*"))
        if found:
            return found[0]
    for core in installed_cores():
        if core.matches(spec):
            if not core.usable:
                raise CoreError(f"{CORE_ENV}={spec}: that core was built from other llamaprompt sources; rebuild it")
            return Path(core.path or "")
    raise CoreError(f"{CORE_ENV}={spec}: no such core file, folder or installed core")


def load_from_env() -> None:
    """Called first by ``import llamaprompt``: when ``LLAMAPROMPT_CORE`` is set, that core
    becomes ``llamaprompt._core`` (the package's own module is then never loaded)."""
    spec = os.environ.get(CORE_ENV)
    if not spec or "llamaprompt._core" in sys.modules:
        return
    path = _resolve_env(spec)
    loader = importlib.machinery.ExtensionFileLoader("llamaprompt._core", str(path))
    mod_spec = importlib.util.spec_from_file_location("llamaprompt._core", str(path), loader=loader)
    if mod_spec is None:
        raise CoreError(f"{CORE_ENV}: {path} cannot be loaded as an extension module")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules["llamaprompt._core"] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules["llamaprompt._core"]
        raise


def core_module(spec: str | None) -> Any:
    """What ChatTemplate calls for ``llama_cpp=spec``: the ``_core`` module itself for the
    in-process core, else a :class:`~llamaprompt.remote.RemoteCore` (the same names, in a
    worker process). Raises CoreError as :func:`find_core`."""
    from . import _core

    if not spec:
        return _core
    core = find_core(spec)
    if core.builtin:
        return _core
    from .remote import remote_core

    return remote_core(core)
