"""Errors in OpenAI's shape, so every client sees one format whatever went wrong.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}

`ApiError` is raised anywhere while a request is handled. `install_handlers` turns it, FastAPI's
validation errors (400, not 422), routing errors (404, 405) and any unexpected exception (500; the
server keeps serving, and the client's keep-alive connection stays open: `InternalErrors`) into
that body. 4xx errors have type `invalid_request_error`, 5xx
`server_error`; `param` names the offending field (dotted, `messages[0].content`) or is null.
"""

from __future__ import annotations

import traceback
from typing import Any, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ROUTING_CODES = {404: "not_found", 405: "method_not_allowed"}


class ApiError(Exception):
    """An HTTP error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def field_name(loc: Sequence[Any]) -> Optional[str]:
    """pydantic error location ('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    name = ""
    for part in loc:
        if part == "body" and not name:
            continue
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or None


def validation_error(errors: Sequence[dict[str, Any]]) -> ApiError:
    """pydantic / FastAPI error list -> ApiError 400 naming the first offending field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    param = field_name(first.get("loc", ()))
    kind, msg = first.get("type", ""), first.get("msg", "invalid value")
    if kind == "missing":
        message = f"'{param}' is required" if param else "the request body is required"
        return ApiError(400, message, param, "missing_field")
    if kind == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", None, "invalid_json")
    msg = msg.removeprefix("Value error, ")
    if "input" in first and kind not in ("model_attributes_type", "dict_type"):
        shown = repr(first["input"])
        msg += f" (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
    return ApiError(400, f"'{param}': {msg}" if param else msg, param, "invalid_value")


def internal_error(err: Exception) -> ApiError:
    return ApiError(500, f"internal error: {type(err).__name__}", None, "internal_error")


class InternalErrors:
    """ASGI middleware: an unexpected exception -> 500 in OpenAI's shape, traceback printed, connection kept.

    Starlette's catch-all handler answers the 500 but then re-raises, and uvicorn resets the
    connection: the client's next request on that keep-alive connection failed too. An exception
    after the response has started (a stream) still propagates: the body is cut, the connection must go.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as err:
            if started or scope["type"] != "http":
                raise
            traceback.print_exc()
            await internal_error(err).response()(scope, receive, send)


def install_handlers(app: FastAPI) -> None:
    """Route every error raised while handling a request to an OpenAI-shaped JSON response."""
    app.add_middleware(InternalErrors)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(err.status_code, str(err.detail))
        return ApiError(err.status_code, message, None, ROUTING_CODES.get(err.status_code), err.headers).response()

    @app.exception_handler(Exception)  # Starlette re-raises it afterwards: uvicorn logs the traceback
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        return internal_error(err).response()
