"""``InProcessClient``: the ``Client`` protocol with the model in the caller's process.

One request's path, top to bottom:

    body (JSON str) -> parse + check + decode   [worker thread, bounded]   (_prepare)
                       (dynamic mode: bodies that queue up are decoded a chunk per thread hop)
                    -> BatchScheduler of this loop and mode             (dynamic mode)
                    -> forward + split          [the device's thread]     (_forward)
                    -> postprocess + JSON       [caller]                  (_finish)

A call that finds nothing else in flight (no other call of its loop, the device idle) skips its
decode thread (dynamic mode: the decode stage): its body rides to the device's thread, which
decodes it just before the pass (_forward_jobs). One thread hop instead of two, ~0.35 ms off a
lone request, and no decoding is kept from overlapping a pass: there is none to overlap. Not an
image bigger than a couple of tiles: a body longer than two raw tiles in base64 takes the decode
stage; one that declares a bigger width x height (a small PNG can hold a 4096 x 4096 image) is
parsed by the device's thread, which then hands it back undecoded (_TooBigHere), and its caller
sends it through the decode stage and queues it again. Decoding and resizing a big image on the
device's thread would hold up, for a tenth of a second or more, the passes of requests arriving
meanwhile, which the decode stage lets run. (Decoding enforces the declared size from the
image's header before a pixel is decoded, so the declaration bounds the work.)

The microservice runs this same client, so in-process and remote behave the same by construction.

Lifetimes: the per-loop state and its schedulers never reference the client (only a weak
reference and the model itself), so a client dropped without ``close()`` is collected; a
finalizer then closes its schedulers in their loops and stops its portal thread. Otherwise the
only thing keeping an idle runner task alive would be a reference cycle through the client, and
the garbage collector would destroy it mid-await ("Task was destroyed but it is pending!").
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import os
import sys
import threading
import time
import traceback
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypedDict, TypeVar, Unpack, cast

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch
from anyio._core._eventloop import threadlocals as _anyio_threadlocals

from ..arguments import check_count, check_flag, check_seconds
from ..batching import (
    BatchScheduler,
    BatchStats,
    PerLoop,
    Reservation,
    StatsSnapshot,
    wait_future,
)
from ..batching.admission import Admission, deadline_exceeded, deadline_from
from ..batching.scheduler import warn_if_batches_cannot_fill
from ..cpus import usable_cpus
from ..errors import (
    ClientClosedError,
    DeadlineExceededError,
    InferenceError,
    InvalidRequestError,
    ModelExecutionError,
)
from ..models import shards
from ..models.base import SampleOutput, ServerModel, non_finite_error
from ..models.device_thread import device_thread
from ..models.openmp import thread_count
from ..models.registry import build_server_model
from ..outcome import Outcome, run_sync, without_tracebacks
from ..protocol import Client, documented_as_client
from ..schema import BatchingSettings, Mode, ModelRequest, locate, parse_request
from .cores import CoreShare
from .lifecycle import ClosingContext, InFlight, mend_after_fork, running_loop_here
from .portal import PortalThread
from .refusals import BatchRefusal

__all__ = ["InProcessClient"]

log = logging.getLogger("histoinfer.client")

# What from_thread.run raises once the host loop has ended (anyio 4.16 has it; an older anyio
# without it: a class never raised, and the call fails as it always did).
_RunFinished: type[Exception] = getattr(anyio, "RunFinishedError", type("_Never", (Exception,), {}))
T = TypeVar("T")

Prepared = tuple[ModelRequest, torch.Tensor]
#: what the decode stage gives back for one body: the prepared tile, or why it was refused
#: (an invalid request, or a model's prepare_sample failing: ServerModel.prepared_tile)
Decoded = Prepared | InferenceError

# Most bodies decoded in one worker-thread hop. A hop costs ~140 µs of CPU on asyncio and
# ~165 µs on trio (wake-ups and handoffs, measured: docs/benchmarks-history.md), a seventh
# of a decode; chunks only form when bodies queue up, so a lone request still takes one hop
# on its own.
DECODE_CHUNK = 8

# A lone request's image is decoded on the device's thread only if it is about a tile's size:
# at most this many tiles, by its body's length (raw RGB in base64: 4 characters a pixel) and by
# the width x height it declares (module docstring).
_LONE_TILES = 2


def _forward(
    model: ServerModel,
    tiles: list[torch.Tensor],
    mode: Mode,
    share: CoreShare | None = None,
    loaded: Callable[[], bool] | None = None,
    lock: AbstractContextManager[Any] | None = None,
) -> list[SampleOutput]:
    """Run ``tiles`` as one batch and split it per sample; on the device's thread (one pass at
    a time).

    A batch of two tiles or more on a small CPU box runs as shards on single-threaded workers,
    which leave the decoders their share of the cores by themselves (models/shards.py). Other
    passes with ``share`` (a CPU device): while ``loaded()`` says requests are on their way, the
    pass may run on fewer threads to leave cores to the decoders (clients/cores.py). Loaded passes
    that ran sharded or left cores record their duration there. ``lock`` (the client's
    ``device_lock``) is held for the pass alone; the core share does not time its wait.

    A function of the model, not a method of the client: schedulers hold it for their loop's
    lifetime, and must not keep the client alive.
    """
    all_threads = threads = torch.get_num_threads()
    workers = shards.plan(model, len(tiles), all_threads)[0]
    if share is None or loaded is None or model.device.type != "cpu" or not loaded():
        share = None  # idle, or not a CPU: every thread, and nothing to learn from
    elif workers == 1:
        threads -= share.cores_to_leave(all_threads)
    # Filling the batch too: a parallel copy wakes the OpenMP workers, which then spin a while.
    held = nullcontext() if lock is None else lock
    with held, thread_count(threads if threads != all_threads else None):
        started = time.perf_counter()
        # Planned for every thread, as above: a pass left on fewer threads must not be split
        # by a plan for those (5 torch threads less one left is 4, which shards).
        output = shards.forward(model, tiles, mode, all_threads)
    # Recorded: passes on single-threaded workers (sharded) or on the threads left after the
    # decoders'. A loaded pass on torch's whole team is not: beside busy decoders its wall time
    # is the team waiting at barriers for descheduled threads (a tiny-model tile measured at
    # 14-100 ms instead of 1-2.5), which says nothing of the pass's cost, and counted, it would
    # keep the pass on the team for good (clients/cores.py).
    if share is not None and (workers > 1 or threads < all_threads):
        used = workers if workers > 1 else threads  # a sharded pass: one thread per worker
        share.record_forward(len(tiles), time.perf_counter() - started, used, all_threads)
    samples = output.split()
    if len(samples) != len(tiles):
        raise RuntimeError(f"the forward pass returned {len(samples)} rows for {len(tiles)} tiles")
    return samples


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and how long it ran, timed on the thread that runs it (the device's): the
    statistics' forward time, as the schedulers time their batch function (BatchScheduler._call).
    From the caller, it would include the hand-offs, and a wait behind other calls' passes."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def _counted(stats: BatchStats, tiles: int, forward: Callable[..., T], *args: Any) -> T:
    """An explicit batch's pass, counted in ``stats`` by the thread that ran it (the
    device's) once it succeeds: counted by its caller, a pass whose caller was interrupted
    (Ctrl-C in a sync ``*_batch``) ran but was never counted (a user trial)."""
    outputs, ran_s = _timed(forward, *args)
    stats.record_batch(tiles, (), ran_s)
    return outputs


class _Job:
    """One request on its way to a forward pass: decoded already, or a body that the device's
    thread decodes before the pass (a request that was alone; see the module docstring)."""

    __slots__ = ("body", "request", "tile")

    def __init__(
        self,
        request: ModelRequest | None = None,
        tile: torch.Tensor | None = None,
        body: str | bytes | None = None,
    ) -> None:
        self.body = body
        self.request = request
        self.tile = tile


def _forward_jobs(
    model: ServerModel,
    jobs: list[_Job],
    mode: Mode,
    share: CoreShare | None = None,
    loaded: Callable[[], bool] | None = None,
    lock: AbstractContextManager[Any] | None = None,
) -> list[SampleOutput | InferenceError | _TooBigHere]:
    """The forward passes' batch function: decode the jobs that came as bodies (a bad one is
    refused alone, and so is one whose image is too big to decode here: its refusal is its
    result, which the scheduler raises to its caller), then :func:`_forward` every tile.

    A decoded job keeps its tile: when a failing batch is bisected, nothing decodes twice.
    """
    refusals: dict[int, InferenceError | _TooBigHere] = {}
    tiles: list[torch.Tensor] = []
    for i, job in enumerate(jobs):
        if job.tile is None:
            assert job.body is not None
            decoded = _prepare_lone(model, job.body, mode)
            if isinstance(decoded, (InferenceError, _TooBigHere)):
                refusals[i] = decoded
                continue
            job.request, job.tile, job.body = *decoded, None
        tiles.append(job.tile)
    outputs = iter(_forward(model, tiles, mode, share, loaded, lock) if tiles else ())
    return [refusals[i] if i in refusals else next(outputs) for i in range(len(jobs))]


async def _forwarded(
    slot: Reservation[_Job, SampleOutput], job: _Job, model: ServerModel
) -> SampleOutput:
    """``job``'s output from its loop's forward scheduler; a failed pass names the request."""
    try:
        return await slot.submit(job)
    except (InferenceError, _TooBigHere):
        raise
    except Exception as exc:
        raise _execution_error(model, job.request, exc) from exc


class _CallerGone(Exception):
    """Raised on a worker thread whose caller has gone (its result goes nowhere)."""


class _ThreadCall:
    """One call's work on a worker thread, counted in flight from its coroutine until the work
    ends (or is known never to start), and stopped at its next check once its caller has gone
    by any cancellation: anyio's, which ``check_cancelled`` sees, or asyncio's own
    (``task.cancel()``, ``asyncio.timeout``, Ctrl-C in ``asyncio.run``), which ends the await at
    once and left the thread computing the whole batch, past ``aclose()`` (a user trial)."""

    def __init__(self, calls: InFlight) -> None:
        calls.enter()  # from here, not from when a thread takes it: aclose() waits (a review)
        self._calls = calls
        self._lock = threading.Lock()
        self._state: Literal["waiting", "running", "abandoned"] = "waiting"
        self._left = threading.Event()

    def check(self) -> None:
        if self._left.is_set():
            raise _CallerGone
        anyio.from_thread.check_cancelled()

    def run(self, work: Callable[[Callable[[], None]], T]) -> T | None:
        """``work(check)``, on the worker thread; None if its caller left before it started."""
        with self._lock:
            if self._state == "abandoned":
                return None
            self._state = "running"
        try:
            return work(self.check)
        finally:
            self._calls.exit()

    def caller_left(self) -> None:
        self._left.set()
        with self._lock:
            if self._state == "waiting":  # the thread never took it: nobody else will count it out
                self._state = "abandoned"
                self._calls.exit()


class _TooBigHere(Exception):
    """A lone body's refusal by the device's thread: its image declares more pixels than two
    tiles, too many to decode there (module docstring). Never reaches a caller: the client
    sends the body through the decode stage and queues it again."""


def _parse(
    model: ServerModel, body: str | bytes, mode: Mode, position: int | None = None
) -> tuple[ModelRequest, str]:
    """JSON -> validated request that ``model`` can serve in ``mode``, and how errors name it."""
    request = parse_request(body, position)
    where = _where(request, position)
    model.check_request(request, mode, where)
    return request, where


def _where(request: ModelRequest, position: int | None) -> str:
    """How errors name a request: ``at batch position 3 for patch_idx=…`` in a batch call."""
    return f"{locate(position).lstrip()} for {request.where()}".strip()


def _prepare(
    model: ServerModel, body: str | bytes, mode: Mode, position: int | None = None
) -> Prepared:
    """JSON -> validated request -> uint8 tile tensor. Thread-safe, CPU only."""
    request, where = _parse(model, body, mode, position)
    return request, model.prepared_tile(request, where)


def _prepare_lone(model: ServerModel, body: str | bytes, mode: Mode) -> Decoded | _TooBigHere:
    """:func:`_prepare_or_refusal` on the device's thread, for a body that came alone: an image
    declaring more pixels than two tiles is left undecoded (refused with :class:`_TooBigHere`).
    """
    try:
        request, where = _parse(model, body, mode)
        if request.width * request.height > _LONE_TILES * model.assets.tile_size**2:
            return _TooBigHere()
        return request, model.prepared_tile(request, where)
    except InferenceError as exc:
        return _returned(exc)


def _check_settings(
    *,
    max_batch_size: object,
    max_wait_ms: object,
    dynamic_batching: object,
    max_queue: object,
    prepare_threads: object,
    request_timeout: object,
    overload: object,
    batch_decode_threads: object,
    name: object,
    device_lock: object = None,
) -> None:
    """An :class:`InProcessClient`'s settings, refused naming the argument: accepted, each
    would fail every call later."""
    check_count("max_batch_size", max_batch_size)
    check_seconds("max_wait_ms", max_wait_ms, zero_ok=True)
    check_count("max_queue", max_queue, none_ok=True)
    check_count("prepare_threads", prepare_threads, none_ok=True)
    check_seconds("request_timeout", request_timeout, none_ok=True)
    check_count("batch_decode_threads", batch_decode_threads)
    _waits(overload)  # type: ignore[arg-type]
    check_flag("dynamic_batching", dynamic_batching)
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if device_lock is not None and (
        isinstance(device_lock, type)  # a class (nullcontext), not a lock
        or not (hasattr(device_lock, "__enter__") and hasattr(device_lock, "__exit__"))
    ):
        raise TypeError(
            "device_lock must be a lock (threading.Lock()) or another context manager, got "
            f"{type(device_lock).__name__}"
        )


def _never_cancelled() -> None:
    """``infer_batch``'s ``check_cancelled`` when the caller gives none."""


