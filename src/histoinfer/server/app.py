"""``create_app``: the FastAPI microservice, HTTP over :class:`~histoinfer.InProcessClient`.

Every inference route reads the raw body bytes and hands them to the very client an in-process
user would call, then returns its JSON string untouched: the server cannot drift from the
in-process behaviour, and the hot path has no ``json.loads``/``dumps`` round trip.

Lifecycle: the port opens at once (``/health/live`` answers), models load and warm up in a
worker thread, and ``/health/ready`` turns 200 only when every model is ready. On shutdown
the app first drains (new requests get 503 ``closed``, readiness fails so load balancers move
away), lets in-flight requests finish, then closes its clients.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import Any, Literal, TypeVar, get_args

import anyio
import anyio.from_thread
import anyio.to_thread
import numpy as np
import pydantic_core
import sniffio
from fastapi import FastAPI, Request
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route
from starlette.types import Scope

from .. import __version__
from ..clients.inprocess import InProcessClient
from ..errors import (
    ClientClosedError,
    InferenceError,
    InvalidRequestError,
    OverloadedError,
    UnsupportedModeError,
)
from ..models.base import ServerModel
from ..models.device_thread import device_thread
from ..outcome import run_sync
from ..schema import (
    FOREIGN_KEY,
    INVOCATION_MODES,
    MAX_BULK_RNA,
    MODES,
    SCREENED_FROM,
    ForeignBody,
    InvocationEnvelope,
    InvocationMetadataOfRequest,
    InvocationMetadataRequest,
    InvocationMode,
    InvocationRequest,
    Mode,
    ModelMetadata,
    ModelRequest,
    ModelResponse,
    byte_count,
    json_hint,
    parse_model,
)
from .memory import return_freed_memory
from .metrics import UNKNOWN, HttpCounters, StatsCollector, render_metrics
from .problems import (
    PROBLEM_JSON,
    ModelNotReadyError,
    PayloadTooLargeError,
    Problem,
    RequestIdMiddleware,
    RequestTimeoutError,
    UnknownModelError,
    install_problem_handlers,
    leave_body_unread,
    problem_response,
)

__all__ = [
    "BATCH_BODIES_JSON",
    "BYTES_KEY",
    "NDJSON",
    "STR_KEY",
    "ClientSource",
    "ServerState",
    "create_app",
]

log = logging.getLogger("histoinfer.server")

#: A ready client, or a factory that loads one (called in a worker thread at startup).
ClientSource = InProcessClient | Callable[[], InProcessClient]

#: Batch request type whose list elements are the bodies exactly as the caller gave them
#: (what :class:`~histoinfer.HttpClient` sends): strings reach the model byte for byte.
BATCH_BODIES_JSON = "application/vnd.histoinfer.bodies+json"
#: In such a batch, ``{BYTES_KEY: base64}`` stands for a bytes body that is not UTF-8.
BYTES_KEY = "$bytes"
STR_KEY = "$str"
#: Batch response type with one response JSON per line: split exactly, without re-parsing.
NDJSON = "application/x-ndjson"
#: "false" on every answer of a model with untrained weights (a reference checkpoint), for
#: HttpClient to warn its user as in-process users are warned; absent for trained models
TRAINED_HEADER = "histoinfer-trained"
_UNTRAINED = (TRAINED_HEADER.encode("latin-1"), b"false")
#: on every inference answer: the sha256 of the checkpoint that computed it
CHECKPOINT_HEADER = "histoinfer-checkpoint-sha256"
_CHECKPOINT = CHECKPOINT_HEADER.encode("latin-1")

_JSON = "application/json"
_Endpoint = TypeVar("_Endpoint", bound=Callable[..., Any])
_Answer = TypeVar("_Answer")  # what a route's work gives: one response's JSON, or a list of them
# Past the limit the rest of the body is read and dropped (up to this much, for up to this
# long, while it keeps coming) before answering 413: a client still writing would otherwise
# see a connection reset instead of the 413. The time bounds: a client that declares more
# than it sends would otherwise hold the request until its own timeout (a stalled one waited
# the whole 5 s for its answer: a user trial). Cut short, the answer closes the connection.
_DRAIN_CAP = 256 * 1024 * 1024
_DRAIN_SECONDS = 5.0
_DRAIN_STALL = 1.0

Status = Literal["loading", "ready", "failed", "closed"]

#: readiness's other answer, for the OpenAPI document (the same JSON as its 200)
_NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"description": "a model is still loading or failed to load, or the server is draining"}
}

#: Route names that are GET-only views at ``/api/{name}/{model}``, not modes: a POST there is 405
_READ_ONLY = ("metadata", "stats")


class Arrival:
    """A request in flight, from the moment the app has its headers (its body's upload
    included), as a context manager around its route's work.

    Its cancel scope is cancelled by three things, and the route then answers
    :meth:`ServerState.unanswered`:

    - the client hanging up (unless the app was told not to watch: ``cancel_on_disconnect``),
      watched once the body is read: answered 499, to nobody. A request that is still queued
      then leaves its queue before dispatch (SPEC §5), one in a forward pass leaves its batch
      undisturbed. Uvicorn and Hypercorn do not cancel a handler whose client left, so
      without this every abandoned request was decoded and computed, and live callers waited
      behind them (1,000 dropped connections made the next request take 4.9 s, not 0.3);
    - the graceful timeout running out (:meth:`ServerState.expire_in_flight`): answered 503
      ``closed`` with ``Retry-After``, which ``HttpClient`` retries, instead of the server's
      bare 500 or dropped connection when it cancels the handler itself; a request still
      uploading its body included (until session 21 only those past their upload were);
    - its body stalling for the body timeout (:meth:`ServerState.watch_bodies`): answered 408.

    A class, not a generator context manager, and one watchdog for every body rather than a
    timeout scope each: those cost the event loop ~25 µs a request (a deadline on an anyio
    scope alone ~14), about 2% of its CPU a request.
    """

    __slots__ = ("_state", "held", "reading_since", "scope", "stalled", "while_draining")

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self.scope = anyio.CancelScope()
        self.while_draining = state.draining
        #: when the body last made progress; None once it is read
        self.reading_since: float | None = time.monotonic()
        self.stalled = False
        #: bytes of its body it holds, counted in the server's ``--max-bodies-mb``
        self.held = 0

    def __enter__(self) -> Arrival:
        self.scope.__enter__()
        self._state.in_flight.add(self)
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        self._state.in_flight.discard(self)
        self._state.http.bodies_held -= self.held
        return bool(self.scope.__exit__(*exc_info))

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes of body would fit in the server's room now."""
        limit = self._state.max_held_bytes
        return limit is None or self._state.http.bodies_held + size <= limit

    def hold(self, size: int) -> bool:
        """Count ``size`` more bytes of its body, if the server has room for them."""
        if not self.fits(size):
            return False
        self._state.http.bodies_held += size
        self.held += size
        return True

    def no_room(self, size: int) -> OverloadedError:
        """The refusal when :meth:`fits` found no room for ``size`` more bytes: a 503, as a
        full queue's. Made at once: by the time the body is drained, others may have left,
        and the figures would say the body fitted (a user trial)."""
        return OverloadedError(
            f"the server holds {self._state.http.bodies_held} bytes of request bodies, and "
            f"{size} more of this one's do not fit in its limit of "
            f"{self._state.max_held_bytes} bytes (--max-bodies-mb, create_app's "
            "max_held_bytes); retry later"
        )


