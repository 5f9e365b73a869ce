"""Differential soak: llamaprompt against an unmodified llama-server built from the same tree.

    python benchmarks/soak_server.py [--requests 10000] [--seed 0] [--templates NAME ...]
        [--flags-sets '[[], ["--reasoning", "off"]]'] [--templates-per-request K] [--out soak.json]
        [--server-binary PATH] [--jobs 2]

What it does (not run by CI; docs/robustness.md has the figures of the last run):

1. Builds ``llama-server`` from ``third_party/llama.cpp`` once, into
   ``~/.cache/llamaprompt/llama-server-build`` (ccache in ``~/.cache/llamaprompt/ccache``);
   skipped when the binary exists or ``--server-binary`` names one.
2. Writes a tiny llama-arch GGUF (``~/.cache/llamaprompt/soak/tiny-llama-spm.gguf``): every
   ``tokenizer.ggml.*`` key of ``models/ggml-vocab-llama-spm.gguf`` (so BOS ``<s>``, EOS
   ``</s>``, add_bos true), one block of random f32 tensors.
3. Generates ``--requests`` OpenAI chat bodies with a seeded generator (roles, string and
   typed content, media parts, tools, tool calls and results, reasoning_content,
   chat_template_kwargs, tool_choice, response_format, continuation, malformed bodies).
4. For every template (``llamaprompt.pinned_templates()`` by default) and flag set, starts
   ``LLAMA_MEDIA_MARKER='<__media__>' llama-server -m MODEL --jinja --chat-template-file T
   -c 256 -np 1 --no-warmup --port P FLAGS`` (no ``--mmproj``: a text-only server), waits for
   ``/health``, checks ``GET /props`` ``chat_template_caps`` against ``ChatTemplate.caps``,
   POSTs the template's share of the requests to ``/apply-template`` and renders the same
   JSON text with ``ChatTemplate.from_file(T, bos_token="<s>", eos_token="</s>",
   add_bos=True, add_eos=False, server_args=FLAGS, media_marker="<__media__>",
   media=False).apply_template``. A 200 must give the same prompt bytes; an error must be
   a ``llamaprompt.Error`` with the same ``.status`` whose ``to_json()`` is the server's
   error JSON. A template the server refuses to load must make ``ChatTemplate`` raise
   ``TemplateError``.

Requests are split over the templates in order (a template that no flag set can load passes
its share on to the next one; ``--templates-per-request K`` gives each request to K templates),
and each request is compared under every flag set of its template. Every difference
(template, flags, request JSON text, both outcomes, first differing offset) goes to ``--out``;
a summary goes to stdout. Exit status 1 when there is a difference.
"""

from __future__ import annotations

import argparse
import base64
import collections
import concurrent.futures
import datetime
import hashlib
import http.client
import io
import json
import math
import os
import random
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import wave
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

import llamaprompt

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "third_party" / "llama.cpp"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llamaprompt"
BUILD_DIR = CACHE / "llama-server-build"
SOAK_DIR = CACHE / "soak"
VOCAB = TREE / "models" / "ggml-vocab-llama-spm.gguf"
MEDIA_MARKER = "<__media__>"
DEFAULT_FLAG_SETS = [[], ["--reasoning", "off"], ["--no-prefill-assistant"], ["--reasoning-format", "none"]]
DEFAULT_FLAGS_JSON = json.dumps(DEFAULT_FLAG_SETS)


# ---------------------------------------------------------------------------------------------
# llama-server build and the tiny model


def build_server(jobs: int) -> Path:
    """Configure and build llama-server from the pinned tree once; return the binary."""
    binary = BUILD_DIR / "bin" / "llama-server"
    if binary.exists():
        return binary
    env = dict(os.environ, CCACHE_DIR=str(CACHE / "ccache"))
    configure = [
        "cmake", "-S", str(TREE), "-B", str(BUILD_DIR), "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF",
        # no web UI download, no TLS: the server only needs to answer on loopback
        "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
    ]  # fmt: skip
    # (this tree has no LLAMA_CURL option any more: it only warns that it is deprecated)
    if shutil.which("ccache"):
        configure += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    print("building llama-server (once) in", BUILD_DIR, file=sys.stderr)
    subprocess.run(configure, check=True, env=env)
    subprocess.run(
        ["cmake", "--build", str(BUILD_DIR), "--target", "llama-server", "-j", str(jobs)], check=True, env=env
    )
    return binary