def _prepare_or_refusal(
    model: ServerModel, body: str | bytes, mode: Mode, position: int | None = None
) -> Decoded:
    """:func:`_prepare`, with a bad body's error returned instead of raised."""
    try:
        return _prepare(model, body, mode, position)
    except InferenceError as exc:
        return _returned(exc)


def _returned(refusal: InferenceError) -> InferenceError:
    """``refusal``, to be returned as a batch result, its tracebacks dropped: they would hold
    the frames that return it, a cycle (histoinfer/outcome.py). Where the model's own code
    failed (a ``prepare_sample`` of the user's), the traceback of what it raised is kept as a
    note, printed with the error: where the bug is."""
    cause = refusal.__cause__
    if isinstance(refusal, ModelExecutionError) and cause is not None:
        where = "".join(traceback.format_exception(cause)).rstrip()
        refusal.add_note(f"raised in the model's code:\n{where}")
    return without_tracebacks(refusal)


def _decode_chunk(
    model: ServerModel, share: CoreShare, jobs: list[tuple[str | bytes, Mode]]
) -> list[Decoded]:
    """The decode stage's batch function: one body's bad input must not fail its neighbours,
    so refusals are returned, not raised: the scheduler raises each to its own caller
    (anything else raised is a bug, and is bisected).

    A loaded decode records its duration in ``share``, what a loaded forward pass weighs
    leaving cores against: a chunk of several bodies (they queued up), or any decode that
    starts while the device runs a pass (at 2 in flight every chunk is one body: without
    these, a heavy model's decode cost would never be known). A lone body on an idle machine
    decodes faster than under load, and is not counted (nor are lone forward passes).
    """
    loaded = len(jobs) > 1 or not device_thread(model.device).idle
    started = time.perf_counter()
    decoded = [_prepare_or_refusal(model, body, mode) for body, mode in jobs]
    if loaded:
        share.record_decode(len(jobs), time.perf_counter() - started)
    return decoded


