"""uvicorn's httptools protocol with what it lacks against a hostile client: a bound on a
request's head (its request line and headers) in bytes and in time.

uvicorn keeps every header a request sends, with no limit, until the head ends; and it times
out only idle keep-alive connections, not a head that never ends. A security trial's one
connection streamed header lines and took the server from 313 MB to 3.6 GB in 10 s, and
20,000 connections that each sent ``GET /he`` and nothing more held the server's every file
descriptor (a good client waited 19 s). hypercorn (h11) answers 431 and closes such
connections after its keep-alive timeout; this does the same for uvicorn: a head over
:data:`MAX_HEAD_BYTES` is answered ``431``, and one not complete :data:`HEAD_TIMEOUT_S` after
the connection opened (or after its request's first byte, on a kept-alive connection) is
answered ``408``; both close the connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HEAD_TIMEOUT_S", "MAX_HEAD_BYTES", "GuardedHttpToolsProtocol"]

#: the most bytes of request line and headers a request may send (nginx's default buffers
#: hold 32 KiB, h11's 16 KiB)
MAX_HEAD_BYTES = 64 * 1024
#: the most seconds a request's head may take to arrive
HEAD_TIMEOUT_S = 10.0


class _HeadTooLarge(Exception):
    pass


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with the request head bounded in bytes and in time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._head_too_large = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that sends nothing is timed out too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        if self._head_timer is None:  # the next request on a kept-alive connection
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        # httptools reports a callback's exception as a parse error, which uvicorn answers 400.
        if self._head_too_large:
            self._refuse(431, "Request Header Fields Too Large")
        else:
            super().send_400_response(msg)

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise _HeadTooLarge

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_too_slow)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # its head arrived; the app is answering it
        if self._head_bytes:
            self._refuse(408, "Request Timeout")
        else:
            self.transport.close()  # nothing sent: nothing to answer

    def _refuse(self, status: int, phrase: str) -> None:
        body = f"request head {'too large' if status == 431 else 'too slow'}".encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, phrase.encode(), len(body), body)
        )
        self.transport.close()
