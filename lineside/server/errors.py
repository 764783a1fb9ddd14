"""OpenAI-shaped errors ({"error": {"message", "type", "code", "param"}}) for every failure.

Bad input of any kind (malformed JSON, invalid UTF-8, schema violations, a user error from the
runtime) is a 400 with one clear line, never a 500; only a real server bug answers 500.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lineside.errors import LinesideError

log = logging.getLogger("lineside.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


class APIError(Exception):
    """Raised by handlers; rendered as an OpenAI error body with the given HTTP status."""

    def __init__(self, status: int, message: str, code: str | None = None, *, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        message, param = _encodable(message), None if param is None else _encodable(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def _encodable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (``\\ud800``): a message or param naming what the
    client sent (an object's key holding a ``\\ud800`` JSON escape) must still encode as UTF-8, or the 400 is a 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def error_response(status: int, message: str, code: str | None = None, *, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    error = APIError(status, message, code, param=param, headers=headers)
    return JSONResponse(error.body(), status_code=status, headers=error.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tagged-union", "union"}


def _loc_param(loc: tuple[Any, ...]) -> str | None:
    """'messages.0.content' from pydantic's location, without the body prefix and union member tags."""
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and (
        p.lower() in _TYPE_TAGS or "[" in p or p.startswith(("function-", "constrained-")) or p in ("TextPart",
                                                                                                    "OtherPart")))]
    return ".".join(parts) or None


# What a union field takes, said when a value matches none of its forms: pydantic names only the first form it tried
# ("Input should be a valid string" for a prompt list that mixes text and token ids)
UNION_FORMS = {
    "prompt": "send a string, a list of strings, a list of token ids, or a list of token-id lists (not a mix)",
    "stop": "send a string or a list of strings",
    "tool_choice": 'send "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


def validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """One line from pydantic's error list: the first problem, where it is, and a code."""
    errs = exc.errors()
    if not errs:
        return "invalid request body", None, "invalid_request"
    first = errs[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return (f"request body is not valid JSON ({ctx.get('error', 'parse error')}); send a JSON object",
                None, "invalid_json")
    loc = tuple(first.get("loc", ()))
    param = _loc_param(loc)
    top = loc[1] if len(loc) > 1 else None  # union members fail at different depths: group by the field
    same = [err for err in errs if len(err.get("loc", ())) > 1 and err["loc"][1] == top]
    if len(same) > 1:
        param = str(top)
    if kind == "missing" and param is None:
        msg = "request body is empty; send a JSON object"
    elif kind == "missing":
        msg = f"missing required field '{param}'"
    elif param is None:
        msg = f"request body must be a JSON object ({first.get('msg', 'invalid')})"
    elif len(same) > 1:
        msg = f"invalid value for '{param}': it matches none of the accepted types ({first.get('msg', 'invalid')})"
        if param in UNION_FORMS:
            msg += f"; {UNION_FORMS[param]}"
    else:
        msg = f"invalid value for '{param}': {first.get('msg', 'invalid')}"
    # other fields that failed (a union field fails once per member, a non-object body once in all)
    more = len({err["loc"][1] if len(err.get("loc", ())) > 1 else None for err in errs}) - 1
    if more > 0:
        msg += f" (and {more} more problem{'s' if more > 1 else ''})"
    return msg, param, "invalid_value" if kind != "missing" else "missing_field"


def route_path(scope: dict[str, Any]) -> str:
    """The request's path without the ``--root-path`` prefix when it carries it (a proxy that keeps the prefix), as
    Starlette's router matches it: what the middleware's decisions by path (key, body limit, drain) must read."""
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def count_invalid(state: Any, scope: dict[str, Any], *, outcome: str = "invalid") -> None:
    """Count a refused API request (any /v1/ path) as ``outcome`` (``invalid`` unless told) in
    lineside_requests_total, whichever layer refused it (a handler, the body checks, the middleware, the browser
    guard)."""
    if state is not None and route_path(scope).startswith("/v1/"):
        state.metrics.reject(outcome)


def _count_invalid(request: Request) -> None:
    count_invalid(getattr(request.app.state, "lineside", None), request.scope)


def install(app: FastAPI) -> None:
    """Register handlers so every error leaves in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        _count_invalid(request)
        msg, param, code = validation_message(exc)
        return error_response(400, msg, code, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's 400 for a body its client stopped sending
            # the client went away (nobody reads this answer): counted as a client that left, not as a bad request
            count_invalid(getattr(request.app.state, "lineside", None), request.scope, outcome="cancelled")
            return error_response(499, "client disconnected while sending the request body", "client_disconnected")
        if status in (400, 413):
            _count_invalid(request)
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if status == 400 and "parsing the body" in detail:
            # FastAPI's catch-all around json.loads: malformed JSON and bad UTF-8 are answered before it, so what
            # lands here is mostly a body nested past the parser's recursion limit
            cause = exc.__cause__
            if isinstance(cause, RecursionError):
                detail = "request body is JSON nested too deeply to parse; send a flatter JSON object"
            elif isinstance(cause, ValueError) and "digits" in str(cause):  # int()'s limit (sys.get_int_max_str_digits)
                detail = (f"request body holds a number of more than {sys.get_int_max_str_digits()} digits, longer "
                          "than the parser reads; send numbers that fit the fields")
            else:
                detail = "request body could not be parsed; send a JSON object encoded as UTF-8"
            return error_response(400, detail, "invalid_json", headers=exc.headers)
        if status == 404:
            detail = ("no such endpoint; this server has /v1/chat/completions, /v1/completions, /v1/responses "
                      "(create, GET and DELETE by id, GET its input_items, POST cancel), /v1/prefill, /v1/models, "
                      "/tokenize, /detokenize, /version")
        elif status == 405:
            allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
            detail = f"{request.method} is not allowed on {request.url.path}" + (f"; send {allowed}" if allowed
                                                                                  else "")
        return error_response(status, detail, "body_too_large" if status == 413 else None, headers=exc.headers)

    @app.exception_handler(LinesideError)
    async def _user(_: Request, exc: LinesideError) -> JSONResponse:
        param = getattr(exc, "param", None)  # an error that knows the request field it is about names it
        return error_response(400, str(exc), "invalid_request", param=param if isinstance(param, str) else None)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this answer and uvicorn then drops the connection: say so, or a client that
        # pools connections sends its next request into a closed socket and gets a reset
        log.exception("internal error: %s", exc)
        return error_response(500, f"internal server error ({type(exc).__name__}); see the server log",
                              "internal_error", headers={"Connection": "close"})
