"""Reading a GGUF file's metadata with llama.cpp's own gguf reader."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import _core

__all__ = ["gguf_metadata"]


def gguf_metadata(path: str | os.PathLike[str], *, max_array_items: int = 16) -> dict[str, Any]:
    """The key/value metadata of a GGUF file, read by ggml's ``gguf_init_from_file``
    (``no_alloc``: tensor data is not read).

    Args:
        path: the GGUF file.
        max_array_items: arrays with more items than this are summarized as
            ``{"type": "array", "element_type": "string", "length": N}``; shorter ones are
            returned as lists.

    Returns:
        ``{key: value}`` in file order; values are str, int, float, bool, list or a summary.

    Raises:
        GGUFError: the file is missing, not a GGUF file, truncated or corrupt
            (llama.cpp's message).
        TypeError: ``max_array_items`` is no int; ValueError: it is negative.
    """
    if isinstance(max_array_items, bool) or not isinstance(max_array_items, (int, np.integer)):
        raise TypeError(f"max_array_items must be an int, not {type(max_array_items).__name__}")
    if max_array_items < 0:
        raise ValueError("max_array_items must be >= 0")
    max_array_items = min(int(max_array_items), 2**63 - 1)  # (more items than any file holds)
    from .text import fspath as _path

    return _core.gguf_metadata(_path(path), int(max_array_items))