#: The refusal, and readiness's reason, while the app's lifespan has not run: a mounted app
#: said "loading" for ever, and nothing in the log said why (an embedding trial).
NOT_STARTED = (
    "the app's lifespan has not run, which loads its models (an app mounted in another "
    "needs the parent's lifespan to run it: docs/server.md, 'Embedding the app')"
)
#: where the body limit is set, in a 413's words
_BODY_OPTION = "(--max-body-mb, create_app's max_body_bytes)"


class ServedModel:
    """One model behind the routes: its client once loaded, and where it is in its life."""

    def __init__(self, name: str, source: ClientSource) -> None:
        self.name = name
        self.client = source if isinstance(source, InProcessClient) else None
        self.factory = None if isinstance(source, InProcessClient) else source
        self.status: Status = "loading"
        self.error: str | None = None


class ServerState:
    """What the routes share: the models, the limits, and whether the server is draining.

    ``begin_drain`` is safe to call from a signal handler: it only flips a flag.
    """

    def __init__(
        self,
        models: Mapping[str, ClientSource],
        *,
        max_body_bytes: int,
        retry_after: int,
        warmup: bool,
        cancel_on_disconnect: bool = True,
        body_timeout: float | None = None,
        max_batch_requests: int | None = None,
        max_batch_calls: int | None = None,
        max_held_bytes: int | None = None,
    ) -> None:
        if not models:
            raise ValueError("create_app needs at least one model")
        if UNKNOWN in models:  # its requests and a missing model's would be one series
            raise ValueError(
                f"a model cannot be served as {UNKNOWN!r}: /metrics gives that model label to "
                "paths naming no model served here; serve it under another name"
            )
        if body_timeout is not None and not body_timeout > 0:  # 0 would spin the watchdog
            raise ValueError(f"body_timeout must be more than 0 s, or None, got {body_timeout!r}")
        if max_batch_requests is not None and not max_batch_requests >= 1:
            raise ValueError(f"max_batch_requests must be at least 1, got {max_batch_requests!r}")
        if max_batch_calls is not None and not max_batch_calls >= 1:
            raise ValueError(f"max_batch_calls must be at least 1, got {max_batch_calls!r}")
        if max_held_bytes is not None and not max_held_bytes >= max_body_bytes:
            raise ValueError(
                f"max_held_bytes ({max_held_bytes!r}) must be at least max_body_bytes "
                f"({max_body_bytes}): a body the server may take must fit in what it holds"
            )
        self.models = {name: ServedModel(name, source) for name, source in models.items()}
        self.max_body_bytes = max_body_bytes
        self.max_batch_requests = max_batch_requests
        #: One ``/batch`` body's list is parsed at a time. Parsing holds the GIL, so two at
        #: once are no faster, and each can briefly take ~16x its body (64 MiB of ``[{},...]``
        #: ~1 GB): one at a time bounds that to one body's worth, not one per worker thread.
        self.batch_parse_lock = threading.Lock()
        #: ``/batch`` calls in progress (their bodies being read, parsed or run): counted on
        #: the event loop, so no lock. Each holds its body and then every decoded tile.
        self.max_batch_calls = max_batch_calls
        self.batch_calls = 0
        #: The most bytes of request bodies held at once, over every request (each counted
        #: from its first chunk until it is answered; ``http.bodies_held`` is the count).
        self.max_held_bytes = max_held_bytes
        self.body_timeout = body_timeout
        self.retry_after = retry_after
        self.warmup = warmup
        self.cancel_on_disconnect = cancel_on_disconnect
        #: Readiness fails (load balancers move away) but requests are still served: the
        #: CLI's --drain-delay, between SIGTERM and draining.
        self.stopping = False
        #: New requests are refused (503 ``closed``); those in flight go on.
        self.draining = False
        #: How many times the app's lifespan has started (it may run once).
        self.lifespans = 0
        #: Whether that one run is going on now (started, not yet ended).
        self.running = False
        #: The graceful timeout is about to run out: requests still in flight are cancelled
        #: and answered 503 ``closed`` (retry elsewhere), not cut off by the server.
        self.out_of_time = False
        #: The requests in flight (:class:`Arrival`): what :meth:`expire_in_flight` cancels.
        self.in_flight: set[Arrival] = set()
        #: Called (on the event loop) if a model fails to load: the CLI stops the server.
        self.on_fatal: Callable[[], None] | None = None
        #: Called (on the event loop) once loading is over, every model ready or failed, unless
        #: ``on_fatal`` was: the CLI freezes the start-up heap there (``gc.freeze``).
        self.on_loaded: Callable[[], None] | None = None
        self.http = HttpCounters()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(StatsCollector(self.loaded_clients, self.http))

    # -- what the routes ask -------------------------------------------------------------

    def client(self, name: str, arrival: Arrival | None = None) -> InProcessClient:
        """The model's client; refused while draining, unless ``arrival`` came before it (a
        request still uploading its body at SIGTERM is in flight, and finishes)."""
        served = self.models.get(name)
        if served is None:
            raise UnknownModelError(
                f"unknown model {name!r}; served here: {', '.join(sorted(self.models))}"
            )
        if self.draining and (arrival is None or arrival.while_draining):
            raise ClientClosedError("the server is shutting down; retry on another instance")
        if not self.lifespans:
            raise ModelNotReadyError(f"model {name!r} is not ready: {NOT_STARTED}")
        if served.status != "ready" or served.client is None:
            why = f": {served.error}" if served.error else "; retry shortly"
            raise ModelNotReadyError(f"model {name!r} is not ready ({served.status}){why}")
        return served.client

    @property
    def ready(self) -> bool:
        return not (self.stopping or self.draining) and all(
            m.status == "ready" for m in self.models.values()
        )

    def loaded_clients(self) -> dict[str, InProcessClient | None]:
        return {
            name: m.client if m.status in ("ready", "closed") else None
            for name, m in self.models.items()
        }

    def begin_stopping(self) -> None:
        """Fail readiness, and go on serving: load balancers see the 503 and move away while
        requests they already sent here are still answered (the CLI's ``--drain-delay``)."""
        self.stopping = True

    def begin_drain(self, announce: bool = False) -> None:
        """Refuse new requests (503 ``closed``) and fail readiness; in-flight ones go on.
        ``announce``: say so in the log (a stop signal's drain; not a shutdown's last step)."""
        if announce and not self.draining:
            log.info(
                "draining: new requests are refused (503 closed); %d in flight go on",
                len(self.in_flight),
            )
        self.stopping = self.draining = True

    @contextmanager
    def batch_call(self) -> Iterator[bool]:
        """A ``/batch`` call's place among those in progress: yields whether it got one."""
        admitted = self.max_batch_calls is None or self.batch_calls < self.max_batch_calls
        self.batch_calls += admitted
        try:
            yield admitted
        finally:
            self.batch_calls -= admitted

    def arrived(self) -> Arrival:
        """A request in flight from its headers on: ``with state.arrived() as arrival:``."""
        return Arrival(self)

    def unanswered(self, request: Request, arrival: Arrival) -> Response:
        """The answer of a request whose scope was cancelled (:class:`Arrival` says by what)."""
        if arrival.reading_since is not None:  # cancelled mid-body
            leave_body_unread(request)
        if arrival.stalled:
            raise RequestTimeoutError(
                f"no part of the request body arrived for {self.body_timeout:g} s (the "
                "server's body timeout)"
            )
        if self.out_of_time:
            raise ClientClosedError(
                "the server is shutting down and its graceful timeout ran out before this "
                "request was answered; retry on another instance"
            )
        return Response(status_code=CLIENT_CLOSED)

    def expire_in_flight(self) -> None:
        """Cancel the requests still in flight, each answered 503 ``closed`` with
        ``Retry-After`` (``HttpClient`` retries it): called just before the server's graceful
        timeout runs out, which would otherwise cut them off with a bare 500 or a dropped
        connection. Queued ones leave their queue; a ``/batch`` stops before its next pass."""
        self.begin_drain()
        self.out_of_time = True
        if self.in_flight:
            log.warning(
                "the graceful timeout is running out: %d request(s) still in flight are "
                "answered 503 closed",
                len(self.in_flight),
            )
        for arrival in list(self.in_flight):
            arrival.scope.cancel()

    async def watch_bodies(self) -> None:
        """Cancel every request whose body has sent nothing for ``body_timeout`` seconds (a
        stalled or slow-loris client held its slot and the shutdown for ever), checking a few
        times a timeout (at least once a second)."""
        if self.body_timeout is None:
            return
        timeout = self.body_timeout
        while True:
            await anyio.sleep(min(timeout / 4, 1.0))
            now = time.monotonic()
            for arrival in list(self.in_flight):
                since = arrival.reading_since
                if since is not None and now - since > timeout:
                    arrival.stalled = True
                    arrival.scope.cancel()

    # -- lifecycle -----------------------------------------------------------------------

    async def load_all(self) -> None:
        """Load (in a worker thread) and warm up every model, one after the other. A model that
        fails is marked failed (readiness says why) and the next one loads: the others serve,
        unless ``on_fatal`` (the CLI's: exit) stops the server."""
        for served in self.models.values():
            try:
                if served.client is None:
                    assert served.factory is not None
                    log.info("loading model %r", served.name)
                    # abandon_on_cancel: a shutdown during a long load need not wait for it.
                    served.client = await anyio.to_thread.run_sync(
                        served.factory, abandon_on_cancel=True
                    )
                if self.warmup:
                    await anyio.to_thread.run_sync(warm_up, served.client, abandon_on_cancel=True)
            except Exception as exc:
                served.status, served.error = "failed", f"{type(exc).__name__}: {exc}"
                log.error("model %r failed to load: %s", served.name, served.error)
                if self.on_fatal is not None:
                    self.on_fatal()
                    return
                continue
            served.status = "ready"
            log.info("model %r is ready", served.name)
        if self.on_loaded is not None:
            self.on_loaded()

    async def close_all(self) -> None:
        """Finish in-flight work and release every client (they refuse new work after)."""
        self.begin_drain()
        for served in self.models.values():
            if served.client is not None:
                await served.client.aclose()
                if served.status == "ready":
                    served.status = "closed"


