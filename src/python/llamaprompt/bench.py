"""Render throughput: :meth:`ChatTemplate.apply_template` against its peers, in one run.

For each template and each request of a request set (default: every template of the
pinned tree x the default request set, ``llamaprompt/resources/requests.json``), the
per-call time of:

- ``llamaprompt`` -- :meth:`ChatTemplate.apply_template` with the fast path (the default);
- ``upstream`` -- the same call with ``fast_path=False``: llama.cpp's unmodified sequence
  (differential analysis, parser and grammar generation on every call), what
  llama-server runs for POST /apply-template;
- ``jinja2`` -- Python Jinja2 configured as ``transformers``' ``apply_chat_template``
  configures it (sandboxed environment, ``trim_blocks``/``lstrip_blocks``,
  ``loopcontrols``, ``tojson`` without ASCII escaping, ``raise_exception``,
  ``strftime_now``); its prompts are compared with llamaprompt's and the requests where
  they differ or Jinja2 raises are counted;
- ``transformers`` -- transformers' own renderer,
  ``transformers.utils.chat_template_utils.render_jinja_template`` (what
  ``apply_chat_template`` runs: its data conversion, reasoning-field aliases and compiled-
  template cache included), compared and counted as Jinja2 is;
- ``server`` -- llama-server over HTTP (keep-alive), when ``server_url`` points at one;
  only for the template that server reports in GET /props;
- ``floor`` -- one plain execution of the template in llama.cpp's Jinja engine
  (``common_chat_template_direct_apply`` with the parameters the autoparser path renders
  with), timed in C++: the floor of an exact prompt. Not available for requests that a
  specialized handler renders or that fail.

plus the one-off template load time, the renders/s of :meth:`ChatTemplate.apply_template_many`
on 1 and on N threads, and (in a fresh process) the memory of many loaded templates.

Times are wall-clock per call (``time.perf_counter``): after one warm-up call, ``min_time``
seconds are split into three windows of as many calls as fit, and the window with the least
mean time per call counts; a peer's renders/s for a template
is ``n / sum(per-call times)`` over the requests it is compared on. Ratios are
llamaprompt's renders/s over the peer's (so > 1 means llamaprompt is faster), except
``floor_ratio`` (llamaprompt's time over the floor's: 1.0 is the floor),
``floor_vs_jinja2`` (the floor's renders/s over Jinja2's, on the requests both render as
llama-server does: llama.cpp's engine against Jinja2's) and ``thread_scaling`` (N threads
over 1 thread).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import IO, Any

from . import LLAMA_CPP_COMMIT, __version__, _core
from .errors import Error
from .fixtures import default_requests
from .pinned import pinned_templates
from .template import ChatTemplate

__all__ = [
    "run_bench",
    "bench_template",
    "format_report",
    "plot_report",
    "memory_report",
    "transformers_jinja2",
    "ServerPeer",
    "LlamaServerProcess",
    "ServerExited",
]

PEERS = ("upstream", "jinja2", "transformers", "server", "floor")
# peers that render the template in Python: compared on the requests where their prompt is llama-server's
PYTHON_PEERS = ("jinja2", "transformers")
RATIOS = ("upstream", "jinja2", "transformers", "server", "floor_ratio", "thread_scaling", "floor_vs_jinja2")


WINDOWS = 3  # timing windows per measurement; the fastest counts


def _per_call(fn: Callable[[], Any], min_time: float) -> float:
    """Seconds per call of ``fn``: one warm-up call, then ``WINDOWS`` windows of calls, each
    until ``min_time / WINDOWS`` has passed (at least one call); the least mean time per call of
    a window (as ``timeit`` advises: a slower window measured the machine's other work)."""
    fn()
    best = float("inf")
    for _ in range(WINDOWS):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time / WINDOWS:
                best = min(best, elapsed / n)
                break
    return best


def _quiet(fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        try:
            return fn()
        except Exception as e:  # a peer that raises is timed all the same
            return e

    return call


# -- Jinja2 as transformers configures it ---------------------------------------------


def transformers_jinja2(source: str) -> Any:
    """Compile ``source`` with Jinja2 set up as ``transformers`` does for
    ``apply_chat_template`` (needs ``pip install jinja2``). Returns the jinja2 Template.

    Raises ImportError without jinja2, jinja2.TemplateError when Jinja2 cannot compile it.
    """
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return _dt.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def transformers_renderer(source: str) -> Callable[..., str]:
    """A function rendering ``source`` with transformers' ``render_jinja_template`` (needs
    ``pip install transformers``): called with the variables of :func:`_jinja2_kwargs`
    (messages, tools, add_generation_prompt, the special tokens ...), it returns the prompt.

    Raises ImportError without transformers; the function raises what transformers raises.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(**variables: Any) -> str:
        messages = variables.pop("messages")
        tools = variables.pop("tools", None)
        add_generation_prompt = variables.pop("add_generation_prompt")
        # (rendered, generation indices), whatever transformers' annotation says
        result: Any = render_jinja_template(
            [messages], tools=tools, chat_template=source, add_generation_prompt=add_generation_prompt, **variables
        )
        return str(result[0][0])

    return render


def _render_with(render: Callable[..., str], variables: Mapping[str, Any]) -> str:
    return render(**dict(variables))  # a fresh dict per call: the transformers peer pops from it


def _jinja2_kwargs(request: Mapping[str, Any], bos_token: str, eos_token: str) -> dict[str, Any]:
    """The variables transformers passes: messages, tools, add_generation_prompt, the
    special tokens, and chat_template_kwargs spread as extra variables."""
    kwargs: dict[str, Any] = dict(request.get("chat_template_kwargs") or {})
    kwargs.update(
        messages=request.get("messages", []),
        add_generation_prompt=request.get("add_generation_prompt", True),
        bos_token=bos_token,
        eos_token=eos_token,
    )
    if request.get("tools"):
        kwargs["tools"] = request["tools"]
    if "reasoning_effort" in request:
        kwargs["reasoning_effort"] = request["reasoning_effort"]
    return kwargs


# -- llama-server over HTTP -----------------------------------------------------------


class ServerPeer:
    """A llama-server (or ``llamaprompt serve``) at ``url``, over one keep-alive connection.

    Raises OSError when it cannot be reached, ValueError for an URL that is not http.
    """

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the server URL must be http://HOST:PORT, not {url!r}")
        self.url = url
        self._prefix = parts.path.rstrip("/")
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
        self.props = self.request("GET", "/props")[1]
        if not isinstance(self.props, dict) or "chat_template" not in self.props:
            raise ValueError(f"{url}/props did not return a chat_template")

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
        """One HTTP request on the kept connection: (status, the JSON answer decoded, or its
        bytes when it is not JSON). A kept connection the server closed meanwhile (its keep-alive
        timeout) is reopened once: the endpoints asked here change nothing, so resending is safe.
        Raises OSError (http.client.RemoteDisconnected included) when the server cannot be reached
        or closes the new connection too (it died)."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        for attempt in (0, 1):
            try:
                self._conn.request(method, self._prefix + path, body=body, headers=headers)
                resp = self._conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._conn.close()
                if attempt:
                    raise
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data

    def apply_template(self, body: bytes) -> str | None:
        """POST /apply-template; the prompt, or None for an error answer."""
        status, data = self.request("POST", "/apply-template", body)
        return data.get("prompt") if status == 200 and isinstance(data, dict) else None

    def serves(self, template: ChatTemplate) -> bool:
        """Whether this server's GET /props ``chat_template`` is ``template``'s text."""
        served = self.props.get("chat_template")
        return served in (template.source, template.source + "\n")

    def close(self) -> None:
        self._conn.close()


class ServerExited(RuntimeError):
    """llama-server exited before it served; ``status`` is its exit status (negative: killed by
    that signal, e.g. -11 when a template's recursion overflowed its stack)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LlamaServerProcess:
    """Start ``llama-server -m MODEL --jinja --chat-template-file TEMPLATE`` on a free
    loopback port; a context manager whose value is the server's URL. Any GGUF model works
    for /apply-template (llama-server loads its weights, so a small one starts fastest).

    Raises ServerExited (a RuntimeError) when the server exits before it answers GET /health
    (e.g. it refuses the template or the model), TimeoutError (an OSError) when it is still
    starting after ``startup_timeout`` seconds -- both messages end with the server's last lines
    of output -- and another OSError when the binary cannot be started. The server runs in a
    process group of its own, which is stopped as a whole (a wrapper script's children too).
    ``max_memory`` (bytes) caps the server's address space (RLIMIT_AS; POSIX only): a template
    that makes it allocate without end then ends it with an allocation failure instead of the
    machine's out-of-memory killer. ValueError: ``startup_timeout`` not > 0.
    """

    def __init__(
        self,
        binary: str,
        model: str,
        template: str | os.PathLike,
        startup_timeout: float = 60.0,
        max_memory: int | None = None,
    ) -> None:
        if not startup_timeout > 0:  # NaN included: no start could ever be awaited
            raise ValueError(f"startup_timeout must be > 0 seconds, not {startup_timeout!r}")
        self.binary, self.model, self.template = binary, model, str(template)
        self.startup_timeout = startup_timeout
        self.max_memory = max_memory
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        import socket
        import tempfile

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self._log: IO[bytes] | None = tempfile.TemporaryFile()
        cmd = [
            self.binary,
            "-m",
            self.model,
            "--jinja",
            "--chat-template-file",
            self.template,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            "2048",
            "-np",
            "1",
            "--no-webui",
        ]
        limit = None
        cap = self.max_memory
        if cap is not None:  # its address space (POSIX RLIMIT_AS), set in the child

            def limit() -> None:
                import resource

                resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

        self._proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=limit, start_new_session=os.name == "posix"
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    return url
                conn.close()
            except OSError:
                pass
            time.sleep(0.1)
        status = self._proc.poll()
        self.__exit__(None, None, None)  # stops it; its log is read first
        if status is None:
            raise TimeoutError(
                f"llama-server did not answer GET /health within {self.startup_timeout} s: {' '.join(cmd)}{self._tail}"
            )
        raise ServerExited(status, f"llama-server exited with status {status} at start: {' '.join(cmd)}{self._tail}")

    def _signal(self, sig: int) -> None:
        assert self._proc is not None
        if os.name == "posix":
            with contextlib.suppress(OSError):
                os.killpg(self._proc.pid, sig)
        else:
            self._proc.send_signal(sig)

    def __exit__(self, *exc: Any) -> None:
        self._tail = ""
        if self._proc is not None:
            self._signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL if os.name == "posix" else signal.SIGTERM)
                self._proc.wait()
            if os.name == "posix":  # what the group still holds (a wrapper script's server)
                with contextlib.suppress(OSError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc = None
        log = getattr(self, "_log", None)
        if log is not None:
            log.seek(0)
            lines = log.read().decode("utf-8", "replace").splitlines()[-5:]  # its last output
            self._tail = "".join("\n  " + line for line in lines)
            log.close()
            self._log = None


# -- one template ---------------------------------------------------------------------


def _rate(times: Sequence[float]) -> float | None:
    total = sum(times)
    return len(times) / total if times and total > 0 else None


def bench_template(
    path: str | os.PathLike,
    requests: Mapping[str, Any],
    *,
    threads: int = 2,
    min_time: float = 0.02,
    peers: Iterable[str] = PEERS,
    server: ServerPeer | None = None,
    template_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Benchmark one template file over ``requests`` (name -> request body).

    Returns a JSON-able dict: ``template``, ``load_ms``, ``requests`` (per request: seconds
    per call for each peer, ``ok``, and for Jinja2 ``jinja2_same`` or ``jinja2_error``),
    ``renders_per_s`` (per peer), ``ratios``, ``threads`` (renders/s on 1 and N threads),
    ``jinja2_differs`` / ``jinja2_raises`` (counts). Raises TemplateError when the template
    cannot be loaded.
    """
    peers = set(peers)
    opts = dict(template_options or {})
    path = Path(path)
    loads = []
    for _ in range(3):
        t0 = time.perf_counter()
        fast = ChatTemplate.from_file(path, **opts)
        loads.append(time.perf_counter() - t0)
    upstream = ChatTemplate.from_file(path, fast_path=False, **opts) if "upstream" in peers else None
    renderers: dict[str, Callable[..., str]] = {}
    load_errors: dict[str, str] = {}
    if "jinja2" in peers:
        try:
            renderers["jinja2"] = transformers_jinja2(fast.source).render
        except ImportError:
            raise
        except Exception as e:  # Jinja2 cannot compile the template
            load_errors["jinja2"] = f"{type(e).__name__}: {e}"
    if "transformers" in peers:
        renderers["transformers"] = transformers_renderer(fast.source)  # compiles on first use
    use_server = server is not None and "server" in peers and server.serves(fast)

    rows: dict[str, dict[str, Any]] = {}
    for name, request in requests.items():
        # llamaprompt as a Python stack calls it (the request's objects, as the Python peers get
        # them); llama-server gets the JSON text over HTTP
        body = json.dumps(request, ensure_ascii=False).encode()
        row: dict[str, Any] = {}
        try:
            prompt: str | None = fast.apply_template(request)
        except Error as e:
            prompt, row["error"] = None, e.message
        row["ok"] = prompt is not None
        row["llamaprompt"] = _per_call(_quiet(partial(fast.apply_template, request)), min_time)
        if upstream is not None:
            row["upstream"] = _per_call(_quiet(partial(upstream.apply_template, request)), min_time)
        for peer, render in renderers.items():
            variables = _jinja2_kwargs(request, fast.bos_token, fast.eos_token)
            try:
                row[f"{peer}_same"] = render(**dict(variables)) == prompt
            except Exception as e:
                row[f"{peer}_error"] = f"{type(e).__name__}: {e}"
            row[peer] = _per_call(_quiet(partial(_render_with, render, variables)), min_time)
        if use_server and server is not None:
            row["server"] = _per_call(partial(server.apply_template, body), min_time)
        if "floor" in peers and prompt is not None:
            floor = fast._core.time_direct_apply(body, max(1, int(min_time / max(row["llamaprompt"], 1e-6))))
            if floor is not None:
                row["floor"] = floor
        rows[name] = row

    def rate(peer: str, names: Iterable[str]) -> float | None:
        return _rate([rows[n][peer] for n in names if peer in rows[n]])

    everything = list(rows)
    rps = {"llamaprompt": rate("llamaprompt", everything)}
    ratios: dict[str, float | None] = {}
    for peer in ("upstream", *PYTHON_PEERS, "server"):
        names = [n for n in everything if peer in rows[n]]
        if peer in PYTHON_PEERS:  # compared where the peer gives llama-server's prompt
            names = [n for n in names if rows[n].get(f"{peer}_same")]
        if names:
            theirs = rps[peer] = rate(peer, names)
            mine = rate("llamaprompt", names)
            ratios[peer] = mine / theirs if mine and theirs else None
    floored = [n for n in everything if "floor" in rows[n]]
    if floored:
        rps["floor"] = rate("floor", floored)
        mine = rate("llamaprompt", floored)
        ratios["floor_ratio"] = rps["floor"] / mine if mine and rps["floor"] else None
        # the engine itself against plain Jinja2, where both render llama-server's prompt
        both = [n for n in floored if rows[n].get("jinja2_same")]
        if both:
            floor_rate, jinja_rate = rate("floor", both), rate("jinja2", both)
            ratios["floor_vs_jinja2"] = floor_rate / jinja_rate if floor_rate and jinja_rate else None

    # apply_template_many on 1 and N threads: the request set repeated to fill min_time per
    # batch, 1 and N alternated three times, the median of each (thread timings are noisy)
    bodies = list(requests.values())
    per_body = max(row["llamaprompt"] for row in rows.values()) if rows else 0.0
    batch = bodies * max(1, int(min_time / max(per_body * len(bodies), 1e-9)) + 1) * threads
    samples: dict[int, list[float]] = {n: [] for n in sorted({1, threads})}

    def measure() -> None:
        for _ in range(3):
            for n_threads in samples:
                t0 = time.perf_counter()
                fast.apply_template_many(batch, threads=n_threads, return_exceptions=True)
                samples[n_threads].append(len(batch) / (time.perf_counter() - t0))

    # from a non-main thread: glibc's main malloc arena (the main thread's) trims its heap
    # far more often than the per-thread arenas, which would flatter N threads over 1
    runner = threading.Thread(target=measure)
    runner.start()
    runner.join()
    thread_rates = {str(n): statistics.median(v) for n, v in samples.items()}
    ratios["thread_scaling"] = thread_rates[str(threads)] / thread_rates["1"]

    out: dict[str, Any] = {
        "template": path.name,
        "handler": "autoparser" if fast.describe().get("autoparser") else "specialized",
        "load_ms": statistics.median(loads) * 1e3,
        "renders_per_s": rps,
        "ratios": ratios,
        "threads": thread_rates,
        "requests": rows,
    }
    for peer in renderers:
        out[f"{peer}_differs"] = sum(1 for r in rows.values() if r.get(f"{peer}_same") is False)
        out[f"{peer}_raises"] = sum(1 for r in rows.values() if f"{peer}_error" in r)
    for peer, error in load_errors.items():
        out[f"{peer}_load_error"] = error
    return out


# -- memory ---------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_child(paths: list[str], n: int) -> dict[str, Any]:
    import resource

    from .samples import SAMPLE_REQUEST

    before = _rss_bytes()
    loaded = []
    for i in range(n):
        loaded.append(ChatTemplate.from_file(paths[i % len(paths)]))
    after_load = _rss_bytes()
    for t in loaded:
        with contextlib.suppress(Error):
            t.apply_template(SAMPLE_REQUEST)
    after_render = _rss_bytes()
    return {
        "templates": n,
        "rss_before_mib": before / 2**20,
        "rss_loaded_mib": after_load / 2**20,
        "rss_after_one_render_each_mib": after_render / 2**20,
        "per_template_kib": (after_render - before) / n / 1024,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def memory_report(paths: Sequence[str | os.PathLike], n: int = 100) -> dict[str, Any]:
    """Load ``n`` templates (cycling through ``paths``) in a fresh Python process, render
    one sample request with each, and report its RSS before, after loading, after
    rendering (MiB), the mean footprint per template (KiB) and the peak RSS (MiB).

    Raises RuntimeError when the child process fails.
    """
    code = (
        "import json, sys; from llamaprompt.bench import _memory_child; "
        "print(json.dumps(_memory_child(json.loads(sys.argv[1]), int(sys.argv[2]))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps([str(p) for p in paths]), str(n)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory report failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


# -- the whole run --------------------------------------------------------------------


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def run_bench(
    templates: Sequence[str | os.PathLike] | None = None,
    requests: Mapping[str, Any] | None = None,
    *,
    threads: int = 2,
    min_time: float = 0.02,
    peers: Iterable[str] = PEERS,
    server_url: str | None = None,
    llama_server: tuple[str, str] | None = None,
    memory: int = 100,
    template_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Benchmark ``templates`` (paths; default every template of the pinned tree) over
    ``requests`` (name -> body; default the default request set).

    Args:
        threads: N for the apply_template_many scaling figure.
        min_time: seconds spent timing each (template, request, peer).
        peers: which of ``upstream``, ``jinja2``, ``transformers``, ``server``, ``floor`` to run.
        server_url: a llama-server (``http://HOST:PORT``); the template its GET /props
            reports is benchmarked against it.
        llama_server: ``(binary, model.gguf)``: start llama-server with each template in
            turn (:class:`LlamaServerProcess`) and benchmark every template against it.
        memory: how many templates to load for the memory report (0: none).
        template_options: keyword arguments for every :meth:`ChatTemplate.from_file`.
        progress: a tqdm bar on stderr (default: when stderr is a terminal).

    Returns a JSON-able dict: ``environment``, ``templates`` (one :func:`bench_template`
    result each; a template that cannot be loaded has ``error``), ``median`` (per ratio,
    over templates), ``memory``.

    Raises ImportError when ``jinja2`` or ``transformers`` is a peer and not installed; OSError /
    ValueError when ``server_url`` cannot be used.
    """
    from tqdm import tqdm

    paths = [Path(p) for p in (templates if templates is not None else pinned_templates())]
    reqs = dict(requests if requests is not None else default_requests())
    peers = set(peers)
    if "jinja2" in peers:
        import jinja2  # noqa: F401  (fail early: pip install 'llamaprompt[bench]')
    if "transformers" in peers:
        import transformers.utils.chat_template_utils  # noqa: F401  (fail early: pip install 'llamaprompt[bench]')
    server = ServerPeer(server_url) if server_url and "server" in peers else None
    if server is not None:
        served = [p for p in paths if server.serves(ChatTemplate.from_file(p))]
        if not served:
            import warnings

            warnings.warn(
                f"{server_url} serves none of the benchmarked templates (GET /props chat_template): "
                "no template is compared with it",
                stacklevel=2,
            )
    results = []
    show = sys.stderr.isatty() if progress is None else progress

    def one(path: Path, peer: ServerPeer | None) -> dict[str, Any]:
        return bench_template(
            path, reqs, threads=threads, min_time=min_time, peers=peers, server=peer, template_options=template_options
        )

    for path in tqdm(paths, desc="bench", unit="template", disable=not show):
        try:
            if llama_server is not None and "server" in peers:
                with LlamaServerProcess(llama_server[0], llama_server[1], path) as url:
                    own_server = ServerPeer(url)
                    try:
                        results.append(one(path, own_server))
                    finally:
                        own_server.close()
            else:
                results.append(one(path, server))
        except Error as e:
            results.append({"template": path.name, "error": e.message})
        except (RuntimeError, TimeoutError) as e:  # llama-server could not serve this template
            import warnings

            warnings.warn(f"{path.name}: llama-server could not serve it, benchmarked without it: {e}", stacklevel=2)
            try:
                results.append({**one(path, None), "server_error": str(e)})
            except Error as err:
                results.append({"template": path.name, "error": err.message, "server_error": str(e)})
    if server is not None:
        server.close()
    ok = [r for r in results if "error" not in r]
    median = {key: _median(r["ratios"].get(key) for r in ok) for key in RATIOS}
    median["load_ms"] = _median(r["load_ms"] for r in ok)
    median["renders_per_s"] = _median(r["renders_per_s"]["llamaprompt"] for r in ok)
    # the templates whose requests take the differential autoparser path (where the fast
    # path applies); the others use one of llama.cpp's specialized handlers
    auto = [r for r in ok if r["handler"] == "autoparser"]
    median_autoparser: dict[str, Any] = {key: _median(r["ratios"].get(key) for r in auto) for key in RATIOS}
    median_autoparser["templates"] = len(auto)
    special = [r for r in ok if r["handler"] != "autoparser"]
    median_specialized: dict[str, Any] = {key: _median(r["ratios"].get(key) for r in special) for key in RATIOS}
    median_specialized["templates"] = len(special)
    report: dict[str, Any] = {
        "environment": {
            "llamaprompt": __version__,
            "llama_cpp_commit": LLAMA_CPP_COMMIT,
            # how the module was built: link-time optimization, the block cache (docs/performance.md)
            "build": {"lto": _core.LTO, "pgo": _core.PGO, "block_cache": _core.BLOCK_CACHE_MODE},
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "date": _dt.date.today().isoformat(),
            "threads": threads,
            "min_time": min_time,
            "requests": len(reqs),
            "server_url": server_url,
            "llama_server": list(llama_server) if llama_server else None,
        },
        "templates": results,
        "median": median,
        "median_autoparser": median_autoparser,
        "median_specialized": median_specialized,
    }
    if memory:
        report["memory"] = memory_report(paths or pinned_templates(), memory)
    return report


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: Mapping[str, Any]) -> str:
    """The report as a Markdown table (one row per template) with the medians and the
    memory figures below it."""
    lines = [
        "| template | load ms | renders/s | × upstream | × jinja2 | jinja2 differs/raises | × transformers "
        "| transformers differs/raises | × server | time / floor | threads × |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["templates"]:
        if "error" in r:
            lines.append(f"| {r['template']} | load error: {r['error'][:60]} |||||||||")
            continue
        ratios = r["ratios"]
        counts = {}
        for peer in PYTHON_PEERS:
            counts[peer] = f"{r[peer + '_differs']}/{r[peer + '_raises']}" if f"{peer}_differs" in r else "-"
            if f"{peer}_load_error" in r:
                counts[peer] = "no compile"
        lines.append(
            f"| {r['template']} | {r['load_ms']:.1f} | {r['renders_per_s']['llamaprompt']:.0f} "
            f"| {_fmt(ratios.get('upstream'), '.1f')} | {_fmt(ratios.get('jinja2'), '.2f')} | {counts['jinja2']} "
            f"| {_fmt(ratios.get('transformers'), '.2f')} | {counts['transformers']} "
            f"| {_fmt(ratios.get('server'), '.1f')} | {_fmt(ratios.get('floor_ratio'), '.2f')} "
            f"| {_fmt(ratios.get('thread_scaling'), '.2f')} |"
        )
    m = report["median"]
    n_req = report["environment"]["requests"]
    lines += [
        "",
        f"Median over {_count(sum('error' not in r for r in report['templates']), 'template')} "
        f"({n_req} requests each): "
        f"{_fmt(m['renders_per_s'], '.0f')} renders/s, load {_fmt(m['load_ms'], '.1f')} ms; "
        f"× upstream {_fmt(m['upstream'], '.1f')}, × jinja2 {_fmt(m['jinja2'], '.2f')}, "
        f"× transformers {_fmt(m.get('transformers'), '.2f')}, "
        f"× server {_fmt(m['server'], '.1f')}, time / floor {_fmt(m['floor_ratio'], '.2f')}, "
        f"{report['environment']['threads']} threads × {_fmt(m['thread_scaling'], '.2f')}.",
    ]
    for key, where in (
        ("median_autoparser", "On the autoparser path"),
        ("median_specialized", "With a specialized handler"),
    ):
        a = report.get(key)
        if a and a["templates"]:
            lines.append(
                f"{where}, {_count(a['templates'], 'template')}: × upstream {_fmt(a['upstream'], '.1f')}, "
                f"× jinja2 {_fmt(a['jinja2'], '.2f')}, × transformers {_fmt(a.get('transformers'), '.2f')}, "
                f"× server {_fmt(a['server'], '.1f')}, time / floor {_fmt(a['floor_ratio'], '.2f')}."
            )
    mem = report.get("memory")
    if mem:
        lines.append(
            f"Memory: {mem['templates']} templates loaded and rendered once each: RSS "
            f"{mem['rss_before_mib']:.1f} → {mem['rss_after_one_render_each_mib']:.1f} MiB "
            f"({mem['per_template_kib']:.0f} KiB per template), peak {mem['peak_rss_mib']:.1f} MiB."
        )
    return "\n".join(lines) + "\n"


def plot_report(report: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Draw renders/s per template for llamaprompt and each peer (log scale, horizontal
    bars) into ``path`` (PNG/SVG/PDF by extension). Needs matplotlib
    (``pip install 'llamaprompt[bench]'``); raises ImportError without it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["templates"] if "error" not in r]
    series = ["llamaprompt", "floor", "jinja2", "transformers", "upstream", "server"]
    series = [s for s in series if any(s in r["renders_per_s"] for r in rows)]
    height = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.32 * len(rows) * max(1, len(series)) / 2))
    for i, s in enumerate(series):
        ys = [j + i * height for j in range(len(rows))]
        xs = [r["renders_per_s"].get(s) or 0 for r in rows]
        ax.barh(ys, xs, height=height, label=s)
    ax.set_yticks([j + height * (len(series) - 1) / 2 for j in range(len(rows))])
    ax.set_yticklabels([r["template"].removesuffix(".jinja") for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("renders/s (single thread, log scale)")
    env = report["environment"]
    ax.set_title(f"apply_template throughput, llama.cpp {env['llama_cpp_commit'][:9]}, {env['requests']} requests")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
