"""``HttpClient``: the ``Client`` protocol against the histoinfer microservice, over httpx.

A drop-in for :class:`~histoinfer.InProcessClient`: the same calls return the same JSON strings,
and a failure raises the same exception class with the same message, mapped back from the
server's RFC 9457 problem+json. It imports neither torch nor the models nor the batcher, so it
loads fast wherever the model does not run.

Sync and async calls share one request/retry policy (:class:`_Attempt`) and differ only in how
they wait. The sync side uses thread-safe ``httpx.Client`` objects. An ``httpx.AsyncClient`` binds
to the event loop it first runs on, so the async side keeps one pool per running loop (asyncio
or trio, any number of threads), and closes each pool on its own loop when the loop ends or
the client is closed.

At most ``max_in_flight`` requests are on the wire at once: per event loop for async calls (an
``anyio.Semaphore`` in each loop's pool), and across all threads for sync calls (a
``threading.BoundedSemaphore``). httpcore scans every connection of its pool each time a
request starts or ends, so a pool of hundreds of busy connections costs the client more CPU than
the requests themselves; for the same reason the connections (each loop's, and the sync
calls') are split over several httpx clients of at most 4 (see :class:`_Shards` and
``docs/server.md``), which share one cookie jar and one TLS context (:class:`_ClientOptions`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import difflib
import email.utils
import functools
import inspect
import json
import logging
import math
import os
import random
import re
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Generic, TypeGuard, TypeVar
from urllib.parse import quote

import anyio
import anyio.lowlevel
import httpx
import pydantic_core
import sniffio

from ..arguments import check_count, check_seconds
from ..errors import (
    ClientClosedError,
    InferenceError,
    InvalidRequestError,
    OverloadedError,
    error_for_problem_type,
)
from ..protocol import Client, documented_as_client
from ..schema import ForeignBody, Mode, not_a_json_string, parse_request, utf8_size
from .lifecycle import CLIENT_CLOSED, ClosingContext, InFlight, mend_after_fork, running_loop_here

if TYPE_CHECKING:
    from ..batching.stats import StatsSnapshot

__all__ = ["BATCH_BODIES_JSON", "BYTES_KEY", "NDJSON", "STR_KEY", "HttpClient"]

log = logging.getLogger("histoinfer.http")
#: the logger an untrained model is announced on, in-process too (models/base.py)
untrained_log = logging.getLogger("histoinfer.untrained")
#: (server, model) pairs announced as untrained in this process: once each, as in-process
#: checkpoints are (a notebook re-running the cell that makes its client heard it each time)
_announced: set[tuple[str, str]] = set()

# The same values as in histoinfer.server.app (which this module must not import: FastAPI).
#: Batch request whose elements are the bodies exactly as the caller passed them.
BATCH_BODIES_JSON = "application/vnd.histoinfer.bodies+json"
#: In such a batch, ``{BYTES_KEY: base64}`` stands for a bytes body that is not UTF-8, and
#: ``{STR_KEY: base64}`` for a str body that is not valid Unicode (a lone surrogate: its UTF-8
#: with surrogates passed through), so that the server refuses each as in-process.
BYTES_KEY = "$bytes"
STR_KEY = "$str"
#: Batch response with one response JSON per line: split exactly, no re-serialization.
NDJSON = "application/x-ndjson"
#: Set to "false" on the answers of a model whose weights are untrained (server/app.py)
TRAINED_HEADER = "histoinfer-trained"
#: On every inference answer: the sha256 of the checkpoint that computed it (server/app.py)
CHECKPOINT_HEADER = "histoinfer-checkpoint-sha256"
_SHA256 = re.compile(r"[0-9a-f]{64}")

_PROBLEM_JSON = "application/problem+json"
#: What ``json.loads`` raises on a body that is not JSON: ``ValueError`` (``UnicodeDecodeError``
#: included), or ``RecursionError`` for arrays or objects nested deeper than it can parse.
_NOT_JSON = (ValueError, RecursionError)
_ACCEPT = "application/json, application/problem+json"
_RETRY_STATUSES = frozenset({502, 503, 504})
# Answers that may differ if the request comes again later: those retried, a gateway's or rate
# limiter's 429, a body that stalled (408).
_TRANSIENT_STATUSES = _RETRY_STATUSES | {408, 429}
# Failures where the request can safely be sent again: inference is a pure function.
_RETRY_ERRORS = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
# What a non-string batch element becomes on the wire: only its type matters to the server,
# which rejects it with the very message in-process callers get ("... got int"). A dict
# becomes an empty one, so it can never be taken for a BYTES_KEY object.
_PLACEHOLDERS: dict[type, object] = {
    int: 0,
    float: 0.0,
    bool: False,
    type(None): None,
    list: [],
    dict: {},
}


def _check_base_url(base_url: object) -> None:
    """An http(s) URL with a host: "127.0.0.1:8080" was taken, and every call then failed
    with httpx's UnsupportedProtocol (a user trial)."""
    if not isinstance(base_url, str):
        raise TypeError(f"base_url must be a str, got {type(base_url).__name__}")
    shown = re.sub(r"//[^/?#]*@", "//", base_url)  # without a user and password (a review)
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"base_url {shown!r} is not a URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        bare = "://" not in base_url and not base_url.lower().startswith(("http:", "https:", "/"))
        hint = f" (did you mean 'http://{base_url}'?)" if bare else ""
        raise ValueError(
            f"base_url must be an http:// or https:// URL with a host, got {shown!r}{hint}"
        )


def _check_httpx_options(options: dict[str, Any]) -> None:
    """Each name one that both ``httpx.Client`` and ``httpx.AsyncClient`` take: a misspelt
    ``timout=5`` was taken, and the first call then failed with httpx's TypeError, which did not
    name HttpClient (a user trial)."""
    accepted = _httpx_option_names()
    for name in options:
        if accepted is not None and name not in accepted:
            ours = [n for n in inspect.signature(HttpClient).parameters if n != "httpx_options"]
            close = difflib.get_close_matches(name, [*ours, *sorted(accepted)], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"HttpClient got an unexpected keyword argument {name!r} (not an HttpClient "
                f"option nor an httpx.Client one){hint}"
            )


@functools.cache
def _httpx_option_names() -> frozenset[str] | None:
    """The keyword arguments both httpx clients take (None: any, an httpx taking ``**kwargs``);
    read when first needed, so that importing this module stays cheap."""
    names: list[set[str]] = []
    for cls in (httpx.Client, httpx.AsyncClient):
        parameters = inspect.signature(cls).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return None
        names.append({p.name for p in parameters if p.kind in _BY_NAME})
    return frozenset(set.intersection(*names))


