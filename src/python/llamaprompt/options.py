"""A ChatTemplate's options in one object: defaults, checks, and what the core receives.

:class:`Options` is what every way of making a template shares -- the constructors,
``with_caps``, pickling and the sandbox's worker -- so each option is defined, defaulted and
checked here once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Options",
    "DEFAULT_MEDIA_MARKER",
    "DEFAULT_TIMEOUT",
    "DEFAULT_MAX_OUTPUT_BYTES",
    "DEFAULT_MAX_TOOLS",
    "MEDIA_KINDS",
    "HANDLERS",
]

#: The media marker llamaprompt pins by default (llama-server draws a random one per
#: process unless LLAMA_MEDIA_MARKER is set; the reference fixtures use this one).
DEFAULT_MEDIA_MARKER = "<__media__>"
#: Default wall-time budget (seconds) of one template execution in-process.
DEFAULT_TIMEOUT = 10.0
#: Default size budget (bytes) of one string repetition (``s * n``) in a template.
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024 * 1024
#: Default largest number of tools in one request.
DEFAULT_MAX_TOOLS = 4096
#: The media kinds a projector can accept, as ``media=`` names them.
MEDIA_KINDS = ("image", "audio", "video")
#: ``handler=`` values.
HANDLERS = ("auto", "autoparser", "pure_content")


def _limit_int(name: str, value: int | None) -> int:
    """A positive int option for the core; None -> 0 (no limit)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    return min(value, 2**62)  # larger is no limit in practice (and fits the core's size_t)


def seconds(timeout: float | None) -> float:
    """A timeout for the core: seconds, 0 for none. Raises ValueError unless positive or None."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    return 0.0 if timeout is None else float(timeout)


def call_timeout(timeout: float | None) -> float:
    """A per-call timeout for the core: -1 keeps the template's."""
    return -1.0 if timeout is None else seconds(timeout)


def media_kinds(media: bool | str | Iterable[str] | None) -> tuple[str, ...]:
    """``media=`` as a tuple in MEDIA_KINDS order: True -> all, False -> none, else the names
    (a comma-separated str or an iterable; ``"vision"`` is ``"image"``). Raises TypeError for
    anything else (None included), ValueError for an unknown name."""
    if media is True:
        return MEDIA_KINDS
    if media is False:
        return ()
    if media is None or isinstance(media, (bytes, int, float)):
        raise TypeError(f"media must be True, False or media names (e.g. ('image',)), not {media!r}")
    names = media.split(",") if isinstance(media, str) else list(media)
    out = set()
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"media names must be str, not {type(n).__name__}")
        n = n.strip().lower()
        if not n:
            continue
        n = "image" if n == "vision" else n
        if n not in MEDIA_KINDS:
            raise ValueError(f"unknown media kind {n!r} (known: {', '.join(MEDIA_KINDS)})")
        out.add(n)
    return tuple(k for k in MEDIA_KINDS if k in out)


def _server_args(server_args: Sequence[str]) -> tuple[str, ...]:
    if isinstance(server_args, (str, bytes)):
        raise TypeError("server_args must be a sequence of strings, e.g. ['--reasoning', 'off']")
    args = []
    for a in server_args:
        if not isinstance(a, str):
            raise TypeError(f"server_args items must be str, not {type(a).__name__}")
        if "\x00" in a or any(0xD800 <= ord(c) <= 0xDFFF for c in a):
            raise ValueError(f"server_args item {a!r} is not valid text")
        args.append(a)
    return tuple(args)


def _caps(caps: Mapping[str, bool] | None, known: Sequence[str] | None) -> dict[str, bool]:
    if not caps:
        return {}
    if not isinstance(caps, Mapping):
        raise TypeError(f"caps must be a mapping of caps keys to bools, not {type(caps).__name__}")
    if known is not None:
        unknown = sorted(set(caps) - set(known))
        if unknown:
            raise ValueError(f"unknown caps keys: {', '.join(unknown)} (known: {', '.join(known)})")
    for k, v in caps.items():
        if not isinstance(v, bool):
            raise ValueError(f"caps value for {k} must be a bool, not {type(v).__name__}")
    return dict(caps)


@dataclass(frozen=True)
class Options:
    """The options of a ChatTemplate (see its constructor for what each does), checked and
    normalized: ``server_args``/``hooks``/``media`` as tuples, ``caps`` as a dict.

    Build with :meth:`make` (which checks), change with :meth:`replace`."""

    server_args: tuple[str, ...] = ()
    media_marker: str = DEFAULT_MEDIA_MARKER
    fetch_remote_media: bool = False
    caps: dict[str, bool] = field(default_factory=dict)
    handler: str = "auto"
    hooks: tuple[Any, ...] = ()
    fast_path: bool = True
    timeout: float | None = DEFAULT_TIMEOUT
    max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES
    max_tools: int | None = DEFAULT_MAX_TOOLS
    media: tuple[str, ...] = MEDIA_KINDS
    llama_cpp: str | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def make(cls, caps_keys: Sequence[str] | None = None, **options: Any) -> Options:
        """Check and normalize keyword options (unknown names raise TypeError, as a
        function call would). ``caps_keys``: the core's chat_template_caps keys (None: the
        caps names are checked by the core later). Raises TypeError/ValueError."""
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        o = {**{f.name: f.default for f in dataclasses.fields(cls) if f.name != "caps"}, "caps": None, **options}
        if o["handler"] not in HANDLERS:
            raise ValueError(f"handler must be one of {', '.join(HANDLERS)}, not {o['handler']!r}")
        if not isinstance(o["media_marker"], str):
            raise TypeError(f"media_marker must be a str, not {type(o['media_marker']).__name__}")
        if o["llama_cpp"] is not None and not isinstance(o["llama_cpp"], str):
            raise TypeError(f"llama_cpp must be a str (a version or commit), not {type(o['llama_cpp']).__name__}")
        seconds(o["timeout"])
        _limit_int("max_output_bytes", o["max_output_bytes"])
        _limit_int("max_tools", o["max_tools"])
        return cls(
            server_args=_server_args(o["server_args"]),
            media_marker=o["media_marker"],
            fetch_remote_media=bool(o["fetch_remote_media"]),
            caps=_caps(o["caps"], caps_keys),
            handler=o["handler"],
            hooks=tuple(o["hooks"]),
            fast_path=bool(o["fast_path"]),
            timeout=o["timeout"],
            max_output_bytes=o["max_output_bytes"],
            max_tools=o["max_tools"],
            media=media_kinds(o["media"]),
            llama_cpp=o["llama_cpp"] or None,
        )

    def replace(self, caps_keys: Sequence[str] | None = None, **changes: Any) -> Options:
        """A checked copy with ``changes``."""
        return Options.make(caps_keys, **{**self.kwargs(), **changes})

    def kwargs(self) -> dict[str, Any]:
        """The options as the keyword arguments of ChatTemplate's constructors."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def core_server_args(self) -> list[str]:
        """server_args as the core parses them (``handler="pure_content"`` adds llama-server's
        ``--skip-chat-parsing``)."""
        return [*self.server_args, *(["--skip-chat-parsing"] if self.handler == "pure_content" else [])]

    def core_limits(self) -> tuple[float, int, int]:
        """(timeout seconds, max_output_bytes, max_tools) for the core; 0 means no limit."""
        return (
            seconds(self.timeout),
            _limit_int("max_output_bytes", self.max_output_bytes),
            _limit_int("max_tools", self.max_tools),
        )
