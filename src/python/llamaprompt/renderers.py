"""Other chat-template renderers, driven the way their users drive them -- for comparing
them with llama.cpp (the reference oracle's scoreboard) and for replaying llama.cpp's exact
template inputs in another engine.

- :class:`Jinja2Renderer` -- Python's Jinja2 (``pip install jinja2``), configured as Hugging
  Face transformers configures it for chat templates: ``trim_blocks``, ``lstrip_blocks``, the
  ``loopcontrols`` extension, ``tojson`` without ASCII escaping, and the ``raise_exception`` and
  ``strftime_now`` globals. Not sandboxed: templates are trusted here.
- :class:`TransformersRenderer` -- transformers' own chat-template rendering
  (``transformers.utils.chat_template_utils.render_jinja_template``, what
  ``apply_chat_template`` runs).
- :class:`MinijinjaRenderer` -- minijinja's Python binding (``pip install minijinja``).
- :class:`HFJinjaRenderer` -- Hugging Face's JavaScript ``@huggingface/jinja`` (npm), run with
  node (``npm install --prefix DIR @huggingface/jinja``; DIR from ``LLAMAPROMPT_HF_JINJA_DIR``,
  default ``~/.cache/llamaprompt/npm``).

Each renderer takes a request as its users give it: ``render_request(source, request,
bos_token=..., eos_token=...)`` passes the OpenAI request's raw ``messages`` and ``tools``,
``bos_token``/``eos_token``, ``add_generation_prompt`` (default true) and the
``chat_template_kwargs`` as template variables -- no normalization, no BOS stripping.
:func:`available_renderers` lists those installed.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "Jinja2Renderer",
    "TransformersRenderer",
    "MinijinjaRenderer",
    "HFJinjaRenderer",
    "available_renderers",
    "request_context",
]


def request_context(request: Mapping[str, Any], bos_token: str = "", eos_token: str = "") -> dict[str, Any]:
    """The template variables a renderer given this OpenAI request would use: raw ``messages``,
    ``tools`` (when any), ``bos_token``, ``eos_token``, ``add_generation_prompt`` (the request's,
    default true as llama-server's) and each ``chat_template_kwargs`` entry (and a top-level
    ``reasoning_effort``, which llama-server also passes to the template)."""
    context: dict[str, Any] = {"messages": request.get("messages", [])}
    if request.get("tools"):
        context["tools"] = request["tools"]
    context["bos_token"] = bos_token
    context["eos_token"] = eos_token
    context["add_generation_prompt"] = bool(request.get("add_generation_prompt", True))
    if isinstance(request.get("reasoning_effort"), str):
        context["reasoning_effort"] = request["reasoning_effort"]
    kwargs = request.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping):
        context.update(kwargs)
    return context


class _Renderer:
    name = ""

    def render(self, source: str, context: Mapping[str, Any]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def render_request(
        self, source: str, request: Mapping[str, Any], *, bos_token: str = "", eos_token: str = ""
    ) -> str:
        """Render ``source`` for an OpenAI request (:func:`request_context`)."""
        return self.render(source, request_context(request, bos_token, eos_token))

    def render_many(self, jobs: list[tuple[str, Mapping[str, Any]]]) -> list[str | Exception]:
        """``render`` for each (source, context), each result the text or the exception raised."""
        out: list[str | Exception] = []
        for source, context in jobs:
            try:
                out.append(self.render(source, context))
            except Exception as e:  # noqa: BLE001 - a renderer's failure of any kind is its answer
                out.append(e)
        return out


class Jinja2Renderer(_Renderer):
    """Jinja2, as transformers sets it up for chat templates.

    ``render(source, context)`` renders a template text with a context (a mapping of template
    variables, e.g. :meth:`llamaprompt.ChatTemplate.template_inputs`'s ``context``) and returns
    the text. Raises ImportError without jinja2; Jinja2's own exceptions (``TemplateSyntaxError``,
    ``UndefinedError``, ``TemplateError`` from ``raise_exception``) pass through.
    """

    name = "jinja2"

    def __init__(self) -> None:
        try:
            import jinja2
        except ImportError as e:  # pragma: no cover - depends on the extra
            raise ImportError("Jinja2Renderer needs jinja2: pip install jinja2") from e
        self._jinja2 = jinja2
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:  # fmt: skip
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: _dt.datetime.now().strftime(fmt)
        self.environment = env
        self._compiled: dict[str, Any] = {}

    @property
    def version(self) -> str:
        return str(self._jinja2.__version__)

    def render(self, source: str, context: Mapping[str, Any]) -> str:
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = self.environment.from_string(source)
        return str(template.render(**context))


class TransformersRenderer(_Renderer):
    """transformers' ``render_jinja_template`` (its compiled, sandboxed Jinja2 environment), given
    the conversation, tools, ``add_generation_prompt`` and the other variables as keyword
    arguments, as ``apply_chat_template`` passes them. Raises ImportError without transformers."""

    name = "transformers"

    def __init__(self) -> None:
        try:
            import transformers
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError as e:  # pragma: no cover - depends on the extra
            raise ImportError("TransformersRenderer needs transformers: pip install transformers") from e
        # transformers' own signature (its annotations differ between releases)
        self._render: Any = render_jinja_template
        self.version = str(transformers.__version__)

    def render(self, source: str, context: Mapping[str, Any]) -> str:
        ctx = dict(context)
        messages = ctx.pop("messages", [])
        tools = ctx.pop("tools", None)
        add = bool(ctx.pop("add_generation_prompt", False))
        rendered, _ = self._render(
            conversations=[messages], tools=tools, chat_template=source, add_generation_prompt=add, **ctx
        )
        return str(rendered[0])


class MinijinjaRenderer(_Renderer):
    """minijinja (Rust, Python binding) with Python compatibility (``pycompat``: ``.items()``,
    ``.startswith()`` ...), ``trim_blocks``/``lstrip_blocks`` and the ``raise_exception`` and
    ``strftime_now`` functions. Raises ImportError without minijinja."""

    name = "minijinja"

    def __init__(self) -> None:
        try:
            import minijinja
        except ImportError as e:  # pragma: no cover - depends on the extra
            raise ImportError("MinijinjaRenderer needs minijinja: pip install minijinja") from e
        env: Any = minijinja.Environment()  # (minijinja's stub lacks add_function)
        env.trim_blocks = True
        env.lstrip_blocks = True
        env.pycompat = True

        def raise_exception(message: str) -> None:
            raise RuntimeError(message)

        env.add_function("raise_exception", raise_exception)
        env.add_function("strftime_now", lambda fmt: _dt.datetime.now().strftime(fmt))
        self._env = env
        try:
            from importlib.metadata import version

            self.version = version("minijinja")
        except Exception:  # noqa: BLE001 - metadata is optional
            self.version = "?"

    def render(self, source: str, context: Mapping[str, Any]) -> str:
        return str(self._env.render_str(source, **context))


_HF_SCRIPT = r"""
const path = require("path");
const { Template } = require(path.join(process.argv[1], "node_modules", "@huggingface", "jinja"));
let input = "";
process.stdin.on("data", (d) => (input += d));
process.stdin.on("end", () => {
  const jobs = JSON.parse(input);
  const cache = new Map();
  const out = jobs.map(([source, context]) => {
    try {
      let t = cache.get(source);
      if (!t) { t = new Template(source); cache.set(source, t); }
      return { text: t.render(context) };
    } catch (e) {
      return { error: String(e && e.message ? e.message : e) };
    }
  });
  process.stdout.write(JSON.stringify(out));
});
"""


class HFJinjaRenderer(_Renderer):
    """Hugging Face's ``@huggingface/jinja`` (what transformers.js runs), in one node process
    per :meth:`render_many` batch. Raises ImportError when node or the package is missing."""

    name = "@huggingface/jinja"

    def __init__(self, prefix: str | None = None) -> None:
        import os
        import shutil
        from pathlib import Path

        self._node = shutil.which("node")
        default = Path(os.environ.get("LLAMAPROMPT_CACHE_DIR", Path.home() / ".cache" / "llamaprompt")) / "npm"
        self._prefix = Path(prefix or os.environ.get("LLAMAPROMPT_HF_JINJA_DIR") or default)
        package = self._prefix / "node_modules" / "@huggingface" / "jinja" / "package.json"
        if not self._node or not package.exists():
            raise ImportError(
                f"HFJinjaRenderer needs node and @huggingface/jinja in {self._prefix} "
                f"(npm install --prefix {self._prefix} @huggingface/jinja)"
            )
        self._node_path: str = self._node
        self.version = json.loads(package.read_text(encoding="utf-8")).get("version", "?")

    def render_many(self, jobs: list[tuple[str, Mapping[str, Any]]]) -> list[str | Exception]:
        import subprocess

        payload = json.dumps([[s, dict(c)] for s, c in jobs], ensure_ascii=False)
        proc = subprocess.run(
            [self._node_path, "-e", _HF_SCRIPT, str(self._prefix)],
            input=payload.encode("utf-8"),
            capture_output=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"node failed: {proc.stderr.decode('utf-8', 'replace')[-2000:]}")
        results = json.loads(proc.stdout)
        return [r["text"] if "text" in r else RuntimeError(r.get("error", "error")) for r in results]

    def render(self, source: str, context: Mapping[str, Any]) -> str:
        result = self.render_many([(source, context)])[0]
        if isinstance(result, Exception):
            raise result
        return result


def available_renderers() -> dict[str, _Renderer]:
    """name -> renderer for each of the four whose library is installed."""
    out: dict[str, _Renderer] = {}
    for cls in (TransformersRenderer, Jinja2Renderer, MinijinjaRenderer, HFJinjaRenderer):
        try:
            r = cls()
        except ImportError:
            continue
        out[r.name] = r
    return out
