"""Packaging facts a user relies on: the requirements files the README and .ci/run install are
the extras pyproject.toml declares, the module exports only its init symbol (it can share a
process with llama-cpp-python or another llama.cpp build), and the installed package carries
its stubs and templates."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llamaprompt
from llamaprompt import _core

ROOT = Path(__file__).resolve().parent.parent
if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _expand(name: str, extras: dict[str, list[str]]) -> set[str]:
    """An extra's requirements with llamaprompt[...] self-references expanded."""
    out: set[str] = set()
    for req in extras[name]:
        if req.startswith("llamaprompt["):
            for inner in req[len("llamaprompt[") : -1].split(","):
                out |= _expand(inner.strip(), extras)
        else:
            out.add(req)
    return out


def _requirements(path: Path) -> set[str]:
    out: set[str] = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            out |= _requirements(path.parent / line[3:].strip())
        elif line:
            out.add(line)
    return out


def test_requirement_files_are_the_extras():
    extras = _extras()
    assert _requirements(ROOT / "tests" / "requirements.txt") == _expand("test", extras)
    assert _requirements(ROOT / "tests" / "requirements-full.txt") == _expand("test-full", extras)
    # the full suite needs every feature extra
    for name in ("server", "datasets", "ray", "renderers", "bench"):
        assert _expand(name, extras) <= _expand("test-full", extras), name


def test_the_core_extra_is_light():
    heavy = {"ray", "pandas", "pyarrow", "matplotlib", "transformers", "starlette", "uvicorn", "minijinja"}
    names = {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0] for r in _expand("test", _extras())}
    assert names.isdisjoint(heavy), names & heavy


@pytest.mark.skipif(sys.platform != "linux", reason="ELF dynamic symbol table (nm -D)")
def test_module_exports_only_its_init_symbol():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils)")
    # (--extern-only: a link-time optimized module's table also lists its operator new / delete,
    # which libstdc++ references, as LOCAL symbols: no other object can bind to them)
    out = subprocess.run(
        [nm, "-D", "--defined-only", "--extern-only", _core.__file__], capture_output=True, text=True, check=True
    )
    names = sorted(line.split()[-1] for line in out.stdout.splitlines() if line.strip())
    assert names == ["PyInit__core"], f"{len(names)} exported symbols, e.g. {names[:10]}"


def test_installed_package_carries_its_stubs_and_templates():
    pkg = Path(llamaprompt.__file__).parent
    assert (pkg / "py.typed").is_file()
    assert (pkg / "_core.pyi").is_file()
    assert len(llamaprompt.pinned_templates()) > 50


# -- the offline sdist's part of the pinned tree (third_party/sdist_tree.py) ---------------------

TREE = ROOT / "third_party" / "llama.cpp"


def _pinned_build_dir() -> Path:
    """A build directory of this checkout configured for the pinned tree, else skip."""
    for ninja in sorted((ROOT / "build").glob("*/build.ninja")):
        cache = ninja.parent / "CMakeCache.txt"
        if cache.is_file() and f"LP_CONFIGURED_TREE:INTERNAL={TREE}" in cache.read_text():
            return ninja.parent
    pytest.skip("no build directory of the pinned tree in this checkout (pip install . builds one)")


def _sdist_tree():
    sys.path.insert(0, str(ROOT / "third_party"))
    try:
        import sdist_tree
    finally:
        sys.path.pop(0)
    return sdist_tree


