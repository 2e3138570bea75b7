"""Tools for the batching and concurrency tests: a batch function the test can hold, polling.

A held batch function stands in for a slow device: while it is held, requests pile up in the
queue, so a test can arrange the exact contents of the next batch without relying on timing.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.abc


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail (not hang) after ``timeout`` seconds."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.002)


class HeldBatchFn:
    """A plain batch function (``x -> 10 * x``) whose calls each wait for ``allow()``.

    It records every batch it is given, and the threads it ran on. ``poison`` items make a call
    raise ``ValueError`` (so a batch holding one fails as a whole, like a device error).
    """

    def __init__(self, *, held: bool = True, poison: Sequence[int] = ()) -> None:
        self.batches: list[list[int]] = []
        self.threads: set[int] = set()
        self.poison = set(poison)
        self._held = held
        self._permits = threading.Semaphore(0)
        self._lock = threading.Lock()

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self.batches)

    def seen(self) -> list[int]:
        """Every item passed to the function, in call order."""
        with self._lock:
            return [item for batch in self.batches for item in batch]

    def allow(self, calls: int = 1) -> None:
        """Let ``calls`` more (current or future) calls return."""
        for _ in range(calls):
            self._permits.release()

    def release_all(self) -> None:
        """Stop holding: every current and future call returns at once."""
        self._held = False
        self.allow(10_000)

    def __call__(self, items: list[int]) -> list[int]:
        with self._lock:
            self.batches.append(list(items))
            self.threads.add(threading.get_ident())
        if self._held and not self._permits.acquire(timeout=20):
            raise TimeoutError("the test never released this batch")
        bad = self.poison.intersection(items)
        if bad:
            raise ValueError(f"poisoned items {sorted(bad)}")
        return [10 * item for item in items]

    def __enter__(self) -> HeldBatchFn:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Never leave a worker thread blocked: the test loop would wait for it at teardown.
        self.release_all()


def spawn_submit(
    tg: anyio.abc.TaskGroup,
    submit: Callable[..., Awaitable[Any]],
    item: int,
    results: dict[int, Any],
    **kwargs: Any,
) -> None:
    """Start ``submit(item, **kwargs)``; store its result, or the exception it raised."""

    async def one() -> None:
        try:
            results[item] = await submit(item, **kwargs)
        except Exception as exc:
            results[item] = exc

    tg.start_soon(one)
