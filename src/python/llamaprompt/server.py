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

from .errors import Error
from .template import ChatTemplate

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


def _json_type(value: Any) -> str:
    """nlohmann::json's type_name() of a parsed JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _json_value(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """llama-server's ``json_value(body, key, default)`` for a bool: the value when it is a JSON
    boolean, else (missing, null, another type: "Wrong type supplied") the default."""
    value = body.get(key)
    return value if isinstance(value, bool) else default


def _json_int(value: Any) -> int:
    """nlohmann's ``get<llama_token>()``: a number (an integer wrapped to 32 bits, a float
    truncated, or INT32_MIN past int32 as x86-64's conversion gives) or a boolean as 0/1; an
    Error (500, nlohmann's message) for anything else."""
    if isinstance(value, (bool, int)):
        return (int(value) + 2**31) % 2**32 - 2**31  # static_cast<int32_t>
    if isinstance(value, float):  # static_cast<int32_t>(double): as x86-64 does it past int32
        return int(value) if abs(value) < 2**31 else -(2**31)
    raise Error(f"[json.exception.type_error.302] type must be number, but is {_json_type(value)}", 500)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON")


def _finite_float(text: str) -> float:
    x = float(text)
    if x in (float("inf"), float("-inf")):
        raise ValueError(f"number overflow parsing {text!r}")  # nlohmann's out_of_range.406
    return x


def _int_or_finite(text: str) -> int | float:
    n = int(text)
    return n if -(2**63) <= n < 2**64 else _finite_float(text)  # past 64 bits nlohmann reads a double


def _parsed_as_llama_server(t: ChatTemplate, raw: bytes, parsed: Any) -> None:
    """Raise llama-server's 500 with its JSON parser's message (nlohmann's, taken from llama.cpp's
    parse of ``raw``) for a body that parser refuses and Python's may not: not JSON at all, not
    UTF-8 (Python's reads UTF-16/32 too), NaN/Infinity, a number past a double, a lone surrogate
    escape."""
    bad = parsed is None and raw.strip() != b"null"
    if not bad:
        try:
            text = (raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw).decode("utf-8")
            json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_int_or_finite)
            json.dumps(parsed, ensure_ascii=False).encode("utf-8")
        except (ValueError, UnicodeError):
            bad = True
        except RecursionError:  # (read once already: as deep as Python's parser goes)
            return
    if bad:
        try:
            t.apply_template(raw)
        except Error as e:
            if e.message.startswith(("[json.exception.parse_error", "[json.exception.out_of_range")):
                raise Error(e.message, 500) from None


def _check_token_ids(t: ChatTemplate, ids: list[int]) -> None:
    """The vocab's ``id_to_token.at(id)`` for each id, as llama-server's handlers reach it: a 500
    with libstdc++'s range-check message for the first id out of range."""
    n = t.vocab_size
    for x in ids:
        if not 0 <= x < n:
            raise Error(f"vector::_M_range_check: __n (which is {x % 2**64}) >= this->size() (which is {n})", 500)


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

    def pick(request: Request, body: Any) -> tuple[str, ChatTemplate] | None:
        name = request.query_params.get("model")
        if name is None and isinstance(body, dict) and isinstance(body.get("model"), str):
            name = body["model"]
            if name not in templates:
                name = names[0] if len(names) == 1 else name  # one model: llama-server ignores the field
        name = name or names[0]
        return (name, templates[name]) if name in templates else None

    def unknown_model(name_hint: str | None = None):
        return _error(404, f"model not found; available: {', '.join(names)}")

    async def with_template(request: Request, fn):
        raw = await read_body(request)
        if raw is None:
            return _error(413, f"request body larger than {max_body_bytes} bytes")
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None  # llama.cpp parses the raw body and reports the error
        except RecursionError:
            return _error(400, "request is nested too deeply")
        chosen = pick(request, parsed)
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
        # llama-server's post_tokenize (server-context.cpp): no "content" (or a body that is no
        # object) -> no tokens; flags of the wrong type take their defaults (json_value);
        # content a string, or an array of strings and token ids (tokenize_mixed)
        if getattr(t, "gguf_path", None) is None:
            raise Error("tokenize needs a GGUF-backed model (serve --gguf, trusted)", 501)
        _parsed_as_llama_server(t, raw, parsed)
        if not isinstance(parsed, dict) or "content" not in parsed:
            return {"tokens": []}
        add_special = _json_value(parsed, "add_special", False)
        parse_special = _json_value(parsed, "parse_special", True)
        content = parsed["content"]
        ids: list[int] = []
        for i, part in enumerate(content if isinstance(content, list) else [content]):
            if isinstance(part, str):
                ids += t.tokenize(part, add_special=add_special and i == 0, parse_special=parse_special).tolist()
            elif isinstance(content, list):
                ids.append(_json_int(part))
            else:
                raise Error(f"[json.exception.type_error.302] type must be string, but is {_json_type(part)}", 500)
        if _json_value(parsed, "with_pieces", False):
            _check_token_ids(t, ids)  # (ids given in "content" are returned unchecked without pieces)
            out = []
            for i in ids:
                piece = t.token_to_piece(i)
                try:
                    out.append({"id": i, "piece": piece.decode("utf-8")})
                except UnicodeDecodeError:
                    out.append({"id": i, "piece": list(piece)})
            return {"tokens": out}
        return {"tokens": ids}

    def do_detokenize(t: ChatTemplate, raw: bytes, parsed: Any) -> dict:
        # llama-server's post_detokenize: no "tokens" (or a body that is no object) -> ""; else
        # body.at("tokens").get<llama_tokens>() (an array of numbers), tokens_to_str; its
        # exceptions are 500s
        if getattr(t, "gguf_path", None) is None:
            raise Error("detokenize needs a GGUF-backed model (serve --gguf, trusted)", 501)
        _parsed_as_llama_server(t, raw, parsed)
        if not isinstance(parsed, dict) or "tokens" not in parsed:
            return {"content": ""}
        tokens = parsed["tokens"]
        if not isinstance(tokens, list):
            raise Error(f"[json.exception.type_error.302] type must be array, but is {_json_type(tokens)}", 500)
        ids = [_json_int(x) for x in tokens]
        _check_token_ids(t, ids)
        return {"content": t.detokenize(ids)}

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
        return await with_template(request, do_tokenize)

    async def detokenize(request: Request):
        return await with_template(request, do_detokenize)

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
    """Run the endpoint with uvicorn until interrupted (binds to loopback by default)."""
    try:
        import uvicorn
    except ImportError as e:  # pragma: no cover - depends on the extra
        raise SystemExit('llamaprompt serve needs the server extra: pip install "llamaprompt[server]"') from e
    uvicorn.run(create_app(templates, max_body_bytes=max_body_bytes), host=host, port=port, log_level=log_level)