_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@documented_as_client
class HttpClient(ClosingContext, Client):
    """Runs the ``Client`` protocol against a histoinfer server (``histoinfer serve``).

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8080"`` (a path prefix is kept).
        model: the served model's name (its route, ``/api/{mode}/{model}``).
        timeout: seconds for each HTTP request (connect, write, read, pool), ``None`` for no
            limit, or an ``httpx.Timeout`` (its ``pool`` part also bounds the wait for a
            ``max_in_flight`` slot).
        max_connections: connection pool size (per event loop for async calls); the pool
            httpx gets is no larger than ``max_in_flight``, which is all it can use.
        retries: how many times a request is sent again after a connection error or a
            502/503/504; 4xx and 500 are never retried (a gateway's 429 raises
            ``OverloadedError`` at once, its ``Retry-After`` in the error's ``retry_after``).
        backoff: first retry delay in seconds, doubled each attempt (with jitter).
        max_backoff: cap on one retry delay, including the server's ``Retry-After``.
        max_in_flight: the most requests sent at once per event loop (async calls) and across
            all threads (sync calls); more callers wait their turn, cancellably, for up to
            ``timeout`` seconds. ``None``: no bound but ``max_connections``. It exists because
            httpcore scans its whole pool each time a request starts or ends, so hundreds of
            busy connections cost the client more CPU than the requests themselves; for the
            same reason each loop's connections, and the sync calls', are split over httpx
            clients of at most 4 connections each. 64 lets one loop fill a default server
            batch. A retry gives its slot back while it sleeps (backoff or ``Retry-After``)
            and waits for one again. Calls through a ``session`` count too. The measurements
            behind these choices: ``docs/server.md`` ("Why ``max_in_flight``").
        max_batch_bytes: the most bytes of bodies in one ``/batch`` request: a ``*_batch``
            call over it (or over ``max_batch_requests`` bodies) goes as several requests, one
            after another, its responses joined in order. Under the server's ``--max-body-mb``
            (64 MiB by default); a body larger than this goes alone.
        max_batch_requests: the most bodies in one ``/batch`` request; at most the server's
            ``--max-batch-requests`` (4096 by default).
        checkpoint_sha256: accept answers only from the checkpoint with this sha256 (the
            model's metadata's ``checkpoint_sha256``): an answer computed by any other (a
            server restarted on a new one mid-job, a load balancer's other replica), or that
            does not say, raises ``InferenceError``. Unset, a change of checkpoint during the
            client's life is logged as a warning once a change, and the results it returns
            mix the two.
        httpx_options: passed to both ``httpx.Client`` and ``httpx.AsyncClient`` (headers,
            auth, verify, proxy, ...); a name neither takes is refused here, not at the first
            call.
    """

    _holds = "open connections and locks"

    def __init__(
        self,
        base_url: str,
        model: str = "h1",
        *,
        timeout: float | httpx.Timeout | None = 120.0,
        max_connections: int = 256,
        retries: int = 3,
        backoff: float = 0.1,
        max_backoff: float = 10.0,
        max_in_flight: int | None = 64,
        max_batch_bytes: int = 48 * 2**20,
        max_batch_requests: int = 4096,
        checkpoint_sha256: str | None = None,
        **httpx_options: Any,
    ) -> None:
        _check_httpx_options(httpx_options)
        if checkpoint_sha256 is not None and not (
            isinstance(checkpoint_sha256, str) and _SHA256.fullmatch(checkpoint_sha256)
        ):
            raise ValueError(
                "checkpoint_sha256 must be the 64 lowercase hex digits of a sha256 (the "
                f"model's metadata's checkpoint_sha256), got {checkpoint_sha256!r}"
            )
        if not isinstance(timeout, httpx.Timeout):
            check_seconds("timeout", timeout, none_ok=True)
        check_count("max_connections", max_connections)
        check_count("retries", retries, minimum=0)
        check_seconds("backoff", backoff, zero_ok=True)
        check_seconds("max_backoff", max_backoff, zero_ok=True)
        check_count("max_in_flight", max_in_flight, none_ok=True)
        check_count("max_batch_bytes", max_batch_bytes)
        check_count("max_batch_requests", max_batch_requests)
        _check_base_url(base_url)
        if not isinstance(model, str) or not model or "/" in model:
            # The server decodes %2F before routing: "h1/batch" would reach the batch route.
            raise ValueError(f"model must be a route name without '/', got {model!r}")
        self.base_url = base_url.rstrip("/")
        # What a message or repr shows: a password in the URL (httpx sends it as basic auth)
        # went into tracebacks and logs.
        self._shown_base_url = str(_shown(httpx.URL(self.base_url)))
        self.model = model
        self.timeout = timeout
        self.max_connections = max_connections
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_in_flight = max_in_flight
        self.max_batch_bytes = max_batch_bytes
        self.max_batch_requests = max_batch_requests
        self._timeout = httpx.Timeout(timeout)
        #: how long a call waits for a max_in_flight slot (None: for ever)
        self._slot_wait = timeout.pool if isinstance(timeout, httpx.Timeout) else timeout
        # More connections than requests in flight would only lengthen httpcore's scans.
        connections = (
            max_connections if max_in_flight is None else min(max_connections, max_in_flight)
        )
        options: dict[str, Any] = {
            "timeout": self._timeout,
            "limits": _limits(connections),
            **httpx_options,
        }
        # The connections (each loop's, and the sync calls') are split over several httpx
        # clients (see _Shards), unless the caller's options fix the transport or the limits.
        if _SHARDS_FIXED_BY.isdisjoint(httpx_options):
            shards = [{**options, "limits": _limits(n)} for n in _shard_sizes(connections)]
        else:
            shards = [options]
        # With a transport or mounts of the caller's, those decide the TLS context.
        self._options = _ClientOptions(shards, share_tls=_TRANSPORTS.isdisjoint(options))
        self._sync_slots = (
            None if max_in_flight is None else threading.BoundedSemaphore(max_in_flight)
        )
        self._calls = InFlight()
        self._warned_untrained = False
        self._pinned = checkpoint_sha256
        #: the checkpoints inference answers have named so far (a new one is warned of)
        self._answered_by: set[str] = set()
        self._released = False  # the pools are closed: after close() and its calls in flight
        self._lock = threading.Lock()
        self._sync: _Shards[httpx.Client] | None = None
        self._sync_finalizer: weakref.finalize[Any, Any] | None = None
        self._pools: dict[object, _LoopPool] = {}
        mend_after_fork(self)

    def _after_fork(self) -> None:
        """In a forked child (before anything else runs there): the pooled connections are
        the parent's too, and a request sent on one could read the answer to the parent's.
        The child starts with pools of its own; the inherited ones are set aside unclosed
        (over TLS, a close here would end the parent's sessions too). Nor do the parent's calls in
        flight, or their slots, exist here."""
        self._lock = threading.Lock()
        self._options.after_fork()
        # Kept, unused: collected, their sockets would be closed (and warn of it).
        self._left_by_the_parent = (self._sync, self._pools)
        self._sync, self._pools = None, {}
        if self._sync_finalizer is not None:  # it would close them at the child's exit
            self._sync_finalizer.detach()
            self._sync_finalizer = None
        if self.max_in_flight is not None:
            self._sync_slots = threading.BoundedSemaphore(self.max_in_flight)
        self._calls.after_fork()

    # -- Client protocol: sync ---------------------------------------------------------------

    def predict(self, body: str) -> str:
        return self._infer(body, "predict")

    def embed(self, body: str) -> str:
        return self._infer(body, "embed")

    def predict_with_embedding(self, body: str) -> str:
        return self._infer(body, "predict_with_embedding")

    def metadata(self) -> str:
        url = self._url(f"/api/metadata/{self._model_path}")
        with self._calls.call():
            return _object_text(self._send("GET", url, None, {"Accept": _ACCEPT}))

    def stats(self) -> dict[Mode, StatsSnapshot]:
        """The server's batching statistics for this model, per mode: what
        ``InProcessClient.stats()`` gives in the server's process (``GET /api/stats/{model}``).
        """
        url = self._url(f"/api/stats/{self._model_path}")
        with self._calls.call():
            response = self._send("GET", url, None, {"Accept": _ACCEPT})
        try:
            return {
                mode: _snapshot(fields) for mode, fields in json.loads(response.content).items()
            }
        except (*_NOT_JSON, TypeError, AttributeError, KeyError) as exc:
            raise _unexpected(response, "a JSON object of statistics per mode") from exc

    # -- Client protocol: async --------------------------------------------------------------

    async def predict_async(self, body: str, session: object | None = None) -> str:
        return await self._infer_async(body, "predict", session)

    async def embed_async(self, body: str, session: object | None = None) -> str:
        return await self._infer_async(body, "embed", session)

    async def predict_with_embedding_async(self, body: str, session: object | None = None) -> str:
        return await self._infer_async(body, "predict_with_embedding", session)

    # -- Client protocol: explicit batches ---------------------------------------------------

    def predict_batch(self, bodies: list[str]) -> list[str]:
        return self._infer_batch(bodies, "predict")

    def embed_batch(self, bodies: list[str]) -> list[str]:
        return self._infer_batch(bodies, "embed")

    def predict_with_embedding_batch(self, bodies: list[str]) -> list[str]:
        return self._infer_batch(bodies, "predict_with_embedding")

    # -- explicit batches from async code (beyond the protocol) --------------------------------

    async def predict_batch_async(
        self, bodies: list[str], session: object | None = None
    ) -> list[str]:
        """``predict_batch`` for async code: its ``/batch`` requests sent on the loop."""
        return await self._infer_batch_async(bodies, "predict", session)

    async def embed_batch_async(
        self, bodies: list[str], session: object | None = None
    ) -> list[str]:
        """``embed_batch`` for async code: its ``/batch`` requests sent on the loop."""
        return await self._infer_batch_async(bodies, "embed", session)

    async def predict_with_embedding_batch_async(
        self, bodies: list[str], session: object | None = None
    ) -> list[str]:
        """``predict_with_embedding_batch`` for async code: its requests sent on the loop."""
        return await self._infer_batch_async(bodies, "predict_with_embedding", session)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._calls.closed

    def close(self) -> None:
        """Refuse new calls, let those in flight finish, then close every connection pool.

        Async pools are closed on their own loops (soon, if that loop is still running). On a
        thread whose event loop is running (a notebook cell), waiting would block the very
        loop whose calls it waits for: close() returns at once, as ``InProcessClient``'s
        does, the calls in flight (on any thread or loop) finish, and the pools close after
        the last of them.
        """
        if running_loop_here() or self._calls.held_here():  # (beneath a call: a signal handler)
            self._calls.close(then=self._release)
            return
        self._calls.close()
        self._calls.wait_idle()
        self._release()

    async def aclose(self) -> None:
        """:meth:`close` for async code; cancellable (the pools then close after the last call
        in flight)."""
        self._calls.close()
        try:
            await self._calls.wait_idle_async()
        except BaseException:
            self._calls.close(then=self._release)
            raise
        sync, pools = self._shut()
        here = _loop_key()
        # Every other pool asked first: a cancellation while this loop's closes (asyncio's
        # own passes anyio's shield) must not leave them open for good.
        for pool in pools:
            if pool.key != here:
                pool.request_close()
        _close_sync(sync)
        for pool in pools:
            if pool.key == here:
                await pool.close_here()  # closed, its keeper gone, when we return

    def __repr__(self) -> str:
        closed = " closed" if self.closed else ""
        return f"<HttpClient {self.model!r} at {self._shown_base_url}{closed}>"

    def _note_untrained(self) -> None:
        """The server said its model's weights are untrained: said here too, once a process
        for each server and model, on the logger an in-process user hears it on (the server's
        own log is not theirs)."""
        if not self._warned_untrained:
            self._warned_untrained = True
            if (self.base_url, self.model) in _announced:
                return
            _announced.add((self.base_url, self.model))
            untrained_log.warning(
                'model %r at %s has UNTRAINED weights (its model.json says "trained": false, '
                "as histoinfer's seeded reference checkpoints do): the real architecture and "
                "costs, but not a trained model's outputs",
                self.model,
                self._shown_base_url,
            )

    @property
    def checkpoint_sha256(self) -> str | None:
        """The checkpoint every inference answer must come from (the constructor's), or None."""
        return self._pinned

    def _note_checkpoint(self, response: httpx.Response) -> None:
        """An inference answer's checkpoint (its header; absent from an older server): refused
        unless it is the pinned one; otherwise each new one after the first is warned of,
        once (a load balancer alternating between two replicas is one change, not one a
        request). A server restarted on another checkpoint mid-job mixed its answers into the
        job's unsaid (a user trial: 884 of 1,500 results from a different model)."""
        checkpoint = response.headers.get(CHECKPOINT_HEADER)
        pinned = self._pinned
        if pinned is not None:
            if checkpoint != pinned:
                said = (
                    f"checkpoint {checkpoint[:12]}…"
                    if checkpoint is not None
                    else f"no checkpoint (no {CHECKPOINT_HEADER} header: a server older than "
                    "this client, or a proxy that drops it)"
                )
                error = InferenceError(
                    f"model {self.model!r} at {self._shown_base_url} answered from {said}, not "
                    f"checkpoint {pinned[:12]}… as this client's checkpoint_sha256 requires; "
                    "the answer was dropped"
                )
                error.request_id = response.headers.get("x-request-id")
                try:
                    raise error
                finally:
                    del error  # this frame is in its traceback (histoinfer/outcome.py)
            return
        if checkpoint is None or checkpoint in self._answered_by:
            return
        with self._lock:  # sync calls answer on many threads at once
            if checkpoint in self._answered_by:
                return
            before = sorted(self._answered_by)
            self._answered_by.add(checkpoint)
        if before:
            log.warning(
                "model %r at %s now answers from checkpoint %s…, not only %s as before: this "
                "client's results mix them (pass checkpoint_sha256= to refuse any other)",
                self.model,
                self._shown_base_url,
                checkpoint[:12],
                ", ".join(f"{sha[:12]}…" for sha in before),
            )

    # -- requests ----------------------------------------------------------------------------

    @property
    def _model_path(self) -> str:
        return quote(self.model, safe="")

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _infer(self, body: str, mode: Mode) -> str:
        with self._calls.call():
            url = self._url(f"/api/{mode}/{self._model_path}")
            return _object_text(self._send("POST", url, _encode_body(body), _JSON_HEADERS))

    async def _infer_async(self, body: str, mode: Mode, session: object | None) -> str:
        with self._calls.call():
            url = self._url(f"/api/{mode}/{self._model_path}")
            content = _encode_body(body)
            session = _session(session)
            pool = self._loop_pool()
            try:
                with pool.call():
                    response = await self._send_async(
                        pool, session, "POST", url, content, _JSON_HEADERS
                    )
                return _object_text(response)
            finally:
                if self._calls.closed and not pool.calls:
                    # A closed client's last call on this loop closes the loop's pool before
                    # it returns (still counted in flight, so that aclose() waits for it):
                    # returning first, it could let the loop end (asyncio.run) during the
                    # close, whose cancellation then left connections open.
                    await pool.close_here()

    def _infer_batch(self, bodies: list[str], mode: Mode) -> list[str]:
        """The call as ``/batch`` requests within ``max_batch_bytes`` and
        ``max_batch_requests``, sent one after another: the server refuses larger ones (a call
        of 2,000 tiles of 100 KB, one 198 MB request, failed over HTTP and not in-process)."""
        with self._calls.call():
            url, batch = self._batch_call(bodies, mode)
            responses: list[str] = []
            for start, stop, content, headers in self._batch_requests(bodies, batch):
                try:
                    response = self._send("POST", url, content, headers, batch.refused(start, stop))
                except InferenceError as exc:
                    batch.shift(exc, start, stop)
                    raise
                batch.answered(response, start, stop)
                responses += _split_batch(response, stop - start)
                # Dropped before the next request's is built: the response holds its request,
                # and so the body (up to max_batch_bytes), until it goes (a review: two held).
                del content, response
            return responses

    async def _infer_batch_async(
        self, bodies: list[str], mode: Mode, session: object | None
    ) -> list[str]:
        """``_infer_batch`` on the loop: its requests through the loop's connections."""
        with self._calls.call():
            session = _session(session)
            url, batch = self._batch_call(bodies, mode)
            pool = self._loop_pool()
            responses: list[str] = []
            try:
                with pool.call():
                    requests = self._batch_requests(bodies, batch)
                    # Encoded on a worker thread: parsing 48 MB of bodies held the loop ~0.1 s.
                    while part := await anyio.to_thread.run_sync(next, requests, None):
                        start, stop, content, headers = part
                        try:
                            response = await self._send_async(
                                pool,
                                session,
                                "POST",
                                url,
                                content,
                                headers,
                                batch.refused(start, stop),
                            )
                        except InferenceError as exc:
                            batch.shift(exc, start, stop)
                            raise
                        batch.answered(response, start, stop)
                        responses += _split_batch(response, stop - start)
                        del part, content, response  # as in _infer_batch
                return responses
            finally:
                if self._calls.closed and not pool.calls:  # as _infer_async's
                    await pool.close_here()

    def _batch_call(self, bodies: list[str], mode: Mode) -> tuple[str, _Batch]:
        """The ``/batch`` route of a ``*_batch`` call, and the call as its requests' errors
        see it."""
        _batch_list(bodies)
        url = self._url(f"/api/{mode}/{self._model_path}/batch")
        parts, size = _plan_batch(bodies, self.max_batch_bytes, self.max_batch_requests)
        return url, _Batch(self, len(bodies), size, split=len(parts) > 1, parts=parts)

    def _batch_requests(
        self, bodies: list[str], batch: _Batch
    ) -> Iterator[tuple[int, int, bytes, dict[str, str]]]:
        """Each ``/batch`` request of the call, encoded as it is reached (one held at a time):
        ``(start, stop, content, headers)`` for ``bodies[start:stop]``."""
        for start, stop in batch.parts:
            yield from self._encoded_part(bodies, start, stop, batch)

    def _encoded_part(
        self, bodies: list[str], start: int, stop: int, batch: _Batch
    ) -> Iterator[tuple[int, int, bytes, dict[str, str]]]:
        """``bodies[start:stop]`` as one request, or as halves where a verbatim batch's
        escapes outgrew the plan."""
        content, headers = _encode_batch(bodies[start:stop])
        if len(content) > self.max_batch_bytes and stop - start > 1:
            del content  # not held while the halves are sent
            batch.split = True
            middle = (start + stop) // 2
            yield from self._encoded_part(bodies, start, middle, batch)
            yield from self._encoded_part(bodies, middle, stop, batch)
        else:
            yield start, stop, content, headers

    def _send(
        self,
        method: str,
        url: str,
        content: bytes | None,
        headers: dict[str, str],
        refused: Callable[[httpx.Response], InferenceError] | None = None,
    ) -> httpx.Response:
        shards = self._sync_shards()
        attempt = _Attempt(self, method, url, refused)
        while True:
            try:
                with _slot(self._sync_slots, self._slot_wait), shards.lease() as client:
                    response = _unbound(
                        client.request(
                            method, url, content=content, headers=headers, timeout=self._timeout
                        )
                    )
            except httpx.HTTPError as exc:
                delay = attempt.failed(exc)
            except RuntimeError as exc:  # httpx: "the client has been closed"
                raise self._closed_error(exc) from None
            else:
                retry = attempt.answered(response)
                if retry is None:
                    return response
                delay = retry
            time.sleep(delay)

    async def _send_async(
        self,
        pool: _LoopPool,
        session: httpx.AsyncClient | None,
        method: str,
        url: str,
        content: bytes | None,
        headers: dict[str, str],
        refused: Callable[[httpx.Response], InferenceError] | None = None,
    ) -> httpx.Response:
        attempt = _Attempt(self, method, url, refused)
        if session is None and not self._options.shared:
            # The first request would build the TLS context and import httpcore (and trio,
            # which it imports where installed) on the loop: 70-270 ms in which the loop's
            # every other task waited (a trial). Once per HttpClient, on a worker thread.
            await anyio.to_thread.run_sync(_warm_transport, self._options)
        while True:
            try:
                async with _slot_async(pool.slots, self._slot_wait):
                    with pool.lease(session) as client:
                        request = client.build_request(
                            method, url, content=content, headers=headers, timeout=self._timeout
                        )
                        if content is not None:
                            request.stream = _RequestBody(content)
                        response = _unbound(await client.send(request))
            except httpx.HTTPError as exc:
                delay = attempt.failed(exc)
            except RuntimeError as exc:
                raise self._closed_error(exc) from None
            else:
                retry = attempt.answered(response)
                if retry is None:
                    return response
                delay = retry
            await anyio.sleep(delay)

    # -- pools -------------------------------------------------------------------------------

    def _closed_error(self, exc: RuntimeError) -> Exception:
        return ClientClosedError(CLIENT_CLOSED) if self._released else exc

    def _sync_shards(self) -> _Shards[httpx.Client]:
        """The sync calls' httpx clients (split as each loop's are; made on first use)."""
        with self._lock:
            if self._released:
                raise ClientClosedError(CLIENT_CLOSED)
            if self._sync is None:
                self._sync = _Shards(self._options, httpx.Client, threading.Lock())
                # Dropped without close(): its connections closed, not left to the collector
                # (a ResourceWarning for each; a soak trial). Each loop's close with it.
                self._sync_finalizer = weakref.finalize(self, _close_sync, self._sync)
                # Not at exit: a live client's calls from a __del__ or a daemon thread then
                # still work (closed, they raised httpx's bare RuntimeError; a review).
                self._sync_finalizer.atexit = False
            return self._sync

    def _loop_pool(self) -> _LoopPool:
        """The running loop's pool (its ``httpx.AsyncClient`` objects are made on first use)."""
        key = _loop_key()
        with self._lock:
            if self._released:
                raise ClientClosedError(CLIENT_CLOSED)
            pool = self._pools.get(key)
            if pool is not None:
                return pool
            for stale in [k for k, p in self._pools.items() if p.finished()]:
                del self._pools[stale]
            pool = self._pools[key] = _LoopPool(
                _Shards(self._options, httpx.AsyncClient),
                self.max_in_flight,
                key,
                self._pools,
                self._lock,
            )
        pool.start_keeper()
        return pool

    def _release(self) -> None:
        """Close every connection pool: the sync one here, each loop's on its loop."""
        sync, pools = self._shut()
        for pool in pools:
            pool.request_close()
        if self._sync_finalizer is not None:
            self._sync_finalizer.detach()
        _close_sync(sync)

    def _shut(self) -> tuple[_Shards[httpx.Client] | None, list[_LoopPool]]:
        with self._lock:
            self._released = True
            sync, self._sync = self._sync, None
            pools = list(self._pools.values())
            self._pools.clear()
        return sync, pools


