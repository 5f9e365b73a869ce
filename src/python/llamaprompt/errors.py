"""Exceptions raised by llamaprompt.

Every failure inside llama.cpp reaches Python as one of these, carrying llama.cpp's own
message (the ``message`` of llama-server's error JSON) and, where llama-server would
answer an HTTP request with an error, that HTTP status:

- :class:`RequestError` -- llama-server answers **400** (upstream threw
  ``std::invalid_argument``): a malformed or contradictory request.
- :class:`TemplateError` -- llama-server answers **500** (any other exception, e.g. the
  Jinja template raised, or the messages could not be parsed), or the template cannot be
  loaded at all (``status`` is ``None``; llama-server would refuse to start).
- :class:`ServerArgsError` -- a ``server_args`` flag that llama.cpp's argument parser
  rejects, or that llamaprompt does not accept (model/template loading, print-and-exit).
- :class:`GGUFError` -- a GGUF file that llama.cpp cannot read.
- :class:`FeatureError` -- the llama.cpp tree this module was built from does not have
  what the call needs (``llamaprompt.features`` says what it has).
- :class:`CoreError` -- a core for another llama.cpp tree (``llama_cpp=``) is not installed,
  cannot be built, or its worker process died.

The class follows the status, whatever the cause (tools/server/server.cpp ``ex_wrapper``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Error", "RequestError", "TemplateError", "ServerArgsError", "GGUFError", "FeatureError", "CoreError"]


class Error(Exception):
    """Base class of every llamaprompt error.

    Attributes:
        message: llama.cpp's message, unchanged.
        status: the HTTP status llama-server would answer with (400 or 500), or ``None``
            where there is no HTTP equivalent.
    """

    # the C++ core makes its errors without calling this (src/cpp/errors.cpp make_py_error sets
    # args, message and status itself): what it sets must stay in step (tests/test_errors.py)
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:  # keep message and status across pickling (worker processes)
        return (type(self), (self.message, self.status))

    def to_json(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` body llama-server sends for this error."""
        status = self.status if self.status is not None else 500
        kind = "invalid_request_error" if status == 400 else "server_error"
        return {"error": {"code": status, "message": self.message, "type": kind}}


class RequestError(Error, ValueError):
    """A request llama-server rejects with HTTP 400."""


# src/cpp/text.h json_text_to_py's message for a result deeper than Python's recursion limit allows
# at the caller's stack depth; the same for the Python-side echoes of such a request
TOO_DEEP_FOR_PYTHON = (
    "request is nested too deeply (its echo exceeds Python's recursion limit at this call's stack depth)"
)


class TemplateError(Error, RuntimeError):
    """HTTP 500 from llama-server, or a template that cannot be loaded (status None)."""


class ServerArgsError(Error, ValueError):
    """A llama-server flag in ``server_args`` that cannot be used."""


class GGUFError(Error, OSError):
    """A GGUF file that llama.cpp cannot open or read."""


class FeatureError(Error, NotImplementedError):
    """The llama.cpp tree llamaprompt was built from lacks the upstream code this call needs.

    The message names the feature and the llama.cpp commit; ``llamaprompt.features`` lists
    what the build has. Never raised on the pinned tree."""


class CoreError(Error, RuntimeError):
    """A llamaprompt core for another llama.cpp tree cannot be used: not installed (the
    message says how to build it), built from other llamaprompt sources, failed to build
    (the message carries the build's own error), or its worker process died."""
