"""What every backend's lifecycle shares: the context-manager half of the ``Client`` protocol,
and the count of calls in flight that ``close()`` waits for.

A backend implements ``close()`` and ``aclose()``; ``with`` and ``async with`` call them.
Torch-free on purpose: ``HttpClient`` uses it too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import ClassVar, NoReturn, Protocol, Self

import anyio
import sniffio

from ..errors import ClientClosedError
from ..protocol import documented_as_client

__all__ = ["CLIENT_CLOSED", "ClosingContext", "InFlight", "mend_after_fork", "running_loop_here"]

#: Why a call on a closed client is refused, and what to do: closing is not undone.
CLIENT_CLOSED = "the client is closed (for good: make a new client to go on)"

log = logging.getLogger("histoinfer.client")

#: how long ``close()`` waits for calls in flight before it says so in the log (and again)
_WAIT_WARNING_S = 30.0


class InFlight:
    """The calls in flight of one client, and whether it is closed (SPEC §5: closing finishes
    the work in flight and refuses new calls with :class:`ClientClosedError`). Thread-safe.

    ``when_done`` runs once the client is closed and no call is in flight: in ``close()`` if
    none is, else as the last one ends (on its thread).
    """

    def __init__(self, when_done: Callable[[], None] | None = None) -> None:
        self._idle = threading.Condition()
        self._active = 0
        self._when_done = when_done
        self._then: list[Callable[[], None]] = []
        self.closed = False
        #: what a refused call is told
        self.why_closed = CLIENT_CLOSED
        self._here = threading.local()  # depth: this thread's calls in flight (call())

    @property
    def active(self) -> int:
        """Calls in flight (a moment stale)."""
        return self._active

    @contextmanager
    def call(self) -> Iterator[None]:
        """One call: refused once closed; counted while it runs."""
        self.enter()
        # As here(), inline (one generator a call, not two). The entering thread's own count,
        # held: a suspended call may be closed on another thread (its abandoned loop's tasks
        # collected there), which must neither miss exit() nor count on its own thread.
        counts: dict[str, int] = self._here.__dict__
        counts["depth"] = counts.get("depth", 0) + 1
        try:
            yield
        finally:
            try:
                self.exit()
            finally:
                counts["depth"] -= 1

    @contextmanager
    def here(self) -> Iterator[None]:
        """A call of this thread, for :meth:`held_here` (a sync call whose work, counted by
        :meth:`call`, runs on another thread marks its own thread so)."""
        counts: dict[str, int] = self._here.__dict__  # this thread's, as in call()
        counts["depth"] = counts.get("depth", 0) + 1
        try:
            yield
        finally:
            counts["depth"] -= 1

    def held_here(self) -> bool:
        """Is a call of this thread in flight? Then ``close()`` runs beneath it (in a signal
        handler, say, that interrupted it) and must not wait for it: that call goes on only
        once ``close()`` has returned (a SIGTERM handler that closed the client hung for ever
        while the main thread was in ``predict_batch``)."""
        counts: dict[str, int] = self._here.__dict__
        return counts.get("depth", 0) > 0

    def enter(self) -> None:
        with self._idle:
            if self.closed:
                raise self.refusal()
            self._active += 1

    def refusal(self) -> ClientClosedError:
        """The error of a call made once closed."""
        return ClientClosedError(self.why_closed)

    def after_fork(self, refuse: str | None = None) -> None:
        """In a forked child: the parent's calls in flight are not here (their threads did not
        survive the fork), so ``close()`` must not wait for them, nor run what the parent's
        close was to run after them. With ``refuse``, closed in this process, saying why."""
        self._idle = threading.Condition()  # the parent's threads may have held it
        self._here = threading.local()
        self._active = 0
        self._then = []
        if refuse is not None:
            self.closed, self.why_closed, self._when_done = True, refuse, None

    def exit(self) -> None:
        with self._idle:
            self._active -= 1
            if self._active:
                return
            self._idle.notify_all()
            done = self.closed
        if done:
            self._done()

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Refuse new calls; ``then`` runs once no call is in flight (here, if none is now;
        else on the thread of the call that ends last), after ``when_done``."""
        with self._idle:
            self.closed = True
            if then is not None:
                self._then.append(then)
            done = self._active == 0
        if done:
            self._done()

    def _done(self) -> None:
        with self._idle:  # each runs once, even when close() and a last exit() race
            then, self._then = self._then, []
        steps = ([self._when_done] if self._when_done is not None else []) + then
        for step in steps:
            # Run at the end of the last call (in its ``finally``): a step that fails must
            # neither replace that call's result nor keep the next step from running.
            try:
                step()
            except Exception:
                log.exception("closing the client: %r failed", step)

    def wait_idle(self) -> None:
        """Until no call is in flight. Said in the log every :data:`_WAIT_WARNING_S` seconds
        it takes: calls left in an event loop that was stopped or closed before they finished
        never finish, and ``close()`` would otherwise wait for them without a word."""
        with self._idle:
            while not self._idle.wait_for(lambda: self._active == 0, _WAIT_WARNING_S):
                log.warning(
                    "close() is still waiting for %d call(s) in flight; a call never ends if "
                    "the event loop running it was stopped or closed before it finished",
                    self._active,
                )

    async def wait_idle_async(self) -> None:
        """:meth:`wait_idle` for ``aclose()``: cancellable, and this loop keeps running its own
        calls meanwhile. (Calls end on any thread or loop, so it looks every few ms.)"""
        while self._active:
            await anyio.sleep(0.005)


class _ForkAware(Protocol):
    def _after_fork(self) -> None: ...


_FORK_AWARE: weakref.WeakSet[_ForkAware] = weakref.WeakSet()


def mend_after_fork(client: _ForkAware) -> None:
    """Call ``client._after_fork()`` in every child forked while it is alive, before anything
    else runs there: a client's threads and locks do not survive a fork, and its pooled
    connections are the parent's too (a child sending on them would take the parent's answers).
    """
    _FORK_AWARE.add(client)


def _in_forked_child() -> None:
    for client in list(_FORK_AWARE):
        try:
            client._after_fork()
        except Exception:  # never the child's problem: its own use of the client will say
            log.exception("mending %r after fork failed", client)


if hasattr(os, "register_at_fork"):  # no fork, nothing to mend (Windows)
    os.register_at_fork(after_in_child=_in_forked_child)


def running_loop_here() -> bool:
    """Is an event loop running on this thread (also outside a task, e.g. in a callback)?
    ``close()`` must not wait there: it would block the loop whose calls it waits for."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return False
    return True


@documented_as_client
class ClosingContext:
    #: what the client holds that cannot be sent to another process
    _holds: ClassVar[str] = "threads"

    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __reduce__(self) -> NoReturn:
        # Said plainly: pickle's own error named an internal (an fx GraphModule, a lock).
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied: it holds {self._holds}. Make "
            "one in each process (for a ProcessPoolExecutor, in its initializer) and send bodies"
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None:
        await self.aclose()