#: The most connections in one httpx client: httpcore's scans grow with the square of
#: this. 4 clients of 16 cost the client a quarter of the CPU a request of one of 64; 16 of 4
#: cost 0.61 of 4 of 16 (docs/benchmarks-history.md, "Session 13").
_SHARD_CONNECTIONS = 4
#: ``httpx_options`` that give the caller's own transports (which decide their TLS context).
_TRANSPORTS = frozenset({"transport", "mounts"})
#: ``httpx_options`` with which the caller fixes the transport or the limits: no sharding.
_SHARDS_FIXED_BY = _TRANSPORTS | {"limits"}


def _limits(connections: int) -> httpx.Limits:
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections)


def _shard_sizes(connections: int) -> list[int]:
    """``connections`` split as evenly as may be into parts of at most ``_SHARD_CONNECTIONS``."""
    parts = max(1, -(-connections // _SHARD_CONNECTIONS))
    size, extra = divmod(connections, parts)
    return [size + 1] * extra + [size] * (parts - extra)


@contextlib.contextmanager
def _slot(slots: threading.BoundedSemaphore | None, timeout: float | None) -> Iterator[None]:
    """Hold one of ``max_in_flight`` sync slots while sending (none to hold: ``None``)."""
    if slots is None:
        yield
        return
    if not slots.acquire(timeout=timeout):
        raise _no_slot(timeout)
    try:
        yield
    finally:
        slots.release()


@contextlib.asynccontextmanager
async def _slot_async(slots: anyio.Semaphore | None, timeout: float | None) -> AsyncIterator[None]:
    """The same for one loop: waiting is cancellable, and a cancelled waiter holds nothing."""
    if slots is None:
        yield
        return
    with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
        await slots.acquire()
    if scope.cancelled_caught:
        raise _no_slot(timeout)
    try:
        yield
    finally:
        slots.release()


def _describe(timeout: float | httpx.Timeout | None) -> str:
    if isinstance(timeout, httpx.Timeout):
        return f"the timeout ({timeout!r})"
    return "no limit" if timeout is None else f"{timeout:g} s"


def _what_failed(exc: httpx.HTTPError, timeout: float | httpx.Timeout | None) -> str:
    """Which step of a request failed, in a few words: a reset after the request went out
    said "cannot reach the server", and a request that could not even be sent "no answer"
    (a chaos trial)."""
    within = _describe(timeout)
    if isinstance(exc, httpx.PoolTimeout):
        return f"no connection or request slot free within {within} (nothing was sent)"
    if isinstance(exc, httpx.ConnectTimeout):
        return f"could not connect within {within}"
    if isinstance(exc, httpx.WriteTimeout):
        return f"could not send the request within {within}"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {within}"
    if isinstance(exc, httpx.ConnectError):
        return "cannot reach the server"
    if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError)):
        return "the connection was lost before the answer"
    return "the request failed"


