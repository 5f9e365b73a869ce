"""llama.cpp's built-in (non-Jinja) chat templates, for ``ChatTemplate.builtin(name)``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from . import _core

__all__ = ["builtin_template_names", "llama_chat_apply_template"]


def builtin_template_names() -> list[str]:
    """The template names llama.cpp renders without Jinja (``llama_chat_builtin_templates``)."""
    return list(_core.builtin_template_names())


def llama_chat_apply_template(name: str, messages: Iterable[Mapping[str, str]], add_ass: bool = True) -> str:
    """llama.cpp's C function ``llama_chat_apply_template`` called directly, for plain
    ``{"role", "content"}`` messages (no request parsing, no server logic).

    Raises RequestError when llama.cpp does not know the template.
    """
    pairs = [(str(m["role"]), str(m["content"])) for m in messages]
    return _core.chat_apply_template(name, pairs, bool(add_ass))
