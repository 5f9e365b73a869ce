"""llama-server's reading of generated text: content, reasoning_content, tool calls,
and the streaming deltas it sends (for one rendered request, see ChatParams.parse)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from . import _core
from .errors import TOO_DEEP_FOR_PYTHON, RequestError
from .text import utf8 as _utf8
from .tree import require

if TYPE_CHECKING:
    from .params import ChatParams

__all__ = ["StreamParser", "output_parser"]


def output_parser(
    params: ChatParams, *, reasoning_format: str | None, parse_tool_calls: bool | None, stream: bool
) -> _core.OutputParser:
    """The C++ parser for one request: its llama_params through llama-server's
    ``eval_llama_cmpl_schema`` (defaults from the template's server_args)."""
    if reasoning_format is not None and not isinstance(reasoning_format, str):
        raise TypeError(f"reasoning_format must be a str or None, not {type(reasoning_format).__name__}")
    if parse_tool_calls is not None and not isinstance(parse_tool_calls, bool):
        raise TypeError(f"parse_tool_calls must be a bool or None, not {type(parse_tool_calls).__name__}")
    origin = params._origin
    if origin is None:
        raise ValueError("this ChatParams was not produced by ChatTemplate.apply()")
    template = origin
    require("parse", "parsing model output", template._lib)
    try:
        llama_params = json.dumps(params.llama_params, ensure_ascii=False)
    except RecursionError:  # an echo as deep as the request may be, from a deep caller
        raise RequestError(TOO_DEEP_FOR_PYTHON, 400) from None
    parser: _core.OutputParser = template._lib.OutputParser(
        llama_params.encode("utf-8", "surrogateescape"),
        [*template._core_server_args],
        template._model,
        reasoning_format or "",
        parse_tool_calls,
        stream,
    )
    return parser


class StreamParser:
    """Incremental parse of streamed output, as llama-server streams a chat completion.

    ``feed(chunk)`` returns the OpenAI ``delta`` objects llama-server sends for that chunk
    (``{"content": ...}``, ``{"reasoning_content": ...}``, ``{"tool_calls": [{"index", "id",
    "type", "function": {"name", "arguments"}}]}``), computed by
    ``common_chat_msg_diff::compute_diffs`` in ``task_result_state::update_chat_msg``.
    ``finish()`` parses the end of the output (non-partial) and returns the last deltas;
    :attr:`message` is the assistant message so far. Concatenating the deltas' text gives
    the final message. Partial input never raises; ``finish()`` raises TemplateError (500)
    where llama-server fails the request ("does not match the expected ... format").
    """

    def __init__(self, core: _core.OutputParser) -> None:
        self._core = core
        self._finished = False

    def feed(self, chunk: str | bytes) -> list[dict[str, Any]]:
        """Add generated text; returns the deltas it produced (possibly none).

        Raises TypeError for a chunk that is no str or bytes, RuntimeError after finish()."""
        if not isinstance(chunk, (str, bytes)):
            raise TypeError(f"chunk must be str or bytes, not {type(chunk).__name__}")
        if self._finished:
            raise RuntimeError("the stream is finished")
        if not chunk:
            return []
        return self._core.feed(_utf8(chunk), False)

    def finish(self) -> list[dict[str, Any]]:
        """End of generation: the final, non-partial parse; returns its remaining deltas."""
        if self._finished:
            return []
        self._finished = True
        return self._core.feed(b"", True)

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message parsed so far (``choices[0].message`` shape)."""
        return self._core.message()

    @property
    def settings(self) -> dict[str, Any]:
        """The parser parameters llama-server derived for this request (chat format,
        reasoning format, reasoning_in_content, parse_tool_calls, generation prompt)."""
        return self._core.settings()
