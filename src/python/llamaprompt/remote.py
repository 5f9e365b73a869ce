"""Another llama.cpp core in a worker process, behind the ``_core`` module's own names.

:class:`RemoteCore` stands in for the ``_core`` module of a core built for another llama.cpp
tree (:mod:`llamaprompt.cores`): its constants (``LLAMA_CPP_COMMIT``, ``CAPS_KEYS``, ...) are
read once from the worker, its classes (``Template``, ``Model``, ``OutputParser``) make
objects that live in the worker, and every method call and function call is sent there and
answered with the core's result or the exception it raised (llamaprompt's error classes
keep their message and status). ChatTemplate uses it exactly as it uses ``_core``, so the
Python layer -- hooks, argument checks, ChatParams, notices -- is the same for every core.
llama.cpp's log lines of a call come back with its answer and are logged here
(``llamaprompt.llama_cpp``, at the levels enabled here), as the in-process core logs them.

The worker is ``python -m llamaprompt.remote`` with ``LLAMAPROMPT_CORE`` naming the core, so
it loads that module and no other. One worker per core per process, started on first use and
shared by every template of that core; calls are serialized (the worker releases nothing
between them). A worker that dies makes the calls raise CoreError; templates made before must
then be created again. At interpreter exit the worker is stopped; a daemon thread's call still
waiting for it then waits for good (CPython ends such threads) instead of raising CoreError.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
from typing import Any

from .cores import CORE_ENV, Core
from .errors import TOO_DEEP_FOR_PYTHON, CoreError, RequestError
from .sandbox import _levels, _PipeConnection, _Records, _relay

__all__ = ["RemoteCore", "remote_core"]

#: Seconds a call may wait for the worker's answer before the worker is stopped
#: (``$LLAMAPROMPT_CORE_TIMEOUT``). The core's own budgets (``timeout=``, 10 s by default)
#: answer long before; this catches a worker that is stopped or stuck.
CALL_TIMEOUT = float(os.environ.get("LLAMAPROMPT_CORE_TIMEOUT", "300"))

_CONSTANTS = ("LLAMA_CPP_COMMIT", "LLAMA_CPP_SOURCE", "LLAMA_CPP_DIR", "TREE_INFO_JSON", "CAPS_KEYS", "SOURCE_HASH")


class _Abandoned(Exception):
    """A daemon thread's call met the worker stopped at interpreter exit (RemoteCore._gone)."""


class _Handle:
    """A reference to an object living in the worker (sent as its id)."""

    __slots__ = ("id",)

    def __init__(self, id: int) -> None:
        self.id = id


def _serve() -> None:
    """The worker: ``_core`` is the core LLAMAPROMPT_CORE names; answer requests until EOF."""
    conn = _PipeConnection(sys.stdin.buffer, sys.stdout.buffer)
    sys.stdout = sys.stderr  # nothing printed may corrupt the channel
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import llamaprompt  # noqa: F401 - loads the core named by LLAMAPROMPT_CORE
        from llamaprompt import _core
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", CoreError(f"the core worker cannot load its core: {e}")))
        return
    objects: dict[int, Any] = {}
    classes = {n for n in dir(_core) if isinstance(getattr(_core, n), type) and not n.startswith("_")}
    functions = {n for n in dir(_core) if callable(getattr(_core, n)) and n not in classes and not n.startswith("_")}
    properties = {
        c: [n for n, v in vars(getattr(_core, c)).items() if isinstance(v, property)] for c in sorted(classes)
    }
    conn.send(
        (
            "ok",
            {
                "constants": {n: getattr(_core, n) for n in _CONSTANTS},
                "classes": sorted(classes),
                "functions": sorted(functions),
                "properties": properties,
            },
        )
    )
    core_types = tuple(getattr(_core, n) for n in classes)
    logs = _Records()  # the core's llama.cpp lines, sent back with each answer

    def unwrap(args: tuple) -> list:
        return [objects[a.id] if isinstance(a, _Handle) else a for a in args]

    def answer(reply: tuple[str, Any], records: list) -> None:
        """Send the reply; what cannot be pickled goes back as an error (OSError: the pipe)."""
        try:
            conn.send((*reply, records))
        except RecursionError:  # as the in-process core answers a result too deep for Python
            conn.send(("error", RequestError(TOO_DEEP_FOR_PYTHON, 400), records))
        except Exception as e:  # noqa: BLE001 - pickling failed: nothing was written
            if isinstance(e, OSError):
                raise
            bad = reply[1] if reply[0] == "error" else e
            try:
                conn.send(("error", bad, records))
            except Exception as e2:  # noqa: BLE001 - an exception that cannot travel: its text does
                if isinstance(e2, OSError):
                    raise
                conn.send(("error", RuntimeError(f"{type(bad).__name__}: {bad}"), records))

    while True:
        try:
            op, target, name, args, kwargs, dropped, levels = conn.recv()
        except EOFError:
            return
        logs.take(levels)
        for h in dropped:
            objects.pop(h, None)
        try:
            if op == "new":
                obj = getattr(_core, name)(*unwrap(args), **kwargs)
            elif op == "call":
                fn = getattr(_core, name) if target is None else getattr(objects[target], name)
                obj = fn(*unwrap(args), **kwargs)
            elif op == "get":
                obj = getattr(objects[target], name)
            else:
                raise ValueError(f"unknown operation {op}")
            if isinstance(obj, core_types):
                objects[id(obj)] = obj
                reply: tuple[str, Any] = ("obj", id(obj))
            else:
                reply = ("ok", obj)
        except BaseException as e:  # noqa: BLE001 - every exception goes back to the caller
            reply = ("error", e)
        try:
            answer(reply, logs.take(levels))
        except OSError:  # the parent closed the pipe (it stopped the worker: its exit): no one to answer
            return


