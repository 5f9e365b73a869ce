"""The sample requests ``llamaprompt render`` (and ``normalize``, ``inputs``) use when given none."""

from __future__ import annotations

from typing import Any

__all__ = ["PLAIN_SAMPLE_REQUEST", "SAMPLE_REQUEST"]

#: A short conversation with a system prompt, a tools list and one earlier tool call.
SAMPLE_REQUEST: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "user", "content": "Thanks! And should I bring an umbrella?"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "description": "City name"}},
                    "required": ["city"],
                },
            },
        }
    ],
}

#: The same conversation without tools, the tool call or its result, for built-in (non-Jinja)
#: templates: llama.cpp's legacy path (``common_chat_templates_apply_legacy``) refuses a request
#: with tools ("tools param requires --jinja flag").
PLAIN_SAMPLE_REQUEST: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "18 C and sunny in Paris right now."},
        {"role": "user", "content": "Thanks! And should I bring an umbrella?"},
    ],
}
