"""ChatParams: everything one chat request makes llama.cpp compute (common_chat_params)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .parse import StreamParser

__all__ = ["ChatParams"]


@dataclass(frozen=True)
class ChatParams:
    """The result of ``common_chat_templates_apply`` for one request, as llama-server
    computes it in ``oaicompat_chat_params_parse`` (tools/server/server-common.cpp).

    Attributes:
        prompt: the prompt text, identical to POST /apply-template's ``prompt``.
        format: the chat format name (``common_chat_format_name``), e.g. ``"peg-native"``.
        grammar: the GBNF grammar constraining the output ("" when none).
        grammar_lazy: whether the grammar only applies after a trigger.
        grammar_triggers: list of ``{"type": int, "value": str[, "token": int]}`` as the
            server serializes ``common_grammar_trigger``.
        preserved_tokens: tokens the sampler must keep whole.
        additional_stops: stop strings the template adds.
        generation_prompt: the text the generation prompt appends (e.g. ``"<think>\\n"``).
        supports_thinking: whether this request's template reasons.
        thinking_start_tag / thinking_end_tags: reasoning delimiters.
        parser: the serialized PEG parser for the model's output ("" for none).
        message_delimiters: role delimiters, as llama-server serializes them.
        llama_params: the whole JSON object ``oaicompat_chat_params_parse`` returns
            (stop list, chat_format id, reasoning budget fields and the request's own keys).
    """

    prompt: str
    format: str
    grammar: str
    grammar_lazy: bool
    grammar_triggers: list[dict[str, Any]]
    preserved_tokens: list[str]
    additional_stops: list[str]
    generation_prompt: str
    supports_thinking: bool
    thinking_start_tag: str
    thinking_end_tags: list[str]
    parser: str
    message_delimiters: Any
    llama_params: dict[str, Any] = field(repr=False)
    _origin: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def _from_core(cls, result: dict[str, Any], origin: Any = None) -> ChatParams:
        chat = result["chat_params"]
        return cls(llama_params=result["llama_params"], _origin=origin, **chat)

    def parse(
        self,
        text: str | bytes,
        *,
        partial: bool = False,
        reasoning_format: str | None = None,
        parse_tool_calls: bool | None = None,
    ) -> dict[str, Any]:
        """The assistant message llama-server returns in ``choices[0].message`` for this
        generated text: ``role``, ``content``, ``reasoning_content`` (when the reasoning
        format separates it) and ``tool_calls`` (``[{"id", "type": "function", "function":
        {"name", "arguments" (JSON text)}}]``; ids are random, as llama-server's).

        The parser is the one ``common_chat_templates_apply`` built for this request
        (``parser``, ``format``, ``generation_prompt``), with llama-server's task parameters
        (``eval_llama_cmpl_schema``). How reasoning is separated is decided when the parser is
        built: put ``"reasoning_format"`` in the request (or ``--reasoning-format`` in
        server_args; ``none`` keeps reasoning in the content), as with llama-server. The
        ``reasoning_format`` and ``parse_tool_calls`` arguments set the task parameters of the
        same names (the server's defaults otherwise); the PEG parsers of this llama.cpp do not
        consult them, so they rarely change the result.

        Like llama-server, the parse is lenient: a finished output that stops inside a tool
        call can come back with partial arguments rather than an error.

        Args:
            text: the generated text (what follows the prompt).
            partial: parse as an unfinished generation (never raises; returns what is
                complete so far).

        Raises:
            TemplateError: status 500, "The model produced output that does not match the
                expected <format> format", when ``partial`` is false and the parser cannot
                accept the text -- llama-server fails such a request with that error.
            TypeError: ``reasoning_format`` is no str (or None), ``parse_tool_calls`` no bool
                (or None), ``partial`` no bool.
        """
        from .parse import output_parser
        from .text import utf8 as _utf8

        if not isinstance(partial, bool):
            raise TypeError(f"partial must be a bool, not {type(partial).__name__}")
        core = output_parser(self, reasoning_format=reasoning_format, parse_tool_calls=parse_tool_calls, stream=False)
        return core.parse(_utf8(text), partial)

    def stream_parser(
        self, *, reasoning_format: str | None = None, parse_tool_calls: bool | None = None
    ) -> StreamParser:
        """A :class:`~llamaprompt.parse.StreamParser` giving the OpenAI streaming deltas
        llama-server sends while this request's output is generated (``stream: true``)."""
        from .parse import StreamParser, output_parser

        return StreamParser(
            output_parser(self, reasoning_format=reasoning_format, parse_tool_calls=parse_tool_calls, stream=True)
        )

    @property
    def stop(self) -> list[str]:
        """The stop strings llama-server would use: the request's ``stop`` plus additional stops."""
        return list(self.llama_params.get("stop", []))
