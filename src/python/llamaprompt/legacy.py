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

    Raises RequestError when llama.cpp does not know the template, TypeError for a message
    that is no mapping with string "role" and "content" (the C function takes two C strings per
    message: nothing is converted to text for it), and ValueError for text no C string in UTF-8
    can carry (a NUL character, a lone surrogate).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (a built-in template's name or a template), not {type(name).__name__}")
    pairs = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"message {i} must be a mapping with 'role' and 'content', not {type(m).__name__}")
        for key in ("role", "content"):
            text = m.get(key)
            if not isinstance(text, str):
                got = "missing" if key not in m else f"a {type(text).__name__}"
                raise TypeError(f"message {i}: {key!r} must be a str, not {got}")
            if "\x00" in text:
                raise ValueError(f"message {i}: {key!r} holds a NUL character, where a C string ends")
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"message {i}: {key!r} holds a lone surrogate (no UTF-8)") from None
        pairs.append((m["role"], m["content"]))
    return _core.chat_apply_template(name, pairs, bool(add_ass))
