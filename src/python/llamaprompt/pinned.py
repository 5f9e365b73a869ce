"""The templates of the llama.cpp tree the module was built from (models/templates/*.jinja;
the pinned tree unless the build was given another), shipped in the package so that
examples, the CLI default and tests need no checkout."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["pinned_template", "pinned_templates", "DEFAULT_TEMPLATE"]

_DIR = Path(__file__).resolve().parent / "templates"

#: The template ``llamaprompt render`` uses when none is given.
DEFAULT_TEMPLATE = "Qwen-Qwen3-0.6B.jinja"


def pinned_templates() -> list[Path]:
    """Paths of every ``*.jinja`` template shipped from the tree the module was built from
    (:data:`llamaprompt.LLAMA_CPP_COMMIT`; 70 in the pin), sorted by name."""
    return sorted(_DIR.glob("*.jinja"))


def pinned_template(name: str | os.PathLike[str] = DEFAULT_TEMPLATE) -> Path:
    """Path of one shipped template, by file name (``.jinja`` may be omitted), or by a path
    whose file name is one (e.g. an element of :func:`pinned_templates`).

    Raises FileNotFoundError (listing what exists) for an unknown name, TypeError for a name
    that is neither a string nor a path.
    """
    if isinstance(name, os.PathLike):
        name = Path(name).name
    if not isinstance(name, str):
        raise TypeError(f"pinned_template() takes a file name or a path, not {type(name).__name__}")
    path = _DIR / (name if name.endswith(".jinja") else name + ".jinja")
    if not path.is_file():
        names = ", ".join(p.name for p in pinned_templates())
        raise FileNotFoundError(f"no pinned template {name!r}; available: {names}")
    return path
