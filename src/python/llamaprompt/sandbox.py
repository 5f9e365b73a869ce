"""Untrusted templates: llama.cpp's chat code in a worker process with budgets.

llama.cpp's Jinja runtime has no step, recursion or memory limit, and a running C++ call
cannot be interrupted: a template from the internet can loop for hours, allocate until the
machine swaps, or recurse until the stack overflows (a segfault). :class:`UntrustedTemplate`
runs every template execution -- the load-time probe included -- in a separate process:

- wall time: a call that exceeds ``timeout`` seconds kills the worker and raises
  :class:`TemplateError`; the next call starts a fresh worker;
- memory: the worker's address space is limited (``max_memory_bytes``), so a runaway
  allocation fails inside llama.cpp (``std::bad_alloc``, raised as llama.cpp reports it)
  instead of exhausting the machine;
- output: a prompt larger than ``max_output_bytes`` raises TemplateError;
- a crash (segfault, abort) of the worker raises TemplateError naming the signal.

The calling process never executes the template. Results are exactly ChatTemplate's (the
worker is a ChatTemplate); the cost is one process (~50 MiB) and an IPC round trip per call
(see benchmarks/sandbox.py). What the worker logs -- :mod:`llamaprompt.notices`' warnings on
``llamaprompt``, llama.cpp's lines on ``llamaprompt.llama_cpp`` -- at the levels the calling
process's loggers have enabled goes back with each answer and is logged here, before the
call returns or raises (a new worker after a crash warns again what the old one had).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import numbers
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import _core
from .errors import Error, GGUFError, RequestError, ServerArgsError, TemplateError
from .notices import UNRAISABLE_CONTEXT
from .options import DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_TIMEOUT, Options
from .params import ChatParams
from .template import read_template_file
from .text import fspath, messages_list, request_body

__all__ = ["UntrustedTemplate", "DEFAULT_TIMEOUT", "DEFAULT_MAX_OUTPUT_BYTES", "DEFAULT_MAX_MEMORY_BYTES"]

DEFAULT_MAX_MEMORY_BYTES = 4 * 1024 * 1024 * 1024
#: the least max_memory_bytes a worker can start and parse with
MIN_MEMORY_BYTES = 512 * 1024 * 1024

_ERRORS = {c.__name__: c for c in (Error, RequestError, TemplateError, ServerArgsError, GGUFError)}

# the loggers whose records the worker sends back: the notices' and llama.cpp's (its child)
_LOGGERS = ("llamaprompt", "llamaprompt.llama_cpp")


def _levels() -> tuple[int, ...]:
    """The calling process's effective levels of _LOGGERS (the worker logs no less than these)."""
    return tuple(logging.getLogger(name).getEffectiveLevel() for name in _LOGGERS)


# a worker's log record as it travels: logger name, level, message, and where it was logged
# (pathname, line, function: in the worker, the same code as in-process)
_Record = tuple[str, int, str, str, int, str]


class _Records(logging.Handler):
    """A worker's handler on the ``llamaprompt`` logger (this module's, and another core's in
    llamaprompt.remote): each record (a :data:`_Record`), sent back with the answer to the call
    that logged it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[_Record] = []
        top = logging.getLogger(_LOGGERS[0])
        top.addHandler(self)
        top.propagate = False  # (the worker's stderr is the parent's: nothing printed twice)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(
                (record.name, record.levelno, record.getMessage(), record.pathname, record.lineno, record.funcName)
            )
        except Exception:  # noqa: BLE001 - a record that cannot be formatted (logging's own way)
            self.handleError(record)

    def take(self, levels: tuple[int, ...]) -> list[_Record]:
        """The records so far (cleared); ``levels`` set for the next call's."""
        out, self.records = self.records, []
        for name, level in zip(_LOGGERS, levels):
            log = logging.getLogger(name)
            if log.level != level:  # (setLevel clears every logger's cache)
                log.setLevel(level)
        return out


