"""ChatTemplate: one chat template, loaded and applied by llama.cpp's own code."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import numpy as np

from . import _core
from .errors import Error, RequestError, TemplateError
from .hooks import check_hook, hooks_for, template_sha256
from .params import ChatParams

__all__ = ["ChatTemplate", "DEFAULT_MEDIA_MARKER", "Request"]

#: The media marker llamaprompt pins by default (llama-server draws a random one per
#: process unless LLAMA_MEDIA_MARKER is set; the reference fixtures use this one).
DEFAULT_MEDIA_MARKER = "<__media__>"

#: A request body: a JSON object (mapping) or its JSON text.
Request = Union[Mapping[str, Any], str, bytes]


def _utf8(text: str | bytes, what: str = "value") -> bytes:
    """UTF-8 bytes for llama.cpp. Surrogate escapes (bytes that were not UTF-8, as prompts
    come back) become those bytes again; any other lone surrogate cannot be UTF-8 and is
    passed as its 3 bytes, which llama.cpp then judges as it judges any invalid UTF-8."""
    if isinstance(text, bytes):
        return text
    if not isinstance(text, str):
        raise TypeError(f"{what} must be str or bytes, not {type(text).__name__}")
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _path(path: Any) -> str:
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if "\x00" in p:
        raise ValueError("path contains a NUL byte")
    return p


_HANDLERS = ("auto", "autoparser", "pure_content")
#: The chat_template_caps keys of the llama.cpp tree this module was built from
#: (jinja::caps::to_map(); 9 keys on the pin, 8 on trees without supports_reasoning_effort)
_CAPS_KEYS = tuple(_core.CAPS_KEYS)


def _server_args(server_args: Sequence[str], handler: str) -> list[str]:
    if isinstance(server_args, (str, bytes)):
        raise TypeError("server_args must be a sequence of strings, e.g. ['--reasoning', 'off']")
    if handler not in _HANDLERS:
        raise ValueError(f"handler must be one of {', '.join(_HANDLERS)}, not {handler!r}")
    args = []
    for a in server_args:
        if not isinstance(a, str):
            raise TypeError(f"server_args items must be str, not {type(a).__name__}")
        if "\x00" in a or any(0xD800 <= ord(c) <= 0xDFFF for c in a):
            raise ValueError(f"server_args item {a!r} is not valid text")
        args.append(a)
    if handler == "pure_content":
        args.append("--skip-chat-parsing")  # llama-server's force-pure-content mode
    return args


def _check_caps(caps: Mapping[str, bool] | None) -> dict[str, bool]:
    if not caps:
        return {}
    if not isinstance(caps, Mapping):
        raise TypeError(f"caps must be a mapping of caps keys to bools, not {type(caps).__name__}")
    unknown = sorted(set(caps) - set(_CAPS_KEYS))
    if unknown:
        raise ValueError(f"unknown caps keys: {', '.join(unknown)} (known: {', '.join(_CAPS_KEYS)})")
    for k, v in caps.items():
        if not isinstance(v, bool):
            raise ValueError(f"caps value for {k} must be a bool, not {type(v).__name__}")
    return dict(caps)


def _before(request: Request, hooks: list[Any]) -> Request:
    if isinstance(request, (str, bytes)):
        try:
            body: Any = json.loads(request)
        except (ValueError, RecursionError):
            return request  # not a JSON object: llama.cpp reports it, as without hooks
        if not isinstance(body, dict):
            return request
    else:
        body = copy.deepcopy(dict(request))
    for hook in hooks:
        before = getattr(hook, "before_request", None)
        if before is not None:
            body = before(body)
            if not isinstance(body, Mapping):
                raise TypeError(f"{type(hook).__name__}.before_request must return the request mapping")
    return body


#: Default wall-time budget (seconds) of one template execution in-process.
DEFAULT_TIMEOUT = 10.0
#: Default size budget (bytes) of one string repetition (``s * n``) in a template.
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024 * 1024


#: Default largest number of tools in one request.
DEFAULT_MAX_TOOLS = 4096


def _limit_int(name: str, value: int | None) -> int:
    """A positive int option for the core; None -> 0 (no limit)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    return min(value, 2**62)  # larger is no limit in practice (and fits the core's size_t)


