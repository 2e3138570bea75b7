"""``--access-log``: one line a request, the same under uvicorn and hypercorn.

The servers' own access logs said neither how long a request took nor which request it was
(its ``X-Request-ID``), left out a request whose client hung up (uvicorn), and differed from one
server to the other. This one wraps the whole application, so it sees every answer, an
unhandled error's 500 included, and the 499 of a client that hung up.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .problems import REQUEST_ID

__all__ = ["AccessLog"]

log = logging.getLogger("histoinfer.access")

_REQUEST_ID = REQUEST_ID.encode()


class AccessLog:
    """ASGI middleware: after each HTTP request, an info line on ``histoinfer.access``::

        127.0.0.1:50312 "POST /api/predict/h1 HTTP/1.1" 200 6.1 KB 12.4 ms id=4f1c9a

    (the client's address, the request line, the status, the bytes of the answer's body, the
    time from the request's arrival to its answer's last byte, and its request ID when it has
    one: the one it sent, or the one an error's answer was given).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0
        sent = 0
        request_id: bytes | None = None

        async def watch(message: Message) -> None:
            nonlocal status, sent, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() == _REQUEST_ID:
                        request_id = value
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if log.isEnabledFor(logging.INFO):
                client, target = _client(scope), _target(scope)
                version = scope.get("http_version", "1.1")
                elapsed_ms = (time.perf_counter() - start) * 1000.0
                named = None if request_id is None else request_id.decode("latin-1")
                log.info(
                    '%s "%s %s HTTP/%s" %s %s %.1f ms%s',
                    client,
                    scope["method"],
                    target,
                    version,
                    status or "-",  # nothing answered: the connection ended first
                    _size(sent),
                    elapsed_ms,
                    "" if named is None else f" id={named}",
                    # the same as fields, for --log-format json
                    extra={
                        "client": client,
                        "method": scope["method"],
                        "path": target,
                        "http_version": version,
                        "status": status or None,
                        "bytes": sent,
                        "duration_ms": round(elapsed_ms, 3),
                        "request_id": named,
                    },
                )


def _client(scope: Scope) -> str:
    client = scope.get("client")
    if not client:
        return "-"
    host, port = client
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _target(scope: Scope) -> str:
    # The path as it was sent (percent-encoded): scope["path"] is decoded, and a %0A in it
    # would start a forged line in the log.
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else scope["root_path"] + scope["path"]
    query: bytes = scope.get("query_string", b"")
    return f"{path}?{query.decode('latin-1')}" if query else path


def _size(count: int) -> str:
    if count < 1000:
        return f"{count} B"
    if count < 1_000_000:
        return f"{count / 1000:.1f} KB"
    return f"{count / 1_000_000:.1f} MB"