def test_the_subset_probes_as_the_whole_tree(tmp_path):
    """adapt_tree.py run on the sdist's subset decides exactly what it decides on the whole
    tree (the same features, rewrites, sources and copies): a probed file left out would
    change them."""
    build_dir = _pinned_build_dir()
    files = _sdist_tree().subset(build_dir)
    part = tmp_path / "subset"
    for rel in files:
        (part / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(TREE / rel, part / rel)
    assert len(files) < sum(1 for p in TREE.rglob("*") if p.is_file()) / 2  # a part, not the tree
    outs = {}
    for name, tree in (("whole", TREE), ("subset", part)):
        out = tmp_path / f"out-{name}"
        proc = subprocess.run(
            [sys.executable, str(ROOT / "third_party" / "adapt_tree.py"), str(tree), str(out)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        outs[name] = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert outs["whole"] == outs["subset"]


def test_the_subset_has_every_compiled_source_and_license():
    build_dir = _pinned_build_dir()
    files = set(_sdist_tree().subset(build_dir))
    import json

    compiled = {e["file"] for e in json.loads((build_dir / "compile_commands.json").read_text())}
    in_tree = {
        Path(f).resolve().relative_to(TREE.resolve()).as_posix()
        for f in compiled
        if Path(f).resolve().is_relative_to(TREE.resolve())
    }
    assert in_tree and in_tree <= files
    assert {"LICENSE", "CMakeLists.txt", ".llamaprompt-commit", "common/chat.cpp"} <= files
    assert any(f.startswith("models/templates/") for f in files)


@pytest.mark.parametrize("marker", ["123456789", None], ids=["other-commit", "no-marker"])
def test_configure_refuses_a_tree_that_is_not_the_locks(tmp_path, marker):
    """A third_party/llama.cpp left from another pin (or an sdist's subset of another commit)
    stops configuration with the folder and both commits, before anything is compiled; a tree
    put there by hand (no marker: its commit is unknown) is refused too, never labelled as the pin."""
    cmake = shutil.which("cmake")
    try:
        import pybind11
    except ImportError:
        pybind11 = None
    if cmake is None or pybind11 is None:
        pytest.skip("needs cmake and pybind11 (the build requirements)")
    src = tmp_path / "src"
    (src / "third_party" / "llama.cpp").mkdir(parents=True)
    for rel in ("CMakeLists.txt", "third_party/llama.cpp.lock", "third_party/fetch_llama_cpp.py"):
        shutil.copyfile(ROOT / rel, src / rel)
    tree = src / "third_party" / "llama.cpp"
    (tree / "CMakeLists.txt").write_text("# a tree\n")
    if marker is not None:
        (tree / ".llamaprompt-commit").write_text(marker + "\n")
    proc = subprocess.run(
        [
            cmake,
            "-S",
            str(src),
            "-B",
            str(tmp_path / "build"),
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    if marker is None:
        assert f"{tree} holds a llama.cpp tree that third_party/fetch_llama_cpp.py did not extract" in out, out[-2000:]
    else:
        assert f"{tree} holds llama.cpp {marker}" in out and _lock()["commit"] in out, out[-2000:]


def _lock() -> dict:
    import json

    return json.loads((ROOT / "third_party" / "llama.cpp.lock").read_text())


# ---------------------------------------------------------------------------------------
# the profile-guided build's training run (third_party/pgo_train.py, CMakeLists.txt LLAMAPROMPT_PGO)

_PGO_TRAIN = ROOT / "third_party" / "pgo_train.py"


def _pgo_train(module: str, profile_dir: Path, requests: Path | None = None) -> subprocess.CompletedProcess[str]:
    package = Path(llamaprompt.__file__).parent
    return subprocess.run(
        [sys.executable, str(_PGO_TRAIN), module, str(ROOT / "src" / "python" / "llamaprompt"),
         str(package / "templates"), str(requests or package / "resources" / "requests.json"), str(profile_dir)],
        capture_output=True, text=True, timeout=600)


def test_pgo_training_fails_when_the_module_does_not_load(tmp_path):
    # a build whose twin cannot be loaded must stop, not compile _core against no profile
    res = _pgo_train(str(tmp_path / "missing.so"), tmp_path)
    assert res.returncode == 1
    assert "no module" in res.stderr and "Traceback" not in res.stderr
    not_a_module = tmp_path / "_core.so"
    not_a_module.write_bytes(b"not an ELF file")
    res = _pgo_train(str(not_a_module), tmp_path)
    assert res.returncode == 1
    assert "the training run failed" in res.stderr


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "{}"])
def test_pgo_training_refuses_requests_it_cannot_use(tmp_path, text):
    requests = tmp_path / "requests.json"
    requests.write_text(text, encoding="utf-8")
    res = _pgo_train(_core.__file__, tmp_path, requests)
    assert res.returncode == 1
    assert str(requests) in res.stderr and "Traceback" not in res.stderr


def test_pgo_training_fails_when_the_module_writes_no_profile(tmp_path):
    # the installed module is not instrumented: it renders every template, and writes no counts
    stale = tmp_path / "#stale#object.gcda"  # a profile of an earlier build goes first
    stale.write_bytes(b"old")
    res = _pgo_train(_core.__file__, tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    rendered = re.search(r"(\d+) templates x \d+ requests: (\d+) renders", res.stdout)
    assert rendered and int(rendered[1]) > 0 and int(rendered[2]) > 0, res.stdout
    assert "wrote no profile" in res.stderr
    assert not stale.exists()
