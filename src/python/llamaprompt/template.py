"""ChatTemplate: one chat template, loaded and applied by llama.cpp's own code."""

from __future__ import annotations

import copy
import itertools
import json
import operator
import os
import threading
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

import numpy as np

from . import _core
from .cores import core_module
from .errors import Error, TemplateError
from .hooks import check_hook, hooks_for, template_sha256
from .notices import Notices, logger
from .options import (
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_MAX_TOOLS,
    DEFAULT_MEDIA_MARKER,
    DEFAULT_TIMEOUT,
    MEDIA_KINDS,
    Options,
    call_timeout,
)
from .params import ChatParams
from .text import Request, core_body, fspath, messages_list, request_body, utf8

if TYPE_CHECKING:
    from ._core import Model as _CoreModel
    from ._core import Template as _CoreTemplate

__all__ = ["ChatTemplate", "DEFAULT_MEDIA_MARKER", "MEDIA_KINDS", "PromptTokens", "Request"]


class PromptTokens(NamedTuple):
    """A prompt and its tokens from one render (``apply_template(request, tokens=True)``)."""

    #: the prompt, as POST /apply-template returns it
    prompt: str
    #: int32 ndarray of shape (n,): the prompt as llama-server tokenizes it for the model
    tokens: np.ndarray


def _looks_like_path(source: str) -> str | None:
    """Why ``source`` (a template text given as str) is probably a file path or a built-in
    template's name (and what to call instead), or None. Bytes are taken as a file's contents."""
    text = source.strip()
    if not text or len(text) > 4096 or "\n" in text or "{" in text:
        return None
    from .legacy import builtin_template_names

    if text in builtin_template_names() and text != "chatml":  # llama.cpp itself maps "chatml" to chatml
        return (
            f"{text!r} is the name of a built-in template, not a Jinja template; use "
            f"ChatTemplate.builtin({text!r}) (llama-server --no-jinja --chat-template {text})"
        )
    try:
        if os.path.isdir(text):
            return f"{text!r} is a directory, not a template; use ChatTemplate.from_file(path) to load a file"
        if os.path.isfile(text):
            return f"{text!r} is the path of an existing file, not a template; use ChatTemplate.from_file(path)"
    except (OSError, ValueError):
        return None
    if " " not in text and "://" not in text and text.endswith((".jinja", ".j2", ".gguf", ".json", ".txt")):
        return f"{text!r} looks like a file path (no such file), not a template; use ChatTemplate.from_file(path)"
    return None


#: The chat_template_caps keys of the in-process core's llama.cpp tree
#: (jinja::caps::to_map(); 9 keys on the pin, 8 on trees without supports_reasoning_effort)
_CAPS_KEYS = tuple(_core.CAPS_KEYS)


def _resolve(options: Options | dict[str, Any]) -> tuple[Any, Options]:
    """The core that ``llama_cpp`` names, and the options checked against its caps keys."""
    if isinstance(options, Options):
        lib = core_module(options.llama_cpp)
        return lib, options.replace(lib.CAPS_KEYS)
    lib = core_module(options.get("llama_cpp"))
    return lib, Options.make(lib.CAPS_KEYS, **options)


def _core_options(opts: Options) -> tuple[Any, ...]:
    """The options part of ``_core.Template``'s arguments (after the template and server args)."""
    return (
        utf8(opts.media_marker),
        opts.fetch_remote_media,
        opts.caps,
        opts.handler == "autoparser",
        opts.fast_path,
        *opts.core_limits(),
    )


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
    result: Mapping[str, Any] = body
    return result


