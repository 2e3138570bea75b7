"""uvicorn's httptools protocol with what it lacks against a hostile client: a bound on a
request's head (its request line and headers) in bytes and in time.

uvicorn keeps every header a request sends, with no limit, until the head ends; and it times
out only idle keep-alive connections, not a head that never ends. A security trial's one
connection streamed header lines and took the server from 313 MB to 3.6 GB in 10 s, and
20,000 connections that each sent ``GET /he`` and nothing more held the server's every file
descriptor (a good client waited 19 s). hypercorn (h11) answers 431 and closes such
connections; this does the same for uvicorn:

- a head's bytes are counted as they are parsed, and across the reads a head spans
  (httptools buffers a header until its line ends, so counting parsed headers alone missed
  one endless header line): past :data:`MAX_HEAD_BYTES`, ``431`` and the connection closed;
- a head not complete :data:`HEAD_TIMEOUT_S` after its first byte (a stray CRLF between
  requests included) is answered ``408`` and the connection closed; should a response to an
  earlier, pipelined request still be running then, once that response has gone;
- a new connection that sends nothing is closed after the keep-alive timeout, as an idle
  kept-alive one is (``--keep-alive-timeout``: a load balancer's pre-opened connections wait
  that long, not less).

Each refusal is logged (once a minute at most: ``ThrottledInvalidRequests``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HEAD_TIMEOUT_S", "MAX_HEAD_BYTES", "GuardedHttpToolsProtocol"]

#: the most bytes of request line and headers a request may send (nginx's default buffers
#: hold 32 KiB, h11's 16 KiB)
MAX_HEAD_BYTES = 64 * 1024
#: the most seconds a request's head may take to arrive, from its first byte
HEAD_TIMEOUT_S = 10.0
#: how often a head past its time looks again whether the response before it has gone
_RECHECK_S = 0.5


class _HeadTooLarge(Exception):
    pass


HEAD_TOO_LARGE = "Request head too large."
HEAD_TOO_SLOW = "Request head too slow."
#: each refusal: its status line's phrase, its log line, its body
_REFUSALS = {
    431: ("Request Header Fields Too Large", HEAD_TOO_LARGE, b"request head too large"),
    408: ("Request Timeout", HEAD_TOO_SLOW, b"request head too slow"),
}

log = logging.getLogger("uvicorn.error")


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with the request head bounded in bytes and in time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the bytes now arriving belong to a request's head (or to the gap before one)
        self._in_head = True
        self._head_bytes = 0
        self._messages = 0  # requests parsed whole, to see one end within a chunk
        self._begun = False  # a request's first bytes parsed, its head not yet whole
        self._parsed = 0  # the bytes of its head parsed so far
        self._parsed_too_large = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Nothing sent yet: closed as an idle kept-alive connection is (uvicorn's own timer,
        # which the first byte cancels).
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        in_head, messages = self._in_head, self._messages
        super().data_received(data)
        if not self._in_head or self.transport.is_closing():
            return
        if in_head and self._messages == messages:  # all of it one head, or the gap before
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431)
                return
            begun = True  # (a stray line end before a request too)
        else:  # a request ended in it: does a next one's head (uncounted) follow it?
            begun = self._begun
        if begun and self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_too_slow)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun = True
        self._parsed = 0

    # A head that arrives whole in one read (up to 256 KiB) is counted here, as it is parsed;
    # data_received counts the reads a head spans (a header line httptools has not ended).
    def on_url(self, url: bytes) -> None:
        self._count_parsed(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_parsed(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_parsed(self, size: int) -> None:
        self._parsed += size
        if self._parsed > MAX_HEAD_BYTES and self._in_head:  # (not a chunked body's trailers)
            self._parsed_too_large = True
            raise _HeadTooLarge  # httptools reports it as a parse error: send_400_response

    def send_400_response(self, msg: str) -> None:
        if self._parsed_too_large:
            self._refuse(431)
        else:
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._begun = True, False  # what follows is the next request's head
        self._messages += 1

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head behind a response still running: refused after it, not in it.
            self._head_timer = self.loop.call_later(_RECHECK_S, self._head_too_slow)
            return
        self._refuse(408)

    def _refuse(self, status: int) -> None:
        phrase, said, body = _REFUSALS[status]
        log.warning(said)
        self._disarm_head_timer()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, phrase.encode(), len(body), body)
        )
        self.transport.close()