def _limits(timeout: float | None, max_output_bytes: int | None) -> tuple[float, int]:
    """The core's (seconds, bytes); 0 means no limit."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    return (0.0 if timeout is None else float(timeout)), _limit_int("max_output_bytes", max_output_bytes)


def _call_timeout(timeout: float | None) -> float:
    """A per-call timeout for the core: -1 keeps the template's."""
    if timeout is None:
        return -1.0
    return _limits(timeout, None)[0]


def _body(request: Request) -> bytes:
    if isinstance(request, (str, bytes)):
        # the text goes to llama.cpp as it is (its parser, its messages); _core refuses
        # bodies nested more than 1000 levels deep before parsing them
        return _utf8(request)
    if not isinstance(request, Mapping):
        raise TypeError(f"request must be a mapping or JSON text, not {type(request).__name__}")
    try:
        text = json.dumps(dict(request), ensure_ascii=False, allow_nan=False)
    except ValueError as e:  # NaN/Infinity: not JSON, llama-server could never receive it
        raise RequestError(f"request is not valid JSON: {e}", 400) from None
    except RecursionError:
        raise RequestError("request is nested too deeply", 400) from None
    return _utf8(text)


class ChatTemplate:
    """A chat template as llama-server loads it with ``--jinja --chat-template-file``.

    Every decision is llama.cpp's (the tree the module was built from: :data:`llamaprompt.LLAMA_CPP_COMMIT`):
    the template is parsed by ``common_chat_templates_init``, requests go through the
    server's ``oaicompat_chat_params_parse`` and ``common_chat_templates_apply``.

    Args:
        source: the Jinja template text (str, or UTF-8 bytes as read from a file).
        bos_token: BOS token text (llama-server takes it from the model's vocab).
        eos_token: EOS token text.
        add_bos: the vocab's add_bos flag: when true, one leading ``bos_token`` is
            stripped from rendered prompts (the tokenizer adds it back).
        add_eos: the vocab's add_eos flag: when true, one trailing ``eos_token`` is stripped.
        server_args: llama-server command-line flags, parsed by llama.cpp's own parser
            (``common_params_parse`` for LLAMA_EXAMPLE_SERVER), e.g.
            ``["--reasoning", "off"]``, ``["--chat-template-kwargs", '{"x": 1}']``,
            ``["--no-prefill-assistant"]``, ``["--reasoning-format", "none"]``.
            Flags that load a model, projector or template, or print and exit, are refused.
            ``LLAMA_ARG_*`` environment variables are ignored.
        media_marker: the text image/audio/video parts become (``get_media_marker()``).
        fetch_remote_media: llama-server downloads ``http(s)`` media URLs; llamaprompt
            does not unless this is true (the prompt is the same either way when the
            download succeeds).
        caps: force chat-template caps (keys as :attr:`caps`): they replace what llama.cpp
            detected in the struct its normalizer and caps-driven workarounds read, then the
            unchanged upstream path runs. :attr:`detected_caps` keeps what was detected.
        handler: ``"auto"`` (llama.cpp's own choice, the default), ``"autoparser"`` (skip
            the specialized-template handlers: the differential autoparser path) or
            ``"pure_content"`` (llama-server's ``--skip-chat-parsing`` force-pure-content mode).
        hooks: objects with ``before_request(request)`` and/or ``after_params(params)``
            (see :mod:`llamaprompt.hooks`); they run before the registered ones.
        fast_path: reuse work that does not depend on the messages across requests, where
            llama-server repeats it on every call. (1) llama.cpp's per-template differential
            analysis (``autoparser::analyze_template``, which depends only on the template).
            (2) For :meth:`apply_template` (which needs only the prompt): once a request
            with the same parser inputs (tools, tool_choice, response format, reasoning
            format, chat_template_kwargs, ... -- everything ``generate_parser`` reads except
            the messages) generated its parser and grammar without error, the prompt comes
            from ``common_chat_template_direct_apply`` alone, the first step of
            ``generate_parser``. Outputs and errors are identical (the test suite proves it
            for every reference case; docs/performance.md gives the argument and its two
            theoretical limits); ``False`` runs the unmodified upstream sequence on every
            call.
        timeout: wall-time budget in seconds of the template executions of one call
            (loading included); ``None``: none. llama.cpp's Jinja engine has no limit;
            llamaprompt checks the clock every 64 execution steps and in ``range()``,
            and raises TemplateError when it has passed. Also on by default: a template
            that recurses until half of the thread's stack is used raises TemplateError
            instead of crashing the process. A single huge built-in operation is not
            interruptible: for untrusted templates use :class:`llamaprompt.sandbox.UntrustedTemplate`
            (a worker process with memory and time limits).
        max_output_bytes: the largest value (in bytes, counting llama.cpp's per-part and
            per-element overhead) that one string repetition (``'x' * n``), string
            concatenation (``a ~ b``) or ``range(n)`` in the template may build; ``None``: no
            limit. Exceeding it raises TemplateError.
        max_tools: the most tools a request may list (default 4096; ``None``: no limit); more
            raise RequestError (400). llama.cpp's parser and grammar generation grow faster
            than linearly with the tools (5000 take ~7 s and 1.5 GB; 10^5 exhaust memory),
            and llama-server has no limit.

    Raises:
        TemplateError: the template cannot be parsed (llama-server would not start),
            or rendering the probe request llama-server makes at load time fails.
        ServerArgsError: a ``server_args`` flag is unknown, malformed or not accepted.
        ValueError: an unknown ``caps`` key or ``handler``.

    A ChatTemplate is immutable and safe to share between threads; the GIL is released
    while llama.cpp works.
    """

    def __init__(
        self,
        source: str | bytes,
        *,
        bos_token: str = "",
        eos_token: str = "",
        add_bos: bool = False,
        add_eos: bool = False,
        server_args: Sequence[str] = (),
        media_marker: str = DEFAULT_MEDIA_MARKER,
        fetch_remote_media: bool = False,
        caps: Mapping[str, bool] | None = None,
        handler: str = "auto",
        hooks: Sequence[Any] = (),
        fast_path: bool = True,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES,
        max_tools: int | None = DEFAULT_MAX_TOOLS,
    ) -> None:
        if not isinstance(source, (str, bytes)):
            raise TypeError(f"source must be str or bytes, not {type(source).__name__}")
        for name, value in (("bos_token", bos_token), ("eos_token", eos_token), ("media_marker", media_marker)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        args = _server_args(server_args, handler)
        forced = _check_caps(caps)
        seconds, max_bytes = _limits(timeout, max_output_bytes)
        tools_limit = _limit_int("max_tools", max_tools)
        self._setup(
            source=source,
            gguf_path=None,
            model=None,
            options={
                "bos_token": bos_token,
                "eos_token": eos_token,
                "add_bos": bool(add_bos),
                "add_eos": bool(add_eos),
                "server_args": tuple(server_args),
                "media_marker": media_marker,
                "fetch_remote_media": bool(fetch_remote_media),
                "caps": forced,
                "handler": handler,
                "hooks": tuple(hooks),
                "fast_path": bool(fast_path),
                "timeout": timeout,
                "max_output_bytes": max_output_bytes,
                "max_tools": max_tools,
            },
            core=lambda: _core.Template(
                _utf8(source),
                _utf8(bos_token),
                _utf8(eos_token),
                bool(add_bos),
                bool(add_eos),
                args,
                _utf8(media_marker),
                bool(fetch_remote_media),
                forced,
                handler == "autoparser",
                bool(fast_path),
                seconds,
                max_bytes,
                tools_limit,
            ),
        )

    @property
    def _core_server_args(self) -> list[str]:
        return _server_args(self._options["server_args"], self._options["handler"])

    def _setup(self, *, source, gguf_path, model, options, core) -> None:
        for hook in options["hooks"]:
            check_hook(hook)
        self._input_source = source
        self._gguf_path = gguf_path
        self._model = model
        self._options = options
        self._core = core()

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        *,
        chat_template: str | bytes | None = None,
        server_args: Sequence[str] = (),
        media_marker: str = DEFAULT_MEDIA_MARKER,
        fetch_remote_media: bool = False,
        caps: Mapping[str, bool] | None = None,
        handler: str = "auto",
        hooks: Sequence[Any] = (),
        fast_path: bool = True,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES,
        max_tools: int | None = DEFAULT_MAX_TOOLS,
    ) -> ChatTemplate:
        """Load a model's chat template as ``llama-server -m PATH`` does, with no weights.

        The file is opened by llama.cpp with ``vocab_only`` (``llama_model_load_from_file``;
        no tensor data is read), then ``common_chat_templates_init(model, chat_template)``
        takes the default template, the ``tokenizer.chat_template.tool_use`` variant (chatml
        when the file has neither), the BOS/EOS text and add_bos/add_eos from the vocab.

        Args:
            path: the GGUF file.
            chat_template: a template text that replaces the file's, as
                ``--chat-template-file`` (the file's tokens still apply).
            server_args, media_marker, fetch_remote_media, caps, handler, hooks: as for the
                constructor.

        The result also tokenizes: :meth:`tokenize`, :meth:`detokenize`,
        :meth:`token_to_piece`, :meth:`apply_template_tokens`.

        Raises:
            GGUFError: missing, unreadable, truncated or corrupt file (llama.cpp's message).
            TemplateError: the template in the file (or ``chat_template``) cannot be parsed.
            ServerArgsError: as for the constructor.
        """
        args = _server_args(server_args, handler)
        forced = _check_caps(caps)
        seconds, max_bytes = _limits(timeout, max_output_bytes)
        tools_limit = _limit_int("max_tools", max_tools)
        fspath = _path(path)
        if not isinstance(media_marker, str):
            raise TypeError(f"media_marker must be a str, not {type(media_marker).__name__}")
        override = b"" if chat_template is None else _utf8(chat_template)
        if chat_template is not None and not override:
            raise ValueError("chat_template is empty")
        model = _core.Model(fspath)
        self = cls.__new__(cls)
        self._setup(
            source=chat_template,
            gguf_path=fspath,
            model=model,
            options={
                "server_args": tuple(server_args),
                "media_marker": media_marker,
                "fetch_remote_media": bool(fetch_remote_media),
                "caps": forced,
                "handler": handler,
                "hooks": tuple(hooks),
                "fast_path": bool(fast_path),
                "timeout": timeout,
                "max_output_bytes": max_output_bytes,
                "max_tools": max_tools,
                "add_bos": bool(model.add_bos),
                "add_eos": bool(model.add_eos),
            },
            core=lambda: _core.Template(
                model,
                override,
                args,
                _utf8(media_marker),
                bool(fetch_remote_media),
                forced,
                handler == "autoparser",
                bool(fast_path),
                seconds,
                max_bytes,
                tools_limit,
            ),
        )
        props = self._core.props()
        self._options["bos_token"] = props["bos_token"]
        self._options["eos_token"] = props["eos_token"]
        return self

    @classmethod
    def builtin(cls, name: str, **options: Any) -> ChatTemplate:
        """A built-in (non-Jinja) template by name, as ``llama-server --no-jinja
        --chat-template NAME``: prompts come from ``llama_chat_apply_template`` through
        ``common_chat_templates_apply_legacy``, requests with tools are refused as the server
        refuses them. Names: :func:`builtin_template_names`.

        Takes the constructor's keyword options (``--no-jinja`` is added to server_args).
        Raises TemplateError for a name llama.cpp does not know.
        """
        # llama-server's own check of `--no-jinja --chat-template NAME`, and its message
        refusal = _core.check_chat_template_arg(_utf8(name), False)
        if refusal:
            raise TemplateError(refusal.rstrip("\n"))
        args = [*options.pop("server_args", ()), "--no-jinja"]
        return cls(name, server_args=args, **options)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **options: Any) -> ChatTemplate:
        """Load a template file, as ``llama-server --chat-template-file PATH``.

        Takes the same keyword options as the constructor. Raises ``OSError`` when the
        file cannot be read, and what the constructor raises.
        """
        with open(_path(path), "rb") as f:
            data = f.read()
        return cls(data, **options)

    # -- what GET /props reports --------------------------------------------------------

    @property
    def caps(self) -> dict[str, bool]:
        """``chat_template_caps`` exactly as GET /props reports them
        (``common_chat_templates_get_caps``: the tool_use variant's caps when there is one).
        """
        return dict(self._core.caps())

    @property
    def detected_caps(self) -> dict[str, bool]:
        """The caps llama.cpp detected for this template (``jinja::caps_get``), before any
        ``caps=`` override; equal to :attr:`caps` when nothing is forced."""
        return dict(self._core.detected_caps())

    @property
    def handler(self) -> str:
        """``"auto"`` (llama.cpp's choice), ``"autoparser"`` or ``"pure_content"``."""
        return self._options["handler"]

    @property
    def hooks(self) -> tuple[Any, ...]:
        """This template's own hooks (registered ones are in :func:`registered_hooks`)."""
        return self._options["hooks"]

    @property
    def sha256(self) -> str:
        """sha256 (hex) of :attr:`source`, UTF-8: the key of ``register_hook(match={"sha256": ...})``
        and of the reference fixtures' ``template_sha256``."""
        return template_sha256(self.source)

    def with_caps(self, **caps: bool) -> ChatTemplate:
        """A new ChatTemplate with the same template and options and these caps forced on top
        of this one's (this object is unchanged). Raises ValueError for an unknown caps key."""
        return self._rebuild(caps={**(self._options["caps"] or {}), **caps})

    def _rebuild(self, **changes: Any) -> ChatTemplate:
        opts = {k: v for k, v in self._options.items() if k not in ("add_bos", "add_eos", "bos_token", "eos_token")}
        opts.update(changes)
        if self._gguf_path is not None:
            return type(self).from_gguf(self._gguf_path, chat_template=self._input_source, **opts)
        opts.update({k: self._options[k] for k in ("add_bos", "add_eos", "bos_token", "eos_token")})
        return type(self)(self._input_source, **opts)

    def describe(self) -> dict[str, Any]:
        """What llama.cpp decided for this template, as one dict: ``chat_format`` (for a
        plain request) and ``chat_format_with_tools`` (``common_chat_format_name``),
        ``handler`` asked for, whether a specialized handler or the differential
        ``autoparser`` produced the params (for each), ``caps`` in force and
        ``detected_caps``, ``supports_thinking``, ``thinking_start_tag``/``thinking_end_tags``,
        the template variant requests with tools use (``"tool_use"`` or ``"default"``),
        ``use_jinja`` and ``server_args``, and the llama.cpp tree that decided it
        (``llama_cpp_commit``, ``llama_cpp_source``).

        Raises what :meth:`apply` raises for the probe requests (a user turn; the same
        with one tool) when the template cannot render them; the error text is then kept
        under ``"error"``/``"error_with_tools"`` instead.
        """
        probe = {"messages": [{"role": "user", "content": "test"}]}
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "probe",
                    "description": "probe",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ]
        out: dict[str, Any] = {
            "llama_cpp_commit": _core.LLAMA_CPP_COMMIT,
            "llama_cpp_source": _core.LLAMA_CPP_SOURCE,
            "handler": self.handler,
            "use_jinja": bool(self._core.use_jinja()),
            "server_args": list(self._core_server_args),  # incl. what handler= adds
            "caps": self.caps,
            "detected_caps": self.detected_caps,
            "caps_forced": bool(self._options["caps"]),
            "supports_thinking": self.supports_thinking,
            "template_variant_with_tools": "tool_use" if self.tool_use_source else "default",
        }
        for suffix, body in (("", probe), ("_with_tools", {**probe, "tools": tools})):
            try:
                res = self._core.apply(_body(body))
            except Error as e:
                out["error" + suffix] = e.message
                continue
            chat = res["chat_params"]
            out["chat_format" + suffix] = chat["format"]
            out["autoparser" + suffix] = bool(out["use_jinja"]) and not res["specialized_handler"]
            if not suffix:
                out["thinking_start_tag"] = chat["thinking_start_tag"]
                out["thinking_end_tags"] = chat["thinking_end_tags"]
                out["generation_prompt"] = chat["generation_prompt"]
        return out

    @property
    def source(self) -> str:
        """The template text as GET /props ``chat_template`` returns it: llama.cpp's
        lexer copy after its load-time patches (CRLF -> LF, one trailing newline dropped)."""
        return self._core.source("")

    @property
    def tool_use_source(self) -> str | None:
        """The ``tool_use`` variant's text (GET /props ``chat_template_tool_use``), or None."""
        text = self._core.source("tool_use")
        return text or None

    @property
    def bos_token(self) -> str:
        """The BOS token text given at construction."""
        return self._options["bos_token"]

    @property
    def eos_token(self) -> str:
        """The EOS token text given at construction."""
        return self._options["eos_token"]

    @property
    def add_bos(self) -> bool:
        return self._options["add_bos"]

    @property
    def add_eos(self) -> bool:
        return self._options["add_eos"]

    @property
    def server_args(self) -> tuple[str, ...]:
        return self._options["server_args"]

    @property
    def media_marker(self) -> str:
        return self._options["media_marker"]

    @property
    def supports_thinking(self) -> bool:
        """Whether llama-server enables thinking for this template by default:
        ``enable_reasoning != 0 && common_chat_templates_support_enable_thinking(...)``
        (so ``False`` under ``--reasoning off``)."""
        return bool(self._core.enable_thinking())

    def props(self) -> dict[str, Any]:
        """The chat-template part of GET /props: ``chat_template``,
        ``chat_template_tool_use`` (when present), ``chat_template_caps``, ``bos_token``,
        ``eos_token``, ``media_marker``."""
        return self._core.props()

    # -- requests -----------------------------------------------------------------------

    def apply_template(self, request: Request, *, timeout: float | None = None) -> str:
        """The prompt POST /apply-template returns for this request body.

        Args:
            request: an OpenAI chat request body (``messages``, ``tools``, ``tool_choice``,
                ``chat_template_kwargs``, ``reasoning_effort``, ``add_generation_prompt``,
                ``continue_final_message``, ``response_format`` ...) as a mapping or JSON text.
                Image, audio and video parts become the media marker. Text nested more than
                1000 levels deep is refused (RequestError).
            timeout: this call's time budget in seconds (default: the template's).

        Returns:
            The prompt (str). Bytes that are not valid UTF-8 are kept as surrogate escapes.

        Raises:
            RequestError: llama-server would answer 400.
            TemplateError: llama-server would answer 500 (e.g. the template raised), or the
                template execution exceeded a budget (time, stack, output size).
        """
        hooks = hooks_for(self, self._options["hooks"])
        seconds = _call_timeout(timeout)
        if not hooks:
            return self._core.apply_template(_body(request), seconds)
        if any(hasattr(h, "after_params") for h in hooks):
            return self._apply_hooked(request, hooks, seconds).prompt
        return self._core.apply_template(_body(_before(request, hooks)), seconds)

    def apply_template_many(
        self,
        requests: Iterable[Request],
        *,
        threads: int = 1,
        return_exceptions: bool = False,
        timeout: float | None = None,
    ) -> list[Any]:
        """:meth:`apply_template` for many requests, rendered on ``threads`` C++ threads.

        The requests are serialized first (in this thread); then the GIL is released once
        for the whole batch and the renders run in parallel inside llama.cpp. With hooks,
        the requests go through :meth:`apply_template` on a Python thread pool instead.

        Args:
            requests: request bodies, as for :meth:`apply_template`.
            threads: how many threads render (>= 1).
            return_exceptions: put each failed request's exception (a
                :class:`~llamaprompt.Error`, or the TypeError / ValueError of a request that
                is not a mapping or JSON text) in its place in the list instead of raising
                the first one (the choice ``asyncio.gather`` offers).

        Returns:
            list of prompts (str), in request order (and exceptions, see above).

        Raises:
            ValueError: ``threads`` < 1.
            TypeError: ``requests`` is one request (a mapping or text) instead of several.
            RequestError / TemplateError: the first failed request's error (unless
                ``return_exceptions``).

        ``timeout`` is each request's budget, as for :meth:`apply_template`.
        """
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, not {threads!r}")
        if isinstance(requests, (Mapping, str, bytes)):
            raise TypeError("requests must be an iterable of requests (e.g. a list of dicts), not one request")
        items = list(requests)
        if hooks_for(self, self._options["hooks"]):
            from concurrent.futures import ThreadPoolExecutor

            def one(request: Request) -> Any:
                try:
                    return self.apply_template(request, timeout=timeout)
                except (Error, TypeError, ValueError) as e:
                    return e

            with ThreadPoolExecutor(threads) as pool:
                results = list(pool.map(one, items))
        else:
            bodies: list[Any] = []
            for request in items:
                try:
                    bodies.append(_body(request))
                except (Error, TypeError, ValueError) as e:  # this request's own problem
                    bodies.append(e)
            to_render = [b for b in bodies if isinstance(b, bytes)]
            rendered = iter(self._core.apply_template_many(to_render, threads, _call_timeout(timeout)))
            results = [next(rendered) if isinstance(b, bytes) else b for b in bodies]
        if not return_exceptions:
            for r in results:
                if isinstance(r, Exception):
                    raise r
        return results

    def _apply_hooked(self, request: Request, hooks: list[Any], seconds: float = -1.0) -> ChatParams:
        params = ChatParams._from_core(self._core.apply(_body(_before(request, hooks)), seconds), self)
        for hook in hooks:
            after = getattr(hook, "after_params", None)
            if after is not None:
                params = after(params)
                if not isinstance(params, ChatParams):
                    raise TypeError(f"{type(hook).__name__}.after_params must return the ChatParams")
        return params

    def apply(self, request: Request, *, timeout: float | None = None) -> ChatParams:
        """Everything the same call computes (``common_chat_params``): prompt, chat format,
        grammar, triggers, preserved tokens, stops, generation prompt, thinking tags, parser.

        ``timeout`` as for :meth:`apply_template`. Raises the same errors as
        :meth:`apply_template`.
        """
        hooks = hooks_for(self, self._options["hooks"])
        seconds = _call_timeout(timeout)
        if hooks:
            return self._apply_hooked(request, hooks, seconds)
        return ChatParams._from_core(self._core.apply(_body(request), seconds), self)

    def normalize(
        self, messages: Iterable[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """The ``messages`` value the template receives, for OpenAI-form messages.

        The messages go through llama-server's request handling (media parts become
        media-marker parts), ``common_chat_msgs_parse_oaicompat``, ``to_json_oaicompat`` and
        ``messages_inp_normalizer`` for this template's caps: typed-only templates get
        string content as ``[{"type": "text", ...}]``, string-only templates get content
        parts joined into one string. With ``tools``, the template that requests with tools
        use (the ``tool_use`` variant when present) decides.

        Raises RequestError / TemplateError as :meth:`apply_template` would.
        """
        body: dict[str, Any] = {"messages": list(messages)}
        if tools:
            body["tools"] = list(tools)
        return self._core.normalize(_body(body))

    # -- tokens (GGUF-backed templates) -----------------------------------------------

    @property
    def gguf_path(self) -> str | None:
        """The GGUF file this template was loaded from, or None."""
        return self._gguf_path

    def _vocab(self) -> _core.Model:
        if self._model is None:
            raise TypeError("tokens need a GGUF-backed template: use ChatTemplate.from_gguf(path)")
        return self._model

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocab (``llama_vocab_n_tokens``)."""
        return int(self._vocab().vocab_size)

    @property
    def bos_token_id(self) -> int | None:
        """The BOS token id (``llama_vocab_bos``), or None when the vocab has none."""
        tok = int(self._vocab().bos_token_id)
        return None if tok < 0 else tok

    @property
    def eos_token_id(self) -> int | None:
        """The EOS token id (``llama_vocab_eos``), or None when the vocab has none."""
        tok = int(self._vocab().eos_token_id)
        return None if tok < 0 else tok

    def tokenize(self, text: str | bytes, *, add_special: bool = False, parse_special: bool = True) -> np.ndarray:
        """Token ids for ``text``, as POST /tokenize ``{"content": text, "add_special": ...,
        "parse_special": ...}`` (``tokenize_mixed`` -> ``common_tokenize``).

        Returns a ``numpy.ndarray`` of dtype int32 and shape ``(n,)``.
        Raises TypeError for a template not loaded from a GGUF file.
        """
        return self._vocab().tokenize(_utf8(text, "text"), bool(add_special), bool(parse_special))

    def detokenize(self, tokens: Iterable[int] | np.ndarray) -> str:
        """Text for token ids, as POST /detokenize (``tokens_to_str``).

        Raises ValueError for ids outside ``[0, vocab_size)``.
        """
        arr = np.asarray(tokens)
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise TypeError("tokens must be a 1-D sequence of integers")
        ids = [int(t) for t in arr]
        self._check_ids(ids)
        return self._vocab().detokenize(ids)

    def token_to_piece(self, token: int, *, special: bool = True) -> bytes:
        """The bytes of one token (``common_token_to_piece``; special tokens rendered when
        ``special``). Bytes, because a piece can be part of a UTF-8 character.

        Raises ValueError for an id outside ``[0, vocab_size)``.
        """
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise TypeError(f"token must be an int, not {type(token).__name__}")
        self._check_ids([int(token)])
        return self._vocab().token_to_piece(int(token), bool(special))

    def _check_ids(self, ids: list[int]) -> None:
        n = self.vocab_size
        for t in ids:
            if not 0 <= t < n:
                raise ValueError(f"token id {t} is out of range [0, {n})")

    def apply_template_tokens(self, request: Request) -> np.ndarray:
        """The prompt tokens llama-server feeds the model for this chat request: the
        :meth:`apply_template` prompt tokenized with ``add_special=True, parse_special=True``
        (the server's ``tokenize_input_prompts`` for a text prompt; BOS is added there when
        the vocab's add_bos is set, which is why the rendered prompt had it stripped).

        Media: llama-server tokenizes a prompt with media through its multimodal projector
        (each marker becomes image/audio embeddings); without a projector this returns the
        text tokens, with the media marker tokenized as plain text.

        Returns int32 ndarray of shape ``(n,)``. Raises what :meth:`apply_template` and
        :meth:`tokenize` raise.
        """
        prompt = self.apply_template(request)
        return self.tokenize(prompt, add_special=True, parse_special=True)

    # -- pickling: rebuilt from its source (or GGUF path) and options in the other process

    def __reduce__(self):
        keys = (
            "server_args", "media_marker", "fetch_remote_media", "caps", "handler", "hooks", "fast_path", "timeout",
            "max_output_bytes", "max_tools",
        )
        opts = {k: self._options[k] for k in keys}
        if self._gguf_path is not None:
            return (_from_gguf, (self._gguf_path, self._input_source, opts))
        for k in ("bos_token", "eos_token", "add_bos", "add_eos"):
            opts[k] = self._options[k]
        return (_from_source, (self._input_source, opts))

    def __repr__(self) -> str:
        if self._gguf_path is not None:
            return f"ChatTemplate.from_gguf({self._gguf_path!r}, server_args={list(self.server_args)!r})"
        head = self.source[:40]
        return f"ChatTemplate({head!r}..., server_args={list(self.server_args)!r})"


def _from_source(source: str | bytes, options: dict[str, Any]) -> ChatTemplate:
    return ChatTemplate(source, **options)


def _from_gguf(path: str, chat_template: str | bytes | None, options: dict[str, Any]) -> ChatTemplate:
    return ChatTemplate.from_gguf(path, chat_template=chat_template, **options)