def map_on_threads(fn: Callable[[Any], Any], items: list[Any], threads: int, lib: Any = None) -> list[Any]:
    """``[fn(x) for x in items]`` computed on ``threads`` Python threads, in order.

    An exception in the calling thread while it waits (a KeyboardInterrupt) stops the threads:
    the template executions in progress on them in core ``lib`` (a ``_core`` module; None: none)
    stop at their next time check (``stop_renders_on_this_thread``), the items not started are
    dropped, and the exception is raised once the threads have ended. The first exception ``fn``
    raises is raised too (in item order; the items after it are not started, those in progress
    end). Not ``concurrent.futures``: its executor takes locks in ``with`` blocks in the calling
    thread (``submit``, ``shutdown``), and a Ctrl-C inside one left the lock held -- ``shutdown``
    then waited for ever -- or raised "RuntimeError: release unlocked lock". Here the calling
    thread only joins threads (``Thread.join`` is safe against it) and sets flags.
    """
    results: list[Any] = [None] * len(items)
    failed: dict[int, BaseException] = {}
    claim = itertools.count()  # (next() on it is one C call: atomic under the GIL)
    stop = [False]
    interrupted = lib.StopFlag() if lib is not None else None

    def work() -> None:
        if lib is not None:
            lib.stop_renders_on_this_thread(interrupted)
        try:
            while not stop[0]:
                i = next(claim)
                if i >= len(items):
                    return
                try:
                    results[i] = fn(items[i])
                except BaseException as e:  # (raised in the calling thread, below)
                    failed[i] = e
                    stop[0] = True
                    return
        finally:
            if lib is not None:
                lib.stop_renders_on_this_thread(None)

    n = min(threads, len(items))
    workers = [threading.Thread(target=work, name="llamaprompt-batch", daemon=True) for _ in range(n)]
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.join()
    except BaseException:
        stop[0] = True
        if interrupted is not None:
            interrupted.set()
        for w in workers:
            w.join()
        raise
    if failed:
        raise failed[min(failed)]
    return results


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
            download succeeds). ``http://`` only: the module has no OpenSSL, and an
            ``https://`` URL then fails with llama.cpp's "HTTPS is not supported" message.
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
            ``generate_parser`` (a continuation, or ``add_generation_prompt`` off: from
            ``generate_parser``'s renders, stopped before it builds the parser); a specialized
            handler stops at its prompt where the configure-time probe proves it, and the
            handler choice is made once per template. Outputs and errors are identical (the test suite proves it
            for every reference case; docs/performance.md gives the argument and its two
            theoretical limits); ``False`` runs the unmodified upstream sequence on every
            call.
        timeout: wall-time budget in seconds of the template executions of one call
            (loading included) and of its grammar generation for tool and ``response_format``
            JSON schemas; ``None``: none. llama.cpp's Jinja engine has no limit;
            llamaprompt checks the clock every 64 execution steps, in ``range()`` and
            ``slice()``, as ``split()`` and ``rsplit()`` work and at each grammar rule, and
            raises TemplateError when it has passed.
            Also on by default: a template that recurses until half of the thread's stack (at
            most 8 MiB; a thread with less than 1 MiB left has its calls run on one with 8 MiB)
            is used raises TemplateError instead of crashing the process. Other single built-in
            operations are not interruptible: for untrusted templates use
            :class:`llamaprompt.sandbox.UntrustedTemplate` (a worker process with memory and
            time limits).
        max_output_bytes: the largest value (in bytes, counting llama.cpp's per-part and
            per-element overhead) that one string repetition (``'x' * n``), string
            concatenation (``a ~ b``), ``range(n)``, ``slice()``, ``indent()``, ``join``,
            ``replace`` or ``tojson`` in the template may build; ``None``: no limit. Exceeding it
            raises TemplateError.
        max_tools: the most tools a request may list (default 4096; ``None``: no limit); more
            raise RequestError (400). llama.cpp's parser and grammar generation grow faster
            than linearly with the tools (5000 take ~7 s and 1.5 GB; 10^5 exhaust memory),
            and llama-server has no limit.
        media: which media parts requests may carry, as llama-server with a multimodal
            projector (``--mmproj``) that supports them: ``True`` (the default: image, audio
            and video, as the reference recordings' vision+audio projector), ``False`` (a
            text-only server: an image part raises TemplateError 500 "image input is not
            supported - hint: ..."), or names from ``("image", "audio", "video")`` (a list, or
            ``"image,audio"``). :meth:`props` reports them under ``modalities``.
        llama_cpp: which llama.cpp decides: ``None`` (the package's own tree,
            :data:`llamaprompt.LLAMA_CPP_COMMIT`), or an installed core for another tree, by
            llama-cpp-python version (``"0.3.33"``) or llama.cpp commit prefix (see
            :mod:`llamaprompt.cores`; ``llamaprompt cores add 0.3.33`` builds one). Another
            core runs in a worker process; results and errors are that tree's own.

    Raises:
        TemplateError: the template cannot be parsed (llama-server would not start),
            or rendering the probe request llama-server makes at load time fails.
        ServerArgsError: a ``server_args`` flag is unknown, malformed or not accepted.
        ValueError: an unknown ``caps`` key or ``handler``.
        CoreError: ``llama_cpp`` names no installed core.

    A ChatTemplate is immutable and safe to share between threads; the GIL is released
    while llama.cpp works.
    """

    # the built llama.cpp objects (in-process _core, or a worker core's stand-ins) and what
    # the template was built from
    _core: _CoreTemplate
    _model: _CoreModel | None
    _tokens: tuple[str, str, bool, bool]
    _opts: Options
    _gguf_path: str | None

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
        media: bool | str | Iterable[str] = True,
        llama_cpp: str | None = None,
    ) -> None:
        if isinstance(source, os.PathLike):
            raise TypeError("source is the template text; to load a template file use ChatTemplate.from_file(path)")
        if not isinstance(source, (str, bytes)):
            raise TypeError(f"source must be str or bytes, not {type(source).__name__}")
        named = "--no-jinja" in server_args  # builtin(): the source is a built-in template's name
        if isinstance(source, str) and not named and (why := _looks_like_path(source)):
            raise ValueError(f"{why} (source is the template text itself)")
        for name, value in (("bos_token", bos_token), ("eos_token", eos_token)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        given = {k: v for k, v in locals().items() if k in Options.names()}  # the keyword options, once
        self._load_source(source, (bos_token, eos_token, bool(add_bos), bool(add_eos)), given)

    def _load_source(self, source: str | bytes, tokens: tuple[str, str, bool, bool], options: Any) -> None:
        lib, opts = _resolve(options)
        bos, eos, add_bos, add_eos = tokens
        self._setup(
            lib,
            opts,
            source=source,
            gguf_path=None,
            model=None,
            tokens=tokens,
            core=lambda: lib.Template(
                utf8(source),
                utf8(bos),
                utf8(eos),
                add_bos,
                add_eos,
                opts.core_server_args(),
                *_core_options(opts),
            ),
        )

    @property
    def _core_server_args(self) -> list[str]:
        return self._opts.core_server_args()

    def _setup(
        self,
        lib: Any,
        opts: Options,
        *,
        source: str | bytes | None,
        gguf_path: str | None,
        model: _CoreModel | None,
        tokens: tuple[str, str, bool, bool],
        core: Callable[[], _CoreTemplate],
    ) -> None:
        for hook in opts.hooks:
            check_hook(hook)
        self._lib = lib
        self._opts = opts
        self._input_source = source
        self._gguf_path = gguf_path
        self._model = model
        self._tokens = tokens
        self._core = core()
        # a request dict goes to an in-process core as it is (text.core_body); a worker's core
        # (llama_cpp= another tree) gets JSON text: a dict would be pickled, classes and all
        self._body: Callable[[Request], Any] = core_body if isinstance(lib, types.ModuleType) else request_body
        kinds = opts.media
        self._core.set_media("image" in kinds, "audio" in kinds, "video" in kinds)
        self._notices = Notices(gguf_path or "template " + template_sha256(self.source)[:12], self._core.caps())
        # in process (a worker's core cannot call back), and a core that can (benchmarks time
        # another build's module with this package)
        if isinstance(lib, types.ModuleType) and hasattr(self._core, "watch_notices"):
            self._notices.watch(self._core)

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
        media: bool | str | Iterable[str] = True,
        llama_cpp: str | None = None,
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
            server_args, media_marker, fetch_remote_media, caps, handler, hooks, media,
                llama_cpp: as for the constructor.

        The result also tokenizes: :meth:`tokenize`, :meth:`detokenize`,
        :meth:`token_to_piece`, :meth:`apply_template_tokens`.

        Raises:
            GGUFError: missing, unreadable, truncated or corrupt file (llama.cpp's message).
            TemplateError: the template in the file (or ``chat_template``) cannot be parsed.
            ServerArgsError: as for the constructor.
        """
        given = {k: v for k, v in locals().items() if k in Options.names()}  # the keyword options, once
        self = cls.__new__(cls)
        self._load_gguf(fspath(path), chat_template, given)
        return self

    def _load_gguf(self, path: str, chat_template: str | bytes | None, options: Any) -> None:
        lib, opts = _resolve(options)
        override = b"" if chat_template is None else utf8(chat_template, "chat_template")
        if chat_template is not None and not override:
            raise ValueError("chat_template is empty")
        model = lib.Model(path)
        self._setup(
            lib,
            opts,
            source=chat_template,
            gguf_path=path,
            model=model,
            tokens=("", "", bool(model.add_bos), bool(model.add_eos)),
            core=lambda: lib.Template(
                model,
                override,
                opts.core_server_args(),
                *_core_options(opts),
            ),
        )
        props = self._core.props()
        self._tokens = (props["bos_token"], props["eos_token"], self._tokens[2], self._tokens[3])
        if chat_template is None:
            keys = _core.gguf_metadata(path, 0)
            if "tokenizer.chat_template" not in keys and "tokenizer.chat_template.tool_use" not in keys:
                logger.warning(
                    "%s: the GGUF file has no chat template (tokenizer.chat_template); llama.cpp falls back to "
                    "chatml, as llama-server -m does. Pass chat_template= (--chat-template-file) for the model's own.",
                    path,
                )

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
        refusal = core_module(options.get("llama_cpp")).check_chat_template_arg(utf8(name), False)
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
        path = fspath(path)
        self = cls(read_template_file(path, "ChatTemplate"), **options)
        self._notices.name = path
        return self

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
        return self._opts.handler

    @property
    def llama_cpp_commit(self) -> str:
        """The llama.cpp commit whose code renders this template (the ``llama_cpp`` core's)."""
        return str(self._lib.LLAMA_CPP_COMMIT)

    @property
    def llama_cpp_source(self) -> str:
        """Where that core's llama.cpp tree came from, e.g. ``"llama-cpp-python 0.3.35 sdist"``."""
        return str(self._lib.LLAMA_CPP_SOURCE)

    @property
    def hooks(self) -> tuple[Any, ...]:
        """This template's own hooks (registered ones are in :func:`registered_hooks`)."""
        return self._opts.hooks

    @property
    def sha256(self) -> str:
        """sha256 (hex) of :attr:`source`, UTF-8: the key of ``register_hook(match={"sha256": ...})``
        and of the reference fixtures' ``template_sha256``."""
        return template_sha256(self.source)

    def with_caps(self, **caps: bool) -> ChatTemplate:
        """A new ChatTemplate with the same template and options and these caps forced on top
        of this one's (this object is unchanged). Raises ValueError for an unknown caps key."""
        return self._rebuild(caps={**self._opts.caps, **caps})

    def with_server_args(self, *args: str) -> ChatTemplate:
        """This template as a llama-server started with these flags added to :attr:`server_args`
        (e.g. ``t.with_server_args("--no-prefill-assistant")``); this object is unchanged. The
        result is cached on this template (one build per flag list), and is this template
        itself for a single flag it already has. Raises ServerArgsError as the constructor."""
        if len(args) == 1 and args[0] in self._opts.server_args:
            return self
        siblings: dict[tuple[str, ...], ChatTemplate] = self.__dict__.setdefault("_siblings", {})
        made = siblings.get(args)
        if made is None:
            made = siblings[args] = self._rebuild(server_args=[*self._opts.server_args, *args])
        return made

    def _rebuild(self, **changes: Any) -> ChatTemplate:
        return _restore(
            self._input_source, self._gguf_path, self._tokens, self._opts.replace(None, **changes), self._notices.name
        )

    def describe(self) -> dict[str, Any]:
        """What llama.cpp decided for this template, as one dict: ``chat_format`` (for a
        plain request) and ``chat_format_with_tools`` (``common_chat_format_name``),
        ``handler`` asked for, whether a specialized handler or the differential
        ``autoparser`` produced the params (for each), whether apply_template can take its
        prompt-only path (``prompt_only_path``: the autoparser's, or a specialized handler's
        stop point -- then ``specialized_handler`` names the handler), ``caps`` in force and
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
            "llama_cpp_commit": self._lib.LLAMA_CPP_COMMIT,
            "llama_cpp_source": self._lib.LLAMA_CPP_SOURCE,
            "handler": self.handler,
            "use_jinja": bool(self._core.use_jinja()),
            "server_args": list(self._core_server_args),  # incl. what handler= adds
            "caps": self.caps,
            "detected_caps": self.detected_caps,
            "caps_forced": bool(self._opts.caps),
            "supports_thinking": self.supports_thinking,
            "template_variant_with_tools": "tool_use" if self.tool_use_source else "default",
        }
        for suffix, body in (("", probe), ("_with_tools", {**probe, "tools": tools})):
            try:
                res = self._core.apply(request_body(body))
            except Error as e:
                out["error" + suffix] = e.message
                continue
            chat = res["chat_params"]
            out["chat_format" + suffix] = chat["format"]
            out["autoparser" + suffix] = bool(out["use_jinja"]) and not res["specialized_handler"]
            # apply_template's prompt-only path: the autoparser's, or a handler's stop point
            out["prompt_only_path" + suffix] = bool(out["use_jinja"]) and (
                not res["specialized_handler"] or res.get("prompt_stop_point") is not None
            )
            if res.get("prompt_stop_point"):
                out["specialized_handler" + suffix] = res["prompt_stop_point"]
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
        return self._tokens[0]

    @property
    def eos_token(self) -> str:
        """The EOS token text given at construction."""
        return self._tokens[1]

    @property
    def add_bos(self) -> bool:
        return self._tokens[2]

    @property
    def add_eos(self) -> bool:
        return self._tokens[3]

    @property
    def server_args(self) -> tuple[str, ...]:
        return self._opts.server_args

    @property
    def media_marker(self) -> str:
        return self._opts.media_marker

    @property
    def media(self) -> tuple[str, ...]:
        """The media kinds requests may carry (``media=``): a subset of ``("image", "audio", "video")``."""
        return self._opts.media

    @property
    def supports_thinking(self) -> bool:
        """Whether llama-server enables thinking for this template by default:
        ``enable_reasoning != 0 && common_chat_templates_support_enable_thinking(...)``
        (so ``False`` under ``--reasoning off``)."""
        return bool(self._core.enable_thinking())

    def props(self) -> dict[str, Any]:
        """The chat-template part of GET /props: ``chat_template``,
        ``chat_template_tool_use`` (when present), ``chat_template_caps``, ``bos_token``,
        ``eos_token``, ``media_marker`` and ``modalities`` (``{"vision", "video", "audio"}``:
        bools, as ``media=`` set them)."""
        return self._core.props()

    # -- requests -----------------------------------------------------------------------

    @overload
    def apply_template(
        self, request: Request, *, tokens: Literal[False] = False, timeout: float | None = None
    ) -> str: ...

    @overload
    def apply_template(
        self, request: Request, *, tokens: Literal[True], timeout: float | None = None
    ) -> PromptTokens: ...

    def apply_template(self, request: Request, *, tokens: bool = False, timeout: float | None = None) -> Any:
        """The prompt POST /apply-template returns for this request body.

        Args:
            request: an OpenAI chat request body (``messages``, ``tools``, ``tool_choice``,
                ``chat_template_kwargs``, ``reasoning_effort``, ``add_generation_prompt``,
                ``continue_final_message``, ``response_format`` ...) as a mapping or JSON text.
                Image, audio and video parts become the media marker. Text nested more than
                1000 levels deep, or with a JSON object of more than 10,000 members (or
                objects whose key lookups add up to more than two such objects'), is
                refused (RequestError).
            tokens: also return the prompt's tokens, from the same render: a
                :class:`PromptTokens` ``(prompt, tokens)``, tokens as :meth:`apply_template_tokens`
                gives them (GGUF-backed templates only).
            timeout: this call's time budget in seconds; ``None`` (the default): the
                template's; ``float("inf")``: none for this call.

        Returns:
            The prompt (str). Bytes that are not valid UTF-8 are kept as surrogate escapes.
            With ``tokens=True``: ``PromptTokens(prompt, tokens)``, tokens an int32 ndarray of shape (n,).

        Raises:
            RequestError: llama-server would answer 400, or a request mapping holds what no JSON
                text can (NaN, bytes, a set, a key that is no string: llama-server never sees it).
            TemplateError: llama-server would answer 500 (e.g. the template raised), or the
                template execution exceeded a budget (time, stack, output size).
            TypeError: ``tokens=True`` for a template not loaded from a GGUF file.
            KeyboardInterrupt: Ctrl-C during a render, called from the main thread with Python's
                default SIGINT handler: the render stops at the engine's next time check (from
                1 ms into the call, SIGINT goes through a handler of the core that notes it, then
                calls Python's; the disposition is put back when the call returns).

        A top-level template variable such as ``enable_thinking`` (llama-server reads it only
        in ``chat_template_kwargs``) and tools sent to a template that renders none are logged
        once per template as warnings on the ``llamaprompt`` logger (:mod:`llamaprompt.notices`).
        """
        if tokens:
            self._vocab()  # before rendering: the TypeError, not a wasted render
        hooks = hooks_for(self, self._opts.hooks)
        if hooks or not self._notices.watching:  # (else the core looks at the body it parses)
            self._notices.check(request)
        seconds = call_timeout(timeout)
        if not hooks:
            prompt = self._core.apply_template(self._body(request), seconds, encode=request_body)
        elif any(hasattr(h, "after_params") for h in hooks):
            prompt = self._apply_hooked(request, hooks, seconds).prompt
        else:  # (the notices were for the caller's request, not the hooks' body)
            body = self._body(_before(request, hooks))
            prompt = self._core.apply_template(body, seconds, notices=False, encode=request_body)
        if tokens:
            return PromptTokens(prompt, self.tokenize(prompt, add_special=True, parse_special=True))
        return prompt

    def apply_template_many(
        self,
        requests: Iterable[Request],
        *,
        threads: int = 1,
        return_exceptions: bool = False,
        timeout: float | None = None,
    ) -> list[Any]:
        """:meth:`apply_template` for many requests, rendered on ``threads`` C++ threads.

        The requests are read in this thread, GIL held (a dict becomes llama.cpp's JSON tree,
        or its JSON text: README, "Requests"), and the renders run in parallel inside
        llama.cpp on ``threads - 1`` C++ threads that are kept between calls (warm for the
        next batch; each leaves after 10 s without work) -- starting on the first requests
        while this thread still reads the later ones -- and on the calling thread, which then
        releases the GIL for the rest of the batch, taking it back every 0.1 s only to run
        Python's signal handlers: a KeyboardInterrupt (or a handler's exception) while the
        requests are read or rendered stops the batch -- the threads stop the renders they are
        in (at the engine's next time check, as :meth:`apply_template` on Ctrl-C) and start no
        other -- and reaches the caller (called from
        the main thread: Python runs signal handlers there only; a handler's ``Exception``
        raised inside Python's encoding of one request is that request's error). At most max(8, 4 x the CPU count)
        threads render (a render waits for nothing: more would only take memory). With hooks,
        the requests go through :meth:`apply_template` on ``threads`` Python threads instead;
        an interruption stops their renders in progress too, but waits for a hook that is running
        (Python code on another thread cannot be interrupted).

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
            TypeError: ``threads`` is not an integer (``operator.index``: numpy integers are;
                a bool or 2.0 is not), or ``requests`` is
                one request (a mapping or text) instead of several.
            RequestError / TemplateError: the first failed request's error (unless
                ``return_exceptions``).

        ``timeout`` is each request's budget, as for :meth:`apply_template`.
        """
        try:  # an integer type of its own (numpy.int64) as its int; a Boolean is no count
            if isinstance(threads, (bool, np.bool_)):
                raise TypeError
            threads = operator.index(threads)
        except TypeError:
            raise TypeError(f"threads must be an int, not {type(threads).__name__}") from None
        if threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads!r}")
        if isinstance(requests, (Mapping, str, bytes)):
            raise TypeError("requests must be an iterable of requests (e.g. a list of dicts), not one request")
        items = list(requests)
        if not self._notices.watching:  # (else the core looks at the bodies it parses)
            for request in items:
                self._notices.check(request)
        if hooks_for(self, self._opts.hooks):

            def one(request: Request) -> Any:
                try:
                    return self.apply_template(request, timeout=timeout)
                except (Error, TypeError, ValueError) as e:
                    return e

            results = map_on_threads(one, items, threads, self._lib)
        else:
            bodies: list[Any] = []
            for request in items:
                try:
                    bodies.append(self._body(request))
                except (Error, TypeError, ValueError) as e:  # this request's own problem
                    bodies.append(e)
            to_render = [b for b in bodies if not isinstance(b, Exception)]
            n = min(threads, max(1, len(to_render)))  # more threads than requests would wait idle
            rendered = iter(self._core.apply_template_many(to_render, n, call_timeout(timeout), encode=request_body))
            results = [b if isinstance(b, Exception) else next(rendered) for b in bodies]
        if not return_exceptions:
            for r in results:
                if isinstance(r, Exception):
                    raise r
        return results

    def _apply_hooked(self, request: Request, hooks: list[Any], seconds: float = -1.0) -> ChatParams:
        body = self._body(_before(request, hooks))
        params = ChatParams._from_core(self._core.apply(body, seconds, encode=request_body), self)
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
        self._notices.check(request)
        hooks = hooks_for(self, self._opts.hooks)
        seconds = call_timeout(timeout)
        if hooks:
            return self._apply_hooked(request, hooks, seconds)
        return ChatParams._from_core(self._core.apply(self._body(request), seconds, encode=request_body), self)

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

        Raises RequestError / TemplateError as :meth:`apply_template` would, TypeError when
        ``messages`` is a string, bytes-like or a mapping (a request: use :meth:`apply`).
        """
        body: dict[str, Any] = {"messages": messages_list(messages)}
        if tools:
            body["tools"] = list(tools)
        return self._core.normalize(request_body(body))

    def template_inputs(self, request: Request, *, timeout: float | None = None) -> dict[str, Any]:
        """What llama.cpp hands its Jinja engine for this request: the context of every render
        of the template, captured from ``common_chat_template_direct_apply_impl`` at its
        ``jinja::global_from_json(ctx, inp, ...)`` call (never reconstructed), during the same
        call as :meth:`apply`.

        A context holds ``messages`` after normalization, llama.cpp's workarounds and the
        specialized handler's rewrites, ``bos_token``, ``eos_token``, ``enable_thinking``,
        ``tools`` (when any), the extra context (``chat_template_kwargs``, server defaults such
        as ``preserve_reasoning``) and ``add_generation_prompt`` (only when true). Templates may
        also call llama.cpp's built-ins (``strftime_now``: today's date; ``raise_exception``).

        Returns:
            ``{"prompt": str, "renders": [...], "prompt_render": int | None, "prompt_match":
            "exact" | "prefix" | None, "context": dict | None}``: each render is ``{"context":
            dict, "variant": "default" | "tool_use", "mark_input": bool, "output": str}`` (the
            output before BOS/EOS stripping), in the order llama.cpp made them (a handler may
            render several times: the generation prompt is the difference of two renders).
            ``prompt_render`` is the index of the render the prompt comes from (the first that
            matches) and ``prompt_match`` how: ``"exact"`` when the prompt is its output (after
            llama.cpp's BOS/EOS stripping), ``"prefix"`` when the prompt continues it
            (``continue_final_message``, assistant prefill); both None when no render is the
            prompt (a handler that rewrites the text after rendering it; none of the pinned
            templates does on the pinned tree). ``context`` is that render's context.

        Raises what :meth:`apply` raises; FeatureError on a tree without the capture point;
        TemplateError for a built-in (non-Jinja) template.
        """
        from .tree import require

        require("template_inputs", "ChatTemplate.template_inputs", self._lib)
        if not self._core.use_jinja():
            raise TemplateError("template_inputs needs a Jinja template (this one is built-in)")
        hooks = hooks_for(self, self._opts.hooks)
        body = request_body(_before(request, hooks) if hooks else request)
        out = dict(self._core.template_inputs(body, call_timeout(timeout)))
        index, match = _prompt_render(out["renders"], out["prompt"], self._tokens)
        out["prompt_render"] = index
        out["prompt_match"] = match
        out["context"] = None if index is None else out["renders"][index]["context"]
        return out

    def render_inputs(
        self,
        context: Mapping[str, Any],
        *,
        variant: str | None = None,
        mark_input: bool = True,
        timeout: float | None = None,
    ) -> str:
        """llama.cpp's Jinja engine on a given context (``common_chat_template_direct_apply_impl``
        with the context as its overrides): no normalization, no workarounds, no handler, no
        BOS/EOS stripping -- for "is it my engine or my preprocessing?": feed it a
        :meth:`template_inputs` context, or your own renderer's.

        Args:
            context: the template's variables (``messages``, ``tools``, ``bos_token`` ...).
            variant: ``"default"`` or ``"tool_use"`` (default: ``"tool_use"`` when the context has
                tools and the template has that variant, as llama.cpp picks it).
            mark_input: llama.cpp's input marking of context strings (as captured).
            timeout: as for :meth:`apply_template`.

        Returns the rendered text (str). Raises TemplateError for what the template raises,
        TypeError for a context that is not a mapping, ValueError for an unknown variant or
        ``"tool_use"`` on a template without that variant, FeatureError on a tree without it.
        """
        from .tree import require

        require("template_inputs", "ChatTemplate.render_inputs", self._lib)
        if not isinstance(context, Mapping):
            raise TypeError(f"context must be a mapping, not {type(context).__name__}")
        if variant is None:
            variant = "tool_use" if context.get("tools") and self.tool_use_source else "default"
        if variant not in ("default", "tool_use"):
            raise ValueError(f"variant must be 'default' or 'tool_use', not {variant!r}")
        if variant == "tool_use" and not self.tool_use_source:
            raise ValueError("this template has no tool_use variant")
        return self._core.render_inputs(request_body(context), variant, bool(mark_input), call_timeout(timeout))

    # -- tokens (GGUF-backed templates) -----------------------------------------------

    @property
    def gguf_path(self) -> str | None:
        """The GGUF file this template was loaded from, or None."""
        return self._gguf_path

    def _vocab(self) -> _CoreModel:
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
        return self._vocab().tokenize(utf8(text, "text"), bool(add_special), bool(parse_special))

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
        :meth:`tokenize` raise. ``apply_template(request, tokens=True)`` gives prompt and
        tokens from one render.
        """
        return self.apply_template(request, tokens=True).tokens

    # -- pickling: rebuilt from its source (or GGUF path) and options in the other process

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (self._input_source, self._gguf_path, self._tokens, self._opts, self._notices.name))

    def __repr__(self) -> str:
        core = f", llama_cpp={self._opts.llama_cpp!r}" if self._lib is not _core else ""
        if self._gguf_path is not None:
            return f"ChatTemplate.from_gguf({self._gguf_path!r}, server_args={list(self.server_args)!r}{core})"
        head = self.source[:40]
        return f"ChatTemplate({head!r}..., server_args={list(self.server_args)!r}{core})"


def _prompt_render(
    renders: list[dict[str, Any]], prompt: str, tokens: tuple[str, str, bool, bool]
) -> tuple[int | None, str | None]:
    """Which render the prompt is: the first whose output, after llama.cpp's BOS/EOS stripping
    (``add_bos``/``add_eos``), is the prompt ("exact"), else the first the prompt starts with
    ("prefix"). The first: the prompt's render comes before the two renders of the generation
    prompt, whose outputs can be the same text (an empty generation prompt)."""
    bos, eos, add_bos, add_eos = tokens
    prefix: int | None = None
    for i, render in enumerate(renders):
        out = render.get("output")
        if out is None:
            continue
        if add_bos and bos and out.startswith(bos):
            out = out[len(bos) :]
        if add_eos and eos and out.endswith(eos):
            out = out[: -len(eos)]
        if out == prompt:
            return i, "exact"
        if prefix is None and out and prompt.startswith(out):
            prefix = i
    return (prefix, "prefix") if prefix is not None else (None, None)


def read_template_file(path: str, owner: str) -> bytes:
    """A template file's bytes (from_file). Raises OSError when it cannot be read, ValueError for a
    GGUF model file (``owner``: the class whose from_gguf to use instead)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] == b"GGUF":
        raise ValueError(f"{path} is a GGUF model file: use {owner}.from_gguf(path)")
    return data


def _restore(
    source: str | bytes | None,
    gguf_path: str | None,
    tokens: tuple[str, str, bool, bool],
    opts: Options,
    name: str | None = None,
) -> ChatTemplate:
    """A ChatTemplate from its parts (pickling, with_caps, the sandbox's worker); ``name``: what
    its notices call it once loaded (from_file's path), None: the default."""
    self = ChatTemplate.__new__(ChatTemplate)
    if gguf_path is not None:
        self._load_gguf(gguf_path, source, opts)
    else:
        assert source is not None
        self._load_source(source, tokens, opts)
    if name is not None:
        self._notices.name = name
    return self