def _decoding(limiter: anyio.CapacityLimiter) -> bool:
    """Are calls being decoded under ``limiter`` (a batch-size-1 client's loop)? Asked on the
    device's thread: a hint, read without the loop (a length, atomic under the GIL)."""
    return limiter.borrowed_tokens > 0


class _LoopState:
    """What one event loop needs: its schedulers (one per mode) and its thread limiters.

    asyncio primitives bind to the first loop that waits on them, so nothing here is shared
    between loops; only thread-safe things (the device thread, the stats) are. It holds the
    client weakly (see the module docstring).
    """

    def __init__(self, client: weakref.ref[InProcessClient], key: object) -> None:
        owner = client()
        if owner is None:  # pragma: no cover - a call in flight holds the client
            raise ClientClosedError("the client was garbage-collected")
        self.prepare_limiter = anyio.CapacityLimiter(owner.prepare_threads)
        self.schedulers: dict[Mode, BatchScheduler[_Job, SampleOutput]] = {}
        # The decode stage: one small scheduler per decode thread, each decoding the bodies
        # that queued up while its previous chunk ran, in one hop. Admission is the forward
        # schedulers' (a caller holds a reservation there while decoding): unbounded here.
        # Dynamic mode only: batch-size-1 calls decode in one to_thread hop each.
        self.decoders: list[BatchScheduler[tuple[str | bytes, Mode], Prepared]] = [
            BatchScheduler(
                partial(_decode_chunk, owner.server_model, owner._cores),
                max_batch_size=DECODE_CHUNK,
                max_wait_ms=0,
                max_queue=None,
                name=f"{owner._model_name}:decode-{i}",
            )
            for i in range(owner.prepare_threads if owner.dynamic_batching else 0)
        ]
        # Batch-size-1 calls queue on the device's thread, not in a scheduler: their bound.
        self.admissions: dict[Mode, Admission] = {}
        self._client = client
        self._key = key

    def loaded(self) -> bool:
        """Are requests of this loop on their way to a next batch (queued, or still being
        decoded)? Asked on the device's thread before a forward pass (clients/cores.py)."""
        schedulers = list(self.schedulers.values())  # atomic under the GIL; the loop may add one
        return any(scheduler.queue_depth or scheduler.preparing for scheduler in schedulers)

    def admitted(self) -> int:
        """Requests of this loop in flight, every mode: reserved, queued or running."""
        return sum(scheduler.admitted for scheduler in self.schedulers.values())

    def decoder(self) -> BatchScheduler[tuple[str | bytes, Mode], Prepared]:
        """The decode scheduler with the fewest bodies queued or being decoded: by queue
        alone, one decoding a chunk looks as free as an idle one, and at low load a body
        would wait behind that chunk while the other thread idles."""
        return min(self.decoders, key=lambda decoder: decoder.admitted)

    def admission(self, mode: Mode) -> Admission:
        """What admits this loop's batch-size-1 calls in ``mode``: ``max_queue`` of them at
        once, the rest waiting or refused as a dynamic call would be by its scheduler."""
        admission = self.admissions.get(mode)
        if admission is None:
            client = self._client()
            if client is None:  # pragma: no cover - a call in flight holds the client
                raise ClientClosedError("the client was garbage-collected")
            admission = self.admissions[mode] = Admission(
                f"{client._model_name}:{mode}",
                client.max_queue,
                on_deadline=partial(client._stats[mode].record_error, "deadline"),
            )
        return admission

    def scheduler(self, mode: Mode) -> BatchScheduler[_Job, SampleOutput]:
        scheduler = self.schedulers.get(mode)
        if scheduler is None:
            client = self._client()
            if client is None:  # pragma: no cover - a call in flight holds the client
                raise ClientClosedError("the client was garbage-collected")
            loops, key, device = client._loops, self._key, client._device_thread
            scheduler = self.schedulers[mode] = BatchScheduler(
                partial(
                    _forward_jobs,
                    client.server_model,
                    mode=mode,
                    share=client._cores,
                    loaded=self.loaded,
                    lock=client.device_lock,
                ),
                max_batch_size=client.max_batch_size,
                max_wait_ms=client.max_wait_ms,
                max_queue=client.max_queue,
                thread=device.submit,
                # Shared by every loop and client on the device: busy with another's pass,
                # the last batch's callers are woken at once rather than behind it.
                thread_idle=lambda: device.idle,
                stats=client._stats[mode],
                name=f"{client._model_name}:{mode}",
                on_exit=partial(loops.discard, key, self),
            )
        return scheduler

    def close_soon(self) -> None:
        """Let each scheduler finish its queue and end, in this state's loop; any thread."""
        for scheduler in self.schedulers.values():
            scheduler.close_soon()
        for decoder in self.decoders:
            decoder.close_soon()


def _when_closed_and_idle(loops: PerLoop[_LoopState], client: weakref.ref[InProcessClient]) -> None:
    """The client is closed and its last call done (on that call's thread): end the loops'
    schedulers, and tell the client's threads to end, without waiting for them here."""
    _close_loop_states(loops)
    alive = client()
    if alive is not None:
        alive._stop_threads(wait=False)