def warm_up(client: InProcessClient) -> None:
    """Run one real tile through every mode, so the first user request pays no first-call cost.

    It calls the model directly (not the client), so warm-up tiles do not show in the stats.
    A model whose own ``prepare_sample`` or ``postprocess`` refuses the made-up request (it
    wants a field set, or a tile it recognises) is warmed up all the same, with a warning: that
    says nothing against serving real requests.
    """
    model = client.server_model
    meta = model.metadata()
    size = meta.tile_size
    # A tile a model would take: textured (a flat one may be refused as background, or give a
    # model's own normalization a zero variance), at the model's resolution, all tissue.
    pixels = np.random.default_rng(0).integers(96, 224, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    request = ModelRequest(
        image_data=base64.b64encode(buffer.getvalue()).decode(),
        slide_name="warm-up",
        x=0,
        y=0,
        width=size,
        height=size,
        patch_idx=0,
        tissue_ratio=1.0,
        resolution=meta.resolution,
    )
    where = "for the warm-up tile"
    postprocess = True
    try:
        tile = model.prepared_tile(request, where)
    except InferenceError as exc:
        log.warning("%s: warm-up without its prepare_sample, which refused: %s", meta.name, exc)
        tile, postprocess = ServerModel.prepare_sample(model, request, where), False
    for mode in meta.modes:
        # On the device's thread, like every pass: run on this worker thread, it would leave it
        # an OpenMP team and slow every later pass (models/device_thread.py).
        output = device_thread(model.device).call(model.forward_tiles, [tile], mode)
        try:
            if postprocess:
                model.response_json(request, output.split()[0], mode, where)
        except InferenceError as exc:
            log.warning("%s: warm-up's postprocess refused (%s): %s", meta.name, mode, exc)


# -- request helpers ---------------------------------------------------------------------


async def read_body(request: Request, limit: int, arrival: Arrival | None = None) -> bytes:
    """The raw body, refused with 413 over ``limit`` bytes (declared or actually streamed).
    Each chunk tells ``arrival`` the body is making progress (:meth:`ServerState.watch_bodies`)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        await refuse_unread(request, arrival)
        raise PayloadTooLargeError(
            f"request body is {int(declared)} bytes; the limit is {limit} bytes {_BODY_OPTION}"
        )
    # A declared body that does not fit now is refused before any of it is read. Nothing is
    # reserved by the header: bytes count as they arrive, or a client declaring 64 MiB and
    # sending nothing would pin that much of the room (a review).
    if arrival is not None and declared.isdigit() and not arrival.fits(int(declared)):
        refusal = arrival.no_room(int(declared))  # its figures before the body is drained
        await refuse_unread(request, arrival)
        try:
            raise refusal
        finally:
            del refusal  # this frame is in its traceback (histoinfer/outcome.py)
    chunks: list[bytes] = []
    size = 0
    stream = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            await _discard(request, stream, size, arrival)
            raise PayloadTooLargeError(
                f"request body is over the limit of {limit} bytes {_BODY_OPTION}"
            )
        if arrival is not None and not arrival.hold(len(chunk)):
            refusal = arrival.no_room(len(chunk))
            await _discard(request, stream, size, arrival)
            try:
                raise refusal
            finally:
                del refusal  # this frame is in its traceback (histoinfer/outcome.py)
        chunks.append(chunk)
        if arrival is not None:  # the timeout runs between chunks: a slow link is no stall
            arrival.reading_since = time.monotonic()
    if arrival is not None:
        arrival.reading_since = None
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":  # a gzip body would otherwise be "not valid JSON"
        raise StarletteHTTPException(
            415,
            f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
            headers={"Accept-Encoding": "identity"},
        )
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def refuse_unread(request: Request, arrival: Arrival | None = None) -> None:
    """Before refusing a request whose body is not read yet: its body, read and dropped, so
    that the client sees the answer rather than a connection reset."""
    # A client that sent "Expect: 100-continue" waits for the server's go-ahead, which
    # reading the body would give: refused now, it never uploads the body at all.
    if request.headers.get("expect", "").lower() == "100-continue":
        leave_body_unread(request)
    else:
        await _discard(request, request.stream(), 0, arrival)


async def _discard(
    request: Request, stream: AsyncIterator[bytes], already: int, arrival: Arrival | None
) -> None:
    """The rest of ``stream`` (the body being read), read and dropped: up to ``_DRAIN_CAP``
    bytes, for ``_DRAIN_SECONDS``, while a chunk comes every ``_DRAIN_STALL``; cut short, the
    request is marked to close its connection. The same iterator: a second
    ``request.stream()`` raises once the body's last chunk has arrived. The body timeout no
    longer watches it: the answer is decided (a slow drain would have turned it into a 408
    saying no part of the body arrived)."""
    if arrival is not None:
        arrival.reading_since = None
    size = already
    chunks = aiter(stream)
    with anyio.move_on_after(_DRAIN_SECONDS):
        while size <= _DRAIN_CAP:
            chunk: bytes | None = None
            with anyio.move_on_after(_DRAIN_STALL) as gap:
                chunk = await anext(chunks, None)
            if gap.cancelled_caught:
                break
            if chunk is None:
                return  # read to its end: the connection can carry the next request
            size += len(chunk)
    leave_body_unread(request)


#: What the log and /metrics show for a request whose client hung up before its answer (nginx's
#: "client closed request"): nobody receives it.
CLIENT_CLOSED = 499


class _Left(Exception):
    """Raised on a worker thread at its next check once the request it works for has left."""


async def _on_thread_until_out_of_time(
    work: Callable[[Callable[[], None]], _Answer], state: ServerState
) -> _Answer:
    """``work(check)`` on a worker thread, ``check()`` raising between its slices once the
    request is cancelled. A cancelled request waits for its thread to stop, keeping its
    ``/batch`` place and its body (a client hanging up and sending again cannot run more
    batches at once than ``max_batch_calls``), unless the graceful timeout is running out:
    then it is answered 503 ``closed`` at once. It waited out the pass under way, and a pass
    longer than the time left before the ASGI server's deadline (seconds on a ViT) was cut
    off with a bare 500 (a user trial)."""
    done, left, lock = threading.Event(), threading.Event(), threading.Lock()
    started = False

    def check() -> None:
        if left.is_set():
            raise _Left
        anyio.from_thread.check_cancelled()

    def on_thread() -> _Answer:
        nonlocal started
        with lock:
            if left.is_set():  # left while it waited for a thread: nobody waits for this
                raise _Left
            started = True
        try:
            return work(check)
        finally:
            done.set()

    try:
        # errors raised without a reference cycle (histoinfer/outcome.py)
        return await run_sync(on_thread, abandon_on_cancel=True)
    except BaseException:
        with lock:
            left.set()
            if not started:  # it never will be
                done.set()
        with anyio.CancelScope(shield=True):
            while not (done.is_set() or state.out_of_time):
                await anyio.sleep(0.01)  # a cancelled call only, ended by a slice (~0.1 s+)
        raise


async def _in_flight(
    request: Request,
    work: Callable[[], Awaitable[_Answer]],
    respond: Callable[[_Answer], Response],
    state: ServerState,
    arrival: Arrival,
) -> Response:
    """``respond(work())``, once the body is read, watched for a hang-up unless the app was
    told not to (``cancel_on_disconnect``); :class:`Arrival` says why."""
    if not state.cancel_on_disconnect:
        return respond(await work())
    return await _watched(request, work, respond, arrival.scope)


async def _watched(
    request: Request,
    work: Callable[[], Awaitable[_Answer]],
    respond: Callable[[_Answer], Response],
    scope: anyio.CancelScope,
) -> Response:
    """:func:`_in_flight`'s work, with the hang-up watch beside it: called once the body is
    read, so the next ASGI message is ``http.disconnect``, when the connection closes (or the
    response is complete, by which time this has returned). On asyncio the watch is a plain
    task cancelling the scope (an anyio task group cost ~90 µs of the loop's CPU a request,
    this ~15 alone); in a server it still measured ~0.1 ms of the loop's CPU a request
    (benchmarks/server_loop.py, docs/server.md)."""
    if sniffio.current_async_library() == "asyncio":
        watch = asyncio.ensure_future(_cancel_on_hang_up(request, scope))
        try:
            return respond(await work())
        finally:
            watch.cancel()
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_hang_up, request, scope)
        try:
            answer = await work()
        except Exception as exc:  # raised below, as itself: the task group would wrap it
            failure = exc
        tg.cancel_scope.cancel()  # the watch
    if failure is not None:
        try:
            raise failure
        finally:
            del failure  # this frame is in its traceback (histoinfer/outcome.py)
    return respond(answer)


async def _cancel_on_hang_up(request: Request, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` if the next ASGI message says the client left. Uvicorn and Hypercorn
    send it only then; any other message (or a failing ``receive``) means the server cannot
    say, and the request is served as before (a loop over ``receive`` could spin)."""
    try:
        message = await request.receive()
    except Exception:
        return
    if message["type"] == "http.disconnect":
        scope.cancel()


def _mode(mode: str) -> Mode:
    if mode not in MODES:
        raise UnsupportedModeError(f"unknown mode {mode!r} (modes: {', '.join(MODES)})")
    return mode


#: what one request of a ``/batch`` body holds at most, its strings included, with room to
#: spare for slide names: ``{`` and ``[`` (its object and its ``bulk_rna`` list, inline or
#: inside a JSON string: 2), and ``"`` (its keys and string values: 24 with the quotes of a
#: body sent as a JSON string)
_CONTAINERS_A_REQUEST = 4
_QUOTES_A_REQUEST = 48
_COMMAS_A_REQUEST = 256


def _screen_batch(raw: bytes, limit: int, bulk_rna: bool) -> None:
    """A long ``/batch`` body holding more JSON objects, arrays, strings or values than
    ``limit`` requests can, refused before it is parsed: pydantic takes ~27 times such a body
    and holds the GIL meanwhile (64 MiB of ``[{},{},...]``: 1.7 GB and 3 s; 60 MB of
    ``[0,0,...]``: 1-3 s, every other request stalled). Counted at ~0.1 ms a MB a character.
    Values by their commas, so a model that takes ``bulk_rna`` (100,000 numbers a request)
    bounds them only loosely."""
    if len(raw) < SCREENED_FROM:  # parsing less is cheap, whatever it holds
        return
    containers = byte_count(raw, "{", "[")
    quotes = byte_count(raw, '"')
    commas = byte_count(raw, ",")
    most_containers = limit * _CONTAINERS_A_REQUEST + 1
    most_quotes = limit * _QUOTES_A_REQUEST
    # A request's fields' separators with room for ~200 in a slide name (in-process a request
    # may hold 64 beside its bulk_rna: a review found a batch of such names refused here, with
    # a small --max-batch-requests), its bulk_rna values, and the one after it in the list.
    most_commas = limit * (_COMMAS_A_REQUEST + (MAX_BULK_RNA if bulk_rna else 0))
    if containers > most_containers or quotes > most_quotes or commas > most_commas:
        raise PayloadTooLargeError(
            f"invalid batch: its body holds {containers:,} JSON objects and arrays, "
            f"{quotes:,} quotes and {commas:,} commas, strings included; a batch of at most "
            f"{limit} requests (histoinfer serve --max-batch-requests) holds at most "
            f"{most_containers:,}, {most_quotes:,} and {most_commas:,}: send fewer requests, "
            "or only the fields a request has"
        )


def _batch_bodies(raw: bytes, verbatim: bool, limit: int | None = None) -> Any:
    """The bodies of a batch request, for ``InProcessClient.infer_batch``.

    String elements are passed as they are (they are request bodies). Object elements are
    requests written inline (curl): they are serialized back to JSON text, unless the request
    is ``BATCH_BODIES_JSON``, where every element is exactly what the caller passed (a dict is
    refused as in-process; ``{BYTES_KEY: base64}`` is a bytes body, ``{STR_KEY: base64}`` a str
    body that is not valid Unicode). A ``BATCH_BODIES_JSON`` body that is not a list is passed
    on: ``infer_batch`` rejects it with the message in-process callers get. A list of more
    than ``limit`` elements is refused (413) before any element is looked at (and the route
    refuses before this parse a long body that holds more than ``limit`` requests could:
    :func:`_screen_batch`).
    """
    try:
        items = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise InvalidRequestError(
            f"invalid batch: body is not valid JSON ({exc}){json_hint(str(exc))}"
        ) from None
    if not isinstance(items, list):
        if verbatim:
            return items
        names: dict[type, str] = {dict: "an object", str: "a string"}
        kind = names.get(type(items), type(items).__name__)
        raise InvalidRequestError(
            f"invalid batch: the body must be a JSON list of requests (objects, or JSON "
            f"strings), got {kind}"
        )
    if limit is not None and len(items) > limit:
        raise PayloadTooLargeError(
            f"invalid batch: {len(items)} requests; the server takes at most {limit} in one "
            "batch (histoinfer serve --max-batch-requests): send them in several"
        )
    if verbatim:
        return [_wrapped_body(item) if isinstance(item, dict) else item for item in items]
    return [pydantic_core.to_json(item) if isinstance(item, dict) else item for item in items]


def _wrapped_body(item: dict[str, Any]) -> Any:
    """A ``BYTES_KEY`` or ``STR_KEY`` object as the body it stands for, a ``FOREIGN_KEY`` one
    as the :class:`ForeignBody` it describes; any other dict as is."""
    if FOREIGN_KEY in item:
        return ForeignBody.from_json(item) or item
    if len(item) == 1:
        [(key, encoded)] = item.items()
        if key in (BYTES_KEY, STR_KEY) and isinstance(encoded, str):
            try:
                raw = base64.b64decode(encoded, validate=True)
                return raw if key == BYTES_KEY else raw.decode("utf-8", "surrogatepass")
            except ValueError:  # UnicodeDecodeError too
                pass
    return item


def _prefers_ndjson(accept: str) -> bool:
    """Whether an ``Accept`` header asks for NDJSON over a JSON list: listed with a quality
    above 0, and at least that of ``application/json`` if that is listed too."""
    if NDJSON not in accept:  # the usual case, decided without parsing
        return False
    quality: dict[str, float] = {}
    for media_range in accept.split(","):
        kind, *parameters = (part.strip() for part in media_range.split(";"))
        q = 1.0
        for parameter in parameters:
            name, _, value = parameter.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        quality[kind.lower()] = q
    ndjson = quality.get(NDJSON, 0.0)
    return ndjson > 0 and ndjson >= quality.get(_JSON, 0.0)


def _provenance(
    client: InProcessClient, respond: Callable[[_Answer], Response]
) -> Callable[[_Answer], Response]:
    """``respond``, its answers naming the checkpoint that computed them
    (:data:`CHECKPOINT_HEADER`: a client can tell a server restarted on another one mid-job),
    and with :data:`TRAINED_HEADER` if the model is untrained."""
    model = client.server_model
    headers = [(_CHECKPOINT, model.checkpoint.sha256.encode("latin-1"))]
    if not model.assets.trained:
        headers.append(_UNTRAINED)

    def said(answer: _Answer) -> Response:
        response = respond(answer)
        # Added to the raw list: ~1 µs; response.headers builds a MutableHeaders each time.
        response.raw_headers.extend(headers)
        return response

    return said


def _json(text: str) -> Response:
    return Response(content=text, media_type=_JSON)


def _json_list(responses: list[str]) -> Response:
    return _json("[" + ",".join(responses) + "]")


def _ndjson(responses: list[str]) -> Response:
    return Response(content="".join(r + "\n" for r in responses), media_type=NDJSON)


def _docs(*statuses: int) -> dict[int | str, dict[str, Any]]:
    schema = Problem.model_json_schema()
    return {
        status: {"description": description, "content": {PROBLEM_JSON: {"schema": schema}}}
        for status, description in {
            400: "unsupported mode",
            404: "unknown model",
            408: "no part of the request body arrived for --body-timeout seconds",
            413: "request body over the size limit",
            415: "a Content-Encoding other than identity (send the body uncompressed)",
            422: "invalid request (bad JSON, schema violation, undecodable image, wrong size)",
            500: "the forward pass failed",
            503: "overloaded, not ready, or shutting down (see Retry-After)",
        }.items()
        if status in statuses
    }


#: every problem an inference route answers (the single-tile, /batch and /invocations routes)
_INFERENCE_PROBLEMS = _docs(400, 404, 408, 413, 415, 422, 500, 503)


class _NamedRoute(Route):
    """A plain Starlette route that, like FastAPI's, names itself in ``scope["route"]``: what
    ASGI middleware and tracing tools read for the route's template."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child_scope = super().matches(scope)
        if match != Match.NONE:
            child_scope["route"] = self
        return match, child_scope


def _body_docs(schema: dict[str, Any], *content_types: str) -> dict[str, Any]:
    content = {ctype: {"schema": schema} for ctype in content_types}
    return {"requestBody": {"required": True, "content": content}}


# -- the app -----------------------------------------------------------------------------


def create_app(
    models: InProcessClient | Mapping[str, ClientSource],
    *,
    max_body_bytes: int = 64 * 1024 * 1024,
    retry_after: int = 1,
    warmup: bool = True,
    cancel_on_disconnect: bool = True,
    body_timeout: float | None = 60.0,
    max_batch_requests: int | None = 4096,
    max_batch_calls: int | None = 4,
    max_held_bytes: int | None = None,
) -> FastAPI:
    """Build the microservice over one or more in-process clients.

    Args:
        models: a client (served under its model's name), or ``{route name: client or
            factory}``. Factories are called in a worker thread at startup, so the port opens
            (and ``/health/live`` answers) while a large checkpoint loads. The app owns its
            clients: it closes them at shutdown. A full queue answers 503 at once (SPEC §4),
            whatever the client's ``overload``: that applies to its in-process callers.
        max_body_bytes: larger request bodies are refused with 413.
        retry_after: seconds sent in ``Retry-After`` with every 503.
        warmup: run one tile through every mode before reporting ready.
        cancel_on_disconnect: cancel a request whose client hangs up (a queued tile is never
            computed; a ``/batch`` stops before its next pass). It costs the event loop a task
            a request (docs/server.md); a server whose clients never leave early may turn it
            off.
        body_timeout: seconds a request's body may go without sending any of it before it
            is answered 408 (nginx's ``client_body_timeout``, 60 s); None: no limit. The time
            to send the headers is the ASGI server's to bound (docs/server.md).
        max_batch_requests: a ``/batch`` body of more requests is refused with 413 before
            any is parsed as a request; None: no limit. A batch holds every tile until all
            are decoded (SPEC §2.2, all or nothing), and a body of millions of tiny elements
            cost minutes of CPU and gigabytes; 4096 is more 224-px tiles than 64 MiB holds.
        max_batch_calls: the most ``/batch`` calls parsed or run at once, across models and
            modes: a call takes its place once its body is read (bodies still uploading
            count in ``max_held_bytes``, so slow uploads cannot hold every place); past it,
            a call is answered 503 ``overloaded`` (with ``Retry-After``), as a full queue
            answers a tile. None: no limit. Each call holds every tile it decoded, so this
            bounds the memory batches take; the device runs one pass at a time, and a few
            calls keep it as busy as many (docs/server.md, "Load shedding").
        max_held_bytes: the most bytes of request bodies held at once, over every request,
            each byte counted as it arrives, until its request is answered; a body that does
            not fit is answered 503 ``overloaded`` (with ``Retry-After``), before any of it is
            read when its ``Content-Length`` already does not fit in what is free (nothing is
            reserved by the header). None: 1 GiB, or 16 × ``max_body_bytes`` if more. It
            must be at least ``max_body_bytes``; a server that wants no such bound passes a
            number larger than its memory.

    The app must run its lifespan (every ASGI server does; in tests use
    ``async with app.router.lifespan_context(app)``), once: it closes the clients as it ends,
    and a second start raises ``RuntimeError``. Its :class:`ServerState` is
    ``app.state.histoinfer``.
    """
    if isinstance(models, InProcessClient):
        models = {models.server_model.metadata().name: models}
    if max_held_bytes is None:
        max_held_bytes = max(2**30, 16 * max_body_bytes)
    state = ServerState(
        models,
        max_body_bytes=max_body_bytes,
        retry_after=retry_after,
        warmup=warmup,
        cancel_on_disconnect=cancel_on_disconnect,
        body_timeout=body_timeout,
        max_batch_requests=max_batch_requests,
        max_batch_calls=max_batch_calls,
        max_held_bytes=max_held_bytes,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.running:
            # FastAPI runs an included router's lifespan itself: included, and also run
            # by hand, it started twice at once (an embedding trial).
            raise RuntimeError(
                "this app's lifespan is already running: started twice? (include_router() "
                "runs an included app's lifespan itself; mount the app instead: "
                "docs/server.md, 'Embedding the app')"
            )
        if state.lifespans:
            # Its clients were closed as the first run ended: started again, it answered
            # "draining" for ever (a user trial, with a test fixture reusing the app).
            raise RuntimeError(
                "this app has run once, and closed its models' clients as it stopped; an app "
                "runs once: call create_app() again for another run"
            )
        state.lifespans += 1
        state.running = True
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(state.load_all)
                tg.start_soon(state.watch_bodies)
                tg.start_soon(return_freed_memory, lambda: not state.in_flight)
                try:
                    yield
                finally:
                    state.begin_drain()
                    tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await state.close_all()
        finally:
            state.running = False

    app = FastAPI(
        title="histoinfer",
        version=__version__,
        summary="Computational-pathology tile models (gene expression, embeddings) over HTTP.",
        lifespan=lifespan,
        # A trailing slash is a 404 naming the route without it: Starlette's 307 points at an
        # absolute http:// URL, wrong behind a TLS-terminating load balancer.
        redirect_slashes=False,
    )
    app.state.histoinfer = state
    install_problem_handlers(app, retry_after)
    app.add_middleware(_EncodedSlashRefusal)  # innermost: counted and given its request ID
    app.add_middleware(_CountingMiddleware, counters=state.http)
    app.add_middleware(RequestIdMiddleware)

    request_schema = ModelRequest.model_json_schema()

    def read_only(path: str, **documented: Any) -> Callable[[_Endpoint], _Endpoint]:
        """A GET route, documented, that answers HEAD too (load balancers and uptime checkers
        probe with it; one route for both would document each operation twice)."""

        def register(endpoint: _Endpoint) -> _Endpoint:
            app.get(path, **documented)(endpoint)
            return app.head(path, include_in_schema=False)(endpoint)

        return register

    @read_only(
        "/api/metadata/{model}",
        tags=["inference"],
        response_class=Response,
        responses={200: {"model": ModelMetadata}, **_docs(404, 503)},
    )
    async def metadata(model: str) -> Response:
        """The model's metadata (SPEC §3.3), with the batching settings in force."""
        return _json(state.client(model).metadata())

    @read_only("/api/models", tags=["inference"])
    async def list_models() -> JSONResponse:
        """Every model this server serves, in the order given: its name (its routes'), its
        status (``loading``, ``ready``, ``failed``), its metadata once loaded (as
        ``/api/metadata/{model}`` gives it; null before), and why it failed, if it did."""
        listed = []
        for name, served in state.models.items():
            client = served.client
            entry: dict[str, object] = {
                "name": name,
                "status": served.status if state.lifespans else "not started",
                "metadata": None if client is None else json.loads(client.metadata()),
            }
            if served.error:
                entry["error"] = served.error
            listed.append(entry)
        return JSONResponse({"models": listed})

    @read_only("/api/stats/{model}", tags=["inference"], responses={**_docs(404, 503)})
    async def stats(model: str) -> JSONResponse:
        """The model's batching statistics per mode, as ``InProcessClient.stats()`` gives them
        in-process (``HttpClient.stats()`` reads them): batches, samples, the batch-size
        histogram, queue-wait and forward-time percentiles (ms), errors, queue depth."""
        snapshots = state.client(model).stats()
        return JSONResponse({mode: snapshot.as_dict() for mode, snapshot in snapshots.items()})

    async def answer(
        request: Request, client: InProcessClient, body: str | bytes, mode: Mode, arrival: Arrival
    ) -> Response:
        """One tile's answer: refused at once by a full queue (SPEC §4), and cancelled if its
        client hangs up (unless the app was told not to)."""
        work = partial(client.infer_async, body, mode, overload="reject")
        return await _in_flight(request, work, _provenance(client, _json), state, arrival)

    async def body_of(request: Request, arrival: Arrival) -> bytes:
        return await read_body(request, state.max_body_bytes, arrival)

    async def infer(request: Request) -> Response:
        """One tile through ``mode`` (predict, embed or predict_with_embedding).

        Concurrent requests are batched dynamically; a full queue answers 503 at once.
        """
        with state.arrived() as arrival:
            # The body is read first even when the answer is an error: a client still writing
            # it would otherwise see the connection reset instead of the answer.
            body = await body_of(request, arrival)
            mode, model = request.path_params["mode"], request.path_params["model"]
            if mode in _READ_ONLY:  # a GET route, with the wrong method: not a mode
                raise StarletteHTTPException(405, headers={"Allow": "GET, HEAD"})
            checked, client = _mode(mode), state.client(model, arrival)
            return await answer(request, client, body, checked, arrival)
        return state.unanswered(request, arrival)

    # The single-tile route, every request's, is served by a plain Starlette route: FastAPI's
    # own handling of a route (its dependency solving and request/response wrappers) cost
    # ~0.17 ms of the event loop's CPU a request, a sixth of it, and that loop is what bounds
    # a server on a fast device (docs/server.md, "Deployment notes"). Added first, it is the
    # route that matches; the APIRoute after it, the same endpoint, documents it in OpenAPI.
    single_tile = "/api/{mode}/{model}"
    app.router.routes.append(
        _NamedRoute(single_tile, infer, methods=["POST"], include_in_schema=False)
    )
    app.post(
        single_tile,
        tags=["inference"],
        response_class=Response,
        responses={200: {"model": ModelResponse}, **_INFERENCE_PROBLEMS},
        openapi_extra={
            **_body_docs(request_schema, _JSON),
            "parameters": [
                {
                    "name": n,
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "title": n.title()},
                }
                for n in ("mode", "model")
            ],
        },
    )(infer)

    @app.post(
        "/api/{mode}/{model}/batch",
        tags=["inference"],
        response_class=Response,
        responses={
            200: {"model": list[ModelResponse]},
            **_INFERENCE_PROBLEMS,
        },
        openapi_extra=_body_docs(
            {"type": "array", "items": request_schema}, _JSON, BATCH_BODIES_JSON
        ),
    )
    async def infer_batch(mode: str, model: str, request: Request) -> Response:
        """A pre-formed batch, all or nothing: one invalid request fails the call, naming
        every bad position, and nothing is computed.

        Answers a JSON list, or one response per line if the request accepts NDJSON.
        """
        with state.arrived() as arrival:
            # The body first (its bytes count in --max-bodies-mb as they arrive): a slot
            # taken before it would let slow uploads hold every slot (a review).
            raw = await body_of(request, arrival)
            if mode in _READ_ONLY:  # /api/metadata/{model} has no batch: no such route
                raise StarletteHTTPException(404)
            checked, client = _mode(mode), state.client(model, arrival)
            with state.batch_call() as admitted:
                if not admitted:
                    raise OverloadedError(
                        f"{state.max_batch_calls} /batch calls are in progress, the most this "
                        "server takes at once (--max-batch-calls, create_app's "
                        "max_batch_calls); retry later"
                    )
                return await run_batch(request, client, checked, raw, arrival)
        return state.unanswered(request, arrival)

    async def run_batch(
        request: Request, client: InProcessClient, checked: Mode, raw: bytes, arrival: Arrival
    ) -> Response:
        """A ``/batch`` call's parse and run, on a worker thread, with its place taken."""
        verbatim = request.headers.get("content-type", "").startswith(BATCH_BODIES_JSON)

        def run(check: Callable[[], None]) -> list[str]:
            # Parsed here, not on the event loop: a 60 MB batch's list and its bodies
            # written back to JSON held the loop (every other request) for 50-240 ms.
            if state.max_batch_requests is not None:
                bulk_rna = client.server_model.assets.accepts_bulk_rna
                _screen_batch(raw, state.max_batch_requests, bulk_rna)  # no lock needed
            with state.batch_parse_lock:
                check()  # hung up while it waited its turn
                bodies = _batch_bodies(raw, verbatim, state.max_batch_requests)
            # Cancelled (a hang-up, the graceful timeout), the batch stops at its next
            # slice or pass.
            return client.infer_batch(bodies, checked, check_cancelled=check)

        work = partial(_on_thread_until_out_of_time, run, state)
        ndjson = _prefers_ndjson(request.headers.get("accept", ""))
        respond = _provenance(client, _ndjson if ndjson else _json_list)
        return await _in_flight(request, work, respond, state, arrival)

    @app.post(
        "/invocations",
        tags=["inference"],
        response_class=Response,
        responses={200: {"model": ModelResponse}, **_INFERENCE_PROBLEMS},
        openapi_extra=_body_docs(InvocationRequest.model_json_schema(), _JSON),
    )
    async def invocations(request: Request) -> Response:
        """SageMaker-style dispatch on ``model_name`` and ``mode`` (``prediction``,
        ``embedding``, ``prediction_with_embedding`` or ``metadata``)."""
        with state.arrived() as arrival:
            raw = await body_of(request, arrival)
            envelope: InvocationEnvelope = parse_model(InvocationEnvelope, raw, "invocation")
            if envelope.mode != "metadata" and envelope.mode not in INVOCATION_MODES:
                known = ", ".join(get_args(InvocationMode))
                raise UnsupportedModeError(
                    f"unknown invocation mode {envelope.mode!r} (modes: {known})"
                )
            client = state.client(envelope.model_name, arrival)
            if envelope.mode == "metadata":
                # The dispatch fields alone, or a whole request beside them (SPEC §4); a few
                # fields of a request are neither, and are named (unknown, or missing).
                alone = set(pydantic_core.from_json(raw)) <= {"model_name", "mode"}
                kind = InvocationMetadataRequest if alone else InvocationMetadataOfRequest
                parse_model(kind, raw, "invocation")
                return _json(client.metadata())
            invocation: InvocationRequest = parse_model(InvocationRequest, raw, "invocation")
            mode = INVOCATION_MODES[envelope.mode]
            try:
                client.server_model.check_mode(mode)  # a subclass's own check included
            except UnsupportedModeError:  # said in the caller's words, not the routes'
                served = client.server_model.modes
                offered = [name for name, m in INVOCATION_MODES.items() if m in served]
                raise UnsupportedModeError(
                    f"model {envelope.model_name!r} does not support invocation mode "
                    f"{envelope.mode!r} (supported: {', '.join([*offered, 'metadata'])})"
                ) from None
            body = invocation.to_model_request().model_dump_json()
            return await answer(request, client, body, mode, arrival)
        return state.unanswered(request, arrival)

    def readiness() -> JSONResponse:
        draining = state.stopping or state.draining
        status = "draining" if draining else "ready" if state.ready else "not ready"
        content: dict[str, object] = {
            "status": status,
            "models": {
                name: m.status if state.lifespans else "not started"
                for name, m in state.models.items()
            },
        }
        if not state.lifespans:
            content["reason"] = NOT_STARTED
        errors = {name: m.error for name, m in state.models.items() if m.error}
        if errors:
            content["errors"] = errors
        return JSONResponse(content, status_code=200 if state.ready else 503)

    @read_only("/health/ready", tags=["health"], responses=_NOT_READY)
    async def health_ready() -> JSONResponse:
        """200 once every model is loaded and warmed up; 503 while loading or draining."""
        return readiness()

    @read_only("/ping", tags=["health"], responses=_NOT_READY)
    async def ping() -> JSONResponse:
        """SageMaker's health check: the same as ``/health/ready``."""
        return readiness()

    @read_only("/health/live", tags=["health"])
    async def health_live() -> JSONResponse:
        """200 while the process serves HTTP, even while models load."""
        return JSONResponse({"status": "alive"})

    @read_only("/metrics", tags=["health"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus text: batches, batch sizes, queue depth and wait, forward time, errors."""
        return Response(render_metrics(state.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _CountingMiddleware:
    """Starlette middleware form of :meth:`HttpCounters.middleware`."""

    def __init__(self, app: Any, counters: HttpCounters) -> None:
        self._app = counters.middleware(app)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._app(scope, receive, send)


class _EncodedSlashRefusal:
    """A path with an encoded slash (``%2F``) is a 404: Starlette routes the decoded path, so
    ``/api/predict/h1%2Fbatch`` reached the ``/batch`` route, which a gateway's rule on the raw
    path (``*/batch`` blocked or rate-limited) never saw (a fuzzing trial). No route or name
    here holds a slash, so nothing valid is refused. (Apache answers such paths 404 alike.)"""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = scope.get("raw_path") if scope["type"] == "http" else None
        if raw and (b"%2F" in raw or b"%2f" in raw):
            path = raw.decode("latin-1")
            response = problem_response(
                404,
                "Not Found",
                f"no route for {scope['method']} {path}: an encoded slash (%2F) is neither a "
                "separator nor part of a name here",
            )
            response.headers["Connection"] = "close"  # its body is left unread
            await response(scope, receive, send)
            return
        await self._app(scope, receive, send)
