"""Randomized stress, with cancellations: nothing lost, nothing duplicated, nothing crossed.

The scheduler alone is driven by hypothesis (random settings, arrivals, cancellations, deadlines,
reservations, poisoned items); the client by a seeded random mix of modes, tiles, arrival times,
cancellations and sync-from-worker-thread calls.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import pytest
from concurrency_helpers import body, expected, mode_of, same_output, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from histoinfer.batching import BatchScheduler
from histoinfer.clients.inprocess import InProcessClient
from histoinfer.errors import DeadlineExceededError, OverloadedError
from histoinfer.models import ServerModel

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class _Op:
    delay_ms: float  # when the caller arrives
    cancel_ms: float | None  # when it gives up, if it does
    reserve: bool  # announce first, "prepare", then submit
    timeout_ms: float | None  # dispatch deadline
    wait: bool  # wait for room, or take OverloadedError


_ops = st.builds(
    _Op,
    delay_ms=st.floats(0, 10),
    cancel_ms=st.none() | st.floats(0, 25),
    reserve=st.booleans(),
    timeout_ms=st.none() | st.floats(1, 25),
    wait=st.booleans(),
)


class _RecordingFn:
    """``x -> 10 * x`` with a little work; items divisible by 11 poison their batch."""

    def __init__(self, seed: int) -> None:
        self.successful: list[int] = []
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    def __call__(self, items: list[int]) -> list[int]:
        time.sleep(self._rng.uniform(0.001, 0.006))  # slow enough for queues to build
        if any(item % 11 == 0 for item in items):
            raise ValueError("poisoned")
        with self._lock:
            self.successful.extend(items)
        return [10 * item for item in items]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(_ops, min_size=1, max_size=40),
    max_batch_size=st.integers(1, 8),
    max_wait_ms=st.floats(0, 20),
    max_queue=st.none() | st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
@pytest.mark.timeout(120)
async def test_random_scheduler_traffic_keeps_every_promise(
    ops: list[_Op], max_batch_size: int, max_wait_ms: float, max_queue: int | None, seed: int
) -> None:
    fn = _RecordingFn(seed)
    sched = BatchScheduler(fn, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                           max_queue=max_queue)  # fmt: skip
    outcomes: dict[int, Any] = {}

    async def caller(item: int, op: _Op) -> None:
        await anyio.sleep(op.delay_ms / 1000)
        timeout = None if op.timeout_ms is None else op.timeout_ms / 1000
        with anyio.CancelScope() as scope:
            if op.cancel_ms is not None:
                scope.deadline = anyio.current_time() + op.cancel_ms / 1000
            try:
                if op.reserve:
                    async with sched.reserve(wait=op.wait) as slot:
                        await anyio.sleep(0.001)  # preparing
                        outcomes[item] = await slot.submit(item, timeout=timeout)
                else:
                    outcomes[item] = await sched.submit(item, timeout=timeout, wait=op.wait)
            except (ValueError, DeadlineExceededError, OverloadedError) as exc:
                outcomes[item] = exc
        if scope.cancelled_caught:
            outcomes[item] = "cancelled"

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for item, op in enumerate(ops, start=1):
                tg.start_soon(caller, item, op)
        await wait_until(lambda: sched.stats.snapshot().queue_depth == 0)
    assert sorted(outcomes) == list(range(1, len(ops) + 1))  # everyone heard back
    for item, outcome in outcomes.items():
        if isinstance(outcome, int):
            assert outcome == 10 * item  # its own result, never another's
        elif isinstance(outcome, ValueError):
            assert item % 11 == 0  # only poisoned items fail
        elif isinstance(outcome, OverloadedError) and not isinstance(
            outcome, DeadlineExceededError
        ):
            assert not ops[item - 1].wait and max_queue is not None
        elif isinstance(outcome, DeadlineExceededError):
            assert ops[item - 1].timeout_ms is not None
            assert item not in fn.successful  # a request that timed out was never run
        else:
            assert outcome == "cancelled"
    assert len(fn.successful) == len(set(fn.successful))  # nothing ran twice
    assert {i for i, o in outcomes.items() if isinstance(o, int)} <= set(fn.successful)
    assert sched.queue_depth == 0 and sched._incoming == 0
    if max_queue is not None:  # every admission was given back
        for _ in range(max_queue):
            sched._admission._room.acquire_nowait()  # type: ignore[union-attr]


def _tile_request(tile: int, request: int) -> str:
    """Tile ``tile``'s pixels, with ``request``'s own echoed fields."""
    data = json.loads(body(tile))
    data.update(patch_idx=request, x=7 * request, y=3 * request + 1, slide_name=f"s{request % 5}")
    return json.dumps(data)


@pytest.mark.timeout(120)
async def test_random_client_traffic_loses_duplicates_and_crosses_nothing(
    client: InProcessClient, tiny_model: ServerModel, anyio_backend: str
) -> None:
    rng = random.Random(2024 if anyio_backend == "asyncio" else 4202)
    tiles = list(range(24))
    want = dict(zip(tiles, expected(tiny_model, tiles), strict=True))
    plan = []
    for request in range(160):
        tile = rng.choice(tiles)
        plan.append(
            (
                request,
                tile,
                rng.uniform(0, 0.3),  # arrival
                rng.uniform(0, 0.4) if rng.random() < 0.35 else None,  # cancel after
                mode_of(tile) == "predict" and rng.random() < 0.25,  # sync, from a worker thread
            )
        )
    texts = {request: _tile_request(tile, request) for request, tile, *_ in plan}
    answers: dict[int, list[str]] = {request: [] for request, *_ in plan}
    cancelled: set[int] = set()

    async def one(request: int, tile: int, arrive: float, cancel: float | None, sync: bool) -> None:
        await anyio.sleep(arrive)
        with anyio.CancelScope() as scope:
            if cancel is not None:
                scope.deadline = anyio.current_time() + cancel
            if sync:
                answer = await anyio.to_thread.run_sync(client.predict, texts[request])
            else:
                method = getattr(client, f"{mode_of(tile)}_async")
                answer = await method(texts[request])
            answers[request].append(answer)
        if scope.cancelled_caught:
            cancelled.add(request)

    with anyio.fail_after(100):
        async with anyio.create_task_group() as tg:
            for step in plan:
                tg.start_soon(one, *step)
        await wait_until(
            lambda: (
                client._calls.active == 0
                and all(s.queue_depth == 0 for s in client.stats().values())
            )
        )
    for request, tile, *_ in plan:
        got = answers[request]
        if request in cancelled:
            assert got == []  # a cancelled call returns nothing
            continue
        assert len(got) == 1  # not lost, not duplicated
        response = json.loads(got[0])
        sent = json.loads(texts[request])
        for key in ("patch_idx", "x", "y", "slide_name"):
            assert response[key] == sent[key]  # its own request, not a neighbour's
        assert same_output(got[0], want[tile])
    assert 0 < len(cancelled) < len(plan)
    assert client._portal is None  # the worker-thread sync calls used this loop