def write_model(path: Path) -> Path:
    """A tiny llama-arch GGUF with the tokenizer of models/ggml-vocab-llama-spm.gguf."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(VOCAB)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    n_embd, n_head, n_ff, n_ctx = 64, 2, 128, 256
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name("llamaprompt soak model")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:  # raw bytes: copied exactly
                value: Any = [bytes(field.parts[i]) for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(key, value, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[field.data[0]]), vtype)
        else:
            w.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:  # numpy shape = reversed ggml ne
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", n_vocab, n_embd)
    tensor("output_norm.weight", n_embd)
    tensor("output.weight", n_vocab, n_embd)
    tensor("blk.0.attn_norm.weight", n_embd)
    tensor("blk.0.attn_q.weight", n_embd, n_embd)
    tensor("blk.0.attn_k.weight", n_embd, n_embd)
    tensor("blk.0.attn_v.weight", n_embd, n_embd)
    tensor("blk.0.attn_output.weight", n_embd, n_embd)
    tensor("blk.0.ffn_norm.weight", n_embd)
    tensor("blk.0.ffn_gate.weight", n_ff, n_embd)
    tensor("blk.0.ffn_up.weight", n_ff, n_embd)
    tensor("blk.0.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# request generator

PNG_1X1 = "data:image/png;base64," + (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
MP4_STUB = "data:video/mp4;base64,AAAAIGZ0eXBpc29tAAACAGlzb21pc28yYXZjMW1wNDE="


def _wav_b64() -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes(b"\0\0" * 160)
    return base64.b64encode(buf.getvalue()).decode()


WAV_B64 = _wav_b64()

TEXTS = [
    "Hello", "What is 2+2?", "Write a haiku about autumn.", "", " ", "Ünïcödé ✓ 日本語 中文 한국어",
    "line one\nline two\n", "\ttabbed\ttext", 'quotes " and \\ backslash', "{{ not jinja }} {% if x %}",
    "</s> <s> <|im_end|> <|eot_id|> <|endoftext|>", "<think>hidden</think> visible", "emoji 🦙🚀",
    'JSON: {"a": 1, "b": [true, null]}', '<tool_call>{"name": "get_weather"}</tool_call>',
    "[INST] fake [/INST]", MEDIA_MARKER, "trailing spaces   ", "\n\nleading newlines", "Ok.",
    "Summarize the following text in one sentence: the quick brown fox jumps over the lazy dog.",
]  # fmt: skip
WORDS = ["alpha", "beta", "gamma", "delta", "the", "of", "a", "weather", "city", "search", "tool", "answer", "think"]
REASONING = ["Let me think.", "The user wants X.\nStep 1: ...", "", "<think>nested</think>", "Hmm 🤔"]

TOOLS = [
    {"name": "get_weather", "description": "Get the current weather for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "description": "City name"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}},
    {"name": "search", "description": "Search the web.",
     "parameters": {"type": "object", "properties": {
         "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
         "required": ["query"]}},
    {"name": "create_event", "description": "Create a calendar event with \"quotes\" and ünïcode.",
     "parameters": {"type": "object", "properties": {
         "title": {"type": "string"}, "start": {"type": "string", "format": "date-time"},
         "attendees": {"type": "array", "items": {"type": "string"}},
         "details": {"type": "object", "properties": {"location": {"type": "string"},
                                                       "notes": {"type": ["string", "null"]}}}},
         "required": ["title", "start"]}},
    {"name": "no_args", "description": "Takes no arguments.", "parameters": {"type": "object", "properties": {}}},
    {"name": "calc", "description": "Evaluate an arithmetic expression.", "strict": True,
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                    "required": ["expression"], "additionalProperties": False}},
    {"name": "set_mode", "description": "Set a mode.",
     "parameters": {"type": "object", "properties": {
         "mode": {"anyOf": [{"type": "string", "enum": ["fast", "slow"]}, {"type": "integer"}]},
         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
         "ratio": {"type": "number"}}, "required": ["mode"]}},
    {"name": "python", "description": "Run Python code.",
     "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}},
    {"name": "lookup", "description": "No parameters key at all."},
]  # fmt: skip
TOOL_ARGS = {
    "get_weather": [{"city": "Paris"}, {"city": "Zürich", "unit": "celsius"}],
    "search": [{"query": "llama.cpp chat templates", "max_results": 3}, {"query": 'ü " \\'}],
    "create_event": [
        {
            "title": "Sync",
            "start": "2026-01-01T10:00:00Z",
            "attendees": ["a", "b"],
            "details": {"location": "Room 1", "notes": None},
        }
    ],
    "no_args": [{}],
    "calc": [{"expression": "2+2"}],
    "set_mode": [{"mode": "fast", "flags": [True, False]}, {"mode": 3, "ratio": 0.5}],
    "python": [{"code": "print('hi')\nfor i in range(3):\n    print(i)"}],
    "lookup": [{}, {"x": 1}],
}
SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    },
    {"type": "array", "items": {"type": "number"}, "minItems": 1},
    {},
]
KWARGS = [
    {"enable_thinking": True}, {"enable_thinking": False}, {"reasoning_effort": "high"},
    {"preserve_reasoning": False}, {"custom_flag": 1, "enable_thinking": False}, {"add_vision_id": True},
    {"thinking": True}, {"builtin_tools": ["code_interpreter"]},
]  # fmt: skip


class RequestGen:
    """Seeded generator of OpenAI chat bodies; ``make()`` returns (JSON text, feature tags)."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.tags: list[str] = []
        self.call_no = 0

    def p(self, prob: float) -> bool:
        return self.r.random() < prob

    def text(self) -> str:
        if self.p(0.25):
            return " ".join(self.r.choice(WORDS) for _ in range(self.r.randint(1, 30)))
        return self.r.choice(TEXTS)

    def media_part(self) -> dict:
        kind = self.r.choice(["image", "image", "image_remote", "audio", "video", "input_video"])
        self.tags.append("media:" + kind)
        if kind == "image":
            return {"type": "image_url", "image_url": {"url": PNG_1X1}}
        if kind == "image_remote":
            return {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
        if kind == "audio":
            return {"type": "input_audio", "input_audio": {"data": WAV_B64, "format": "wav"}}
        if kind == "video":
            return {"type": "video_url", "video_url": {"url": MP4_STUB}}
        return {"type": "input_video", "input_video": {"url": MP4_STUB}}

    def content(self, media: float = 0.0) -> Any:
        if self.p(0.6):
            self.tags.append("content:string")
            return self.text()
        self.tags.append("content:typed")
        parts: list[dict] = [{"type": "text", "text": self.text()} for _ in range(self.r.randint(1, 3))]
        if self.p(media):
            parts.insert(self.r.randint(0, len(parts)), self.media_part())
        return parts

    def tool_call(self, names: list[str]) -> dict:
        self.call_no += 1
        name = self.r.choice(names) if names and self.p(0.95) else "undeclared_tool"
        args = self.r.choice(TOOL_ARGS.get(name, [{"q": 1}]))
        call: dict = {
            "id": f"call_{self.call_no:04d}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=self.p(0.5))},
        }
        if self.p(0.05):
            del call["id"]
            self.tags.append("tool_call:no_id")
        return call

    def assistant(self, names: list[str], last: bool) -> list[dict]:
        msg: dict = {"role": "assistant"}
        out = [msg]
        if names and not last and self.p(0.4):
            calls = [self.tool_call(names) for _ in range(1 if self.p(0.7) else self.r.randint(2, 3))]
            msg["content"] = self.r.choice([None, "", "Let me check."])
            msg["tool_calls"] = calls
            self.tags.append("assistant:tool_calls" if len(calls) == 1 else "assistant:parallel_tool_calls")
            for call in calls:
                result: dict = {
                    "role": "tool",
                    "tool_call_id": call.get("id", "x"),
                    "content": self.r.choice([json.dumps({"result": 42}), "sunny, 21 C", ""]),
                }
                if self.p(0.3):
                    result["content"] = [{"type": "text", "text": "typed tool result"}]
                    self.tags.append("tool:typed_result")
                if self.p(0.3):
                    result["name"] = call["function"]["name"]
                out.append(result)
            self.tags.append("tool:result")
        else:
            msg["content"] = None if self.p(0.05) else self.content()
        if self.p(0.3):
            msg["reasoning_content"] = self.r.choice(REASONING)
            self.tags.append("assistant:reasoning_content")
            if self.p(0.3) and "tool_calls" not in msg:
                msg["content"] = None
        return out

    def messages(self, names: list[str]) -> tuple[list[dict], str]:
        msgs: list[dict] = []
        if self.p(0.5):
            role = self.r.choice(["system", "system", "developer"])
            self.tags.append("role:" + role)
            msgs.append({"role": role, "content": self.content()})
        end = self.r.choices(["user", "assistant", "tool"], [0.7, 0.2, 0.1])[0]
        turns = self.r.randint(1, 4)
        for t in range(turns):
            msgs.append({"role": "user", "content": self.content(media=0.12)})
            if t < turns - 1:
                msgs += self.assistant(names, last=False)
            if self.p(0.02):  # an unusual order: system message in the middle
                msgs.append({"role": "system", "content": self.text()})
                self.tags.append("role:system_mid")
        if end == "assistant":
            msgs += self.assistant(names, last=True)
        elif end == "tool" and names:
            msgs += self.assistant(["get_weather"] if "get_weather" in names else names, last=False)[:2]
            if msgs[-1]["role"] != "tool":
                end = "assistant"
        return msgs, end

    def make(self) -> tuple[str, list[str]]:
        self.tags = []
        r = self.r
        body: dict = {}
        names: list[str] = []
        if self.p(0.4):
            tools = r.sample(TOOLS, r.randint(1, 3))
            names = [t["name"] for t in tools]
            body["tools"] = [{"type": "function", "function": t} for t in tools]
            self.tags.append("tools")
            if self.p(0.4):
                choice = r.choice(["auto", "none", "required", "named"])
                body["tool_choice"] = (
                    choice if choice != "named" else {"type": "function", "function": {"name": r.choice(names)}}
                )
                self.tags.append("tool_choice:" + choice)
            if self.p(0.15):
                body["parallel_tool_calls"] = self.p(0.5)
                self.tags.append("parallel_tool_calls")
        body["messages"], end = self.messages(names)
        self.tags.append("last:" + end)
        if end == "assistant":  # continuation variations
            v = r.choice(
                [
                    "prefill",
                    "continue_true",
                    "continue_false",
                    "continue_content",
                    "continue_reasoning",
                    "no_gen_prompt",
                    "gen_prompt_true",
                ]
            )
            self.tags.append("continuation:" + v)
            if v.startswith("continue_"):
                body["continue_final_message"] = {
                    "continue_true": True,
                    "continue_false": False,
                    "continue_content": "content",
                    "continue_reasoning": "reasoning_content",
                }[v]
                if self.p(0.7):
                    body["add_generation_prompt"] = False
            elif v == "no_gen_prompt":
                body["add_generation_prompt"] = False
            elif v == "gen_prompt_true":
                body["add_generation_prompt"] = True
        elif self.p(0.1):
            body["add_generation_prompt"] = False
            self.tags.append("add_generation_prompt:false")
        if self.p(0.25):
            body["chat_template_kwargs"] = dict(r.choice(KWARGS))
            self.tags.append("chat_template_kwargs")
        if self.p(0.1):
            body["reasoning_effort"] = r.choice(["low", "medium", "high", "none"])
            self.tags.append("reasoning_effort:" + body["reasoning_effort"])
        if self.p(0.05):
            body["reasoning_format"] = r.choice(["none", "deepseek", "auto", "deepseek-legacy"])
            self.tags.append("reasoning_format")
        if self.p(0.15):
            kind = r.choice(["json_object", "json_object_schema", "json_schema", "text"])
            self.tags.append("response_format:" + kind)
            if kind == "json_object":
                body["response_format"] = {"type": "json_object"}
            elif kind == "json_object_schema":
                body["response_format"] = {"type": "json_object", "schema": r.choice(SCHEMAS)}
            elif kind == "json_schema":
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": r.choice(SCHEMAS)},
                }
            else:
                body["response_format"] = {"type": "text"}
        if self.p(0.03):
            body["json_schema"] = r.choice(SCHEMAS)
            self.tags.append("json_schema")
        if self.p(0.05):
            body.update(
                r.choice(
                    [
                        {"stream": True},
                        {"temperature": 0.2, "max_tokens": 16},
                        {"stop": "</s>"},
                        {"logprobs": True, "top_logprobs": 2},
                        {"model": "x"},
                    ]
                )
            )
            self.tags.append("sampling_fields")
        if self.p(0.09):
            return self.malformed(body)
        self.tags.append("valid_shape")
        return json.dumps(body, ensure_ascii=self.p(0.7)), self.tags

    def malformed(self, body: dict) -> tuple[str, list[str]]:
        r = self.r
        msgs = body["messages"]
        user = next(m for m in msgs if m["role"] == "user")
        kind = r.choice([
            "content_number", "content_bool", "content_object", "content_empty_list", "user_no_content",
            "no_role", "role_number", "messages_object", "messages_missing", "message_string",
            "assistant_empty", "tool_call_no_function", "tool_call_bad_type", "tool_call_no_name",
            "tool_call_args_object", "tool_call_args_invalid", "part_no_type", "part_unknown_type",
            "part_text_number", "part_no_text", "enable_thinking_string", "kwargs_list", "two_trailing_assistants",
            "continue_and_gen_prompt", "continue_tool_calls", "response_format_bad", "grammar_with_tools",
            "grammar_and_json_schema", "reasoning_format_number", "reasoning_format_bad", "tool_choice_bad",
            "top_logprobs_alone", "tools_string", "tool_no_function", "tool_bad_type", "tool_no_name",
            "broken_json", "add_generation_prompt_string", "continue_number",
        ])  # fmt: skip
        self.tags.append("malformed:" + kind)
        fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        calls = [{"id": "c1", "type": "function", "function": fn}]
        if kind == "content_number":
            user["content"] = 5
        elif kind == "content_bool":
            user["content"] = True
        elif kind == "content_object":
            user["content"] = {"text": "hi"}
        elif kind == "content_empty_list":
            user["content"] = []
        elif kind == "user_no_content":
            del user["content"]
        elif kind == "no_role":
            del user["role"]
        elif kind == "role_number":
            user["role"] = 7
        elif kind == "messages_object":
            body["messages"] = {"role": "user", "content": "hi"}
        elif kind == "messages_missing":
            del body["messages"]
        elif kind == "message_string":
            msgs.append("hello")
        elif kind == "assistant_empty":
            msgs.append({"role": "assistant"})
        elif kind.startswith("tool_call_"):
            call = calls[0]
            if kind == "tool_call_no_function":
                del call["function"]
            elif kind == "tool_call_bad_type":
                call["type"] = "code"
            elif kind == "tool_call_no_name":
                del call["function"]["name"]
            elif kind == "tool_call_args_object":
                call["function"]["arguments"] = {"city": "Paris"}
            else:
                call["function"]["arguments"] = '{"city": "Par'
            msgs += [
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ]
        elif kind.startswith("part_"):
            part: dict = {
                "part_no_type": {"text": "x"},
                "part_unknown_type": {"type": "file", "file": {"file_data": "x"}},
                "part_text_number": {"type": "text", "text": 3},
                "part_no_text": {"type": "text"},
            }[kind]
            user["content"] = [{"type": "text", "text": "a"}, part]
        elif kind == "enable_thinking_string":
            body["chat_template_kwargs"] = {"enable_thinking": r.choice(["false", "true"])}
        elif kind == "kwargs_list":
            body["chat_template_kwargs"] = ["enable_thinking"]
        elif kind == "two_trailing_assistants":
            msgs += [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
        elif kind == "continue_and_gen_prompt":
            msgs.append({"role": "assistant", "content": "a"})
            body.update(continue_final_message=True, add_generation_prompt=True)
        elif kind == "continue_tool_calls":
            msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
            body.update(continue_final_message=True, add_generation_prompt=False)
        elif kind == "continue_number":
            msgs.append({"role": "assistant", "content": "a"})
            body.update(continue_final_message=1, add_generation_prompt=False)
        elif kind == "response_format_bad":
            body["response_format"] = {"type": r.choice(["xml", "grammar"])}
        elif kind == "grammar_with_tools":
            body.setdefault("tools", [{"type": "function", "function": TOOLS[0]}])
            body.pop("tool_choice", None)
            body["grammar"] = 'root ::= "a"'
        elif kind == "grammar_and_json_schema":
            body.update(grammar='root ::= "a"', json_schema=SCHEMAS[0])
        elif kind == "reasoning_format_number":
            body["reasoning_format"] = 1
        elif kind == "reasoning_format_bad":
            body["reasoning_format"] = "bogus"
        elif kind == "tool_choice_bad":
            body.setdefault("tools", [{"type": "function", "function": TOOLS[0]}])
            body["tool_choice"] = r.choice(["bogus", "any"])
        elif kind == "top_logprobs_alone":
            body.pop("logprobs", None)
            body["top_logprobs"] = 3
        elif kind == "tools_string":
            body["tools"] = "get_weather"
        elif kind == "tool_no_function":
            body["tools"] = [{"type": "function"}]
        elif kind == "tool_bad_type":
            body["tools"] = [{"type": "retrieval", "function": TOOLS[0]}]
        elif kind == "tool_no_name":
            body["tools"] = [{"type": "function", "function": {"description": "x", "parameters": {"type": "object"}}}]
        elif kind == "add_generation_prompt_string":
            body["add_generation_prompt"] = "no"
        text = json.dumps(body, ensure_ascii=self.p(0.7))
        if kind == "broken_json":
            text = text[: r.randint(1, max(1, len(text) - 1))]
        return text, self.tags


# ---------------------------------------------------------------------------------------------
# llama-server process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server for one template and flag set, started and stopped by this script only."""

    def __init__(self, binary: Path, model: Path, template: Path, flags: list[str], log: Path):
        self.port = free_port()
        self.argv = [
            str(binary),
            "-m",
            str(model),
            "--jinja",
            "--chat-template-file",
            str(template),
            "-c",
            "256",
            "-np",
            "1",
            "--no-warmup",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> bool:
        """True once /health answers 200; False when the server exits first (it refused to load)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        env["LLAMA_MEDIA_MARKER"] = MEDIA_MARKER
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"llama-server did not become healthy in {timeout} s: {shlex.join(self.argv)}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=60) as r:
            return json.loads(r.read())

    def apply_template(self, text: str, timeout: float) -> dict:
        """The server's outcome: {"status": 200, "prompt": ...} or {"status": s, "error": {...}}."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/apply-template",
            data=text.encode("utf-8"),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            data = json.loads(raw)
        except ValueError:
            return {"status": status, "raw": raw.decode("utf-8", "replace")}
        if status == 200 and isinstance(data, dict) and "prompt" in data:
            return {"status": 200, "prompt": data["prompt"]}
        return {"status": status, "error": data}

    def log_tail(self, n: int = 12) -> list[str]:
        try:
            return self.log.read_text("utf-8", "replace").splitlines()[-n:]
        except OSError:
            return []

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------
# comparison


def lp_outcome(tmpl: llamaprompt.ChatTemplate, text: str) -> dict:
    try:
        return {"status": 200, "prompt": tmpl.apply_template(text)}
    except llamaprompt.Error as e:
        return {"status": e.status, "error": e.to_json(), "exception": type(e).__name__}
    except Exception as e:  # noqa: BLE001 -- any other exception is a difference by itself
        return {"status": None, "exception": type(e).__name__, "message": str(e)}


def _bytes(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def first_difference(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def compare(server: dict, lp: dict) -> tuple[str, int | None]:
    """("same_prompt" | "same_error" | "difference", first differing offset)."""
    if server["status"] == 200 and "prompt" in server:
        if lp["status"] == 200:
            a, b = _bytes(server["prompt"]), _bytes(lp["prompt"])
            return ("same_prompt", None) if a == b else ("difference", first_difference(a, b))
        return "difference", None
    if "error" in server and "error" in lp:
        if lp["status"] == server["status"] and lp["error"] == server["error"]:
            return "same_error", None
        sm = str(server["error"].get("error", {}).get("message", "")) if isinstance(server["error"], dict) else ""
        return "difference", first_difference(_bytes(sm), _bytes(lp["error"]["error"]["message"]))
    return "difference", None


# ---------------------------------------------------------------------------------------------
# driver


def run(args: argparse.Namespace) -> dict:
    binary = Path(args.server_binary) if args.server_binary else build_server(args.build_jobs)
    if not binary.exists():
        raise SystemExit(f"no llama-server binary at {binary}")
    model = write_model(SOAK_DIR / "tiny-llama-spm.gguf")
    pinned = {p.name: p for p in llamaprompt.pinned_templates()}
    names = args.templates or sorted(pinned)
    unknown = [n for n in names if n not in pinned and not Path(n).is_file()]
    if unknown:
        raise SystemExit(f"unknown templates: {unknown}")
    templates = [pinned.get(n) or Path(n) for n in names]
    flag_sets = args.flags_sets

    build = provenance()
    gen = RequestGen(args.seed)
    requests = [gen.make() for _ in range(args.requests)]
    # each request goes to --templates-per-request consecutive shares (different templates)
    work = requests * min(args.templates_per_request, len(templates))
    features = collections.Counter(t for _, tags in requests for t in set(tags))
    logs = Path(tempfile.mkdtemp(prefix="soak-logs-", dir=SOAK_DIR))

    totals = collections.Counter()
    server_status = collections.Counter()
    per_template: dict[str, dict] = {}
    differences: list[dict] = []
    load: dict[str, dict] = {}
    caps_diffs: list[dict] = []
    crashes: list[dict] = []
    cursor = 0
    started = time.monotonic()
    bar = tqdm(total=len(work) * len(flag_sets), unit="cmp", dynamic_ncols=True, disable=args.no_progress)

    for ti, tpath in enumerate(templates):
        name = tpath.name
        quota = math.ceil((len(work) - cursor) / (len(templates) - ti))
        chunk = work[cursor : cursor + quota]
        stats = per_template[name] = collections.Counter(requests=len(chunk))
        any_loaded = False
        load[name] = {}
        for flags in flag_sets:
            fkey = shlex.join(flags)
            bar.set_postfix_str(f"{name} [{fkey}]", refresh=False)
            try:
                tmpl = llamaprompt.ChatTemplate.from_file(
                    tpath,
                    bos_token="<s>",
                    eos_token="</s>",
                    add_bos=True,
                    add_eos=False,
                    server_args=flags,
                    media_marker=MEDIA_MARKER,
                    media=False,
                )
                lp_load: dict = {"loaded": True}
            except llamaprompt.Error as e:
                tmpl, lp_load = (
                    None,
                    {"loaded": False, "exception": type(e).__name__, "status": e.status, "message": e.message},
                )
            server = Server(binary, model, tpath, flags, logs / f"{name}.{len(load[name])}.log")
            srv_loaded = server.start()
            entry = {"server_loaded": srv_loaded, "llamaprompt": lp_load}
            load[name][fkey] = entry
            if not srv_loaded:
                entry["server_log"] = [ln for ln in server.log_tail(40) if "error" in ln.lower()][-4:]
                agree = not lp_load["loaded"] and lp_load["exception"] == "TemplateError" and lp_load["status"] is None
                entry["agree"] = agree
                totals["load_error_agree" if agree else "load_difference"] += 1
                server.stop()
                continue
            any_loaded = True
            if tmpl is None:
                entry["agree"] = False
                totals["load_difference"] += 1
                server.stop()
                continue
            entry["agree"] = True
            try:
                srv_caps = server.get("/props").get("chat_template_caps")
                if srv_caps != tmpl.caps:
                    caps_diffs.append({"template": name, "flags": flags, "server": srv_caps, "llamaprompt": tmpl.caps})

                live = {"server": server, "tmpl": tmpl}

                def one(item: tuple[str, list[str]], live: dict = live) -> tuple:
                    text = item[0]
                    try:
                        srv = live["server"].apply_template(text, args.request_timeout)
                    except (urllib.error.URLError, ConnectionError, http.client.HTTPException, TimeoutError) as e:
                        srv = {"status": None, "transport": f"{type(e).__name__}: {e}"}
                    return text, srv, lp_outcome(live["tmpl"], text)

                with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                    for text, srv, lp in pool.map(one, chunk):
                        if srv.get("transport") and not server.alive():
                            crashes.append(
                                {
                                    "template": name,
                                    "flags": flags,
                                    "request": text,
                                    "server": srv,
                                    "log": server.log_tail(),
                                }
                            )
                            server.stop()
                            server = Server(binary, model, tpath, flags, logs / f"{name}.restart{len(crashes)}.log")
                            live["server"] = server
                            server.start()
                        server_status[str(srv["status"])] += 1
                        verdict, offset = compare(srv, lp)
                        totals[verdict] += 1
                        stats[verdict] += 1
                        stats["compared"] += 1
                        if verdict == "difference":
                            differences.append(
                                {
                                    "template": name,
                                    "flags": flags,
                                    "request": text,
                                    "server": srv,
                                    "llamaprompt": lp,
                                    "first_difference_offset": offset,
                                }
                            )
                        bar.update()
            finally:
                server.stop()
        if any_loaded:
            cursor += len(chunk)
        else:
            stats["passed_on"] = len(chunk)
            stats["requests"] = 0
    bar.close()
    compared = totals["same_prompt"] + totals["same_error"] + totals["difference"]
    return {
        "date": datetime.date.today().isoformat(),
        "llama_cpp_commit": llamaprompt.LLAMA_CPP_COMMIT,
        "llamaprompt_version": getattr(llamaprompt, "__version__", None),
        **build,
        "server_binary": str(binary),
        "server_command": "LLAMA_MEDIA_MARKER='<__media__>' llama-server -m <tiny llama-spm model> --jinja "
        "--chat-template-file <template> -c 256 -np 1 --no-warmup --host 127.0.0.1 --port <port> "
        "<flags>",
        "seed": args.seed,
        "requests": args.requests,
        "templates_per_request": min(args.templates_per_request, len(templates)),
        "requests_unassigned": len(work) - cursor,
        "templates": [t.name for t in templates],
        "flag_sets": flag_sets,
        "compared": compared,
        "same_prompt": totals["same_prompt"],
        "same_error": totals["same_error"],
        "differences_count": totals["difference"],
        "load_error_agree": totals["load_error_agree"],
        "load_differences": totals["load_difference"],
        "caps_differences": caps_diffs,
        "server_crashes": crashes,
        "server_status_counts": dict(server_status),
        "elapsed_seconds": round(time.monotonic() - started, 1),
        "server_logs": str(logs),
        "features": dict(sorted(features.items())),
        "load": load,
        "per_template": {k: dict(v) for k, v in per_template.items()},
        "differences": differences,
    }


def provenance() -> dict:
    """Which llamaprompt build ran: the extension module's sha256 and mtime, the repository's HEAD."""
    core = Path(llamaprompt._core.__file__)
    info: dict = {
        "llamaprompt_core": str(core),
        "llamaprompt_core_sha256": hashlib.sha256(core.read_bytes()).hexdigest(),
        "llamaprompt_core_mtime": datetime.datetime.fromtimestamp(
            core.stat().st_mtime, datetime.timezone.utc
        ).isoformat(timespec="seconds"),
    }
    try:
        git = ["git", "-C", str(REPO)]
        info["repo_commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        info["repo_dirty"] = bool(dirty.stdout.strip())
    except OSError:
        pass
    return info


def summary(rep: dict) -> str:
    lines = [
        f"llama.cpp {rep['llama_cpp_commit']}, llamaprompt {rep['llamaprompt_version']}, {rep['date']}, "
        f"seed {rep['seed']}, {rep['elapsed_seconds']} s; repository {rep.get('repo_commit', '?')[:9]}"
        f"{' (dirty)' if rep.get('repo_dirty') else ''}, core sha256 {rep['llamaprompt_core_sha256'][:12]} "
        f"({rep['llamaprompt_core_mtime']})",
        f"requests {rep['requests']} x {rep['templates_per_request']} template(s) "
        f"({rep['requests_unassigned']} unassigned), templates {len(rep['templates'])}, "
        f"flag sets {len(rep['flag_sets'])}: {[shlex.join(f) for f in rep['flag_sets']]}",
        f"compared {rep['compared']}: same prompt {rep['same_prompt']}, same error {rep['same_error']}, "
        f"differences {rep['differences_count']}",
        f"server statuses {rep['server_status_counts']}",
        f"load errors refused by both {rep['load_error_agree']}, load differences {rep['load_differences']}, "
        f"caps differences {len(rep['caps_differences'])}, server crashes {len(rep['server_crashes'])}",
    ]
    for name, per in rep["load"].items():
        for fkey, e in per.items():
            if not e["server_loaded"] or not e["agree"]:
                lines.append(
                    f"  load: {name} [{fkey}] server_loaded={e['server_loaded']} llamaprompt={e['llamaprompt']}"
                )
    by = collections.Counter((d["template"], shlex.join(d["flags"])) for d in rep["differences"])
    for (name, fkey), n in by.most_common():
        lines.append(f"  {n:5d} differences: {name} [{fkey}]")
    return "\n".join(lines)


def flag_sets_arg(text: str) -> list[list[str]]:
    """--flags-sets: a JSON list of lists of strings."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not (isinstance(value, list) and value and all(isinstance(f, list) for f in value)) or not all(
        isinstance(a, str) for f in value for a in f
    ):
        raise argparse.ArgumentTypeError('expected a non-empty JSON list of lists of strings, e.g. [[], ["--jinja"]]')
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=10000, help="how many requests to generate (default 10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--templates",
        nargs="+",
        metavar="NAME",
        help="pinned template names (or template files); default: all of llamaprompt.pinned_templates()",
    )
    ap.add_argument(
        "--flags-sets",
        type=flag_sets_arg,
        default=DEFAULT_FLAG_SETS,
        metavar="JSON",
        help=f"llama-server flag sets, a JSON list of argument lists ([] = defaults); default: {DEFAULT_FLAGS_JSON}",
    )
    ap.add_argument(
        "--templates-per-request",
        type=int,
        default=1,
        metavar="K",
        help="compare each request on K templates (each under every flag set; default 1)",
    )
    ap.add_argument("--out", type=Path, default=Path("soak_server.json"), help="JSON report (default %(default)s)")
    ap.add_argument("--server-binary", help="use this llama-server instead of building one")
    ap.add_argument("--jobs", type=int, default=2, help="requests in flight (default 2)")
    ap.add_argument("--build-jobs", type=int, default=2, help="cmake --build -j (default 2)")
    ap.add_argument("--request-timeout", type=float, default=300, help="seconds per HTTP request (default 300)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = ap.parse_args(argv)
    if min(args.requests, args.jobs, args.templates_per_request) < 1:
        ap.error("--requests, --templates-per-request and --jobs must be >= 1")
    rep = run(args)
    text = json.dumps(rep, indent=1, ensure_ascii=False) + "\n"
    args.out.write_text(text, encoding="utf-8", errors="surrogateescape")
    print(summary(rep))
    print("report:", args.out)
    bad = rep["differences_count"] + rep["load_differences"] + len(rep["caps_differences"]) + len(rep["server_crashes"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
