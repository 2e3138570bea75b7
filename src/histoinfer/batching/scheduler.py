"""``BatchScheduler``: turns concurrent ``submit`` calls into calls of a batch function.

It knows nothing of models, torch, HTTP or images: items are opaque, and the batch function maps
a list of items to a list of results, positionally. One scheduler serves one event loop (asyncio
or trio); :class:`~histoinfer.batching.PerLoop` keeps one per loop.

How it works (``docs/batching.md`` has the reasons and a sequence diagram):

* ``submit`` admits the caller (a semaphore bounds queued + running work: backpressure), puts a
  ``_Pending`` on an unbounded memory stream with ``send_nowait`` (a cancelled blocking send may
  still have delivered its item, so we never block on send), and waits on the pending's event.
* A runner task, started lazily as a trio *system task* or an asyncio task, takes the first item,
  then drains with ``receive_nowait`` until the batch is full, the window ``max_wait_ms`` after
  the first item has passed, or nothing else is on its way (a lone request is not held).
  Callers announced by :meth:`BatchScheduler.reserve` count as "on their way"; when the last of
  them leaves without an item, a no-op marker wakes the runner so it stops waiting for them.
* The batch function runs in a worker thread (``anyio.to_thread.run_sync``) under the scheduler's
  own limiter, never the loop's shared default one, or on a thread the owner names (``thread=``:
  the clients give each device one forward thread); requests that arrive meanwhile accumulate
  for the next batch.
* A finished batch's callers are woken by the forward thread as it starts the next batch (or by
  the runner, before it waits for anything): woken first, they would run before the next batch
  is handed over, and the device would idle meanwhile.
* A caller cancelled while queued marks its pending abandoned and the runner skips it; one
  whose batch still waits for its thread (busy with other work) is left out of it when it
  starts; one cancelled while its batch runs just leaves, and the batch completes for the
  others. A deadline is the same: an item that has not started by then never runs.
* A batch function that raises is bisected, so only the failing items get the exception. One
  that returns an exception as an item's result (a refused item) has it raised to that caller
  alone; a refused item is not counted as a sample of the batch.
* Completing a pending never raises into the runner, a failing statistics update is logged and
  ignored, and the runner survives its own bugs: anything unexpected fails the requests it holds,
  and it carries on. On trio the runner is a system task, where any escaping exception would
  crash the whole run, so nothing but cancellation leaves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence, Sized
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import sniffio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..arguments import check_count, check_seconds
from ..errors import ClientClosedError, DeadlineExceededError, InferenceError, ThreadAbortedError
from ..outcome import run_sync
from .admission import Admission, deadline_exceeded, deadline_from
from .perloop import call_soon_in_loop, current_loop_key, wait_future
from .stats import BatchStats

__all__ = [
    "BatchScheduler",
    "Reservation",
    "deadline_exceeded",
    "deadline_from",
    "warn_if_batches_cannot_fill",
]

log = logging.getLogger("histoinfer.batching")

#: the (owner, max_queue, max_batch_size) already warned about: a client makes a scheduler
#: per loop and mode, named "<client>:<mode>", and warns when it is made itself, so each
#: client (a server's each model) says it once a process, not at each loop's first call
_WARNED_QUEUE_BOUNDS: set[tuple[str, int, int]] = set()


def warn_if_batches_cannot_fill(name: str, max_queue: int | None, max_batch_size: int) -> None:
    """Warn, once a process for these settings, that ``max_queue`` caps every batch below
    ``max_batch_size`` (Ray Serve #43288: an admission cap below the batch size)."""
    if max_queue is None or max_queue >= max_batch_size:
        return
    key = (name.partition(":")[0], max_queue, max_batch_size)
    if key in _WARNED_QUEUE_BOUNDS:
        return
    _WARNED_QUEUE_BOUNDS.add(key)
    log.warning(
        "%s: max_queue=%d is below max_batch_size=%d; batches can never fill",
        name,
        max_queue,
        max_batch_size,
    )


T = TypeVar("T")
R = TypeVar("R")

# QUEUED -> DISPATCHED (handed to the batch function's thread) -> RUNNING (the batch function
# has it) -> DONE; a caller may leave (ABANDONED) until its item is RUNNING.
_QUEUED, _DISPATCHED, _RUNNING, _DONE, _ABANDONED = range(5)


class _Left(Exception):
    """The result of an item whose caller left before its batch started (never run)."""


class _Pending(Generic[T, R]):
    __slots__ = (
        "deadline",
        "done",
        "enqueued_at",
        "error",
        "item",
        "left",
        "refused",
        "result",
        "started",
        "state",
    )

    def __init__(self, item: T, now: float, deadline: float | None) -> None:
        self.item = item
        self.enqueued_at = now
        self.deadline = deadline
        self.state = _QUEUED
        self.refused = False  # the batch function returned an exception as its result
        self.left = False  # its caller left: nobody will read its outcome
        self.started = False  # the batch function had it once (a bisected half may rerun it)
        self.done = anyio.Event()
        self.result: R | None = None
        self.error: BaseException | None = None

    def resolve(self, result: R | None = None, error: BaseException | None = None) -> None:
        # Never raises: setting an event nobody waits on any more is harmless (ray#41057).
        if self.left:  # an error kept for nobody: a cycle through its batch's frames
            result, error = None, None
        self.result, self.error, self.state = result, error, _DONE
        self.done.set()


class _Handoff(Generic[T, R]):
    """A finished batch whose callers are woken a little later: by the forward thread as it
    starts the next batch, or by the runner before it waits for anything (or at once, when the
    next batch would wait for a thread busy with other work). Waking them first
    would let them run (serialize responses, send new requests) before the runner hands the
    next batch over, since ``to_thread.run_sync`` yields to the loop first: the device would
    idle ~7% of the time at 512 in flight (docs/benchmarks-history.md). Fired once, in the loop."""

    __slots__ = ("fired", "pendings", "results")

    def __init__(
        self, pendings: list[_Pending[T, R]], results: Sequence[R | BaseException]
    ) -> None:
        self.pendings = pendings
        self.results = results
        self.fired = False
        for p, result in zip(pendings, results, strict=True):
            p.refused = isinstance(result, BaseException)

    def fire(self) -> None:
        # Marked fired once every caller is woken, each woken once: a KeyboardInterrupt landing
        # midway (asyncio) leaves the rest to the next fire (the runner fires it again).
        if not self.fired:
            for p, result in zip(self.pendings, self.results, strict=True):
                if p.done.is_set():
                    continue
                if isinstance(result, BaseException):
                    p.resolve(error=result)
                else:
                    p.resolve(result)
            self.fired = True


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a runner's end as seen: one ended by a KeyboardInterrupt (which its caller got) was
    otherwise logged as "Task exception was never retrieved" when collected."""
    if not task.cancelled():
        task.exception()


def _is_async(fn: object) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one (``functools.partial``
    of one included): called in a thread, it would return a coroutine, never run."""
    while isinstance(fn, partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the method: is it async, not callable?
    )


def _wake_marker() -> _Pending[Any, Any]:
    """A no-op stream entry: the runner skips it, but receiving it ends a wait for company."""
    marker: _Pending[Any, Any] = _Pending.__new__(_Pending)
    marker.state = _ABANDONED
    return marker


#: what a batch function may not return, though it has a length: iterating it does not give
#: one result per item
_NOT_RESULTS = (Mapping, AbstractSet, str, bytes, bytearray, memoryview)


class BatchScheduler(Generic[T, R]):
    """Dynamic batching of ``submit(item)`` calls into ``batch_fn(items)`` calls.

    Args:
        batch_fn: maps a list of items to a same-length sequence of results. Runs in a worker
            thread; it may raise, and the batch is then split to isolate the failing items. An
            exception returned as an item's result is raised to that item's caller (a refusal:
            no bisection, and not counted as a sample in ``stats``).
        max_batch_size: most items per call of ``batch_fn`` (counts items, not requests).
        max_wait_ms: upper bound on how long the first item of a batch waits for company.
        max_queue: most items admitted at once (reserved, queued or running); further
            callers wait for room, or get :class:`OverloadedError` with ``wait=False``.
            ``None`` means unbounded.
        limiter: the thread limiter for ``batch_fn``; by default one of its own, with one token
            (the loop's default limiter is shared with everything else, and a forward pass
            waiting there for a token is pure latency).
        thread: where ``batch_fn`` runs instead of an anyio worker thread: a function that
            starts a call on a thread of the caller's choosing and returns its
            ``concurrent.futures.Future`` (e.g. a dedicated device thread's ``submit``). The
            scheduler awaits it without a worker thread of its own; ``limiter`` is then unused.
        thread_idle: with ``thread``, whether it has nothing queued or running. A finished
            batch's callers are woken as the next batch starts there, unless it is busy with
            other work: the next batch would wait behind that, and they with it.
        stats: where to record batches and waits; by default a fresh :class:`BatchStats`.
        on_exit: called once when the runner ends (its loop ended or the scheduler closed).
    """

    def __init__(
        self,
        batch_fn: Callable[[list[T]], Sequence[R | BaseException]],
        *,
        max_batch_size: int = 64,
        max_wait_ms: float = 5.0,
        max_queue: int | None = 4096,
        limiter: anyio.CapacityLimiter | None = None,
        thread: Callable[
            [Callable[[], Sequence[R | BaseException]]], Future[Sequence[R | BaseException]]
        ]
        | None = None,
        thread_idle: Callable[[], bool] | None = None,
        stats: BatchStats | None = None,
        name: str = "batch",
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        if _is_async(batch_fn):
            raise TypeError(
                f"{name}: batch_fn must be a plain function (it runs in a worker thread), got "
                f"the coroutine function {batch_fn!r}: call it there with anyio.from_thread.run"
            )
        check_count("max_batch_size", max_batch_size)  # 2.5 was taken
        check_seconds("max_wait_ms", max_wait_ms, zero_ok=True)
        check_count("max_queue", max_queue, none_ok=True)
        warn_if_batches_cannot_fill(name, max_queue, max_batch_size)
        self.batch_fn = batch_fn
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.name = name
        self.stats = stats if stats is not None else BatchStats()
        # Made outside a loop, these bind lazily to the first (and only) loop that uses them.
        self._limiter = limiter if limiter is not None else anyio.CapacityLimiter(1)
        self._thread = thread
        self._thread_idle = thread_idle
        self._admission = Admission(
            name, max_queue, on_deadline=partial(self._count, self.stats.record_error, "deadline")
        )
        self._on_exit = on_exit
        # Made when the runner starts: a scheduler never used would hold streams nobody closes
        # (a ResourceWarning when it is collected).
        self._send: MemoryObjectSendStream[_Pending[T, R]]
        self._receive: MemoryObjectReceiveStream[_Pending[T, R]]
        self._incoming = 0  # admitted by reserve(), not yet submitted
        self._admitted = 0  # admitted and not yet released: reserved, queued or running
        self._queued = 0  # submitted, not yet dispatched nor abandoned
        self._closing = False
        #: why it refuses new items once closing (its loop's end is not a close of the caller's)
        self._closed_why = "the scheduler is closed"
        self._loop: object | None = None
        self._runner: asyncio.Task[None] | None = None
        self._finished: anyio.Event | None = None
        self._handoff: _Handoff[T, R] | None = None  # the last batch, callers not yet woken
        # Every item queued and not yet returned to its caller: an interrupted runner fails
        # these, wherever it had them (between the stream and its batch included).
        self._waiting: set[_Pending[T, R]] = set()
        # Seconds the batch function has run, on its thread (one call at a time: the runner
        # awaits each); a batch's share is read after it, bisected halves included.
        self._last_pass_s = 0.0  # the latest batch function call's duration, on its thread
        self._dispatched_at: float | None = None  # when the batch now out was dispatched
        # Guards DISPATCHED -> RUNNING (the batch function's thread) against DISPATCHED ->
        # ABANDONED (a caller leaving): an item is either run or left, never both.
        self._start_lock = threading.Lock()

    # -- public ---------------------------------------------------------------------------

    async def submit(self, item: T, *, timeout: float | None = None, wait: bool = True) -> R:
        """Queue ``item`` and return its result from the batch function.

        ``timeout`` is a dispatch deadline in seconds, counted from this call: if the item has
        not reached the batch function by then (waiting for room, and for a thread busy with
        other work, included), it never will, and :class:`DeadlineExceededError` is raised
        (once it has, it runs to completion).
        ``wait=False`` raises :class:`OverloadedError` instead of waiting for room.
        """
        deadline = deadline_from(timeout)
        self._ensure_runner()
        await self._admit(wait, deadline)
        try:
            return await self._enqueue_and_wait(item, deadline)
        finally:
            self._release()

    @asynccontextmanager
    async def reserve(
        self, *, wait: bool = True, timeout: float | None = None
    ) -> AsyncIterator[Reservation[T, R]]:
        """Admit a caller *before* its item exists, e.g. while it is being prepared.

        The runner knows a reserved item is on its way and waits for it (within ``max_wait_ms``)
        instead of dispatching early: pipelined preparation still fills batches. ``timeout`` is
        the dispatch deadline, counted from now: it covers waiting for room, preparing and
        queueing, and carries over to :meth:`Reservation.submit`.
        """
        deadline = deadline_from(timeout)
        self._ensure_runner()
        await self._admit(wait, deadline)
        self._incoming += 1
        reservation: Reservation[T, R] = Reservation(self, deadline)
        try:
            yield reservation
        finally:
            reservation.ended = True
            if not reservation.used:
                self._incoming -= 1
                if self._incoming == 0:
                    self._wake_runner()
            self._release()

    async def aclose(self) -> None:
        """Refuse new items, finish every queued one, then stop the runner. In the scheduler's
        own loop (from another thread or loop: :meth:`close_soon`)."""
        finished = self._finished
        if finished is None or finished.is_set():  # never started, or its runner has ended
            self._closing = True
            return
        if self._loop is not current_loop_key():
            # Checked before anything is touched: the stream and the event belong to that loop
            # (closed from here, trio's internals assert).
            raise RuntimeError(
                f"{self.name}: aclose() must run in the scheduler's own loop "
                f"(close_soon() closes it from any thread)"
            )
        self._closing = True
        self._send.close()
        await finished.wait()

    def close_soon(self) -> None:
        """:meth:`aclose` without the wait, callable from any thread: refuse new items; the
        runner finishes the queued ones, then ends (in its own loop, which must be left to run).
        """
        self._closing = True
        loop = self._loop
        if loop is not None:
            # The stream belongs to the runner's loop: close it there. False: that loop ended,
            # and the runner with it.
            call_soon_in_loop(loop, self._send.close)

    @property
    def queue_depth(self) -> int:
        """Items submitted and waiting for dispatch (not counting abandoned ones)."""
        return self._queued

    @property
    def preparing(self) -> int:
        """Callers admitted by :meth:`reserve` that have not submitted their item yet (e.g.
        still decoding it): work on its way, which the batch function may want to leave CPU
        for. Safe to read from any thread (a plain int, possibly a moment stale)."""
        return self._incoming

    @property
    def admitted(self) -> int:
        """Callers admitted and not yet gone: reserved, queued or running. A caller inside a
        reservation that sees 1 is alone in this scheduler. Read it in the scheduler's loop."""
        return self._admitted

    # -- the caller's side ----------------------------------------------------------------

    async def _admit(self, wait: bool, deadline: float | None) -> None:
        if self._closing:
            raise ClientClosedError(f"{self.name}: {self._closed_why}")
        await self._admission.acquire(wait, deadline)
        self._admitted += 1

    def _deadline_exceeded(self, detail: str) -> DeadlineExceededError:
        self._count(self.stats.record_error, "deadline")
        return deadline_exceeded(self.name, detail)

    def _release(self) -> None:
        self._admitted -= 1
        self._admission.release()

    async def _enqueue_and_wait(
        self, item: T, deadline: float | None, reservation: Reservation[T, R] | None = None
    ) -> R:
        now = time.perf_counter()
        if deadline is not None and deadline <= now:
            if self._incoming == 0:  # a reservation ends here, without an item: wake the runner
                self._wake_runner()
            raise self._deadline_exceeded("it expired before the request was queued")
        pending: _Pending[T, R] = _Pending(item, now, deadline)
        try:
            self._send.send_nowait(pending)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            if self._closing or self._loop is not None:
                raise ClientClosedError(f"{self.name}: {self._closed_why}") from None
            self._ensure_runner()  # its runner was interrupted while this caller waited
            self._send.send_nowait(pending)
        self._waiting.add(pending)
        self._queued += 1
        self._count(self.stats.queue_changed, +1)
        try:
            if deadline is None:
                await pending.done.wait()
            else:
                with anyio.move_on_after(deadline - now):
                    await pending.done.wait()
                if pending.state == _QUEUED:
                    self._abandon(pending)
                    raise self._deadline_exceeded(self._why_still_queued())
                if self._leave_dispatched(pending, started_ok=False):
                    raise self._deadline_exceeded("its batch was still waiting for its thread")
                await pending.done.wait()  # started in time: it runs to completion
        except BaseException:
            pending.left = True
            # Cancelled before its batch started: leave, and it never runs.
            if pending.state == _QUEUED:
                self._abandon(pending)
                self._count(self.stats.record_cancelled)
            elif self._leave_dispatched(pending, started_ok=True):
                self._count(self.stats.record_cancelled)
            raise
        finally:
            self._waiting.discard(pending)
        error, pending.error = pending.error, None
        if error is not None:
            if reservation is not None:
                reservation.refused = pending.refused
            try:
                raise error
            finally:
                # Its traceback holds this frame: a frame that held the error too would be a
                # cycle, the request's memory kept until the collector's next full pass.
                del error, pending
        return pending.result  # type: ignore[return-value]

    def _why_still_queued(self) -> str:
        """What held a request queued to its deadline: others ahead of it, and the batch out
        (a long pass, or one waiting for a device busy with other work), if one is."""
        why = f"{self._queued} other requests still queued"
        if self._dispatched_at is not None:
            out_s = time.perf_counter() - self._dispatched_at
            why += f", behind a batch out for {out_s:.1f} s (its pass, or a wait for its thread)"
        return why

    def _leave_dispatched(self, pending: _Pending[T, R], started_ok: bool) -> bool:
        """Abandon ``pending`` if its batch is waiting for its thread (e.g. behind another job
        on a busy device): the batch then runs without it. False once it has started; and, at
        a deadline (``started_ok`` False), for an item the batch function already had once
        (a bisected half waiting to rerun it): it reached the model in time."""
        if pending.state != _DISPATCHED or (pending.started and not started_ok):
            return False
        with self._start_lock:
            if pending.state != _DISPATCHED:
                return False
            pending.state = _ABANDONED
        return True

    def _abandon(self, pending: _Pending[T, R]) -> None:
        pending.state = _ABANDONED
        self._queued -= 1
        self._count(self.stats.queue_changed, -1)

    def _wake_runner(self) -> None:
        # Closed: the runner is not waiting for anyone any more.
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._send.send_nowait(_wake_marker())

    def _count(self, update: Callable[..., None], *args: Any) -> None:
        """Update the statistics; a failure there is logged, never a failed request."""
        try:
            update(*args)
        except Exception:
            log.exception("%s: statistics update failed", self.name)

    # -- the runner -----------------------------------------------------------------------

    def _ensure_runner(self) -> None:
        token = current_loop_key()
        if self._loop is token:
            return
        if self._closing:
            raise ClientClosedError(f"{self.name}: {self._closed_why}")
        if self._loop is not None:
            raise RuntimeError(
                f"{self.name}: this BatchScheduler belongs to another event loop; "
                "use one scheduler per loop (histoinfer.batching.PerLoop)"
            )
        # The streams before the loop is registered: close_soon (any thread) reads _loop, then
        # closes _send. Registered before the task exists: an eager task factory runs it at once.
        self._send, self._receive = anyio.create_memory_object_stream[_Pending[T, R]](math.inf)
        self._loop = token
        self._finished = anyio.Event()
        if sniffio.current_async_library() == "trio":
            import trio

            trio.lowlevel.spawn_system_task(self._run, name=f"histoinfer:{self.name}")
        else:
            # asyncio keeps only weak references to tasks: hold a strong one.
            self._runner = asyncio.get_running_loop().create_task(
                self._run(), name=f"histoinfer:{self.name}"
            )
            self._runner.add_done_callback(_retrieve)

    async def _run(self) -> None:
        interrupted: BaseException | None = None
        try:
            while await self._step():
                pass
        except (KeyboardInterrupt, SystemExit) as exc:
            # Ctrl-C landed in this task. On asyncio it ends the task, and the loop's
            # run_until_complete, but not the loop: IPython's and nest_asyncio's run on, and a
            # scheduler that took it for the loop's end refused every later call (a user trial).
            interrupted = exc
            raise
        except Exception:  # pragma: no cover - _step lets only cancellation out
            log.exception("%s: scheduler runner failed", self.name)
        finally:
            # The loop is ending (cancelled), the scheduler was closed, or the runner was
            # interrupted: nobody is left behind.
            self._shutdown(interrupted)

    async def _step(self) -> bool:
        """Collect and dispatch one batch; False once the stream has ended."""
        batch: list[_Pending[T, R]] = []
        try:
            more = await self._collect(batch)
            await self._dispatch(batch)
            return more
        except Exception as exc:  # a bug of ours: fail what we hold, keep serving
            self._wake_finished()
            log.exception("%s: scheduler error; failing %d requests", self.name, len(batch))
            self._fail(batch, partial(InferenceError, f"{self.name}: scheduler error: {exc!r}"))
            await anyio.lowlevel.checkpoint()  # a repeating bug must not starve the loop
            return True

    def _shutdown(self, interrupted: BaseException | None = None) -> None:
        """The runner's end: every item it holds fails. Interrupted (and not closing), the
        scheduler goes on: the next item starts a runner again, in the same loop."""
        self._wake_finished()
        restart = interrupted is not None and not self._closing
        make_error: Callable[[], BaseException] = self._closed_error
        if restart:
            make_error = partial(self._interrupted_error, type(interrupted).__name__)
        else:
            if not self._closing:  # nobody closed it: its loop is ending
                self._closed_why = (
                    "the event loop it served has ended (a BatchScheduler serves one loop; "
                    "histoinfer.batching.PerLoop gives one per loop)"
                )
            self._closing = True
        self._send.close()
        self._receive.close()
        self._runner = None
        if restart:
            # First: a second interrupt landing while the callers below are failed must still
            # leave a scheduler the next call restarts.
            self._loop = None  # _ensure_runner makes new streams and a runner
        if self._finished is not None:
            self._finished.set()
        self._fail(list(self._waiting), make_error)  # the stream's, the batch's, any between
        if restart:
            return
        if self._on_exit is not None:
            try:
                self._on_exit()
            except Exception:
                log.exception("%s: on_exit callback failed", self.name)

    def _closed_error(self) -> InferenceError:
        return ClientClosedError(f"{self.name}: the event loop or scheduler shut down")

    def _interrupted_error(self, by: str) -> InferenceError:
        return InferenceError(
            f"{self.name}: {by} interrupted the scheduler before this "
            "request was answered; the scheduler goes on serving: send it again"
        )

    def _fail(
        self, pendings: list[_Pending[T, R]], make_error: Callable[[], BaseException]
    ) -> None:
        queued = 0
        for p in pendings:
            # Not by state alone: an interrupted resolve() can leave one DONE, never woken.
            if p.state != _ABANDONED and not p.done.is_set():
                queued += p.state == _QUEUED
                p.resolve(error=make_error())
        if queued:
            self._queued -= queued
            self._count(self.stats.queue_changed, -queued)

    async def _collect(self, batch: list[_Pending[T, R]]) -> bool:
        """Fill ``batch``; return False once the stream has ended (after this batch)."""
        receive = self._receive
        try:
            while True:  # the first live item
                try:
                    first = receive.receive_nowait()
                except anyio.WouldBlock:
                    self._wake_finished()  # nothing to hand over next: wake them now
                    first = await receive.receive()
                if first.state == _QUEUED:
                    batch.append(first)
                    break
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._wake_finished()
            return False
        deadline = first.enqueued_at + self.max_wait
        limit = self.max_batch_size
        yielded = False
        while len(batch) < limit:
            try:
                item = receive.receive_nowait()
            except anyio.WouldBlock:
                if self._incoming == 0:
                    # Nothing is on its way. Yield once so that callers already woken can
                    # enqueue; if still nothing, dispatch now rather than hold a lone request.
                    if yielded:
                        break
                    yielded = True
                    await anyio.lowlevel.checkpoint()
                    continue
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._wake_finished()  # about to wait for company
                got: _Pending[T, R] | None = None
                with anyio.move_on_after(remaining):
                    got = await self._receive_or_none()
                if got is None:  # the window is over, or the stream ended: dispatch
                    break
                item = got
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if item.state == _QUEUED:
                batch.append(item)
        return True

    async def _receive_or_none(self) -> _Pending[T, R] | None:
        # Its own try: an end of stream raised inside _collect's `except WouldBlock` handler
        # would not be caught by that try's other handlers, and would fail the batch.
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return None

    async def _dispatch(self, batch: list[_Pending[T, R]]) -> None:
        live = [p for p in batch if p.state == _QUEUED]
        if not live:
            return
        now = time.perf_counter()
        for p in live:
            p.state = _DISPATCHED
        self._queued -= len(live)
        self._count(self.stats.queue_changed, -len(live))
        self._dispatched_at = now
        try:
            await self._execute(live, now)
        finally:
            self._dispatched_at = None

    async def _execute(
        self, pendings: list[_Pending[T, R]], dispatched_at: float, *, bisected: bool = False
    ) -> None:
        for p in pendings:  # a bisected half, dispatched again
            if p.state == _RUNNING:
                p.state = _DISPATCHED
        handoff, self._handoff = self._handoff, None
        if handoff is not None and self._thread_idle is not None and not self._thread_idle():
            # The thread is busy with other work (another loop's pass on a shared device):
            # this batch will wait behind it, and so would the last one's callers. Wake them
            # now; the device has work meanwhile.
            handoff.fire()
            handoff = None
        self._last_pass_s = 0.0
        try:
            if self._thread is not None:
                results = await wait_future(self._thread(partial(self._call, pendings, handoff)))
            else:
                # errors raised without a reference cycle (histoinfer/outcome.py)
                results = await run_sync(self._call, pendings, handoff, limiter=self._limiter)
        except BaseException as exc:
            if handoff is not None:  # whether or not the thread got to it
                handoff.fire()
            if not isinstance(exc, Exception):
                raise
            if self._last_pass_s:  # it ran, and failed: the device was busy all the same
                self._count(self.stats.record_failed_pass, self._last_pass_s)
            # Callers that left before it started are out of it (nobody waits for them): a
            # failing item must not rerun once per neighbour that left.
            pendings = [p for p in pendings if p.state in (_DISPATCHED, _RUNNING)]
            if not pendings:
                return
            if len(pendings) == 1:
                self._count(self.stats.record_error, type(exc).__name__)
                pendings[0].resolve(error=exc)
                return
            # Split to isolate the failing items (LitServe #340): only they get the error.
            if not bisected:  # once a batch: every split's line would flood the log
                log.warning("%s: batch of %d failed (%r); bisecting", self.name, len(pendings), exc)
            middle = len(pendings) // 2
            await self._execute(pendings[:middle], dispatched_at, bisected=True)
            await self._execute(pendings[middle:], dispatched_at, bisected=True)
            return
        if handoff is not None:  # a no-op: the thread's wake-up ran long before this batch ended
            handoff.fire()
        self._handoff = _Handoff(pendings, results)
        # One batch per pass that ran (a bisected batch ran as its halves), of the items the
        # model answered: not one refused, failed (a failing device must not look busy on the
        # batches counter) or left before it started.
        waits = [
            dispatched_at - p.enqueued_at
            for p, result in zip(pendings, results, strict=True)
            if not isinstance(result, BaseException)
        ]
        if waits:
            self._count(self.stats.record_batch, len(waits), waits, self._last_pass_s)

    def _wake_finished(self) -> None:
        handoff = self._handoff
        if handoff is not None:
            handoff.fire()
            self._handoff = None  # after: interrupted midway, the next call fires the rest

    def _call(
        self, pendings: list[_Pending[T, R]], handoff: _Handoff[T, R] | None = None
    ) -> Sequence[R | BaseException]:
        """The batch, on its thread: the items whose callers are still there, run."""
        if handoff is not None:
            # The previous batch's callers wake now, while this batch runs.
            call_soon_in_loop(self._loop, handoff.fire)
        with self._start_lock:
            live = [p for p in pendings if p.state == _DISPATCHED]
            for p in live:
                p.state = _RUNNING
                p.started = True
        started = time.perf_counter()
        try:
            results = self.batch_fn([p.item for p in live]) if live else []
        except BaseException as exc:
            # SystemExit, a user's BaseException...: bisected like any failure, not taken by
            # the loop for its own cancellation (which would fail every caller of the batch).
            contained = ThreadAbortedError.contain(exc, f"{self.name}: the batch function")
            try:
                if contained is exc:
                    raise
                raise contained from exc
            finally:
                del contained  # this frame is in its traceback: no cycle (histoinfer/outcome.py)
        finally:
            # Timed here, on its thread: from the loop, the time would include the hand-offs
            # and the loop's wake-up, and under load its wait for the thread.
            self._last_pass_s = time.perf_counter() - started
        if isinstance(results, _NOT_RESULTS) or not isinstance(results, Sized):
            # a dict's keys would be taken for results, silently
            raise TypeError(
                f"{self.name}: batch function must return one result per item, in order (a "
                f"list, a tuple, an array), got {type(results).__name__}"
            )
        if len(results) != len(live):
            raise RuntimeError(
                f"{self.name}: batch function returned {len(results)} results for {len(live)} items"
            )
        if len(live) == len(pendings):
            return results
        ran = iter(results)
        return [next(ran) if p.state == _RUNNING else _Left() for p in pendings]


class Reservation(Generic[T, R]):
    """A place in a scheduler, taken by :meth:`BatchScheduler.reserve` before the item exists."""

    __slots__ = ("_deadline", "_scheduler", "ended", "refused", "used")

    def __init__(self, scheduler: BatchScheduler[T, R], deadline: float | None = None) -> None:
        self._scheduler = scheduler
        self._deadline = deadline
        self.used = False
        #: the batch function returned an exception for the submitted item (see :meth:`reopen`)
        self.refused = False
        #: the ``reserve()`` block is over
        self.ended = False

    async def submit(self, item: T, *, timeout: float | None = None) -> R:
        """Queue the item; the reservation's deadline applies, or ``timeout`` from now if
        that is sooner."""
        if self.used or self.ended:
            raise RuntimeError("a reservation submits one item, inside its reserve() block")
        self.used = True
        self._scheduler._incoming -= 1
        if timeout is not None:
            own = time.perf_counter() + timeout
            self._deadline = own if self._deadline is None else min(self._deadline, own)
        return await self._scheduler._enqueue_and_wait(item, self._deadline, self)

    def remaining(self) -> float | None:
        """Seconds left before the reservation's deadline (negative once past; ``None``: none).
        For the caller's own waits while it prepares the item, e.g. a decode that should not
        start once the item could no longer be dispatched in time."""
        return None if self._deadline is None else self._deadline - time.perf_counter()

    def reopen(self) -> None:
        """Take the place again after the batch function refused the submitted item (its result
        an exception, e.g. "prepare it another way first"): the caller is on its way again, as
        before its first :meth:`submit` (the runner waits for it within ``max_wait_ms``), and
        submits one more item. The deadline stays."""
        if not (self.used and self.refused) or self.ended:
            raise RuntimeError("reopen follows a refused submit, inside the reserve() block")
        self.used = self.refused = False
        self._scheduler._incoming += 1
