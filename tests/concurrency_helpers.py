"""Tools for the batching and concurrency tests: a batch function the test can hold, polling,
explicit-mode reference outputs, and a model wrapper that can watch or sabotage forward passes.

A held batch function stands in for a slow device: while it is held, requests pile up in the
queue, so a test can arrange the exact contents of the next batch without relying on timing.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache, partial
from typing import Any

import anyio
import anyio.abc
import numpy as np
import torch
from helpers import make_body

from histoinfer.clients.inprocess import InProcessClient
from histoinfer.models import ServerModel
from histoinfer.schema import MODES, Mode


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail (not hang) after ``timeout`` seconds."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.002)


class HeldBatchFn:
    """A plain batch function (``x -> 10 * x``) whose calls each wait for ``allow()``.

    It records every batch it is given, and the threads it ran on. ``poison`` items make a call
    raise ``raises`` (``ValueError``: a batch holding one fails as a whole, like a device error).
    """

    def __init__(
        self,
        *,
        held: bool = True,
        poison: Sequence[int] = (),
        raises: type[BaseException] = ValueError,
    ) -> None:
        self.batches: list[list[int]] = []
        self.threads: set[int] = set()
        self.poison = set(poison)
        self.raises = raises
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
            raise self.raises(f"poisoned items {sorted(bad)}")
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


# -- requests and their explicit-mode answers --------------------------------------------------


def mode_of(i: int) -> Mode:
    """Request ``i`` runs in this mode: the tests mix all three, deterministically."""
    return MODES[i % len(MODES)]


@cache
def body(i: int) -> str:
    """Request body ``i`` (tile seeded by ``i``); cached, PNG encoding is not free."""
    return make_body(i)


_EXPECTED: dict[tuple[int, int, Mode], str] = {}
_EXPECTED_LOCK = threading.Lock()


def expected(model: ServerModel, indices: Sequence[int]) -> list[str]:
    """The explicit-mode response to ``body(i)`` in ``mode_of(i)``; each is computed once."""
    with _EXPECTED_LOCK:
        missing = [i for i in indices if (id(model), i, mode_of(i)) not in _EXPECTED]
        if missing:
            with InProcessClient(model, max_batch_size=64, dynamic_batching=False) as ref:
                for mode in MODES:
                    todo = [i for i in missing if mode_of(i) == mode]
                    answers = ref.infer_batch([body(i) for i in todo], mode) if todo else []
                    for i, answer in zip(todo, answers, strict=True):
                        _EXPECTED[id(model), i, mode] = answer
        return [_EXPECTED[id(model), i, mode_of(i)] for i in indices]


def same_output(got: str, want: str, tol: float = 1e-4) -> bool:
    """Same model output (``output`` and ``embedding``), whatever the echoed tile fields."""
    a, b = json.loads(got), json.loads(want)
    for key in ("output", "embedding"):
        if (a.get(key) is None) != (b.get(key) is None):
            return False
        if a.get(key) is not None and not np.allclose(a[key], b[key], atol=tol, rtol=0):
            return False
    return True


async def call(client: InProcessClient, i: int, text: str | None = None) -> str:
    """Request ``i`` (or ``text``, in ``mode_of(i)``) through the public async method."""
    method: Callable[[str], Awaitable[str]] = getattr(client, f"{mode_of(i)}_async")
    return await method(body(i) if text is None else text)


# -- a model whose forward passes a test can watch or sabotage ---------------------------------


class ForwardWatch:
    """Counts `forward_batch` calls and the most that ever ran at once: one pass at a time per
    device (SPEC §5). A sharded pass calls it once per part, on several threads at once:
    :func:`hooked_model` watches an unsharded copy unless asked."""

    def __init__(self) -> None:
        self.calls = 0
        self.sizes: list[int] = []
        self.max_concurrent = 0
        self._running = 0
        self._lock = threading.Lock()

    @contextmanager
    def running(self, size: int) -> Iterator[None]:
        with self._lock:
            self.calls += 1
            self.sizes.append(size)
            self._running += 1
            self.max_concurrent = max(self.max_concurrent, self._running)
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1


def hooked_model(
    model: ServerModel,
    before: Callable[[torch.Tensor], None] = lambda batch: None,
    *,
    sharded: bool = False,
) -> tuple[ServerModel, ForwardWatch]:
    """A shallow copy of ``model`` whose ``forward_batch`` is watched and calls ``before(batch)``
    first. The shared session model is never touched: only the copy gets the wrapper.

    Unless ``sharded``, the copy's CPU passes are never sharded (models/shards.py), so that
    each ``forward_batch`` call is a whole pass: the batch the scheduler formed, on the device's
    thread. (A client of an unshardable model also decodes on fewer threads by default: those
    torch's threads leave, ``prepare_threads``.)
    """
    wrapped = copy.copy(model)
    if not sharded:
        wrapped.shard_cpu_passes = False  # type: ignore[misc]
    original = model.forward_batch
    watch = ForwardWatch()

    def forward_batch(batch: torch.Tensor, mode: Mode) -> Any:
        with watch.running(int(batch.shape[0])):
            before(batch)
            return original(batch, mode)

    wrapped.forward_batch = forward_batch  # type: ignore[method-assign]
    return wrapped, watch


def gated_model(model: ServerModel) -> tuple[ServerModel, ForwardWatch, threading.Event]:
    """A copy of ``model`` whose forward passes wait until the returned gate is set."""
    gate = threading.Event()

    def wait_for_gate(batch: torch.Tensor) -> None:
        if not gate.wait(20):
            raise TimeoutError("the test never opened the gate")

    wrapped, watch = hooked_model(model, wait_for_gate)
    return wrapped, watch, gate


def start_calls(
    tg: anyio.abc.TaskGroup,
    client: InProcessClient,
    indices: Sequence[int],
    results: dict[int, Any],
) -> None:
    """Start request ``i`` (``call``) for each index; each result or exception lands in
    ``results[i]``."""
    for i in indices:
        spawn_submit(tg, partial(call, client), i, results)


# -- plain threads -----------------------------------------------------------------------------


def start_threads(
    targets: Sequence[Callable[[], None]],
) -> tuple[list[threading.Thread], list[Any]]:
    """Start one daemon thread per target; exceptions they raise are collected in the list."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    return threads, errors


def join_threads(threads: Sequence[threading.Thread], timeout: float = 60.0) -> None:
    """Join them all within ``timeout`` seconds in total; a thread still running is a hang."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread hung"


def watch_decoding(monkeypatch: Any) -> tuple[list[str], Callable[..., Any]]:
    """Record the name of every thread on which the client decodes a body
    (``clients.inprocess._prepare``, or ``_prepare_lone`` on the device's thread, recorded as
    ``"<thread>:handed-back"`` when it hands the body back undecoded); returns the list and the
    real ``_prepare``."""
    from histoinfer.clients import inprocess

    names: list[str] = []
    real, real_lone = inprocess._prepare, inprocess._prepare_lone

    def watched(*args: Any, **kwargs: Any) -> Any:
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    def watched_lone(*args: Any, **kwargs: Any) -> Any:
        result = real_lone(*args, **kwargs)
        handed_back = isinstance(result, inprocess._TooBigHere)
        names.append(threading.current_thread().name + (":handed-back" if handed_back else ""))
        return result

    monkeypatch.setattr(inprocess, "_prepare", watched)
    monkeypatch.setattr(inprocess, "_prepare_lone", watched_lone)
    return names, real


async def all_at_once(client: InProcessClient, bodies: list[str]) -> dict[int, str | Exception]:
    """``predict_async`` of every body concurrently: each one's response or error, by index."""
    outcomes: dict[int, str | Exception] = {}

    async def call(i: int) -> None:
        try:
            outcomes[i] = await client.predict_async(bodies[i])
        except Exception as exc:
            outcomes[i] = exc

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(len(bodies)):
                tg.start_soon(call, i)
    return outcomes
