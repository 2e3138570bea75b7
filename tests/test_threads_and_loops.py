"""One client, many threads and event loops: correctness, one forward pass at a time, no leaks."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable
from functools import partial

import anyio
import pytest
from concurrency_helpers import call, expected, hooked_model, join_threads, start_threads
from helpers import outputs_close

from histoinfer.batching import BatchScheduler
from histoinfer.clients.inprocess import InProcessClient
from histoinfer.models import ServerModel


def _settle(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Wait (in plain time) for background threads to wind down."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _schedulers_alive() -> int:
    gc.collect()
    return sum(type(o) is BatchScheduler for o in gc.get_objects())


@pytest.mark.timeout(120)
def test_six_threads_with_their_own_loops_share_one_client(tiny_model: ServerModel) -> None:
    model, watch = hooked_model(tiny_model)
    backends = ["asyncio", "trio"] * 3
    per_thread = 12
    slots = [list(range(t * per_thread, (t + 1) * per_thread)) for t in range(len(backends))]
    want = expected(tiny_model, [i for s in slots for i in s])
    got: dict[int, str] = {}
    all_running = threading.Barrier(len(backends), timeout=30)

    with InProcessClient(model, max_batch_size=8, max_wait_ms=20) as client:

        def slide(indices: list[int], backend: str) -> None:
            async def main() -> None:
                await anyio.to_thread.run_sync(all_running.wait)  # every loop alive at once
                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:
                        for i in indices:
                            tg.start_soon(one, i)

            async def one(i: int) -> None:
                got[i] = await call(client, i)

            anyio.run(main, backend=backend)

        jobs = [partial(slide, s, b) for s, b in zip(slots, backends, strict=True)]
        threads, errors = start_threads(jobs)
        join_threads(threads, 90)
        assert errors == []
        stats = client.stats()
        assert sum(s.samples for s in stats.values()) == len(want)
        assert sum(s.batches for s in stats.values()) < len(want)  # batched within each loop
        assert len(client._loops._values) == 0  # each loop's schedulers went with it
    indices = [i for s in slots for i in s]
    assert [i for i, a in zip(indices, want, strict=True) if not outputs_close(got[i], a)] == []
    assert watch.max_concurrent == 1  # one forward pass at a time on the device, across loops


@pytest.mark.timeout(120)
def test_200_asyncio_run_lifetimes_leak_nothing(client: InProcessClient) -> None:
    answers: list[str] = []

    async def lifetime() -> None:
        answers.append(await call(client, 0))

    asyncio.run(lifetime())  # warm up: the first loop may start long-lived helpers
    assert _settle(lambda: len(client._loops._values) == 0)
    threads_before = threading.active_count()
    schedulers_before = _schedulers_alive()
    for _ in range(200):
        asyncio.run(lifetime())
    assert len(set(answers)) == 1 and len(answers) == 201
    # Each loop's scheduler removed its own entry when the loop ended (no purge needed).
    assert len(client._loops._values) == 0
    assert _settle(lambda: threading.active_count() <= threads_before), [
        t.name for t in threading.enumerate()
    ]
    # An idle worker thread of the last loop holds its last job until it exits: let it go.
    assert _settle(lambda: _schedulers_alive() <= schedulers_before)
    gc.collect()
    closed_loops = [
        o
        for o in gc.get_objects()
        if issubclass(type(o), asyncio.AbstractEventLoop) and o.is_closed()
    ]
    assert len(closed_loops) <= 2  # a closed loop or two may await collection; not 200
    runner_tasks = [
        o
        for o in gc.get_objects()
        if type(o) is asyncio.Task and o.get_name().startswith("histoinfer:")
    ]
    assert runner_tasks == []
    snap = client.stats()["predict"]
    assert snap.samples == 201 and snap.queue_depth == 0


@pytest.mark.timeout(60)
def test_trio_run_lifetimes_leak_no_schedulers(client: InProcessClient) -> None:
    async def lifetime() -> str:
        return await call(client, 1)

    anyio.run(lifetime, backend="trio")
    schedulers_before = _schedulers_alive()
    answers = {anyio.run(lifetime, backend="trio") for _ in range(30)}
    assert len(answers) == 1
    assert len(client._loops._values) == 0
    assert _settle(lambda: _schedulers_alive() <= schedulers_before)
