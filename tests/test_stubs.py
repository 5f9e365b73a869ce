"""``_core.pyi`` against the built module: every public name of ``llamaprompt._core`` is in the
stub and every stub name is in the module, and each function's and method's parameters (names,
order, which have defaults) are those pybind11 reports in the module's own signatures.

The expected side is the compiled module (pybind11 writes each overload's signature as the
first lines of its ``__doc__``); the stub is the file under test. mypy (run by .ci/run) checks
the package's calls against that stub.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import llamaprompt
from llamaprompt import _core

STUB = Path(llamaprompt.__file__).with_name("_core.pyi")
# classes a tree may lack (the module then has no such name, and the feature is off)
OPTIONAL = {"OutputParser": "parse"}


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, bool]]:
    """(name, has default) of a stub function's parameters, ``self`` left out."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    out = [(a.arg, d) for a, d in zip(positional, defaults)]
    out += [(a.arg, d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return [p for p in out if p[0] != "self"]


def _stub() -> tuple[dict[str, list[list[tuple[str, bool]]]], dict[str, dict[str, object]], set[str]]:
    """functions (name -> overloads' params), classes (name -> {member: overloads | "property"}),
    annotated module constants."""
    tree = ast.parse(STUB.read_text())
    functions: dict[str, list[list[tuple[str, bool]]]] = {}
    classes: dict[str, dict[str, object]] = {}
    constants: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions.setdefault(node.name, []).append(_stub_params(node))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            constants.add(node.target.id)
        elif isinstance(node, ast.ClassDef):
            members: dict[str, object] = {}
            for item in node.body:
                if not isinstance(item, ast.FunctionDef):
                    continue
                decorators = {d.id for d in item.decorator_list if isinstance(d, ast.Name)}
                if "property" in decorators:
                    members[item.name] = "property"
                else:
                    overloads = members.setdefault(item.name, [])
                    assert isinstance(overloads, list)
                    overloads.append(_stub_params(item))
            classes[node.name] = members
    return functions, classes, constants


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts]


def _module_params(obj: object, name: str) -> list[list[tuple[str, bool]]]:
    """Each overload's (name, has default) from pybind11's signature lines in ``__doc__``."""
    doc = inspect.getdoc(obj) or ""
    found = []
    for line in doc.splitlines():
        m = re.match(rf"^(?:\d+\. )?{re.escape(name)}\((.*)\) -> .*$", line)
        if not m:
            continue
        params = []
        for part in _split_top_level(m.group(1)):
            pname = part.split(":", 1)[0].split("=", 1)[0].strip()
            if pname != "self":
                params.append((pname, "=" in part.split(":", 1)[-1] or "=" in pname))
        found.append(params)
    assert found, f"no pybind11 signature for {name} in its docstring: {doc[:200]!r}"
    return found


def _public(obj: object) -> set[str]:
    return {n for n in vars(obj) if not n.startswith("_")}


def test_every_module_name_is_in_the_stub_and_back():
    functions, classes, constants = _stub()
    stub_names = set(functions) | set(classes) | constants
    module_names = _public(_core)
    assert sorted(module_names - stub_names) == [], "in the module, missing from _core.pyi"
    missing = stub_names - module_names
    for name, feature in OPTIONAL.items():
        if name in missing and not llamaprompt.features.get(feature, False):
            missing.discard(name)  # this tree has no such class: the feature is off
    assert sorted(missing) == [], "in _core.pyi, not in the module"


def test_function_signatures_match_the_module():
    functions, _, _ = _stub()
    for name, overloads in functions.items():
        assert _module_params(getattr(_core, name), name) == overloads, name


@pytest.mark.parametrize("cls", sorted(_stub()[1]))
def test_class_members_and_signatures_match_the_module(cls):
    members = _stub()[1][cls]
    if not hasattr(_core, cls):
        pytest.skip(f"this tree's module has no {cls} (feature {OPTIONAL[cls]!r} is off)")
    klass = getattr(_core, cls)
    assert sorted(_public(klass)) == sorted(n for n in members if not n.startswith("_")), cls
    for name, stub in members.items():
        attr = inspect.getattr_static(klass, name)
        if stub == "property":
            assert isinstance(attr, property), f"{cls}.{name} is a property in the stub"
        else:
            assert not isinstance(attr, property), f"{cls}.{name} is a property in the module"
            assert _module_params(getattr(klass, name), name) == stub, f"{cls}.{name}"


def test_constants_have_the_stubbed_types():
    _, _, constants = _stub()
    tree = ast.parse(STUB.read_text())
    kinds = {"str": str, "list[str]": list, "bool": bool}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            expected = kinds[ast.unparse(node.annotation)]
            assert isinstance(getattr(_core, node.target.id), expected), node.target.id
    assert constants
