"""transformers' ``apply_chat_template``, answered by llama.cpp.

    import llamaprompt
    t = llamaprompt.ChatTemplate.from_gguf("model.gguf")
    prompt = llamaprompt.apply_chat_template(t, messages, enable_thinking=False)
    ids = llamaprompt.apply_chat_template(t, messages, tokenize=True)

Same argument names and return shapes as ``PreTrainedTokenizerBase.apply_chat_template``;
each call is mapped onto the llama-server request that means the same thing, and the
prompt is what llama-server's POST /apply-template returns for it. The defaults are
llama-server's where they differ from transformers' (``add_generation_prompt=True``,
``tokenize=False``, ``return_dict=False``); docs/transformers.md lists every difference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .template import ChatTemplate

__all__ = ["apply_chat_template", "chat_request"]

#: transformers arguments about its own tokenizer call (padding, tensors ...): llama-server
#: has no equivalent, so they are refused rather than passed to the template as variables
_TOKENIZER_ONLY = (
    "chat_template",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "sanitize_control_tokens",
)

_NO_PREFILL = "--no-prefill-assistant"


def _tool(tool: Any) -> Any:
    if callable(tool) and not isinstance(tool, Mapping):
        try:
            from transformers.utils import get_json_schema
        except ImportError as e:
            raise TypeError(
                "a Python function as a tool needs transformers' get_json_schema (pip install transformers); "
                "or pass the OpenAI tool object"
            ) from e
        return get_json_schema(tool)
    return tool


def chat_request(
    conversation: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any] | Callable[..., Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | str = False,
    **template_kwargs: Any,
) -> dict[str, Any]:
    """The llama-server request body for this ``apply_chat_template`` call: ``messages``,
    ``tools`` (Python functions converted by transformers' ``get_json_schema``),
    ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` (the
    ``template_kwargs``, plus ``documents``): llama-server passes chat_template_kwargs to the
    template as variables, as transformers passes its keyword arguments.

    One thing a body cannot say: a final assistant message as a *closed* turn (transformers'
    meaning without ``continue_final_message``). llama-server renders it closed only when
    started with ``--no-prefill-assistant``; with its default it is an open prefill.
    :func:`apply_chat_template` uses such a template for those conversations.

    Raises ValueError for ``continue_final_message`` with ``add_generation_prompt=True`` (as
    transformers), for a ``continue_final_message`` other than True/False/"content"/
    "reasoning_content", or when the final message to continue is not an assistant message;
    TypeError for transformers' tokenizer-only arguments (padding, return_tensors ...), for
    ``tools`` that is not a list and for a non-boolean ``add_generation_prompt``.
    """
    for name in _TOKENIZER_ONLY:
        if name in template_kwargs:
            raise TypeError(
                f"apply_chat_template(): {name}= is a transformers tokenizer option with no llama-server "
                "equivalent (the template is the ChatTemplate; tokens come as llama-server tokenizes the prompt)"
            )
    if isinstance(conversation, Mapping):
        raise TypeError("conversation must be a list of messages (or of conversations), not one mapping")
    if add_generation_prompt is not None:
        if not isinstance(add_generation_prompt, (bool, np.bool_)):
            raise TypeError(f"add_generation_prompt must be a bool, not {type(add_generation_prompt).__name__}")
        add_generation_prompt = bool(add_generation_prompt)
    if isinstance(continue_final_message, np.bool_):
        continue_final_message = bool(continue_final_message)
    if not (isinstance(continue_final_message, bool) or continue_final_message in ("content", "reasoning_content")):
        raise ValueError(
            f"continue_final_message must be True, False, 'content' or 'reasoning_content' (llama-server's values), "
            f"not {continue_final_message!r}"
        )
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of tools, not {type(tools).__name__}")
    if continue_final_message:
        last = conversation[-1] if conversation else None
        role = last.get("role") if isinstance(last, Mapping) else None
        if role != "assistant":
            raise ValueError(
                f"continue_final_message continues the final assistant message; the final message is {role!r} "
                "(llama-server would render its text as the start of an assistant reply)"
            )
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible: continue_final_message "
            "continues the final message, add_generation_prompt starts a new assistant message"
        )
    body: dict[str, Any] = {"messages": list(conversation)}
    if tools:
        body["tools"] = [_tool(t) for t in tools]
    body["add_generation_prompt"] = (
        (not continue_final_message) if add_generation_prompt is None else add_generation_prompt
    )
    if continue_final_message:
        body["continue_final_message"] = continue_final_message
    kwargs = dict(template_kwargs)
    if documents is not None:
        kwargs["documents"] = list(documents)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


def _renderer(template: ChatTemplate, body: dict[str, Any], continuing: Any) -> ChatTemplate:
    """transformers renders a final assistant message as a closed turn unless asked to continue
    it; llama-server does so only under --no-prefill-assistant (built once, when first needed)."""
    messages = body["messages"]
    last = messages[-1] if messages else None
    if continuing or not isinstance(last, Mapping) or last.get("role") != "assistant":
        return template
    return template.with_server_args(_NO_PREFILL)


def _is_batch(conversation: Any) -> bool:
    return isinstance(conversation, (list, tuple)) and bool(conversation) and isinstance(conversation[0], (list, tuple))


def apply_chat_template(
    template: ChatTemplate,
    conversation: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
    *,
    tools: Sequence[Mapping[str, Any] | Callable[..., Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | str = False,
    tokenize: bool = False,
    return_dict: bool = False,
    **template_kwargs: Any,
) -> Any:
    """transformers' ``tokenizer.apply_chat_template(conversation, ...)``, rendered by llama.cpp.

    Args:
        template: the ChatTemplate (a GGUF-backed one for ``tokenize=True``).
        conversation: OpenAI-form messages, or a list of such lists (a batch).
        tools: OpenAI tool objects (``{"type": "function", "function": {...}}``), or Python
            functions (converted by transformers' ``get_json_schema``).
        documents: RAG documents, given to the template as the ``documents`` variable.
        add_generation_prompt: end with the assistant header (default True -- llama-server's
            default; transformers' is False), except with ``continue_final_message``.
        continue_final_message: leave the final (assistant) message open for the model to
            continue: True, or ``"content"`` / ``"reasoning_content"`` for the field to
            continue (llama-server's values). When False, a final assistant message is a
            closed turn, as transformers renders it -- llama-server's
            ``--no-prefill-assistant``; its default would render it open.
        tokenize: return token ids instead of text (default False; transformers' is True):
            the prompt as llama-server tokenizes it for the model (BOS added when the vocab
            adds it), from the same render.
        return_dict: with ``tokenize``, ``{"input_ids": [...], "attention_mask": [1, ...]}``
            instead of the list (default False; transformers' is True). Ignored without
            ``tokenize``, as in transformers.
        template_kwargs: template variables (``enable_thinking=False``, ``reasoning_effort="low"``
            ...), sent as llama-server's ``chat_template_kwargs``.

    Returns:
        str; or list[int] (``tokenize``); or dict of lists (``tokenize`` and ``return_dict``) --
        for a batch, a list of str / list of lists / dict of lists of lists.

    Raises:
        RequestError, TemplateError: as :meth:`ChatTemplate.apply_template` (llama-server's
            400 / 500, llama.cpp's message).
        ValueError: ``continue_final_message`` with ``add_generation_prompt=True``; an empty
            conversation (as transformers).
        TypeError: ``tokenize`` for a template without a GGUF file; a transformers tokenizer
            option (padding, truncation, max_length, return_tensors, ...).
    """
    if not isinstance(template, ChatTemplate):
        raise TypeError(f"template must be a ChatTemplate, not {type(template).__name__}")
    if isinstance(conversation, (list, tuple)) and not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    batch = list(conversation) if _is_batch(conversation) else [conversation]
    options = {
        "tools": tools,
        "documents": documents,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        **template_kwargs,
    }
    bodies = [chat_request(c, **options) for c in batch]  # type: ignore[arg-type]
    if tokenize:
        ids = [
            _renderer(template, b, continue_final_message).apply_template(b, tokens=True).tokens.tolist()
            for b in bodies
        ]
        out: Any = {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]} if return_dict else ids
        if len(batch) == 1 and not _is_batch(conversation):
            return {k: v[0] for k, v in out.items()} if return_dict else out[0]
        return out
    prompts = [_renderer(template, b, continue_final_message).apply_template(b) for b in bodies]
    return prompts if _is_batch(conversation) else prompts[0]
