"""uvicorn's protocol with a request's head bounded (server/guarded_http.py): a security trial's
one connection streaming header lines took the server to 3.6 GB, and connections that never
finished their head held every file descriptor."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_server_support import ThreadServer

from histoinfer.server import guarded_http
from histoinfer.server.guarded_http import MAX_HEAD_BYTES, GuardedHttpToolsProtocol

pytestmark = pytest.mark.timeout(60)


async def ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Every request answered 200 (lifespan events acknowledged)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(guarded_http, "HEAD_TIMEOUT_S", 0.5)
        served = ThreadServer(ok, http=GuardedHttpToolsProtocol)
        try:
            yield served
        finally:
            served.stop()


def connect(server: ThreadServer) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    return connection


def answer(connection: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    got = b""
    while chunk := connection.recv(65536):
        got += chunk
    return got


def test_a_head_too_large_is_refused_431(server: ThreadServer) -> None:
    line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
    with connect(server) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + line * 70)  # never ended
        assert answer(connection).startswith(b"HTTP/1.1 431 Request Header Fields Too Large")
    with connect(server) as connection:  # a large head within the bound is served
        big = b"X-Big: " + b"a" * (MAX_HEAD_BYTES - 200) + b"\r\n"
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + big + b"\r\n")
        assert answer(connection).startswith(b"HTTP/1.1 200")


def test_a_head_too_slow_is_refused_408_and_a_silent_connection_closed(
    server: ThreadServer,
) -> None:
    with connect(server) as slow, connect(server) as silent:
        slow.sendall(b"GET /he")
        started = time.monotonic()
        assert answer(slow).startswith(b"HTTP/1.1 408 Request Timeout")
        assert answer(silent) == b""
        assert time.monotonic() - started < 10


def test_a_kept_alive_connection_is_timed_out_only_in_a_head(server: ThreadServer) -> None:
    """The head's timer stops with its head: a connection idle past it between requests (for
    less than the keep-alive timeout) is served, and a second slow head refused."""
    with connect(server) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert connection.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # twice the head's timeout; under uvicorn's keep-alive timeout (5 s)
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert connection.recv(65536).startswith(b"HTTP/1.1 200")
        connection.sendall(b"GET / HTTP/1.1\r\n")
        assert b"HTTP/1.1 408 Request Timeout" in answer(connection)  # after the 200's end
