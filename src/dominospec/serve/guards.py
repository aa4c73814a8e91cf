"""The checks every request passes before routing and parsing: bearer key, then body size.

`Guards` is the outermost ASGI middleware of the built-in server.
- Key: when one is configured (the env var named by `serve.api_key_env` is set and non-empty),
  every `/v1/*` request needs `Authorization: Bearer <key>`, else 401. `/health` and
  `/server_info` stay open (load balancers and monitors probe them).
- Size: a declared Content-Length above `max_body_bytes` gets 413 before a byte is read; a body
  without one (chunked) is counted as it arrives and gets 413 as soon as it passes the limit.
"""

from __future__ import annotations

import hmac
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dominospec.serve.errors import ApiError


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (serve.max_body_bytes)", None, "body_too_large")


class Guards:
    """ASGI middleware: 401 without the bearer key on /v1/*, 413 above `max_body_bytes`."""

    def __init__(self, app: ASGIApp, api_key: Optional[str], max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-case byte names; the last value of a repeated header wins
        if self.expected and scope["path"].startswith("/v1/") and not self._authorized(headers.get(b"authorization")):
            error = ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`", None,
                             "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                error = ApiError(400, "invalid Content-Length header", None, "invalid_header")
                await error.response()(scope, receive, send)
                return
            if int(declared) > self.max_body_bytes:
                await body_too_large(self.max_body_bytes).response()(scope, receive, send)
                return
        await self.app(scope, self._counting(receive), send)

    def _authorized(self, header: Optional[bytes]) -> bool:
        return header is not None and hmac.compare_digest(header, self.expected)

    def _counting(self, receive: Receive) -> Receive:
        """`receive` that raises ApiError 413 once the body passes the limit (the app renders it)."""
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise body_too_large(self.max_body_bytes)
            return message

        return counted
