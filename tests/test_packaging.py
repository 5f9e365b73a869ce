"""Packaging facts a user relies on: the requirements files the README and .ci/run install are
the extras pyproject.toml declares, the module exports only its init symbol (it can share a
process with llama-cpp-python or another llama.cpp build), and the installed package carries
its stubs and templates."""

from __future__ import annotations

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
    out = subprocess.run([nm, "-D", "--defined-only", _core.__file__], capture_output=True, text=True, check=True)
    names = sorted(line.split()[-1] for line in out.stdout.splitlines() if line.strip())
    assert names == ["PyInit__core"], f"{len(names)} exported symbols, e.g. {names[:10]}"


def test_installed_package_carries_its_stubs_and_templates():
    pkg = Path(llamaprompt.__file__).parent
    assert (pkg / "py.typed").is_file()
    assert (pkg / "_core.pyi").is_file()
    assert len(llamaprompt.pinned_templates()) > 50