def _no_slot(timeout: float | None) -> httpx.PoolTimeout:
    # What httpx raises when its own pool has no connection in time: reported the same way.
    return httpx.PoolTimeout(f"no request slot (max_in_flight) free within {_describe(timeout)}")


_JSON_HEADERS = {"Content-Type": "application/json", "Accept": _ACCEPT}
_BATCH_ACCEPT = f"{NDJSON}, {_PROBLEM_JSON}"
#: a batch of requests as SPEC §4 writes it, for any server of the wire format
_JSON_BATCH_HEADERS = {"Content-Type": "application/json", "Accept": _BATCH_ACCEPT}
#: a batch that needs the bodies exactly as passed (see _encode_batch)
_VERBATIM_BATCH_HEADERS = {"Content-Type": BATCH_BODIES_JSON, "Accept": _BATCH_ACCEPT}


class _Attempt:
    """The retry policy of one call, shared by the sync and async send loops.

    ``failed`` and ``answered`` return the delay before the next try, or raise the error to
    give the caller (``answered`` returns None for a success).
    """

    def __init__(
        self,
        client: HttpClient,
        method: str,
        url: str,
        refused: Callable[[httpx.Response], InferenceError] | None = None,
    ) -> None:
        self.client = client
        self.method = method
        self.url = url
        #: the error for an answer that is not retried (``_error_from`` by default)
        self.refused = refused or _error_from
        self.number = 0

    def failed(self, exc: httpx.HTTPError) -> float:
        if self.client._released:  # its pool closed under it (not since session 23: defensive)
            raise ClientClosedError(CLIENT_CLOSED) from exc
        if not isinstance(exc, _RETRY_ERRORS) or self.number >= self.client.retries:
            # Counted even when 1: a timeout is not retried, and the message says so.
            tries = f" after {self.number + 1} attempt{'s' if self.number else ''}"
            why = _what_failed(exc, self.client.timeout)
            # httpx's async timeouts carry no words of their own ("ReadTimeout: ").
            said = _os_reason(exc) or str(exc)
            error = InferenceError(
                f"{self.method} {_shown(httpx.URL(self.url))} failed{tries}: {why} "
                f"({type(exc).__name__}{': ' + said if said else ''})"
            )
            error.retryable = isinstance(exc, (*_RETRY_ERRORS, httpx.TimeoutException))
            try:
                raise error from exc
            finally:
                del error  # this frame is in its traceback (histoinfer/outcome.py)
        return self._next(None)

    def answered(self, response: httpx.Response) -> float | None:
        if response.is_success:
            headers = response.headers
            if headers.get(TRAINED_HEADER) == "false":
                self.client._note_untrained()
            if self.method == "POST":  # an inference answer
                self.client._note_checkpoint(response)
            return None
        if response.status_code in _RETRY_STATUSES and self.number < self.client.retries:
            log.debug("HTTP %d from %s; retrying", response.status_code, _shown(response.url))
            return self._next(response)
        raise self.refused(response)

    def _next(self, response: httpx.Response | None) -> float:
        cap = self.client.max_backoff
        delay = min(cap, self.client.backoff * 2.0**self.number) * random.uniform(0.5, 1.0)
        if response is not None:
            retry_after = _retry_after(response.headers.get("retry-after"))
            if retry_after is not None:
                # Not before the server's time, and spread over half as much again: callers it
                # refused at once came back at one instant, wave after wave (a user trial).
                # Spread within the cap too, or all of those capped would come back together.
                base = max(retry_after, delay)
                low = base if base <= cap else cap * 2 / 3  # a cap under Retry-After: the cap's
                delay = random.uniform(low, min(cap, 1.5 * base))
        self.number += 1
        return delay


