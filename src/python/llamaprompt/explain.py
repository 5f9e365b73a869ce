"""Why another renderer's prompt differs from llama-server's: every differing span, and a
cause found by experiment with llama.cpp's own stages (``llamaprompt diff --explain``).

Each experiment changes one thing about what llama.cpp does and re-renders with llama.cpp's
engine (:meth:`ChatTemplate.render_inputs` on the captured :meth:`ChatTemplate.template_inputs`
context, or a whole request with other llama-server flags); when the result equals OTHER,
that one thing is the cause. Nothing is guessed from the text. The causes:

- ``dates`` -- the prompts agree once the dates a template prints are masked;
- ``leading BOS`` / ``trailing EOS`` -- OTHER keeps the BOS (EOS) text that llama.cpp strips
  because the vocab adds the token (``add_bos`` / ``add_eos``);
- ``thinking default`` -- OTHER is the render with ``enable_thinking`` undefined or false
  (llama-server passes true for templates that support thinking);
- ``extra context`` -- OTHER is the render without the variables llama.cpp adds to every
  request (``date_string``, ``datetime``, ``preserve_reasoning`` and what it sets ...);
- ``message preprocessing`` -- OTHER is the render of the request's messages as sent, without
  llama.cpp's normalization, workarounds and handler rewrites (content parts joined or
  wrapped, ``developer`` -> ``system``, system merged, null content -> ``""``, arguments parsed);
- ``object arguments`` -- OTHER is the render with tool-call arguments left as JSON text;
- ``assistant prefill`` -- OTHER closes a final assistant turn that llama-server leaves open
  (it equals llama-server's render under ``--no-prefill-assistant``);
- ``generation prompt`` -- OTHER is the render with ``add_generation_prompt`` the other way;
- ``unknown`` -- no experiment reproduced OTHER (an engine difference, or several causes at once).
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Mapping
from typing import Any

from .errors import Error
from .fixtures import mask_dates
from .template import ChatTemplate

__all__ = ["spans", "explain", "CAUSES"]

CAUSES = (
    "dates",
    "leading BOS",
    "trailing EOS",
    "thinking default",
    "extra context",
    "message preprocessing",
    "object arguments",
    "assistant prefill",
    "generation prompt",
    "unknown",
)

#: variables llama.cpp's context has that a renderer given the OpenAI request would not
_LLAMA_CPP_EXTRA = (
    "date_string",
    "datetime",
    "preserve_reasoning",
    "preserve_thinking",
    "clear_thinking",
    "truncate_history_thinking",
    "drop_thinking",
    "reasoning_strength",
    "reasoning_effort",
)


def spans(reference: str, other: str, *, context: int = 20, limit: int = 100, gap: int = 5) -> list[dict[str, Any]]:
    """Every differing span of two prompts, in order: difflib's opcodes (no junk heuristic),
    with spans separated by fewer than ``gap`` equal characters merged (a changed date is one
    span, not three). Each: ``{"op": "replace"|"delete"|"insert", "reference_offset",
    "other_offset", "reference_text", "other_text"`` (exactly what differs) ``, "reference",
    "other"`` (the same with ``context`` characters around) ``}``. More than ``limit`` spans:
    the last item is ``{"omitted": n}``."""
    merged: list[list[int]] = []
    matcher = difflib.SequenceMatcher(None, reference, other, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            continue
        if merged and a0 - merged[-1][1] < gap and b0 - merged[-1][3] < gap:
            merged[-1][1], merged[-1][3] = a1, b1
        else:
            merged.append([a0, a1, b0, b1])
    out: list[dict[str, Any]] = []
    for a0, a1, b0, b1 in merged[:limit]:
        op = "replace" if a1 > a0 and b1 > b0 else ("delete" if a1 > a0 else "insert")
        out.append(
            {
                "op": op,
                "reference_offset": a0,
                "other_offset": b0,
                "reference_text": reference[a0:a1],
                "other_text": other[b0:b1],
                "reference": reference[max(0, a0 - context) : a1 + context],
                "other": other[max(0, b0 - context) : b1 + context],
            }
        )
    if len(merged) > limit:
        out.append({"omitted": len(merged) - limit})
    return out


def _strip(template: ChatTemplate, text: str) -> str:
    if template.add_bos and template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token) :]
    if template.add_eos and template.eos_token and text.endswith(template.eos_token):
        text = text[: -len(template.eos_token)]
    return text


def _string_arguments(messages: Any) -> Any:
    out = copy.deepcopy(messages)
    for m in out if isinstance(out, list) else []:
        for call in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and not isinstance(fn.get("arguments"), str) and "arguments" in fn:
                fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
    return out


def explain(template: ChatTemplate, request: Mapping[str, Any], reference: str, other: str) -> list[str]:
    """The causes (from :data:`CAUSES`) of OTHER differing from ``reference`` (llama-server's
    prompt for ``request`` with ``template``), found by experiment; ``["unknown"]`` when no
    experiment reproduces OTHER. BOS/EOS and dates are peeled off first and reported with
    whatever else explains the rest (dates are always compared masked here).

    Raises nothing for a request llama.cpp rejects or a template that fails: the cause is then
    ``"unknown"``."""
    causes: list[str] = []
    ref, oth = reference, other
    if (
        template.add_bos
        and template.bos_token
        and oth.startswith(template.bos_token)
        and not ref.startswith(template.bos_token)
    ):
        causes.append("leading BOS")
        oth = oth[len(template.bos_token) :]
    if (
        template.add_eos
        and template.eos_token
        and oth.endswith(template.eos_token)
        and not ref.endswith(template.eos_token)
    ):
        causes.append("trailing EOS")
        oth = oth[: -len(template.eos_token)]
    if oth != ref and mask_dates(oth) == mask_dates(ref):
        return [*causes, "dates"]
    if oth == ref:
        return causes or ["unknown"]

    def same(text: str | None) -> bool:
        return text is not None and mask_dates(_strip(template, text)) == mask_dates(oth)

    def found(text: str | None, *why: str) -> list[str]:
        # the printed dates differed too when only the masked texts agree
        dated = text is not None and _strip(template, text) != oth
        return [*causes, *why, *(["dates"] if dated else [])]

    try:
        inputs = template.template_inputs(request)
    except (Error, TypeError, ValueError):
        return [*causes, "unknown"]
    index = inputs["prompt_render"]
    if index is not None:
        render = inputs["renders"][index]
        context = render["context"]

        def replay(changed: dict[str, Any]) -> str | None:
            try:
                text = template.render_inputs(changed, variant=render["variant"], mark_input=render["mark_input"])
            except (Error, TypeError, ValueError):
                return None
            if inputs["prompt_match"] == "prefix":  # the handler appended the continued text
                text += inputs["prompt"][len(_strip(template, render["output"])) :]
            return text

        raw_messages = request.get("messages")
        experiments: list[tuple[str, dict[str, Any]]] = [
            ("thinking default", {k: v for k, v in context.items() if k != "enable_thinking"}),
            ("thinking default", {**context, "enable_thinking": False}),
            ("extra context", {k: v for k, v in context.items() if k not in _LLAMA_CPP_EXTRA}),
            ("object arguments", {**context, "messages": _string_arguments(context.get("messages"))}),
            ("message preprocessing", {**context, "messages": raw_messages}),
            (
                "generation prompt",
                {k: v for k, v in context.items() if k != "add_generation_prompt"}
                if context.get("add_generation_prompt")
                else {**context, "add_generation_prompt": True},
            ),
        ]
        for cause, changed in experiments:
            text = replay(changed)
            if same(text):
                return found(text, cause)
        # two at once: the request as a renderer given the OpenAI body sees it
        plain = {k: v for k, v in context.items() if k not in _LLAMA_CPP_EXTRA and k != "enable_thinking"}
        plain["messages"] = raw_messages
        text = replay(plain)
        if same(text):
            return found(text, "message preprocessing", "extra context", "thinking default")
    try:
        closed = template.with_server_args("--no-prefill-assistant").apply_template(request)
    except (Error, TypeError, ValueError):
        closed = None
    if closed is not None and closed != reference and same(closed):
        return found(closed, "assistant prefill")
    return [*causes, "unknown"]