class _RemoteObject:
    """An object of the worker's core (a Template, Model, OutputParser)."""

    def __init__(self, remote: RemoteCore, handle: int, kind: str) -> None:
        object.__setattr__(self, "_remote", remote)
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_kind", kind)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        remote, handle = self._remote, self._handle
        if name in remote._properties.get(self._kind, ()):
            return remote._request("get", handle, name, (), {})

        def method(*args: Any, **kwargs: Any) -> Any:
            return remote._request("call", handle, name, args, kwargs)

        return method

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._remote._dropped.append(self._handle)

    def __repr__(self) -> str:
        return f"<{self._kind} in the llama.cpp {self._remote.core.label()} core worker>"


class RemoteCore:
    """The ``_core`` module of ``core``, run in a worker process (see the module docstring).

    Attributes are the module's: constants as values, classes as constructors of worker
    objects, functions as calls. Raises CoreError when the worker cannot start or dies."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._lock = threading.Lock()
        self._at_exit = False
        # why the worker was stopped from this side (close(), a timeout, an interrupted call): later
        # calls say so rather than how the process ended (SIGTERM)
        self._stopped: str | None = None
        self._dropped: list[int] = []
        self._pid = os.getpid()
        env = {**os.environ, CORE_ENV: str(core.path)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "llamaprompt.remote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self._conn = _PipeConnection(self._proc.stdout, self._proc.stdin)
        kind, info = self._receive(CALL_TIMEOUT)[:2]
        if kind != "ok":
            raise info
        self._classes = set(info["classes"])
        self._functions = set(info["functions"])
        # attributes of the core's classes that are properties, not methods (read with "get")
        self._properties = {c: set(p) for c, p in info["properties"].items()}
        for name, value in info["constants"].items():
            setattr(self, name, value)
        atexit.register(self._close_at_exit)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self.__dict__.get("_classes", ()) | self.__dict__.get(
            "_functions", set()
        ):
            raise AttributeError(f"the llama.cpp core has no {name!r}")
        if name in self._classes:
            return lambda *args, **kwargs: self._request("new", None, name, args, kwargs, kind=name)
        return lambda *args, **kwargs: self._request("call", None, name, args, kwargs)

    def _close_at_exit(self) -> None:
        self._at_exit = True
        self.close()

    def _gone(self) -> None:
        """Returns when the worker's end is an error for this thread's call; raises _Abandoned in
        a daemon thread once the worker was stopped at interpreter exit (_request then waits for
        good, outside its lock): atexit handlers run after threading joined the other threads, so
        the calls still waiting belong to daemon threads, which CPython abandons -- a CoreError
        would only print its traceback as the process exits."""
        if self._at_exit and threading.current_thread().daemon:
            raise _Abandoned

    def _receive(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The worker's next answer: (status, value, log records); at start (status, info)."""
        try:
            ready = timeout is None or self._conn.poll(timeout)
        except (OSError, ValueError):  # the pipe was closed (close(), at exit)
            ready = True  # recv says how
        if not ready:
            self._stop(f"was stopped: a call did not answer within {timeout:g} s")
            raise CoreError(
                f"the worker process of the llama.cpp {self.core.label()} core did not answer within {timeout:g} s "
                "(LLAMAPROMPT_CORE_TIMEOUT); it was stopped: create the template again"
            )
        try:
            return self._conn.recv()
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):
            self._gone()
            if self._stopped:
                raise self._stopped_error() from None
            code = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._proc.wait(5)
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise CoreError(
                f"the worker process of the llama.cpp {self.core.label()} core died ({how}); create the template "
                "again (a new worker starts)"
            ) from None

    def _request(self, op: str, target: int | None, name: str, args: tuple, kwargs: dict, kind: str = "") -> Any:
        if os.getpid() != self._pid:
            raise CoreError("a core worker cannot be shared with a forked process; create the template there")
        wire = tuple(_Handle(a._handle) if isinstance(a, _RemoteObject) else a for a in args)
        try:
            return self._exchange(op, target, name, wire, kwargs, kind)
        except _Abandoned:
            pass
        # the lock is released: an atexit handler registered before this core may still call it
        threading.Event().wait()
        raise AssertionError("unreachable")

    def _exchange(self, op: str, target: int | None, name: str, wire: tuple, kwargs: dict, kind: str) -> Any:
        with self._lock:
            if not self._conn.in_sync:  # an interrupted call's answer would come next
                self._gone()  # (at exit: a daemon thread's call behind an abandoned one)
                self._stop("was stopped: a call to it was interrupted")
                raise CoreError(
                    f"a call to the worker process of the llama.cpp {self.core.label()} core was interrupted; the "
                    "worker was stopped: create the template again (a new worker starts)"
                )
            dropped, self._dropped[:] = list(self._dropped), []
            try:
                self._conn.send((op, target, name, wire, kwargs, dropped, _levels()))
            except (OSError, ValueError):
                self._gone()
                if self._stopped:
                    raise self._stopped_error() from None
                raise CoreError(
                    f"the worker process of the llama.cpp {self.core.label()} core is gone; create the template "
                    "again (a new worker starts)"
                ) from None
            status, value, records = self._receive(CALL_TIMEOUT)
        _relay(records)  # (outside the lock: a handler may call the core)
        if status == "error":
            raise value
        if status == "obj":
            return _RemoteObject(self, value, kind or "object")
        return value

    def _stopped_error(self) -> CoreError:
        return CoreError(
            f"the worker process of the llama.cpp {self.core.label()} core {self._stopped}; create the template "
            "again (a new worker starts)"
        )

    def close(self) -> None:
        """Stop the worker (templates of this core stop working: CoreError)."""
        self._stop("was closed (close(), or at interpreter exit)")

    def _stop(self, why: str) -> None:
        if self._stopped is None:
            self._stopped = why
        with contextlib.suppress(Exception):
            self._conn.close()  # (in a forked child: the child's copies of the descriptors)
        if os.getpid() != self._pid:
            # a forked child (its atexit handlers, close()): the worker is the parent's -- never
            # signalled from here (Popen.poll() may answer None in the child: a thread of the
            # parent held its lock at the fork, and the child's exit stopped the parent's worker)
            return
        with contextlib.suppress(Exception):
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGCONT)  # a stopped worker cannot exit otherwise
                self._proc.terminate()
        with contextlib.suppress(Exception):
            self._proc.wait(5)
        with contextlib.suppress(Exception):
            if self._proc.poll() is None:
                self._proc.kill()


_REMOTES: dict[tuple[int, str], RemoteCore] = {}
_REMOTES_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # a thread of the parent may have held the lock at the fork (starting a worker): the child
    # has no such thread, so its copy of the lock would stay held for good. The parent's workers
    # stay in _REMOTES under the parent's pid (never the child's: remote_core keys by pid).
    global _REMOTES_LOCK
    _REMOTES_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def remote_core(core: Core) -> RemoteCore:
    """The worker for ``core`` in this process (started on first use)."""
    key = (os.getpid(), str(core.path))
    with _REMOTES_LOCK:
        remote = _REMOTES.get(key)
        if remote is None or remote._proc.poll() is not None:
            remote = _REMOTES[key] = RemoteCore(core)
        return remote


if __name__ == "__main__":
    # through the package module, so that _Handle is the class the parent pickles
    from llamaprompt.remote import _serve as serve

    serve()
