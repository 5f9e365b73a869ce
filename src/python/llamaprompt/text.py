"""Text and paths as llama.cpp receives them (UTF-8 bytes), and request bodies as JSON text."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Union

from .errors import RequestError

__all__ = ["Request", "utf8", "fspath", "request_body", "json_safe"]

#: A request body: a JSON object (mapping) or its JSON text.
Request = Union[Mapping[str, Any], str, bytes]


def utf8(text: str | bytes, what: str = "value") -> bytes:
    """UTF-8 bytes for llama.cpp. Surrogate escapes (bytes that were not UTF-8, as prompts
    come back) become those bytes again; any other lone surrogate cannot be UTF-8 and is
    passed as its 3 bytes, which llama.cpp then judges as it judges any invalid UTF-8.
    Raises TypeError for anything but str or bytes (``what`` names it)."""
    if isinstance(text, bytes):
        return text
    if not isinstance(text, str):
        raise TypeError(f"{what} must be str or bytes, not {type(text).__name__}")
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def fspath(path: Any) -> str:
    """A filesystem path as str (``os.fspath``; bytes decoded). Raises ValueError on NUL."""
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if "\x00" in p:
        raise ValueError("path contains a NUL byte")
    return p


# json.dumps with keyword arguments builds a new encoder per call; this one is built once
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def request_body(request: Request) -> bytes:
    """The body llama.cpp parses: JSON text as given (its parser judges it, as llama-server's),
    or a mapping as JSON. Raises RequestError (400) for what JSON cannot carry (NaN/Infinity, a
    value or key of a type that is no JSON: bytes, a set, a tuple key, ...) or nesting too deep
    for Python's encoder, TypeError for a request that is no mapping, str or bytes."""
    if isinstance(request, (str, bytes)):
        # the text goes to llama.cpp as it is (its parser, its messages); _core refuses
        # bodies nested more than 1000 levels deep before parsing them
        return utf8(request)
    if not isinstance(request, Mapping):
        raise TypeError(f"request must be a mapping or JSON text, not {type(request).__name__}")
    try:
        text = _ENCODER.encode(request if type(request) is dict else dict(request))
    except (ValueError, TypeError) as e:  # NaN/Infinity, bytes, ...: not JSON, llama-server could never receive it
        raise RequestError(f"request is not valid JSON: {e}", 400) from None
    except RecursionError:
        raise RequestError("request is nested too deeply", 400) from None
    return utf8(text)


def core_body(request: Request) -> bytes | dict[str, Any]:
    """A request as ``_core`` takes it: a dict as it is (the core builds the JSON tree from
    its values, or calls :func:`request_body` on it when it holds anything else), anything
    else as :func:`request_body` gives it."""
    return request if type(request) is dict else request_body(request)


def json_safe(text: str) -> str:
    """Text that can be written as UTF-8 JSON: bytes that were not UTF-8 (kept as surrogate
    escapes, as prompts and template sources come back) become U+FFFD, as llama-server's JSON
    responses replace them (``dump_safe``)."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte
        raw = text.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def messages_list(messages: Iterable[Mapping[str, Any]]) -> list[Any]:
    """``messages`` as a list; TypeError for text (it would be iterated as characters), bytes-like
    objects and a mapping (a request, not its messages)."""
    if isinstance(messages, (str, bytes, bytearray, memoryview, Mapping)):
        raise TypeError(f"messages must be an iterable of message mappings, not {type(messages).__name__}")
    return list(messages)
