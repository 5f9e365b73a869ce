"""Warnings about requests whose outcome is probably not what the caller meant, logged once
per template on ``logging.getLogger("llamaprompt")`` (a NullHandler: silent until the
application configures logging). They never change what llama.cpp receives or returns.

- a template variable (``enable_thinking``, ``documents`` ...) at the top level of a
  request: llama-server reads template variables from ``chat_template_kwargs`` only, so the
  top-level key has no effect (the transformers habit ``apply_chat_template(..., enable_thinking=False)``);
- ``tools`` sent to a template whose ``chat_template_caps`` say it renders neither tools nor
  tool calls: llama.cpp passes them on, the template ignores them, the prompt has none;
- a GGUF file without a chat template: llama.cpp falls back to chatml (``common_chat_templates_init``).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from . import _core

__all__ = ["MISPLACED_KWARGS", "WATCHED", "Notices", "logger"]

logger = logging.getLogger("llamaprompt")

#: Template variables that the pinned templates read and transformers users pass as
#: ``apply_chat_template`` keyword arguments; llama-server reads none of them at the top level
#: of a request (it does read ``reasoning_effort`` there, which is why it is not listed).
# below this much stack left on the calling thread, a request is not decoded for its notices
# (the module runs its own calls from such a thread on one with 8 MiB: src/cpp/gil.h)
SMALL_STACK = 1 << 20

MISPLACED_KWARGS = (
    "enable_thinking",
    "thinking",
    "thinking_mode",
    "documents",
    "builtin_tools",
    "custom_tools",
    "date_string",
    "tools_in_user_message",
    "preserve_thinking",
    "keep_past_thinking",
    "clear_thinking",
    "truncate_history_thinking",
    "model_identity",
    "add_vision_id",
)


@functools.lru_cache(maxsize=64)
def _keys_text(keys: frozenset[str]) -> re.Pattern[bytes] | None:
    """A search for any of ``keys`` as an object key anywhere in request text (a cheap filter
    before decoding it: a hit may be nested, e.g. in ``chat_template_kwargs``); None for none."""
    if not keys:
        return None
    return re.compile(rb'"(' + b"|".join(re.escape(k.encode()) for k in sorted(keys)) + rb')"\s*:')


# a JSON string followed by a colon (an object key), its text in group 1: one way to match each
# character, so a failed attempt backtracks in linear time
_ANY_KEY = re.compile(rb'"([^"\\]*(?:\\.[^"\\]*)*)"\s*:')


def _escaped_key_in(text: bytes) -> bool:
    """Whether request text has an object key written with a ``\\u`` escape
    (``"custom\\u005ftools"`` is the key ``custom_tools`` to llama.cpp's parser too): decoding
    then tells what it is."""
    return b"\\u" in text and any(b"\\u" in m.group(1) for m in _ANY_KEY.finditer(text))


#: What an error of a notice's logging is reported as (``sys.unraisablehook``'s ``err_msg``
#: "Exception ignored in" and this ``object``), from Python and from the core alike.
UNRAISABLE_CONTEXT = "llamaprompt notices"

#: The top-level request keys a :class:`Notices` waits for, in the order of the bits of
#: ``_core.Template.watch_notices`` (``tools`` counts only as a non-empty array).
WATCHED = (*MISPLACED_KWARGS, "tools")
_TOOLS_BIT = 1 << WATCHED.index("tools")


class Notices:
    """The warnings one template still owes (each is logged at most once).

    After :meth:`watch` (an in-process core), the core's apply_template looks for the pending
    keys in the body it parses anyway and reports them back; :meth:`check` looks at a request
    in Python (the other calls, hooks, a core in a worker process)."""

    __slots__ = ("_misplaced", "_pending_text", "_tools", "name", "watching")

    def __init__(self, name: str, caps: Mapping[str, bool]) -> None:
        self.name = name
        self._misplaced = set(MISPLACED_KWARGS)
        # llama.cpp's own caps: a template that renders neither tools nor tool calls ignores them
        self._tools = not caps.get("supports_tools", True) and not caps.get("supports_tool_calls", True)
        self.watching = False
        self._pending_changed()

    def watch(self, core: Any) -> None:
        """Let ``core`` (an in-process ``_core.Template``) find the pending keys in the bodies its
        apply_template and apply_template_many parse. The core holds :meth:`_seen`; this object
        holds nothing of the core's (no reference cycle)."""
        core.watch_notices(list(WATCHED), _TOOLS_BIT, self._pending_bits(), self._seen)
        self.watching = True

    def _pending_bits(self) -> int:
        bits = _TOOLS_BIT if self._tools else 0
        for i, key in enumerate(MISPLACED_KWARGS):
            if key in self._misplaced:
                bits |= 1 << i
        return bits

    def _seen(self, bits: int) -> int:
        """The core saw the keys of ``bits`` at the top level of a request body: warn (once each)
        and return the bits still pending."""
        self._warn_misplaced([key for i, key in enumerate(MISPLACED_KWARGS) if bits >> i & 1])
        if bits & _TOOLS_BIT:
            self._warn_tools()
        return self._pending_bits()

    def _pending_changed(self) -> None:
        # request text is decoded only when it names a key a warning is still pending for: a
        # template that renders tools never decodes a request for its "tools"
        keys = set(self._misplaced) | ({"tools"} if self._tools else set())
        self._pending_text = _keys_text(frozenset(keys))

    def check(self, request: Any) -> None:
        """Log what this request shows for the first time (cheap when nothing is pending).

        An error while logging (a failing handler or filter) is reported as unraisable
        (``sys.unraisablehook``), as when the core reports the keys it saw: a notice never
        replaces the call's result or error. KeyboardInterrupt and SystemExit propagate."""
        try:
            self._check(request)
        except Exception as e:
            _core.write_unraisable(e, UNRAISABLE_CONTEXT)

    def _check(self, request: Any) -> None:
        if self._pending_text is None:
            return
        if isinstance(request, (bytes, str)):
            text = request.encode("utf-8", "surrogatepass") if isinstance(request, str) else request
            if not self._pending_text.search(text) and not _escaped_key_in(text):
                return
            if _core.stack_left() < SMALL_STACK:
                # a thread with a small stack: CPython's json could overflow it on a deep request
                # (the module's own calls move to a thread of their own); the notice waits
                return
            try:
                request = json.loads(text)
            except (ValueError, RecursionError):
                return
        if not isinstance(request, Mapping):
            return
        if self._misplaced:
            self._warn_misplaced(list(self._misplaced.intersection(request.keys())))
        if self._tools:
            tools = request.get("tools")
            if isinstance(tools, list) and tools:
                self._warn_tools()

    def _warn_misplaced(self, keys: list[str]) -> None:
        for key in keys:
            if key not in self._misplaced:
                continue
            self._misplaced.discard(key)
            self._pending_changed()
            logger.warning(
                "%s: request key %r is not read by llama-server at the top level of a request, so it has no "
                'effect; template variables go in "chat_template_kwargs" (e.g. {"chat_template_kwargs": '
                '{"%s": ...}}). This warning is logged once per template.',
                self.name,
                key,
                key,
            )

    def _warn_tools(self) -> None:
        if not self._tools:
            return
        self._tools = False
        self._pending_changed()
        logger.warning(
            "%s: the request has tools, but the template renders neither tools nor tool calls "
            "(chat_template_caps supports_tools and supports_tool_calls are false): llama.cpp passes "
            "them to the template, which leaves them out of the prompt. This warning is logged once "
            "per template.",
            self.name,
        )
