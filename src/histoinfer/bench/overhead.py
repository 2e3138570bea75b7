"""Batching machinery alone: ``BatchScheduler`` vs ``async-batcher`` with a no-op batch function.

Users who measure batch throughput measure this first: how many requests a second the batcher
itself sustains when the batch function costs nothing. Both batchers run the no-op in a worker
thread (ours through ``anyio.to_thread``, async-batcher through the loop's default executor,
because its ``process_batch`` is synchronous), with the same batch size and window and the same
number of requests in flight.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from ..batching import BatchScheduler
from .measure import Sample, drive_async

__all__ = ["OVERHEAD_VARIANTS", "OverheadConfig", "measure_overhead"]


@dataclass(frozen=True)
class OverheadConfig:
    requests: int = 20_000
    concurrency: int = 256
    max_batch_size: int = 64
    max_wait_ms: float = 5.0


def _noop(items: list[str]) -> list[str]:
    return items


async def _scheduler(cfg: OverheadConfig, items: Sequence[str]) -> Sample:
    scheduler: BatchScheduler[str, str] = BatchScheduler(
        _noop, max_batch_size=cfg.max_batch_size, max_wait_ms=cfg.max_wait_ms
    )
    try:
        wall, latencies, _ = await drive_async(scheduler.submit, items, cfg.concurrency)
    finally:
        await scheduler.aclose()
    snap = scheduler.stats.snapshot()
    return Sample(len(items), wall, latencies, snap.batches, snap.samples, snap.forward_busy_s)


async def _async_batcher(cfg: OverheadConfig, items: Sequence[str], *, sync: bool) -> Sample:
    from async_batcher.batcher import AsyncBatcher

    counts = [0, 0]

    class NoopSync(AsyncBatcher):  # type: ignore[misc]
        def process_batch(self, batch: list[Any]) -> list[Any]:
            counts[0] += 1
            counts[1] += len(batch)
            return batch

    class NoopAsync(AsyncBatcher):  # type: ignore[misc]
        async def process_batch(self, batch: list[Any]) -> list[Any]:
            counts[0] += 1
            counts[1] += len(batch)
            return batch

    batcher = (NoopSync if sync else NoopAsync)(
        max_batch_size=cfg.max_batch_size, max_queue_time=cfg.max_wait_ms / 1000.0
    )
    try:
        wall, latencies, _ = await drive_async(batcher.process, items, cfg.concurrency)
    finally:
        await batcher.stop(force=True)
    return Sample(len(items), wall, latencies, counts[0], counts[1])


Variant = tuple[str, str, Callable[[OverheadConfig, Sequence[str]], Awaitable[Sample]]]

#: name -> (anyio backend, description, coroutine function)
OVERHEAD_VARIANTS: dict[str, Variant] = {
    "scheduler-asyncio": ("asyncio", "BatchScheduler, asyncio", _scheduler),
    "scheduler-trio": ("trio", "BatchScheduler, trio", _scheduler),
    "async-batcher": (
        "asyncio",
        "async-batcher, sync process_batch (executor)",
        lambda cfg, items: _async_batcher(cfg, items, sync=True),
    ),
    "async-batcher-async": (
        "asyncio",
        "async-batcher, async process_batch (on the loop)",
        lambda cfg, items: _async_batcher(cfg, items, sync=False),
    ),
}


def measure_overhead(name: str, cfg: OverheadConfig) -> Sample:
    backend, _, fn = OVERHEAD_VARIANTS[name]
    items = ["x"] * cfg.requests

    async def run() -> Sample:
        return await fn(cfg, items)

    return anyio.run(run, backend=backend)
