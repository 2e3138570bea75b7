"""uvicorn's protocol with a request's head bounded (server/guarded_http.py): a security trial's
one connection streaming header lines took the server to 3.6 GB, and connections that never
finished their head held every file descriptor."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from test_server_support import ThreadServer

from histoinfer.server import guarded_http
from histoinfer.server.guarded_http import MAX_HEAD_BYTES, GuardedHttpToolsProtocol

pytestmark = pytest.mark.timeout(60)


async def ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Every request answered 200 (``/slow`` after 1.5 s; lifespan events acknowledged)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/slow":
        await anyio.sleep(1.5)
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(guarded_http, "HEAD_TIMEOUT_S", 0.5)
        served = ThreadServer(ok, http=GuardedHttpToolsProtocol, timeout_keep_alive=2)
        try:
            yield served
        finally:
            served.stop()


def connect(server: ThreadServer) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    return connection


def response(connection: socket.socket) -> bytes:
    """One of ``ok``'s answers, whole (its body is ``ok``), on a connection kept alive."""
    got = b""
    while not got.endswith(b"\r\n\r\nok"):
        chunk = connection.recv(65536)
        assert chunk, got
        got += chunk
    return got


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


def test_a_whole_head_too_large_in_one_read_is_refused_431(server: ThreadServer) -> None:
    """A head that arrives whole in one read is parsed at once (counted as parsed, not by
    the reads it spans: a review found 70 KB in one read served)."""
    big = b"X-Big: " + b"a" * (MAX_HEAD_BYTES + 1000) + b"\r\n"
    with connect(server) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
        assert answer(connection).startswith(b"HTTP/1.1 431")


def test_one_endless_header_line_is_refused_431(server: ThreadServer) -> None:
    """Regression (a review): httptools buffers a header until its line ends, so counting
    parsed headers let one endless line grow (92 MiB in 8 s) until the head's timeout."""
    with connect(server) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: ")
        with pytest.raises(OSError):  # refused and closed while we still send
            for _ in range(64):
                connection.sendall(b"a" * 16384)
                time.sleep(0.005)
        assert answer(connection).startswith(b"HTTP/1.1 431")


def test_a_head_too_slow_is_refused_408_and_a_silent_connection_closed(
    server: ThreadServer,
) -> None:
    with connect(server) as slow, connect(server) as silent:
        slow.sendall(b"GET /he")
        started = time.monotonic()
        assert answer(slow).startswith(b"HTTP/1.1 408 Request Timeout")
        assert time.monotonic() - started < 5
        assert answer(silent) == b""  # closed after the keep-alive timeout (2 s here)
        assert 1.5 < time.monotonic() - started < 10


def test_a_stray_line_end_after_a_response_starts_the_clock(server: ThreadServer) -> None:
    """Regression (a review): a bare CRLF cancelled uvicorn's keep-alive timer and began no
    request, so the connection had no timer at all and stayed open for ever."""
    with connect(server) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert response(connection).startswith(b"HTTP/1.1 200")
        connection.sendall(b"\r\n")
        started = time.monotonic()
        assert answer(connection).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - started < 1.8  # the head's 0.5 s, not the keep-alive's 2


def test_a_pipelined_head_behind_a_slow_response_is_refused_after_it(
    server: ThreadServer,
) -> None:
    """Regression (a review): the head's timer, firing while the response before it ran,
    was not set again: that head then had no time limit."""
    with connect(server) as connection:
        connection.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nX-")
        got = answer(connection)
        assert got.startswith(b"HTTP/1.1 200") and b"\r\n\r\nokHTTP/1.1 408" in got


def test_a_kept_alive_connection_is_timed_out_only_in_a_head(server: ThreadServer) -> None:
    """The head's timer stops with its head: a connection idle past it between requests (for
    less than the keep-alive timeout) is served, and a second slow head refused."""
    with connect(server) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert response(connection).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # twice the head's timeout; under uvicorn's keep-alive timeout (5 s)
        connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert response(connection).startswith(b"HTTP/1.1 200")
        connection.sendall(b"GET / HTTP/1.1\r\n")
        assert b"HTTP/1.1 408 Request Timeout" in answer(connection)  # after the 200's end