def _relay(records: list[_Record]) -> None:
    """Log the worker's records on this process's loggers of the same names, where enabled, with
    the worker's origin (file, line, function: as ChatTemplate's records have them). A failing
    handler of a notice is reported as unraisable (as ChatTemplate's notices are); one of
    llama.cpp's lines raises (as ChatTemplate's log does)."""
    for name, level, message, pathname, lineno, func in records:
        log = logging.getLogger(name)
        if not log.isEnabledFor(level):
            continue
        # the text as msg, no args (never %-formatted), as ChatTemplate's llama.cpp lines come
        record = log.makeRecord(name, level, pathname, lineno, message, (), None, func)
        if name != _LOGGERS[0]:
            log.handle(record)
            continue
        try:
            log.handle(record)
        except Exception as e:  # noqa: BLE001
            _core.write_unraisable(e, UNRAISABLE_CONTEXT)


def _source_parts(source: str | bytes, options: dict[str, Any]) -> tuple[Any, ...]:
    """(source, gguf_path, tokens) for a template given as text, the token options taken out of
    ``options``. Raises TypeError for a source that is no text (as ChatTemplate does, before a
    worker is started)."""
    if isinstance(source, os.PathLike):
        raise TypeError("source is the template text; to load a template file use UntrustedTemplate.from_file(path)")
    if not isinstance(source, (str, bytes)):
        raise TypeError(f"source must be str or bytes, not {type(source).__name__}")
    tokens = tuple(
        options.pop(k, d) for k, d in (("bos_token", ""), ("eos_token", ""), ("add_bos", False), ("add_eos", False))
    )
    return (source, None, tokens)