def _count_abandoned_pass(
    stats: BatchStats,
    future: concurrent.futures.Future[
        tuple[list[SampleOutput | InferenceError | _TooBigHere], float]
    ],
) -> None:
    """A batch-size-1 pass whose caller left while it ran, counted as it ends (on the device's
    thread): it ran, so the statistics say so."""
    error = future.exception()
    if error is not None:
        stats.record_error(type(error).__name__)
        return
    [result], ran_s = future.result()
    if not isinstance(result, (InferenceError, _TooBigHere)):  # a refusal ran nothing
        stats.record_batch(1, (), ran_s)


def _forked_away(maker: int) -> str:
    """Why a forked child cannot use a client made in process ``maker``, and what to do."""
    return (
        f"this InProcessClient was made in process {maker}, and process {os.getpid()} is a "
        "fork of it: the threads that run its model did not survive the fork. Make a client in "
        "each process (for a ProcessPoolExecutor, in its initializer), or start processes "
        "with the 'spawn' method"
    )


def _close_loop_states(loops: PerLoop[_LoopState]) -> None:
    """Forget every loop's state and end its schedulers (on close, or when the client is
    dropped: this is also the client's finalizer, so it must not reference the client)."""
    for state in loops.clear():
        state.close_soon()


@documented_as_client
class InProcessClient(ClosingContext, Client):
    """Runs a :class:`ServerModel` in this process; implements the whole ``Client`` protocol.

    Args (every one after ``server_model`` keyword-only):
        server_model: a loaded model (see :func:`~histoinfer.build_server_model`).
        max_batch_size: most tiles per forward pass (dynamic batching and ``*_batch`` chunks).
        max_wait_ms: longest a queued tile waits for company before its batch is dispatched.
        dynamic_batching: batch concurrent ``*_async`` calls (default); if False, async calls
            run at batch size 1 and batching is the caller's, through ``*_batch``.

    Tuning:
        max_queue: most requests admitted per loop and mode (preparing, queued or running).
            In-process callers wait for room; ``overload="reject"`` raises
            :class:`~histoinfer.errors.OverloadedError` instead (the server answers 503).
        overload: what a call does with the queue full: ``"wait"`` for room (default) or
            ``"reject"`` at once with :class:`~histoinfer.errors.OverloadedError`.
        prepare_threads: worker threads per loop for parsing and decoding.
        request_timeout: seconds from the call until its tile must reach the model (waiting
            for room and preparing included), or :class:`~histoinfer.errors.DeadlineExceededError`;
            ``None`` waits as long as needed. Once its pass starts, it runs to completion (a
            request alone on an idle device is dispatched as a body, decoded on the device's
            thread: docs/batching.md).
        batch_decode_threads: threads that decode the bodies of one ``*_batch`` call (default
            1: in the calling thread, one after another). More decode a batch in parallel
            before its forward pass: ~1.25x the throughput of ``predict_batch`` with 2 on 2
            cores (docs/benchmarks-history.md). Results are the same either way.
        name: what its errors, logs and threads call it (``"NAME:mode: queue full ..."``);
            by default the model's name. The server's CLI passes the route's name, so a
            model served under two names (``--model fast=h1 --model slow=h1``) says which.
        device_lock: a lock (any context manager) every forward pass of this client holds,
            and nothing else: hold it around your own work on the device and the two never
            overlap (docs/batching.md).
    """

    _holds = "a loaded model and its threads"

    def __init__(
        self,
        server_model: ServerModel,
        *,
        max_batch_size: int = 64,
        max_wait_ms: float = 5.0,
        dynamic_batching: bool = True,
        max_queue: int | None = 4096,
        prepare_threads: int | None = None,
        request_timeout: float | None = None,
        overload: Overload = "wait",
        batch_decode_threads: int = 1,
        name: str | None = None,
        device_lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        _check_settings(
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
            dynamic_batching=dynamic_batching,
            max_queue=max_queue,
            prepare_threads=prepare_threads,
            request_timeout=request_timeout,
            overload=overload,
            batch_decode_threads=batch_decode_threads,
            name=name,
            device_lock=device_lock,
        )
        if not isinstance(server_model, ServerModel):
            hint = (
                ": for a checkpoint file, InProcessClient.from_checkpoint(model, path)"
                if isinstance(server_model, (str, os.PathLike))
                else ""
            )
            raise TypeError(
                f"InProcessClient takes a loaded ServerModel, got {type(server_model).__name__}"
                f"{hint}"
            )
        self.server_model = server_model
        self.max_batch_size = max_batch_size
        self.max_wait_ms = float(max_wait_ms)
        self.dynamic_batching = bool(dynamic_batching)
        self.max_queue = max_queue
        self.prepare_threads = prepare_threads or _default_prepare_threads(server_model)
        self.request_timeout = request_timeout
        self.batch_decode_threads = batch_decode_threads
        #: held by every forward pass of this client (SPEC §2.2's "device lock"): a lock the
        #: caller's own work on the device takes too, so that the two never overlap
        self.device_lock = device_lock
        self._batch_decoder: ThreadPoolExecutor | None = None
        self._wait_for_room = _waits(overload)
        self._model_name = name or server_model.metadata().name
        if self.dynamic_batching:  # said now, not at the first call (a server's start-up)
            warn_if_batches_cannot_fill(self._model_name, max_queue, max_batch_size)
        # Every forward pass on the device's one thread, one at a time across every loop, thread
        # and client (SPEC §5), and one OpenMP team (models/device_thread.py).
        self._device_thread = device_thread(server_model.device)
        self._cores = CoreShare(self.prepare_threads)
        # A longer lone body takes the decode stage (_prepare_lone checks the declared size).
        self._lone_body_limit = 4 * _LONE_TILES * server_model.assets.tile_size**2
        self._stats = _mode_stats(server_model)
        self._loops: PerLoop[_LoopState] = PerLoop(partial(_LoopState, weakref.ref(self)))
        # Dropped without close(): end the runner tasks in their loops rather than leave them
        # to the garbage collector. Holds the loops, which hold nothing of the client.
        weakref.finalize(self, _close_loop_states, self._loops)
        # Every loop's schedulers end, and the threads are told to, once the client is closed
        # and its last call is done: even if no close() or aclose() gets to stop them (an
        # aclose() cancelled while calls were in flight).
        self._calls = InFlight(
            when_done=partial(_when_closed_and_idle, self._loops, weakref.ref(self))
        )
        self._portal: PortalThread | None = None
        # Reentrant: a signal handler's close() on a thread starting the portal (a review).
        self._threads_lock = threading.RLock()
        self._portal_finalizer: weakref.finalize[Any, Any] | None = None
        self._batch_decoder_finalizer: weakref.finalize[Any, Any] | None = None
        self._made_in = os.getpid()  # the process whose threads run it
        metadata = server_model.metadata().model_copy(
            update={
                "batching": BatchingSettings(
                    dynamic_batching=self.dynamic_batching,
                    max_batch_size=max_batch_size,
                    max_wait_ms=self.max_wait_ms,
                    max_queue=max_queue,
                    request_timeout=request_timeout,
                )
            }
        )
        self._metadata_json = metadata.model_dump_json()
        mend_after_fork(self)

    def _after_fork(self) -> None:
        """In a forked child (before anything else runs there): the device's, the portal's
        and the decoders' threads are not here, so a call would wait for them for ever (a
        ProcessPoolExecutor's workers with a module-level client hung). Every call is refused
        saying why and what to do; ``close()`` has nothing left to stop."""
        self._threads_lock = threading.RLock()
        for finalizer in (self._portal_finalizer, self._batch_decoder_finalizer):
            if finalizer is not None:  # at exit, it would wait on the parent's threads' locks
                finalizer.detach()
        self._portal, self._portal_finalizer, self._batch_decoder = None, None, None
        self._batch_decoder_finalizer = None
        self._loops.forget_after_fork()
        # The child's own (empty): the parent's threads may have held their locks at the fork.
        self._stats = _mode_stats(self.server_model)
        self._calls.after_fork(refuse=_forked_away(self._made_in))

    @classmethod
    def from_checkpoint(
        cls,
        model: str,
        checkpoint_path: str | Path,
        device: str = "cpu",
        assets_dir: str | Path | None = None,
        max_batch_size: int = 64,
        max_wait_ms: float = 5.0,
        dynamic_batching: bool = True,
        **tuning: Unpack[ClientTuning],
    ) -> InProcessClient:
        """Load ``checkpoint_path`` as registry key ``model`` and wrap it in a client.

        The client's settings are checked first: a misspelt one, or one out of range, is
        refused before the load (seconds for a large model), not after it."""
        settings = {
            "max_batch_size": max_batch_size,
            "max_wait_ms": max_wait_ms,
            "dynamic_batching": dynamic_batching,
            **tuning,
        }
        try:
            bound = inspect.signature(cls.__init__).bind(None, None, **settings)
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.from_checkpoint(): {exc}") from None
        bound.apply_defaults()
        own = ("self", "server_model")
        _check_settings(**{k: v for k, v in bound.arguments.items() if k not in own})
        server_model = build_server_model(model, checkpoint_path, device, assets_dir)
        return cls(
            server_model,
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
            dynamic_batching=dynamic_batching,
            **tuning,
        )

    # -- Client protocol: async --------------------------------------------------------------

    async def predict_async(self, body: str, session: object | None = None) -> str:
        return await self.infer_async(body, "predict")

    async def embed_async(self, body: str, session: object | None = None) -> str:
        return await self.infer_async(body, "embed")

    async def predict_with_embedding_async(self, body: str, session: object | None = None) -> str:
        return await self.infer_async(body, "predict_with_embedding")

    # -- Client protocol: sync (thin anyio.from_thread wrappers) ----------------------------

    def predict(self, body: str) -> str:
        return self._run_sync(self.predict_async, body)

    def embed(self, body: str) -> str:
        return self._run_sync(self.embed_async, body)

    def predict_with_embedding(self, body: str) -> str:
        return self._run_sync(self.predict_with_embedding_async, body)

    def metadata(self) -> str:
        if self._calls.closed:  # as HttpClient, and every other method: closed means closed
            raise self._calls.refusal()
        return self._metadata_json

    # -- Client protocol: explicit batches ---------------------------------------------------

    def predict_batch(self, bodies: list[str]) -> list[str]:
        return self.infer_batch(bodies, "predict")

    def embed_batch(self, bodies: list[str]) -> list[str]:
        return self.infer_batch(bodies, "embed")

    def predict_with_embedding_batch(self, bodies: list[str]) -> list[str]:
        return self.infer_batch(bodies, "predict_with_embedding")

    # -- explicit batches from async code (beyond the protocol) --------------------------------

    async def predict_batch_async(
        self, bodies: list[str], session: object | None = None
    ) -> list[str]:
        """``predict_batch`` for async code: the same call, run on a worker thread."""
        return await self.infer_batch_async(bodies, "predict")

    async def embed_batch_async(
        self, bodies: list[str], session: object | None = None
    ) -> list[str]:
        """``embed_batch`` for async code: the same call, run on a worker thread."""
        return await self.infer_batch_async(bodies, "embed")

    async def predict_with_embedding_batch_async(
        self, bodies: list[str], session: object | None = None
    ) -> list[str]:
        """``predict_with_embedding_batch`` for async code: the same call, on a worker thread."""
        return await self.infer_batch_async(bodies, "predict_with_embedding")

    async def infer_batch_async(self, bodies: list[str], mode: Mode) -> list[str]:
        """``infer_batch`` on a worker thread, so that the loop goes on while the batch runs
        (the sync call blocks it: every other task, a server's every request, waits). Cancelled,
        the call returns at once, and its thread stops at its next slice of decoding or forward
        pass, as a hung-up ``/batch`` request does; nothing after that point is computed, and
        ``aclose()`` waits for the slice under way."""
        call = _ThreadCall(self._calls)
        try:
            # A limiter of its own: one of the loop's 40 shared threads held for a whole
            # slide's batch would starve everything else that uses them. Abandoned when
            # cancelled: anyio's cancellation (a fail_after, Ctrl-C on trio) waited out the
            # pass under way, seconds on a ViT, where asyncio's own returned at once (a user
            # trial); the thread sees its caller gone at its next check either way.
            result: list[str] | None = await run_sync(  # errors raised without a cycle
                call.run,
                partial(self._infer_batch, bodies, mode),
                limiter=anyio.CapacityLimiter(1),
                abandon_on_cancel=True,
            )
        except BaseException:
            call.caller_left()
            raise
        assert result is not None  # None only for a call whose caller had left
        return result

    # -- observability -----------------------------------------------------------------------

    def stats(self) -> dict[Mode, StatsSnapshot]:
        """Per mode the model serves: batches, samples, batch-size histogram, queue wait and
        forward percentiles."""
        # A copy first: a mode a subclass's check_mode lets through is added at its first call.
        return {mode: stats.snapshot() for mode, stats in tuple(self._stats.items())}

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._calls.closed

    def close(self) -> None:
        """Finish the work in flight, refuse new calls, and release the portal thread.

        Every loop's schedulers end once the last call in flight is done.
        """
        self._calls.close()
        if running_loop_here():
            # Waiting here would block the very loop whose requests we wait for (a notebook
            # cell): those finish on their own; we only refuse new ones. Nor is the portal's
            # thread joined: it lets the sync calls of other threads finish first (seconds,
            # with this loop frozen); it ends after them by itself.
            log.debug("close() on a thread with a running loop: not waiting for in-flight work")
            self._stop_threads(wait=False)
        elif self._calls.held_here():
            # Beneath a call of this thread (a signal handler): that call goes on only once
            # this returns, so waiting for it would never end. The threads stop after the
            # last call in flight (_when_closed_and_idle).
            log.debug("close() beneath a call of this thread: not waiting for in-flight work")
        else:
            self._calls.wait_idle()
            self._stop_threads()

    async def aclose(self) -> None:
        """:meth:`close`, awaited. Cancellable: cancelled before the calls in flight are done,
        the client is closed all the same, and its threads end as the last call does."""
        self._calls.close()
        # This loop keeps running its own in-flight requests meanwhile.
        await self._calls.wait_idle_async()
        await anyio.to_thread.run_sync(self._stop_threads)

    def __repr__(self) -> str:
        mode = "dynamic" if self.dynamic_batching else "explicit"
        return (
            f"<InProcessClient {self._model_name!r} on {self.server_model.device} "
            f"{mode} max_batch_size={self.max_batch_size} max_wait_ms={self.max_wait_ms}"
            f"{' closed' if self._calls.closed else ''}>"
        )

    # -- the pipeline ------------------------------------------------------------------------

    def _finish(
        self, request: ModelRequest, output: SampleOutput, mode: Mode, position: int | None = None
    ) -> str:
        # A batch call's errors say where the tile sits in it (~1 µs a tile, beside ~ms passes).
        where = None if position is None else _where(request, position)
        return self.server_model.response_json(request, output, mode, where)

    async def infer_async(
        self, body: str | bytes, mode: Mode, *, overload: Overload | None = None
    ) -> str:
        """Run one request body in ``mode`` (what the server routes call); see ``predict_async``.
        ``overload`` overrides the client's for this call: the server refuses at once with a
        full queue (SPEC §5) whatever its client does for in-process callers."""
        wait_for_room = self._wait_for_room if overload is None else _waits(overload)
        with self._calls.call():
            self.server_model.check_mode(mode)  # an unknown mode is the caller's error
            state = self._loops.get()
            if self.dynamic_batching:
                scheduler = state.scheduler(mode)
                # The deadline runs from here: waiting for room and preparing count too.
                reservation = scheduler.reserve(wait=wait_for_room, timeout=self.request_timeout)
                async with reservation as slot:
                    output: SampleOutput | None = None
                    if self._alone(body, others=state.admitted() - 1):
                        job = _Job(body=body)  # decoded on the device's thread
                        try:
                            output = await _forwarded(slot, job, self.server_model)
                        except _TooBigHere:  # too big an image to decode there: as any other
                            slot.reopen()
                    if output is None:  # a bad body is refused here (the decode stage returns it)
                        job = _Job(*await self._decoded(state, body, mode, slot))
                        output = await _forwarded(slot, job, self.server_model)
            else:
                job, output = await self._infer_unbatched(state, body, mode, wait_for_room)
            assert job.request is not None
            try:
                return self._finish(job.request, output, mode)
            except ModelExecutionError as exc:  # NaN or infinity: counted as a batch's are
                self._stats[mode].record_error(type(exc).__name__)
                raise

    async def _decoded(
        self,
        state: _LoopState,
        body: str | bytes,
        mode: Mode,
        slot: Reservation[_Job, SampleOutput],
    ) -> Prepared:
        """``body`` through the decode stage. Not started once the call's deadline is past: its
        tile could no longer reach the model in time, and under overload, when deadlines pass,
        the decoders' CPU is what every other call is waiting for."""
        remaining = slot.remaining()
        self._check_not_expired(mode, remaining)
        try:
            return await state.decoder().submit((body, mode), timeout=remaining)
        except DeadlineExceededError:
            raise self._deadline_exceeded(mode, "it was still waiting to be decoded") from None

    async def _infer_unbatched(
        self, state: _LoopState, body: str | bytes, mode: Mode, wait_for_room: bool
    ) -> tuple[_Job, SampleOutput]:
        """Batch size 1 (``dynamic_batching=False``): decode the body, then run its tile alone.
        ``request_timeout`` bounds the wait for decoding and for the device, as a dynamic
        call's deadline does: a call not started in time never runs. ``max_queue`` of them
        per loop and mode are in at once; the next waits for room or is refused (``overload``),
        as a dynamic call is by its scheduler."""
        start_by = deadline_from(self.request_timeout)
        admission = state.admission(mode)
        await admission.acquire(wait_for_room, start_by)
        try:
            return await self._run_unbatched(state, body, mode, start_by)
        finally:
            admission.release()

    async def _run_unbatched(
        self, state: _LoopState, body: str | bytes, mode: Mode, start_by: float | None
    ) -> tuple[_Job, SampleOutput]:
        limiter = state.prepare_limiter
        if self._alone(body, others=limiter.borrowed_tokens):
            try:  # decoded on the device's thread
                return await self._forward_unbatched(_Job(body=body), mode, limiter, start_by)
            except _TooBigHere:  # a big image: decoded as any other
                pass
        remaining = _remaining(start_by)
        self._check_not_expired(mode, remaining)
        with anyio.move_on_after(remaining) as waited:
            decoded = await anyio.to_thread.run_sync(
                _decode_chunk, self.server_model, self._cores, [(body, mode)], limiter=limiter
            )
        if waited.cancelled_caught:
            raise self._deadline_exceeded(mode, "it was still waiting to be decoded")
        if isinstance(decoded[0], InferenceError):
            raise cast(InferenceError, decoded.pop())  # held by no frame of its traceback
        return await self._forward_unbatched(_Job(*decoded[0]), mode, limiter, start_by)

    async def _forward_unbatched(
        self, job: _Job, mode: Mode, limiter: anyio.CapacityLimiter, start_by: float | None
    ) -> tuple[_Job, SampleOutput]:
        """``job`` alone through a forward pass on the device's thread. A lone body's refusal
        there is raised (:class:`_TooBigHere` included), and counts as nothing."""
        # Loaded while other calls are being decoded: then the pass leaves them their cores,
        # as a dynamic client's does (clients/cores.py).
        loaded = partial(_decoding, limiter)
        self._check_not_expired(mode, _remaining(start_by))
        future = self._device_thread.submit(
            _timed,
            _forward_jobs,
            self.server_model,
            [job],
            mode,
            self._cores,
            loaded,
            self.device_lock,
        )
        try:
            results, ran_s = await wait_future(future, start_by=start_by)
        except anyio.get_cancelled_exc_class():
            if future.cancelled():  # left before its pass started, as a dynamic call counts it
                self._stats[mode].record_cancelled()
            else:  # its pass runs on: counted when it ends, as a dynamic batch's is
                future.add_done_callback(partial(_count_abandoned_pass, self._stats[mode]))
            raise
        except Exception as exc:
            if future.cancelled():  # the device had not got to it by the deadline
                raise self._deadline_exceeded(mode, "the device was busy with other work") from None
            self._stats[mode].record_error(type(exc).__name__)
            raise _execution_error(self.server_model, job.request, exc) from exc
        finally:
            del future  # it holds the error, whose traceback holds this frame (outcome.py)
        if isinstance(results[0], (InferenceError, _TooBigHere)):
            raise results.pop()  # a lone body refused, nothing ran; held by no frame of its own
        self._stats[mode].record_batch(1, (), ran_s)
        return job, results[0]

    def _check_not_expired(self, mode: Mode, remaining: float | None) -> None:
        """A deadline passed before the call waited for anything here is said to have (as the
        scheduler words it), not blamed on the wait that would follow."""
        if remaining is not None and remaining <= 0:
            raise self._deadline_exceeded(mode, _EXPIRED_ON_ARRIVAL)

    def _deadline_exceeded(self, mode: Mode, detail: str) -> DeadlineExceededError:
        """As a dynamic call's scheduler words it and counts it."""
        self._stats[mode].record_error("deadline")
        return deadline_exceeded(f"{self._model_name}:{mode}", detail)

    def _alone(self, body: object, others: int) -> bool:
        """May this call skip its decode thread (module docstring)? Only with ``others`` (calls
        of its loop in flight) at 0, the device's thread idle, and a body of a tile's size
        (anything but str or bytes is refused by the decode step, as ever). The device's
        thread may still hand it back (:class:`_TooBigHere`)."""
        return (
            others == 0
            and self._device_thread.idle
            and isinstance(body, (str, bytes))
            and len(body) <= self._lone_body_limit
        )

    def infer_batch(
        self,
        bodies: list[str],
        mode: Mode,
        *,
        check_cancelled: Callable[[], object] | None = None,
    ) -> list[str]:
        """Run pre-formed batch ``bodies`` in ``mode``, all or nothing; see ``predict_batch``.

        ``check_cancelled`` (e.g. ``anyio.from_thread.check_cancelled`` in a worker thread) is
        called in this thread before each slice of decoding and each forward pass; whatever it
        raises abandons the call there. The server passes it so that a ``/batch`` request whose
        client hung up stops within one pass instead of computing every tile.
        """
        with self._calls.call():
            return self._infer_batch(bodies, mode, check_cancelled or _never_cancelled)

    def _infer_batch(self, bodies: list[str], mode: Mode, check: Callable[[], object]) -> list[str]:
        """``infer_batch``'s work, within a call counted in flight by its caller."""
        if not isinstance(bodies, list):
            raise InvalidRequestError(
                f"bodies must be a list of JSON strings, got {type(bodies).__name__}"
            )
        self.server_model.check_mode(mode)
        prepared: list[Prepared] = []
        refusal = BatchRefusal()
        for position, decoded in enumerate(self._decode_batch(bodies, mode, check)):
            if isinstance(decoded, InferenceError):
                refusal.add(position, decoded)
                prepared.clear()  # nothing will be computed: its tiles need not be held
            elif not refusal:
                prepared.append(decoded)
        if refusal:
            raise refusal.error(len(bodies))
        responses: list[str] = []
        for start in range(0, len(prepared), self.max_batch_size):
            check()
            chunk = prepared[start : start + self.max_batch_size]
            outputs = self._forward_chunk(chunk, mode, start)
            for i, ((request, _), output) in enumerate(zip(chunk, outputs, strict=True)):
                try:
                    responses.append(self._finish(request, output, mode, start + i))
                except ModelExecutionError as exc:  # postprocess: counted as a single call's
                    self._stats[mode].record_error(type(exc).__name__)
                    exc.positions = [start + i]
                    raise
        return responses

    def _decode_batch(
        self, bodies: list[str], mode: Mode, check: Callable[[], object]
    ) -> Iterator[Decoded]:
        """Every body of a ``*_batch`` call, in order, as it is decoded; on
        ``batch_decode_threads`` threads. ``check()`` runs before every ``max_batch_size``
        bodies are taken (in this thread)."""
        decode = partial(_prepare_or_refusal, self.server_model, mode=mode)
        every = self.max_batch_size
        if self.batch_decode_threads == 1 or len(bodies) < 2:
            for i, body in enumerate(bodies):
                if i % every == 0:
                    check()
                yield decode(body, position=i)
            return
        pool = self._batch_decode_pool()
        # A window of bodies ahead of the one taken, not the whole batch at once: a future
        # each for millions of bodies held gigabytes, and a hang-up left them all queued.
        ahead = 2 * max(every, self.batch_decode_threads)
        pending: deque[concurrent.futures.Future[Decoded]] = deque()
        taken = 0

        def take() -> Decoded:
            nonlocal taken
            if taken % every == 0:
                check()
            taken += 1
            return pending.popleft().result()

        try:
            for i, body in enumerate(bodies):
                try:
                    pending.append(pool.submit(decode, body, position=i))
                except RuntimeError:
                    if self._calls.closed:  # close() from a thread with a running loop
                        raise self._calls.refusal() from None
                    raise
                if len(pending) == ahead:
                    yield take()
            while pending:
                yield take()
        finally:  # left early: the bodies not yet decoded never are
            for future in pending:
                future.cancel()

    def _batch_decode_pool(self) -> ThreadPoolExecutor:
        with self._threads_lock:
            if self._batch_decoder is None:
                self._batch_decoder = ThreadPoolExecutor(
                    self.batch_decode_threads, thread_name_prefix="histoinfer-batch-decode"
                )
                self._batch_decoder_finalizer = weakref.finalize(
                    self, self._batch_decoder.shutdown, wait=False
                )
            return self._batch_decoder

    def _forward_chunk(self, chunk: list[Prepared], mode: Mode, offset: int) -> list[SampleOutput]:
        """The chunk's outputs; or one error naming every tile that failed alone and every
        tile whose outputs are NaN or infinite (``postprocess`` would stop at the first)."""
        outputs, failing = self._forward_bisecting(chunk, mode, offset)
        non_finite = {
            offset + i: f"batch position {offset + i} ({request.where()})"
            for i, ((request, _), output) in enumerate(zip(chunk, outputs, strict=True))
            if output is not None and not output.finite
        }
        name = self.server_model.metadata().name
        problems = []
        if failing:
            problems.append(
                f"model {name!r}: forward pass failed for " + "; ".join(failing.values())
            )
        if non_finite:
            self._stats[mode].record_error(ModelExecutionError.__name__)
            where = "for " + "; ".join(non_finite.values())
            problems.append(str(non_finite_error(name, where)))
        if problems:
            error = ModelExecutionError("; and ".join(problems))
            error.positions = sorted([*failing, *non_finite])
            try:
                raise error
            finally:
                del error  # this frame is in its traceback (histoinfer/outcome.py)
        return [output for output in outputs if output is not None]

    def _forward_bisecting(
        self, chunk: list[Prepared], mode: Mode, offset: int, *, bisected: bool = False
    ) -> tuple[list[SampleOutput | None], dict[int, str]]:
        """The chunk's outputs (None for a tile that fails alone), and those tiles (by batch
        position: its words, with its error).

        A pass that raises is run again as two halves, as the scheduler bisects a failed
        batch: a pass that fails only at this size (a GPU out of memory) still answers every
        tile, as it would through ``predict_async``, and a tile that fails alone is named.
        """
        stats = self._stats[mode]
        try:
            outputs = self._device_thread.call(
                _counted,
                stats,
                len(chunk),
                partial(_forward, lock=self.device_lock),
                self.server_model,
                [tile for _, tile in chunk],
                mode,
            )
        except Exception as exc:
            if len(chunk) == 1:
                stats.record_error(type(exc).__name__)
                return [None], {offset: f"batch position {offset} ({chunk[0][0].where()}): {exc!r}"}
            if not bisected:  # once a chunk, as the scheduler logs it
                name = f"{self._model_name}:{mode}"
                log.warning("%s: batch of %d failed (%r); bisecting", name, len(chunk), exc)
            middle = len(chunk) // 2
            first, failed_first = self._forward_bisecting(
                chunk[:middle], mode, offset, bisected=True
            )
            second, failed_second = self._forward_bisecting(
                chunk[middle:], mode, offset + middle, bisected=True
            )
            return first + second, failed_first | failed_second
        return list(outputs), {}

    # -- sync bridge and bookkeeping ---------------------------------------------------------

    def _run_sync(self, fn: Callable[[str], Coroutine[Any, Any, T]], body: str) -> T:
        if getattr(_anyio_threadlocals, "current_token", None) is not None:
            # In an anyio worker thread: run in the host loop, and batch with it.
            try:
                outcome = anyio.from_thread.run(_in_host_loop, fn, body)
            except _RunFinished:
                pass  # a thread its host abandoned, whose loop has ended: as any other thread
            else:
                return outcome.unwrap()
        # Any other thread (a plain thread, or one whose loop is running, like a notebook
        # cell): the client's own portal. Sync calls from many threads batch together there.
        portal = self._get_portal()
        try:
            with self._calls.here():  # close() in a signal handler must not wait for it
                return portal.call(fn, body)
        except RuntimeError:
            if self._calls.closed:  # the portal stopped under us: close() won the race
                raise self._calls.refusal() from None
            if sys.is_finalizing() or not portal.thread.is_alive():
                raise ClientClosedError(_EXITING) from None  # its finalizer stopped it
            raise

    def _get_portal(self) -> PortalThread:
        with self._threads_lock:
            if self._calls.closed:  # never start a portal for a closed client
                raise self._calls.refusal()
            if sys.is_finalizing():  # a thread started now would never run: the call hung
                raise ClientClosedError(_EXITING)
            if self._portal is None:
                portal = PortalThread(name=f"histoinfer-portal-{self._model_name}")
                if self._calls.closed:  # by a signal handler, while it started: nothing would
                    portal.stop(timeout=0)  # stop it
                    raise self._calls.refusal()
                self._portal = portal
                # Stops the portal if the client is dropped, or at interpreter exit.
                self._portal_finalizer = weakref.finalize(self, portal.stop)
            return self._portal

    def _stop_threads(self, wait: bool = True) -> None:
        """Stop the portal thread and the batch decoding threads (whatever this client runs);
        with ``wait``, the portal's thread is joined (a portal told to stop before, without
        waiting, is joined now)."""
        with self._threads_lock:
            portal = self._portal
            decoder = self._batch_decoder
            if wait:
                finalizer, self._portal_finalizer, self._portal = self._portal_finalizer, None, None
                self._batch_decoder = None
                if finalizer is not None:
                    finalizer.detach()
        if portal is not None:
            portal.stop(timeout=_PORTAL_JOIN_S if wait else 0.0)
        if decoder is not None:
            decoder.shutdown(wait=False)


async def _in_host_loop(fn: Callable[[str], Coroutine[Any, Any, T]], body: str) -> Outcome[T]:
    """Run a sync call from an anyio worker thread in the host loop, cancellable as it should be.

    anyio 4.16's asyncio backend adds the ``from_thread.run`` task to the host's cancel scope but
    does not deliver a cancellation that happened there before: anyio primitives in the task
    (semaphores, limiters) then spin in ``checkpoint_if_cancelled`` forever, and the worker
    thread with its host task hang. Leaving a cancel scope restarts the delivery of a pending
    cancellation in the parent scope, and the checkpoint takes it. A no-op otherwise, and on trio.
    """
    with anyio.CancelScope():
        pass
    await anyio.lowlevel.checkpoint()
    # an error comes back as a value: raised through from_thread.run, it would be held by
    # anyio's frame that holds its future, a cycle (histoinfer/outcome.py)
    return await Outcome[T]().capture_async(fn, body)


#: the longest ``close()`` waits for the portal's thread to end (its calls are done by then)
_PORTAL_JOIN_S = 10.0


#: why a sync call made as the interpreter exits (from a ``__del__``, say) is refused
_EXITING = (
    "the interpreter is exiting, and the client's threads have stopped: make sync calls "
    "before exit (or close the client in an atexit handler)"
)


def _default_prepare_threads(model: ServerModel) -> int:
    """Decode threads per loop: on a CPU device, the cores torch's forward pass leaves free,
    or every core where passes are sharded.

    A CPU forward pass on torch's threads holds ``torch.get_num_threads()`` cores (its OpenMP
    workers spin between ops); more decoders than the remaining cores oversubscribe the
    machine and slow the pass down more than they gain. A sharded pass (models/shards.py)
    spins nowhere, so decoders and parts share every core: on 2 cores, 2 decode threads gave
    dynamic batching 1.20-1.22x the explicit loop, 1 thread 1.15x (docs/benchmarks-history.md,
    "Session 5"). On an accelerator the CPU is free for decoding.
    """
    cores = usable_cpus()
    if model.device.type == "cpu":
        threads = torch.get_num_threads()
        return cores if shards.available(model, threads) else max(1, cores - threads)
    return max(2, cores)


#: a deadline's error detail when it passed before the call waited for anything (as the
#: scheduler words it: batching/scheduler.py)
_EXPIRED_ON_ARRIVAL = "it expired before the request was queued"

#: what a call does when its loop's queue is full: wait for room, or be refused at once
Overload = Literal["wait", "reject"]


class ClientTuning(TypedDict, total=False):
    """:meth:`InProcessClient.from_checkpoint`'s ``**tuning``: the constructor's other settings,
    typed, so that a type checker catches a misspelt one (``max_queu=10``) as the call does."""

    max_queue: int | None
    prepare_threads: int | None
    request_timeout: float | None
    overload: Overload
    batch_decode_threads: int
    name: str | None
    device_lock: AbstractContextManager[Any] | None


def _mode_stats(model: ServerModel) -> defaultdict[Mode, BatchStats]:
    """Statistics for each mode the model serves (``stats()`` listed every mode, and a model
    serving one showed two that stayed 0); one a subclass's ``check_mode`` lets through
    besides is counted from its first call."""
    stats: defaultdict[Mode, BatchStats] = defaultdict(BatchStats)
    for mode in model.modes:
        stats[mode] = BatchStats()
    return stats


def _waits(overload: Overload) -> bool:
    if overload not in ("wait", "reject"):
        raise ValueError(f"overload must be 'wait' or 'reject', got {overload!r}")
    return overload == "wait"


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.perf_counter()


def _execution_error(
    model: ServerModel, request: ModelRequest | None, exc: BaseException
) -> ModelExecutionError:
    """A failed pass, worded as the model's other failures are ("model 'h1': ...")."""
    where = request.where() if request is not None else "a request"
    name = model.metadata().name
    return ModelExecutionError(f"model {name!r}: forward pass failed for {where}: {exc!r}")
