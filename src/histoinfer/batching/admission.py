"""``Admission``: how many callers are in at once, and what happens to the next one.

A bounded queue (SPEC §5) is a semaphore taken on the way in: in-process callers wait for room
(backpressure, until their deadline), the server's are refused at once (503). The scheduler
admits this way, and so do ``InProcessClient``'s batch-size-1 calls, which queue on the
device's thread without a scheduler: the same bound, the same errors, word for word.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from ..errors import DeadlineExceededError, OverloadedError

__all__ = ["Admission", "deadline_exceeded", "deadline_from"]


def deadline_from(timeout: float | None) -> float | None:
    """``timeout`` seconds from now, on ``time.perf_counter()``'s clock (None: no deadline)."""
    return None if timeout is None else time.perf_counter() + timeout


def deadline_exceeded(name: str, detail: str) -> DeadlineExceededError:
    """The error of a request that did not reach its batch function in time, worded alike
    wherever it is raised (the scheduler; ``InProcessClient``'s batch-size-1 calls)."""
    return DeadlineExceededError(f"{name}: request not dispatched within its deadline: {detail}")


class Admission:
    """At most ``limit`` callers in at once (``None``: no bound).

    Made outside a loop, it binds lazily to the first loop that waits on it: one per loop.
    ``on_deadline`` is called (to count it) when a caller's deadline passes while it waits.
    """

    def __init__(self, name: str, limit: int | None, on_deadline: Callable[[], None]) -> None:
        self.name = name
        self.limit = limit
        self._room = anyio.Semaphore(limit, fast_acquire=True) if limit is not None else None
        self._on_deadline = on_deadline

    async def acquire(self, wait: bool, deadline: float | None) -> None:
        """Room for one caller: waited for until ``deadline`` (then DeadlineExceededError), or
        with ``wait=False`` none now is OverloadedError."""
        room = self._room
        if room is None:
            return
        if not wait:
            try:
                room.acquire_nowait()
            except anyio.WouldBlock:
                raise OverloadedError(
                    f"{self.name}: queue full ({self.limit} requests admitted); retry later"
                ) from None
        elif deadline is None:
            await room.acquire()
        else:
            try:  # room now: in, however near the deadline (its next step words a miss)
                room.acquire_nowait()
                return
            except anyio.WouldBlock:
                pass
            with anyio.move_on_after(deadline - time.perf_counter()):
                await room.acquire()
                return
            self._on_deadline()
            detail = f"still waiting for room in a full queue ({self.limit} requests admitted)"
            raise deadline_exceeded(self.name, detail)

    def release(self) -> None:
        if self._room is not None:
            self._room.release()
