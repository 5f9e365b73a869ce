"""A model-free HTTP endpoint with llama-server's paths and JSON shapes.

    pip install "llamaprompt[server]"
    llamaprompt serve --template T.jinja [--template U.jinja ...] [--gguf M.gguf ...] [--port 8080]

Routes (llama-server's): ``POST /apply-template``, ``GET /props``, ``POST /tokenize``,
``POST /detokenize`` (GGUF-backed templates), ``GET /health``, ``GET /models`` and
``/v1/models``; and llamaprompt's own ``POST /llamaprompt/template-inputs`` (a chat request
body -> :meth:`ChatTemplate.template_inputs` as JSON) and ``POST /llamaprompt/render-inputs``
(``{"context": {...}, "variant": ...}`` -> ``{"text": ...}``, llama.cpp's engine alone).
Several templates are served at once; a request picks one with a
``"model"`` field in its body or ``?model=NAME`` (default: the first). Errors use
llama-server's status codes and ``{"error": {"code", "message", "type"}}`` body.

Built on Starlette + uvicorn (the ``server`` extra). Rendering runs in a thread pool; the
GIL is released inside llama.cpp, so requests are served in parallel. With ``--untrusted``
every template runs in a sandboxed worker process (llamaprompt.sandbox): a template that
loops or crashes costs that request a 500 error, not the server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .errors import Error, FeatureError
from .template import ChatTemplate
from .tree import require

__all__ = ["create_app", "serve", "DEFAULT_MAX_BODY_BYTES"]

#: Bodies larger than this are refused with 413 (llama-server has no such limit; a
#: public-facing oracle needs one).
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def _json_response_class():
    """starlette's JSONResponse, writing bytes that were not UTF-8 (a template file in another
    encoding, a prompt cut inside a character) as U+FFFD, as llama-server's JSON does."""
    import json

    from starlette.responses import JSONResponse

    from .text import json_safe

    class SafeJSONResponse(JSONResponse):
        def render(self, content: Any) -> bytes:
            return json_safe(json.dumps(content, ensure_ascii=False, separators=(",", ":"))).encode("utf-8")

    return SafeJSONResponse


def _error(status: int, message: str, kind: str | None = None):
    JSONResponse = _json_response_class()  # noqa: N806 - a class

    kind = kind or {
        400: "invalid_request_error",
        404: "not_found_error",
        413: "invalid_request_error",
        501: "not_supported_error",
    }.get(status, "server_error")
    return JSONResponse({"error": {"code": status, "message": message, "type": kind}}, status_code=status)


def _has_vocab(t: Any) -> bool:
    """Whether ``t`` was loaded from a GGUF file in this process (its vocab at hand)."""
    return getattr(t, "gguf_path", None) is not None and getattr(t, "_model", None) is not None


def _vocab_handler(t: ChatTemplate, handler: str, raw: bytes) -> Any:
    """llama-server's ``post_tokenize`` / ``post_detokenize`` (server-context.cpp) run on ``raw``
    as it runs them: their bodies compiled from the tree (``_core.post_tokenize`` /
    ``post_detokenize``, src/cpp/server_tokenize.cpp), so the body's parse, the flags' defaults
    (json_value), mixed content (tokenize_mixed), the ids' casts and every error message are
    nlohmann's and llama.cpp's. Returns the response's JSON; raises Error with llama-server's
    status (500 for what the handler throws, 501 without a GGUF vocab or the handlers)."""
    if not _has_vocab(t):
        raise Error(f"{handler[5:]} needs a GGUF-backed model (serve --gguf, trusted)", 501)
    model = t._model
    try:
        require("serve_tokenize", f"POST /{handler[5:]}", t._lib)
    except FeatureError as e:
        raise Error(e.message, 501) from None
    status, text = getattr(t._lib, handler)(model, raw)
    out = json.loads(text)
    if status != 200:
        raise Error(out["error"]["message"], status)
    return out