def _worker_main(
    conn, build: tuple, max_memory_bytes: int | None, max_output_bytes: int, levels: tuple[int, ...]
) -> None:
    """The worker: builds the ChatTemplate, then answers (method, args, levels) requests; each
    answer ends with the records logged meanwhile."""
    with contextlib.suppress(ValueError):  # the parent decides when we stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if max_memory_bytes:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
        except (ImportError, ValueError, OSError):
            pass
    from .template import _restore

    logs = _Records()
    logs.take(levels)

    def reply_error(e: BaseException) -> None:
        if isinstance(e, Error):
            conn.send(("error", type(e).__name__, e.message, e.status, logs.take(levels)))
        elif isinstance(e, MemoryError):
            conn.send(("error", "TemplateError", "out of memory (the sandbox's memory budget)", 500, logs.take(levels)))
        else:
            conn.send(("error", type(e).__name__, str(e), None, logs.take(levels)))

    try:
        template = _restore(*build)  # (source, gguf_path, tokens, Options, name): the parent's template
        info = {
            "caps": template.caps,
            "detected_caps": template.detected_caps,
            "props": template.props(),
            "supports_thinking": template.supports_thinking,
            "source": template.source,
            "tool_use_source": template.tool_use_source,
        }
        conn.send(("ok", info, logs.take(levels)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        reply_error(e)
        return
    while True:
        try:
            method, payload, levels = conn.recv()
            logs.take(levels)  # (nothing logged between calls)
        except EOFError:
            return
        try:
            if method == "apply_template":
                out: Any = template.apply_template(payload)
                if len(out.encode("utf-8", "surrogateescape")) > max_output_bytes:
                    raise TemplateError(
                        f"the prompt exceeds the sandbox's output budget ({max_output_bytes} bytes)", 500
                    )
            elif method == "apply":
                p = template.apply(payload)
                if len(p.prompt.encode("utf-8", "surrogateescape")) > max_output_bytes:
                    raise TemplateError(
                        f"the prompt exceeds the sandbox's output budget ({max_output_bytes} bytes)", 500
                    )
                out = {k: v for k, v in vars(p).items() if k != "_origin"}
            elif method == "normalize":
                messages, tools = payload
                out = template.normalize(messages, tools=tools)
            else:
                raise ValueError(f"unknown method {method}")
            conn.send(("ok", out, logs.take(levels)))
        except BaseException as e:  # noqa: BLE001
            reply_error(e)


class _PipeConnection:
    """Length-prefixed pickles over a pair of pipes (the worker's stdin/stdout), on raw file
    descriptors so that poll() never blocks on a buffered read."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self._files = (reader, writer)
        self._r, self._w = reader.fileno(), writer.fileno()
        self._buf = bytearray()
        self._closed = False
        self._pending = False  # a message was sent whose answer was not read in full

    @property
    def in_sync(self) -> bool:
        """False when a call was interrupted (KeyboardInterrupt, a signal handler's exception)
        between sending and reading its whole answer: the next answer read would be that one's."""
        return self._closed or not self._pending  # closed: every call fails as such

    def _check_open(self) -> None:
        # after close() the descriptor numbers may already belong to other files (a new worker's
        # pipes): never read or write them again
        if self._closed:
            raise OSError("the connection to the worker is closed")

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(struct.pack("<Q", len(data)) + data)
        self._check_open()
        self._pending = True
        while view:
            self._check_open()
            n = os.write(self._w, view)
            view = view[n:]

    def _fill(self, n: int) -> None:
        # a bytearray grows in place (amortized): a large answer arrives in pipe-sized chunks,
        # and `bytes += chunk` copied everything read so far for each one (quadratic)
        while len(self._buf) < n:
            self._check_open()
            chunk = os.read(self._r, min(max(n - len(self._buf), 1 << 16), 1 << 20))
            if not chunk:
                raise EOFError("worker closed the pipe")
            self._buf += chunk

    def recv(self) -> Any:
        self._fill(8)
        (n,) = struct.unpack_from("<Q", self._buf)
        self._fill(8 + n)
        # consumed before `_pending` is cleared: an exception from a signal handler anywhere here
        # leaves either the whole answer in the buffer or the call counted as interrupted (never
        # an answer read as the next call's)
        data = self._buf[8 : 8 + n]  # a copy (one pass over the answer)
        del self._buf[: 8 + n]
        self._pending = False
        return pickle.loads(data)

    def poll(self, timeout: float) -> bool:
        if self._buf:
            return True
        # select takes at most a time_t's worth of seconds: a longer budget waits in steps
        deadline = time.monotonic() + timeout
        while True:
            self._check_open()
            ready, _, _ = select.select([self._r], [], [], max(0.0, min(deadline - time.monotonic(), 86400.0)))
            if ready:
                return True
            if time.monotonic() >= deadline:
                return False

    def close(self) -> None:
        self._closed = True
        for f in self._files:
            with contextlib.suppress(OSError, ValueError):
                f.close()


def _worker_entry() -> None:
    """``python -m llamaprompt.sandbox``: a worker talking over its stdin/stdout."""
    conn = _PipeConnection(sys.stdin.buffer, sys.stdout.buffer)
    sys.stdout = sys.stderr  # anything printed must not corrupt the channel
    try:
        build, max_memory, max_output, levels = conn.recv()
    except Exception as e:  # noqa: BLE001 - e.g. a hook class that cannot be imported here
        conn.send(("error", "TemplateError", f"the sandbox worker cannot rebuild the template: {e}", None, []))
        return
    _worker_main(conn, build, max_memory, max_output, levels)


# the objects whose workers are stopped at interpreter exit (_stop_workers)
_LIVE: weakref.WeakSet[UntrustedTemplate] = weakref.WeakSet()


def _stop_workers() -> None:
    """At interpreter exit: kill every worker of this process. A daemon thread's call may still be
    waiting for one (its answer would never be read: the template ran on, an orphan, for as long
    as its work took -- an hour, with an hour's budget). No lock is taken: that
    thread may hold it."""
    for template in list(_LIVE):
        proc = template._proc
        if proc is not None and template._pid == os.getpid():
            with contextlib.suppress(OSError):
                proc.kill()


atexit.register(_stop_workers)


def _is_number(value: object, kind: type) -> bool:
    """``value`` is a number of ``kind`` (numbers.Real, numbers.Integral: numpy's too), not a bool."""
    return isinstance(value, kind) and not isinstance(value, bool)


class UntrustedTemplate:
    """A chat template run in a worker process with wall-time, memory and output budgets.

    Construct like :class:`~llamaprompt.ChatTemplate` (``UntrustedTemplate(source, **opts)``,
    ``UntrustedTemplate.from_file(path, ...)``, ``UntrustedTemplate.from_gguf(path, ...)``)
    plus the budgets:

    Args:
        timeout: seconds one call (and the initial load) may take (default 10).
        max_output_bytes: largest prompt accepted (default 64 MiB).
        max_memory_bytes: the worker's address-space limit (default 4 GiB; at least 512 MiB;
            None: no limit).

    ``caps``, ``detected_caps``, ``props()``, ``source``, ``tool_use_source``,
    ``supports_thinking``, ``apply_template()``, ``apply()`` and ``normalize()`` behave as
    ChatTemplate's, and log as it does (the worker's records are logged here when its answer
    arrives, on the loggers of the same names, at the levels enabled here). The ChatParams
    from ``apply()`` carry no parser binding (parse them with a trusted ChatTemplate). Raises
    TemplateError when a budget is exceeded or the worker crashes; the object stays usable (a
    new worker is started on the next call). Calls from several threads are serialized. Workers
    are stopped at interpreter exit (a daemon thread's call in progress included).
    """

    def __init__(
        self,
        source: str | bytes,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES,
        **options: Any,
    ) -> None:
        self._init(_source_parts(source, options), options, timeout, max_output_bytes, max_memory_bytes)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES,
        **options: Any,
    ) -> UntrustedTemplate:
        """As ChatTemplate.from_file: the file is read here, the template runs in the worker, and
        its notices name the file. Raises OSError when the file cannot be read, ValueError for a
        GGUF file (use :meth:`from_gguf`), and what the constructor raises."""
        path = fspath(path)
        data = read_template_file(path, "UntrustedTemplate")
        self = cls.__new__(cls)
        self._init(_source_parts(data, options), options, timeout, max_output_bytes, max_memory_bytes, name=path)
        return self

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES,
        **options: Any,
    ) -> UntrustedTemplate:
        """As ChatTemplate.from_gguf, with the file opened and its template run in the worker."""
        self = cls.__new__(cls)
        chat_template = options.pop("chat_template", None)
        self._init(
            (chat_template, fspath(path), ("", "", False, False)), options, timeout, max_output_bytes, max_memory_bytes
        )
        return self

    def _init(
        self,
        parts: tuple,
        options: dict[str, Any],
        timeout: float,
        max_output_bytes: int,
        max_memory_bytes: int | None,
        name: str | None = None,
    ) -> None:
        # budgets the worker is killed or refused past: finite, and of their types
        if not _is_number(timeout, numbers.Real) or not 0 < float(timeout) < math.inf:
            raise ValueError(
                f"timeout must be a finite number of seconds > 0 (the worker is killed past it), not {timeout!r}"
            )
        if not _is_number(max_output_bytes, numbers.Integral) or int(max_output_bytes) <= 0:
            raise ValueError(
                f"max_output_bytes must be a positive int (the sandbox's output budget), not {max_output_bytes!r}"
            )
        if max_memory_bytes is not None and (
            not _is_number(max_memory_bytes, numbers.Integral) or int(max_memory_bytes) < MIN_MEMORY_BYTES
        ):
            raise ValueError(
                f"max_memory_bytes must be an int of at least {MIN_MEMORY_BYTES >> 20} MiB (the worker's interpreter "
                f"and llama.cpp's code take ~160 MiB of address space, a parse's stack 256 MiB) or None, "
                f"not {max_memory_bytes!r}"
            )
        # the worker's ChatTemplate stops cooperatively at the same budgets (no restart);
        # killing the worker is the backstop for what cannot be interrupted. The options are
        # checked here (the caps names by the worker's core) and rebuilt there as they are.
        opts = Options.make(None, **{**options, "timeout": float(timeout), "max_output_bytes": int(max_output_bytes)})
        self._build = (*parts, opts, name)  # _restore's arguments (name: what the notices call it)
        self._timeout = float(timeout)
        self._max_output = int(max_output_bytes)
        # (a plain int: pickled to the worker; past 2**62, which RLIMIT_AS cannot hold, no limit)
        self._max_memory = None if max_memory_bytes is None else min(int(max_memory_bytes), 2**62)
        # reentrant: the worker's log records are logged while it is held (the answer already
        # read in full), and a logging handler may call this object again
        self._lock = threading.RLock()
        self._pid = os.getpid()  # the process whose worker this is
        self._proc: Any = None
        self._conn: Any = None
        _LIVE.add(self)
        with self._lock:
            self._info = self._start()

    def _after_fork(self) -> None:
        # in a forked child: the worker and its pipes are the parent's (never signalled or used
        # from here), and the lock may have been held by a thread of the parent at the fork
        if self._conn is not None:
            self._conn.close()  # the child's copies of the descriptors only
        self._proc = self._conn = None
        self._lock = threading.RLock()
        self._pid = os.getpid()

    # -- the worker -----------------------------------------------------------------------

    def _start(self) -> dict[str, Any]:
        # a fresh interpreter running this module (no fork of a threaded parent, and unlike
        # multiprocessing's spawn it never re-imports the caller's __main__)
        proc = subprocess.Popen(
            [sys.executable, "-m", "llamaprompt.sandbox"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True
        )
        self._proc = proc
        self._conn = _PipeConnection(proc.stdout, proc.stdin)
        try:
            self._conn.send((self._build, self._max_memory, self._max_output, _levels()))
        except (OSError, ValueError, pickle.PicklingError, AttributeError, TypeError) as e:
            self._kill()
            raise TemplateError(f"the template cannot be sent to the sandbox worker: {e}", None) from None
        # the load runs the template too (llama-server's thinking probe); start-up gets 30 s more
        return self._receive(self._timeout + 30.0, loading=True)

    def _kill(self) -> None:
        if self._pid != os.getpid():
            self._after_fork()
            return
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def _receive(self, timeout: float, loading: bool = False) -> Any:
        conn, proc = self._conn, self._proc
        if not conn.poll(timeout):
            self._kill()
            what = f"{timeout:g} s to load" if loading else f"{self._timeout:g} s"
            raise TemplateError(
                f"the template ran longer than the sandbox's budget ({what}); its worker was stopped", 500
            )
        try:
            msg = conn.recv()
        except (EOFError, OSError, pickle.UnpicklingError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            code = proc.returncode
            self._kill()
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise TemplateError(f"the template crashed the sandbox worker ({how})", 500) from None
        _relay(msg[-1])
        if msg[0] == "ok":
            return msg[1]
        _, cls_name, message, status, _ = msg
        cls = _ERRORS.get(cls_name)
        if cls is not None:
            raise cls(message, status)
        if cls_name in ("TypeError", "ValueError"):
            raise {"TypeError": TypeError, "ValueError": ValueError}[cls_name](message)
        raise TemplateError(f"{cls_name}: {message}", 500)

    def _call(self, method: str, payload: Any) -> Any:
        if self._pid != os.getpid():
            self._after_fork()  # a fresh worker of the child's own below
        with self._lock:
            if self._conn is not None and not self._conn.in_sync:
                self._kill()  # an interrupted call's answer would come next: a fresh worker instead
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._info = self._start()
            try:
                self._conn.send((method, payload, _levels()))
            except (OSError, EOFError, BrokenPipeError):
                self._kill()
                raise TemplateError("the sandbox worker is gone", 500) from None
            # the worker's own budget answers at self._timeout; the kill is the backstop
            return self._receive(self._timeout + max(1.0, self._timeout / 4))

    def close(self) -> None:
        """Stop the worker (it is also stopped when the object is collected)."""
        if self._pid != os.getpid():
            self._after_fork()
            return
        with self._lock:
            self._kill()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._kill()

    def __enter__(self) -> UntrustedTemplate:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- ChatTemplate's surface -----------------------------------------------------------

    @property
    def caps(self) -> dict[str, bool]:
        return dict(self._info["caps"])

    @property
    def detected_caps(self) -> dict[str, bool]:
        return dict(self._info["detected_caps"])

    @property
    def source(self) -> str:
        return self._info["source"]

    @property
    def tool_use_source(self) -> str | None:
        return self._info["tool_use_source"]

    @property
    def supports_thinking(self) -> bool:
        return bool(self._info["supports_thinking"])

    def props(self) -> dict[str, Any]:
        return dict(self._info["props"])

    def apply_template(self, request: Any) -> str:
        """As ChatTemplate.apply_template, in the worker, within the budgets."""
        return self._call("apply_template", request_body(request))

    def apply(self, request: Any) -> ChatParams:
        """As ChatTemplate.apply, in the worker (the result has no parser binding)."""
        return ChatParams(**self._call("apply", request_body(request)))

    def normalize(
        self, messages: Iterable[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """As ChatTemplate.normalize, in the worker."""
        return self._call("normalize", (messages_list(messages), list(tools) if tools else None))


if __name__ == "__main__":
    _worker_entry()
