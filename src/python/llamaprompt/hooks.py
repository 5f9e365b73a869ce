"""Hooks: Python code that runs around llama.cpp's unchanged path, for inference stacks
that must patch a known-bad template for their users without forking it.

A hook is any object with one or both of these methods:

- ``before_request(request: dict) -> dict``: gets a copy of the request body and returns
  the body to render (e.g. add a ``chat_template_kwargs`` value a template needs);
- ``after_params(params: ChatParams) -> ChatParams``: gets what llama.cpp computed and
  returns what the caller receives (``dataclasses.replace`` makes a changed copy).

Hooks given to a ChatTemplate (``hooks=[...]``) run first, in order, then the registered
hooks that match the template, in registration order. An exception raised by a hook
reaches the caller unchanged. No hook is registered by default.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

if TYPE_CHECKING:
    from .template import ChatTemplate

__all__ = ["Hook", "Match", "register_hook", "unregister_hook", "registered_hooks", "template_sha256"]


@runtime_checkable
class Hook(Protocol):
    """What a hook may define (both methods are optional)."""


#: Selects templates: ``{"sha256": HEX}`` (of the template's ``.source``),
#: ``{"contains": TEXT}`` (a substring of the source), or a predicate
#: ``Callable[[ChatTemplate], bool]``; ``None`` matches every template.
Match = Union[None, dict, Callable[["ChatTemplate"], bool]]


def template_sha256(source: str) -> str:
    """sha256 (hex) of a template's source text, UTF-8 encoded: the key ``match={"sha256": ...}`` uses."""
    return hashlib.sha256(source.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class _Entry:
    hook: Any
    match: Match

    def matches(self, template: ChatTemplate) -> bool:
        m = self.match
        if m is None:
            return True
        if callable(m):
            return bool(m(template))
        if "sha256" in m:
            return template.sha256 == str(m["sha256"]).lower()
        if "contains" in m:
            return str(m["contains"]) in template.source
        raise ValueError(f"unknown match {m!r}: use {{'sha256': ...}}, {{'contains': ...}} or a callable")


_lock = threading.Lock()
_registry: list[_Entry] = []


def check_hook(hook: Any) -> None:
    """Raise TypeError unless ``hook`` has before_request or after_params."""
    if not (hasattr(hook, "before_request") or hasattr(hook, "after_params")):
        raise TypeError("a hook needs a before_request(request) or after_params(params) method")


def _check_match(match: Match) -> None:
    if match is None or callable(match):
        return
    if not isinstance(match, dict) or len(match) != 1 or next(iter(match)) not in ("sha256", "contains"):
        raise ValueError("match must be None, {'sha256': HEX}, {'contains': TEXT} or a callable")


def register_hook(hook: Any, *, match: Match = None) -> Any:
    """Register ``hook`` for every ChatTemplate whose template matches ``match``.

    Returns the hook (so it can be used as a decorator on a class instance). Raises
    TypeError for an object with neither hook method, ValueError for a bad ``match``.
    """
    check_hook(hook)
    _check_match(match)
    with _lock:
        _registry.append(_Entry(hook, match))
    return hook


def unregister_hook(hook: Any) -> None:
    """Remove every registration of ``hook`` (no error when it was not registered)."""
    with _lock:
        _registry[:] = [e for e in _registry if e.hook is not hook]


def registered_hooks() -> list[tuple[Any, Match]]:
    """The registered ``(hook, match)`` pairs, in order."""
    with _lock:
        return [(e.hook, e.match) for e in _registry]


def hooks_for(template: ChatTemplate, own: tuple[Any, ...]) -> list[Any]:
    """The hooks that apply to one call: the template's own, then matching registered ones."""
    if not _registry:  # the common case, without taking the lock
        return list(own)
    with _lock:
        entries = list(_registry)
    return list(own) + [e.hook for e in entries if e.matches(template)]