def create_app(templates: Mapping[str, Any], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """A Starlette app serving ``templates`` (name -> ChatTemplate, or UntrustedTemplate for
    templates that must run in a sandboxed worker; the first is the default)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.routing import Route

    JSONResponse = _json_response_class()  # noqa: N806 - a class

    if not templates:
        raise ValueError("serve needs at least one template")
    names = list(templates)
    # /tokenize and /detokenize need a vocab: their default is the first model served from a GGUF
    vocab_default = next((n for n in names if _has_vocab(templates[n])), names[0])

    async def read_body(request: Request) -> bytes | None:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            return None
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                return None
        return body

    def pick(request: Request, body: Any, default: str = names[0]) -> tuple[str, ChatTemplate] | None:
        name = request.query_params.get("model")
        if name is None and isinstance(body, dict) and isinstance(body.get("model"), str):
            name = body["model"]
            if name not in templates:
                name = names[0] if len(names) == 1 else name  # one model: llama-server ignores the field
        name = name or default
        return (name, templates[name]) if name in templates else None

    def unknown_model(name_hint: str | None = None):
        return _error(404, f"model not found; available: {', '.join(names)}")

    async def with_template(request: Request, fn, default: str = names[0]):
        raw = await read_body(request)
        if raw is None:
            return _error(413, f"request body larger than {max_body_bytes} bytes")
        try:
            parsed = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            # llama.cpp parses the raw body and reports the error; a body deeper than Python's
            # reader goes (its "model" field unread) to llama.cpp, which reads it as llama-server
            parsed = None
        chosen = pick(request, parsed, default)
        if chosen is None:
            return unknown_model()
        try:
            return JSONResponse(await run_in_threadpool(fn, chosen[1], raw, parsed))
        except Error as e:
            status = e.status or 500
            return _error(status, e.message)
        except (TypeError, ValueError) as e:
            return _error(400, str(e))

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def props(request: Request):
        chosen = pick(request, None)
        if chosen is None:
            return unknown_model()
        name, t = chosen
        data = dict(t.props())
        data["model_alias"] = name
        data.setdefault("modalities", {"vision": True, "audio": True, "video": True})  # as props() reports them
        return JSONResponse(data)

    async def models(request: Request):
        return JSONResponse(
            {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "llamaprompt"} for n in names]}
        )

    def do_apply(t: ChatTemplate, raw: bytes, parsed: Any) -> dict:
        return {"prompt": t.apply_template(raw)}

    def do_tokenize(t: ChatTemplate, raw: bytes, parsed: Any) -> dict:
        return _vocab_handler(t, "post_tokenize", raw)

    def do_detokenize(t: ChatTemplate, raw: bytes, parsed: Any) -> dict:
        return _vocab_handler(t, "post_detokenize", raw)

    def do_inputs(t: ChatTemplate, raw: bytes, parsed: Any) -> dict:
        if not hasattr(t, "template_inputs"):
            raise Error("template inputs need a trusted template (not --untrusted)", 501)
        return t.template_inputs(raw)

    def do_render_inputs(t: ChatTemplate, raw: bytes, parsed: Any) -> dict:
        if not hasattr(t, "render_inputs"):
            raise Error("render-inputs needs a trusted template (not --untrusted)", 501)
        if not isinstance(parsed, dict) or not isinstance(parsed.get("context"), dict):
            raise TypeError('body must be {"context": {...template variables...}, "variant": optional}')
        return {"text": t.render_inputs(parsed["context"], variant=parsed.get("variant"))}

    async def apply_template(request: Request):
        return await with_template(request, do_apply)

    async def template_inputs(request: Request):
        return await with_template(request, do_inputs)

    async def render_inputs(request: Request):
        return await with_template(request, do_render_inputs)

    async def tokenize(request: Request):
        return await with_template(request, do_tokenize, vocab_default)

    async def detokenize(request: Request):
        return await with_template(request, do_detokenize, vocab_default)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/props", props, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/apply-template", apply_template, methods=["POST"]),
        # llamaprompt's own: ChatTemplate.template_inputs / render_inputs
        Route("/llamaprompt/template-inputs", template_inputs, methods=["POST"]),
        Route("/llamaprompt/render-inputs", render_inputs, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    from starlette.exceptions import HTTPException

    async def http_error(request: Request, exc: HTTPException):
        # unknown paths and methods answer with llama-server's JSON error body too
        return _error(exc.status_code, str(exc.detail))

    handlers: dict[Any, Any] = {HTTPException: http_error}
    return Starlette(routes=routes, exception_handlers=handlers)


def serve(
    templates: Mapping[str, ChatTemplate],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
) -> None:
    """Run the endpoint with uvicorn until interrupted (binds to loopback by default).

    Raises ImportError, saying what to install, without starlette and uvicorn (the "server" extra)."""
    try:
        import uvicorn
    except ImportError as e:  # pragma: no cover - depends on the extra
        raise ImportError(
            'serve needs starlette and uvicorn (the "server" extra): pip install starlette uvicorn'
        ) from e
    uvicorn.run(create_app(templates, max_body_bytes=max_body_bytes), host=host, port=port, log_level=log_level)