def _os_reason(exc: BaseException) -> str | None:
    """The system's words for the connection error under ``exc`` ("Connection refused"), if
    every one under it says the same: sync, asyncio and trio calls word the same refusal three
    ways ("[Errno 111] Connection refused", "All connection attempts failed", "all attempts to
    connect to … failed"). Anything else (a name that does not resolve, a certificate refused,
    two addresses failing differently) keeps its own words."""
    reasons: set[str] = set()
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, ConnectionError) and error.errno is not None:
            reasons.add(os.strerror(error.errno))
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)
        pending.extend(e for e in (error.__cause__, error.__context__) if e is not None)
    return reasons.pop() if len(reasons) == 1 else None


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds: delay-seconds, or an HTTP date."""
    if not value:
        return None
    if value.isascii() and value.strip().isdigit():  # not "²": str.isdigit takes it
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _error_from(response: httpx.Response) -> InferenceError:
    """The exception InProcessClient raises, from a problem+json body: same class, message.

    An ``OverloadedError`` (a 503, or a gateway's 429) carries the answer's ``Retry-After``, in
    seconds, as its ``retry_after``, for the caller's own back-off; every error carries the
    answer's ``X-Request-ID`` as its ``request_id``, which the server's log names.
    """
    error, problem = _mapped_error(response)
    positions = problem.get("positions")
    if isinstance(positions, list) and all(type(p) is int for p in positions):
        error.positions = positions
    if isinstance(error, OverloadedError):
        error.retry_after = _retry_after(response.headers.get("retry-after"))
    error.request_id = response.headers.get("x-request-id")
    error.http_status = response.status_code
    if response.status_code in _TRANSIENT_STATUSES:
        error.retryable = True  # the server's "closed" 503 too: it drains, another may not
    return error


def _mapped_error(response: httpx.Response) -> tuple[InferenceError, dict[str, Any]]:
    """The error, and the problem+json object it came from (empty if none)."""
    status = response.status_code
    if response.headers.get("content-type", "").startswith(_PROBLEM_JSON):
        try:
            problem = json.loads(response.content)
        except _NOT_JSON:
            problem = None
        if isinstance(problem, dict) and isinstance(problem.get("detail"), str):
            kind = error_for_problem_type(problem.get("type"), status)
            return kind(problem["detail"]), problem
    error = error_for_problem_type(None, status)(
        f"HTTP {status} from {response.request.method} {_shown(response.request.url)}: "
        f"{_head(response)}"
    )
    return error, {}


def _unexpected(response: httpx.Response, expected: str) -> InferenceError:
    """A server that does not answer as histoinfer's does (a proxy's page, another API)."""
    kind = response.headers.get("content-type", "no content type")
    request = response.request
    return InferenceError(
        f"the server answered {request.method} {_shown(request.url)} with HTTP "
        f"{response.status_code} ({kind}), not {expected}: {_head(response)}"
    )


def _head(response: httpx.Response) -> str:
    """The start of a body that is not what was expected, for an error message."""
    return response.content[:300].decode("utf-8", "replace")


def _snapshot(fields: dict[str, Any]) -> StatsSnapshot:
    """A ``StatsSnapshot`` from its JSON (the histogram's keys, batch sizes, came as strings)."""
    from ..batching.stats import StatsSnapshot  # here: importing HttpClient stays light

    # Only the fields this version knows: a newer server's added ones must not break it.
    known = {f.name for f in dataclasses.fields(StatsSnapshot)}
    fields = {name: value for name, value in fields.items() if name in known}

    histogram = {int(size): count for size, count in fields["batch_size_histogram"].items()}
    return StatsSnapshot(**{**fields, "batch_size_histogram": histogram})


def _shown(url: httpx.URL) -> httpx.URL:
    """``url`` as an error message may show it: without a user name and password."""
    return url.copy_with(userinfo=b"") if url.userinfo else url


#: JSON's whitespace (RFC 8259), which may come before the ``{`` of an object.
_JSON_SPACE = b" \t\r\n"


def _object_text(response: httpx.Response) -> str:
    """The body of a one-object answer (a tile's response, the metadata), as the server wrote it.

    A 200 that is not a JSON object (a proxy's login page, a captive portal, an ingress routed
    elsewhere: HTML, text, an empty body) is an error, not the caller's response. Only the first
    byte that is not whitespace is checked (``{``): this runs on every call, so the body is not
    parsed again. The content type is not checked: a server of the wire format may omit or
    mislabel it, and the body is what the caller would parse.
    """
    content = response.content
    if content[:1] != b"{" and content.lstrip(_JSON_SPACE)[:1] != b"{":  # faster than startswith
        raise _unexpected(response, "a JSON object")
    try:  # _text, inline: the hot path
        return content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(response, exc) from exc


def _text(response: httpx.Response) -> str:
    """The body as the server wrote it: histoinfer's answers are UTF-8 (a proxy's may not be)."""
    try:
        return response.content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(response, exc) from exc


def _not_utf8(response: httpx.Response, exc: UnicodeDecodeError) -> InferenceError:
    return _unexpected(response, f"a UTF-8 body ({exc.reason} at offset {exc.start})")


def _encode_body(body: str | bytes) -> bytes:
    if isinstance(body, str):
        try:
            return body.encode("utf-8")
        except UnicodeEncodeError:
            # Not valid Unicode (a lone surrogate): as UTF-8 it would reach the server as
            # invalid JSON. Refused here by the function that refuses it in-process.
            parse_request(body)
            raise InvalidRequestError("invalid request: body is not valid Unicode") from None
    if isinstance(body, bytes | bytearray):
        return bytes(body)
    raise not_a_json_string(body)


def _encode_batch(bodies: Sequence[object]) -> tuple[bytes, dict[str, str]]:
    """The request of a batch: its content and headers.

    Bodies that are each a JSON object (the usual batch) go as SPEC §4's JSON list of
    requests, their text joined as it is, which any server of the wire format takes. Any other
    batch (a body that is not JSON, not an object, not a str) goes as ``BATCH_BODIES_JSON``,
    each body exactly as given, so that the server refuses each as ``InProcessClient`` would,
    naming its position (a JSON list could not even carry a body that is not JSON).
    """
    bodies = _batch_list(bodies)
    objects = [body for body in bodies if _json_object(body)]
    if len(objects) == len(bodies):
        joined = b",".join(body.encode("utf-8") for body in objects)
        return b"[" + joined + b"]", _JSON_BATCH_HEADERS
    return _encode_verbatim(bodies), _VERBATIM_BATCH_HEADERS


def _batch_list(bodies: object) -> list[object]:
    """``bodies``, a list, as in-process (``bodies must be a list ...``)."""
    if not isinstance(bodies, list):
        raise InvalidRequestError(
            f"bodies must be a list of JSON strings, got {type(bodies).__name__}"
        )
    return bodies


def _plan_batch(
    bodies: Sequence[object], max_bytes: int, max_requests: int
) -> tuple[list[tuple[int, int]], int]:
    """The ``/batch`` requests of a call, as ``(start, stop)`` positions, in order: each of at
    most ``max_requests`` bodies and ``max_bytes`` as a JSON list (a body over it alone), and
    at least one (an empty call is the server's to answer: an unknown model, a mode it does
    not serve); and the bodies' bytes in all."""
    parts: list[tuple[int, int]] = []
    start, size, total = 0, 1, 0  # size: "[", and each body with its "," (or the "]")
    for i, body in enumerate(bodies):
        n = _size(body)
        total += n
        if i > start and (size + n + 1 > max_bytes or i - start == max_requests):
            parts.append((start, i))
            start, size = i, 1
        size += n + 1
    parts.append((start, len(bodies)))
    return parts, total


def _size(body: object) -> int:
    """A body's bytes in a ``/batch`` request: exact in a JSON list (the usual batch); a
    verbatim one's escapes are the send's to notice (``HttpClient._send_part``)."""
    if isinstance(body, str):
        return utf8_size(body)
    if isinstance(body, bytes | bytearray):
        return -(-len(body) // 3) * 4 + 16  # sent as base64, in an object of one key
    return 64  # a placeholder or a type's name (_encode_verbatim)


def _session(session: object | None) -> httpx.AsyncClient | None:
    """A call's ``session``: an ``httpx.AsyncClient`` to send through, or None."""
    if session is not None and not isinstance(session, httpx.AsyncClient):
        raise TypeError(f"session must be an httpx.AsyncClient, got {type(session).__name__}")
    return session


class _Batch:
    """One ``*_batch`` call sent as ``/batch`` requests: the errors of each, as the call's."""

    def __init__(
        self,
        client: HttpClient,
        count: int,
        size: int,
        *,
        split: bool,
        parts: list[tuple[int, int]],
    ) -> None:
        self.client = client
        self.count = count
        self.size = size
        #: whether the call is sent as more than one request
        self.split = split
        #: the planned requests, ``(start, stop)`` of the bodies
        self.parts = parts
        #: the checkpoint header of the call's first answer (``_Batch.answered``)
        self.checkpoint: str | None = None

    def answered(self, response: httpx.Response, start: int, stop: int) -> None:
        """Refuses a split call's answer from another checkpoint than its first: a server
        restarted on another checkpoint, or replicas on two, between its requests returned
        one list mixing two models' results (a user trial). A pinned client refused it already."""
        checkpoint = response.headers.get(CHECKPOINT_HEADER)
        if not start:
            self.checkpoint = checkpoint
            return
        if checkpoint == self.checkpoint:
            return

        def named(sha: str | None) -> str:
            return f"checkpoint {sha[:12]}…" if sha is not None else "an unnamed checkpoint"

        error = InferenceError(
            f"model {self.client.model!r} at {self.client._shown_base_url} answered from "
            f"{named(checkpoint)}, not {named(self.checkpoint)} as it did this call's earlier "
            "requests: the call's results would mix two models (pass checkpoint_sha256= to "
            "accept one only)"
        )
        error.request_id = response.headers.get("x-request-id")
        self.shift(error, start, stop)
        try:
            raise error
        finally:
            del error  # this frame is in its traceback (histoinfer/outcome.py)

    def refused(self, start: int, stop: int) -> Callable[[httpx.Response], InferenceError]:
        """The error for a refusal of the request of ``bodies[start:stop]``: a 413 of several
        bodies says which option to lower (the server takes less than the defaults)."""

        def error(response: httpx.Response) -> InferenceError:
            error = _error_from(response)
            if response.status_code == 413 and stop - start > 1:
                client = self.client
                error.args = (
                    f"{error}; this call's {self.count:,} bodies (~{self.size / self.count:,.0f} "
                    f"bytes each) went as /batch requests of up to max_batch_bytes="
                    f"{client.max_batch_bytes:,} bytes and max_batch_requests="
                    f"{client.max_batch_requests:,} bodies, more than this server takes: give "
                    "HttpClient a smaller max_batch_bytes or max_batch_requests",
                )
            return error

        return error

    def shift(self, error: InferenceError, start: int, stop: int) -> None:
        """A request's refusal of its bodies, as the call's: its ``positions`` are the
        call's own, and its message (the server's, whose positions count within the request)
        says which request it was. A call sent as one request keeps the server's words, as
        ``InProcessClient`` has them."""
        if not self.split:
            return
        held = f"position {start:,}" if stop - start == 1 else f"positions {start:,}-{stop - 1:,}"
        if not (isinstance(error, InvalidRequestError) or error.positions):
            # Not a refusal of bodies (a server out of reach, overloaded, failing): which
            # request failed, and what became of those before it, which a caller resuming
            # the call needs (a chaos trial: "failed after 4 attempts", and 600 answers gone).
            before = f"the {start:,} before it were answered and " if start else ""
            error.args = (
                f"in the /batch request holding {held} of this call's {self.count:,} "
                f"({before}nothing is returned): {error}",
            )
            return
        if error.positions is not None:
            error.positions = [start + position for position in error.positions]
        add = f"add {start:,} to the positions named below; " if start else ""
        # The server's "nothing was computed" is of its request: earlier ones of the call were.
        said = str(error).replace(", nothing was computed:", ", nothing of it was computed:", 1)
        error.args = (
            f"in the /batch request holding {held} of this call's {self.count:,} ({add}"
            f"error.positions are the call's; nothing is returned): {said}",
        )


class _RequestBody(httpx.AsyncByteStream):
    """A request's content sent by an async client: as httpx's own ``ByteStream``, but its
    ``__aiter__`` is not an async generator. A call cancelled while httpx sends the body left
    that generator unfinished, and on trio (whose every send is a checkpoint) its collection
    printed a ResourceWarning, "Async generator 'httpx._content.ByteStream.__aiter__' was
    garbage collected before it had been exhausted", for every such call (a user trial)."""

    def __init__(self, content: bytes) -> None:
        self._content = content

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _Once(self._content)


class _Once:
    """An async iterator of one chunk (each retry of a request starts a new one)."""

    def __init__(self, chunk: bytes) -> None:
        self._chunk: bytes | None = chunk

    def __aiter__(self) -> _Once:
        return self

    async def __anext__(self) -> bytes:
        if self._chunk is None:
            raise StopAsyncIteration
        chunk, self._chunk = self._chunk, None
        return chunk


def _unbound(response: httpx.Response) -> httpx.Response:
    """``response`` (read) out of httpx's reference cycle: its stream (a ``BoundSyncStream``
    or ``BoundAsyncStream``) refers back to it, and it holds its request, whose content (a
    ``/batch`` body: tens of MB) then lived until the cycle collector ran, which counts
    objects, not bytes (a user trial: RSS 193 -> 650 MB over 8 calls with gc disabled). The
    stream, closed once read, becomes one of the content read, as in a response made with
    ``content=``."""
    response.stream = httpx.ByteStream(response.content)
    return response


def _json_object(body: object) -> TypeGuard[str]:
    """Is ``body`` a str holding one JSON object, as the server's batch parse reads it?"""
    if not isinstance(body, str):
        return False
    try:
        # Inside a list, as the server reads it: a level deeper (its nesting limit counts).
        items = pydantic_core.from_json(f"[{body}]", allow_inf_nan=False)
        return len(items) == 1 and isinstance(items[0], dict)
    except (ValueError, TypeError):  # not JSON, a lone surrogate, a str subclass
        return False


def _encode_verbatim(bodies: list[object]) -> bytes:
    """The bodies as a JSON list, each string exactly as given (``BATCH_BODIES_JSON``)."""
    items: list[object] = []
    for body in bodies:
        if isinstance(body, str):
            items.append(body)
        elif isinstance(body, bytes | bytearray):
            try:
                items.append(bytes(body).decode("utf-8"))
            except UnicodeDecodeError:  # sent as is, for the server to refuse as in-process
                items.append({BYTES_KEY: base64.b64encode(body).decode("ascii")})
        elif type(body) in _PLACEHOLDERS:
            items.append(_PLACEHOLDERS[type(body)])
        else:  # a tile, a tuple...: refused by the server with the other bad positions
            items.append(ForeignBody.of(body).to_json())
    try:
        return json.dumps(items, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # some str body is not valid Unicode (STR_KEY)
        return json.dumps([_wrap_invalid_str(item) for item in items], ensure_ascii=False).encode()


def _wrap_invalid_str(item: object) -> object:
    if isinstance(item, str):
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raw = item.encode("utf-8", "surrogatepass")
            return {STR_KEY: base64.b64encode(raw).decode("ascii")}
    return item


def _split_batch(response: httpx.Response, expected: int) -> list[str]:
    """One response string per request, exactly as the server wrote them."""
    if response.headers.get("content-type", "").startswith(NDJSON):
        lines = _text(response).split("\n")
        responses = lines[:-1] if lines and lines[-1] == "" else lines
    else:  # a server (or proxy) that ignores Accept: each element of its JSON list, verbatim
        responses = _list_elements(response)
    if len(responses) != expected:
        raise InferenceError(f"the server answered {len(responses)} responses for {expected}")
    return responses


_ELEMENTS = json.JSONDecoder()


def _list_elements(response: httpx.Response) -> list[str]:
    """The text of each element of a JSON list body, exactly as written: re-serialized, a
    float would change its form (``4.97e-05`` for the server's ``0.0000497``), and responses
    must be the server's bytes whichever way they came (SPEC 3.2)."""
    text = _text(response)
    end = len(text)

    def skip(i: int) -> int:
        while i < end and text[i] in " \t\n\r":
            i += 1
        return i

    elements: list[str] = []
    i = skip(0)
    if text[i : i + 1] != "[":
        raise _unexpected(response, "NDJSON or a JSON list of responses")
    i = skip(i + 1)
    if text[i : i + 1] == "]":
        i += 1
    else:
        while True:
            try:
                _, stop = _ELEMENTS.raw_decode(text, i)
            except _NOT_JSON:
                raise _unexpected(response, "NDJSON or a JSON list of responses") from None
            elements.append(text[i:stop])
            i = skip(stop)
            if text[i : i + 1] == "]":
                i += 1
                break
            if text[i : i + 1] != ",":
                raise _unexpected(response, "NDJSON or a JSON list of responses")
            i = skip(i + 1)
    if skip(i) != end:
        raise _unexpected(response, "NDJSON or a JSON list of responses")
    return elements


# -- one async pool per event loop ---------------------------------------------------------


def _loop_key() -> object:
    """The running loop's native identity: the asyncio loop, or trio's ``TrioToken``."""
    try:
        return anyio.lowlevel.current_token().native_token
    except Exception:
        return None


class _ClientOptions:
    """The options of each shard's httpx client, and what every client of one ``HttpClient``
    shares (sync, and each loop's): one cookie jar and one TLS context, given to the options
    by :meth:`share` before the first client is made (so never for calls that all go through
    a caller's ``session``).

    httpx keeps cookies per client: a cookie the server sets (a load balancer's stickiness, a
    gateway's session) would reach only the requests sent through the same shard. And it builds
    a TLS context per client, loading the CA bundle (~50 ms) each time. The shared context is
    built from the caller's ``verify``, ``cert`` and ``trust_env`` as httpx would (``cert``
    loaded into it once); ALPN for ``http2`` is set by httpcore on every connection, the same
    for every client. Pools hold this, not the ``HttpClient``.
    """

    def __init__(self, shards: list[dict[str, Any]], *, share_tls: bool) -> None:
        self.shards = shards
        self.share_tls = share_tls
        self.shared = False
        self._lock = threading.Lock()

    def after_fork(self) -> None:
        """In a forked child: a parent thread may have held the lock (building the TLS
        context, ~50 ms) as the process forked."""
        self._lock = threading.Lock()

    def share(self) -> None:
        with self._lock:
            if self.shared:
                return
            first = self.shards[0]
            shared: dict[str, Any] = {"cookies": httpx.Cookies(first.get("cookies")).jar}
            if self.share_tls:
                shared["verify"] = httpx.create_ssl_context(
                    verify=first.get("verify", True),
                    cert=first.get("cert"),
                    trust_env=first.get("trust_env", True),
                )
            for options in self.shards:
                options.update(shared)
                if self.share_tls:
                    options.pop("cert", None)  # in the context already
            self.shared = True


def _warm_transport(options: _ClientOptions) -> None:
    """What an async client's first request would otherwise do on its loop: share the TLS
    context, and import what httpx imports at the first transport it makes (httpcore, its
    async network backends) and at the first connection (h11)."""
    options.share()
    import httpcore._backends.anyio
    import httpcore._backends.auto

    if "trio" in sys.modules:
        import httpcore._backends.trio  # noqa: F401


_C = TypeVar("_C", httpx.Client, httpx.AsyncClient)


def _close_sync(shards: _Shards[httpx.Client] | None) -> None:
    for client in shards.close() if shards is not None else ():
        client.close()


class _Shards(Generic[_C]):
    """A pool's connections as several httpx clients of at most ``_SHARD_CONNECTIONS``.

    httpcore scans every connection of a pool, several times (some scans quadratic), each time
    a request starts or ends: over 64 connections that costs ~8 ms of CPU per request on
    asyncio, over 4 pools of 16 ~2.6 ms, over 16 of 4 ~1.5 (sync calls from 64 threads: 2.5
    ms over one pool of 64, 1.2 over 16 of 4). A request takes the first shard with a free
    connection, so light use makes and keeps one client. Clients are made on first use
    (cheap: they share one TLS context). ``lock``: for shards shared by threads
    (the sync calls'); a loop's are touched only on its thread.
    """

    def __init__(
        self,
        options: _ClientOptions,
        make: Callable[..., _C],
        lock: threading.Lock | None = None,
    ) -> None:
        self._options = options
        self._make: Callable[..., _C] = make
        self._clients: list[_C | None] = [None] * len(options.shards)
        self._active = [0] * len(options.shards)
        # A caller's own httpx.Limits may leave the connections unbounded (None).
        self._capacity = [o["limits"].max_connections or math.inf for o in options.shards]
        self._closed = False
        self._lock: contextlib.AbstractContextManager[Any] = lock or contextlib.nullcontext()

    @contextlib.contextmanager
    def lease(self) -> Iterator[_C]:
        """The client to send one request through."""
        active, capacity = self._active, self._capacity
        with self._lock:
            i = next((i for i, n in enumerate(active) if n < capacity[i]), None)
            if i is None:  # only without max_in_flight: queue where the fewest wait
                i = min(range(len(active)), key=lambda j: active[j] - capacity[j])
            client = self._clients[i]
            if client is None:
                if self._closed:  # never open a pool that nothing would close
                    raise ClientClosedError(CLIENT_CLOSED)
                self._options.share()
                client = self._clients[i] = self._make(**self._options.shards[i])
            active[i] += 1
        try:
            yield client
        finally:
            with self._lock:
                active[i] -= 1

    def close(self) -> list[_C]:
        """Make no more clients; the ones made, for the caller to close."""
        with self._lock:
            self._closed = True
            return [client for client in self._clients if client is not None]


#: The most seconds a closing call waits for its loop's pool to close (httpx closes sockets
#: at once; this only bounds a close stuck on a broken transport).
_CLOSE_WAIT = 5.0


class _LoopPool:
    """The ``httpx.AsyncClient`` objects bound to one loop, and the keeper that closes them there.

    ``slots`` bounds the requests in flight on this loop (anyio primitives are loop-bound, so
    one per loop). The loop's connections are split over several clients (:class:`_Shards`);
    a call through a caller's ``session`` needs only the slots. Slots and shards are touched
    only on this loop's thread.

    The keeper sleeps until the loop ends (its tasks are cancelled) or the HttpClient closes
    (it is cancelled from any thread, through the loop's thread-safe callback), then closes the
    pool on its own loop, so no connection outlives its loop.
    """

    def __init__(
        self,
        shards: _Shards[httpx.AsyncClient],
        max_in_flight: int | None,
        key: object,
        registry: dict[object, _LoopPool],
        lock: threading.Lock,
    ) -> None:
        self._shards = shards
        self.slots = (
            None
            if max_in_flight is None
            else anyio.Semaphore(max_in_flight, max_value=max_in_flight)
        )
        self.key = key
        self._registry = registry
        self._registry_lock = lock
        self._lock = threading.Lock()
        self._scope: anyio.CancelScope | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None  # asyncio holds tasks weakly
        self._closed = anyio.Event()  # made on its loop, as it is waited on there
        #: async calls in flight through this pool (touched on its loop only)
        self.calls = 0

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        self.calls += 1
        try:
            yield
        finally:
            self.calls -= 1

    @contextlib.contextmanager
    def lease(self, session: httpx.AsyncClient | None) -> Iterator[httpx.AsyncClient]:
        """The client to send one request through: the caller's ``session``, or a shard."""
        if session is not None:
            yield session
            return
        with self._shards.lease() as client:
            yield client

    async def aclose_clients(self) -> None:
        interrupted: BaseException | None = None
        for client in self._shards.close():
            try:
                await client.aclose()
            except BaseException as exc:  # asyncio's own cancellation passes anyio's shield:
                interrupted = interrupted or exc  # close the others all the same
        if interrupted is not None:
            raise interrupted

    async def close_here(self) -> None:
        """Close this pool, on its own loop (the running one), and wait until its keeper has
        closed it and ended; shielded (a cancelled caller must not cut the close short)."""
        self.request_close()
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_WAIT):
            await self._closed.wait()

    def start_keeper(self) -> None:
        if sniffio.current_async_library() == "trio":
            import trio

            trio.lowlevel.spawn_system_task(self._keep, name="histoinfer-http-pool")
        else:
            self._task = asyncio.get_running_loop().create_task(
                self._keep(), name="histoinfer-http-pool"
            )

    async def _keep(self) -> None:
        try:
            with anyio.CancelScope() as scope:
                with self._lock:
                    self._scope = scope
                    if self._closing:
                        scope.cancel()
                await anyio.sleep_forever()
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self.aclose_clients()
            except Exception:  # a trio system task must not raise
                log.debug("closing an HTTP pool failed", exc_info=True)
            finally:  # even cancelled (asyncio's own, past the shield): no waiter is left
                with self._registry_lock:
                    if self._registry.get(self.key) is self:
                        del self._registry[self.key]
                self._closed.set()  # last: the keeper ends in this step

    def request_close(self) -> None:
        """Cancel the keeper from any thread; it closes the pool on its loop."""
        with self._lock:
            self._closing = True
            scope = self._scope
        if scope is None:
            return  # the keeper has not started: it will see _closing
        try:
            if isinstance(self.key, asyncio.AbstractEventLoop):
                self.key.call_soon_threadsafe(scope.cancel)
            else:
                self.key.run_sync_soon(scope.cancel)  # type: ignore[attr-defined]
        except Exception:  # the loop has ended, and its connections with it
            pass

    def finished(self) -> bool:
        """Whether this pool's loop has ended (its entry can be dropped)."""
        if isinstance(self.key, asyncio.AbstractEventLoop):
            return self.key.is_closed()
        try:
            self.key.run_sync_soon(lambda: None)  # type: ignore[attr-defined]
        except Exception:  # trio.RunFinishedError
            return True
        return False
