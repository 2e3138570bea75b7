"""External peers: the same pipeline behind batchers we did not write.

Each peer runs exactly our per-request work (parse + validate + decode in a thread, one batched
forward pass, postprocess + JSON on the loop) so that the batching machinery is what differs:

* :class:`AsyncBatcherPeer`: the ``async-batcher`` package (``AsyncBatcher.process``), with a
  synchronous ``process_batch`` that it runs in the executor it is given (its ``executor=``).
* :class:`QueueBatcher`: a plain ``asyncio.Queue`` batcher, written the way a user writes one
  after reading the asyncio docs: a background task that takes the first item, waits up to
  ``max_wait`` for more with ``asyncio.wait_for(queue.get(), ...)``, and runs the batch in an
  executor. Preparation goes through ``asyncio.to_thread``, as a user would do it.

Both are given what our clients have, so that the comparison is of the batchers: their forward
passes run on the thread that runs ours (the device's thread, models/device_thread.py, behind an
``Executor``: :func:`forward_thread`), not in the loop's default executor, and as ours run
(``models.shards.forward``: a CPU batch of 2+ tiles is sharded). In the default executor a pass
waits behind every decode already queued there, so decoding and passes never overlap; and any thread
other than the device's leaves a second OpenMP team in the process (the model's load-time probe
ran on the device's), which puts every small pass in the slow regime (~3x for one tile). What
they do not get is ``CoreShare`` (clients/cores.py), our clients' rule for running a loaded
pass that is not sharded (one tile, where passes are sharded) on one thread fewer while requests
are being decoded: that is scheduling, ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

import torch

from ..models import shards
from ..models.base import SampleOutput, ServerModel
from ..models.device_thread import DeviceThread, device_thread
from ..schema import Mode, ModelRequest, parse_request

__all__ = ["AsyncBatcherPeer", "Pipeline", "QueueBatcher", "forward_thread"]

T = TypeVar("T")


class _DeviceExecutor(Executor):
    """An ``Executor`` whose work runs on a device's thread, one call at a time."""

    def __init__(self, thread: DeviceThread) -> None:
        self._thread = thread

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self._thread.submit(functools.partial(fn, *args, **kwargs))


def forward_thread(model: ServerModel) -> Executor:
    """Where a peer runs its forward passes: the thread that runs our clients' (see above)."""
    return _DeviceExecutor(device_thread(model.device))


class Pipeline:
    """Our per-request work, as plain functions a peer batcher can call; counts forward time."""

    def __init__(self, model: ServerModel, mode: Mode = "predict") -> None:
        self.model = model
        self.mode = mode
        self._lock = threading.Lock()
        self.batches = 0
        self.samples = 0
        self.forward_busy_s = 0.0

    def prepare(self, body: str) -> tuple[ModelRequest, torch.Tensor]:
        request = parse_request(body)
        where = f"for {request.where()}"
        self.model.check_request(request, self.mode, where)
        return request, self.model.prepared_tile(request, where)

    def forward(self, tiles: Sequence[torch.Tensor]) -> list[SampleOutput]:
        # Timed on the thread that runs the pass, as the scheduler times ours (its _call).
        started = time.perf_counter()
        # What our clients call for a batch (a list: no stacked copy on a CPU; sharded).
        outputs = shards.forward(self.model, list(tiles), self.mode).split()
        elapsed = time.perf_counter() - started
        with self._lock:
            self.batches += 1
            self.samples += len(tiles)
            self.forward_busy_s += elapsed
        return outputs

    def finish(self, request: ModelRequest, output: SampleOutput) -> str:
        return self.model.response_json(request, output, self.mode)

    def counters(self) -> tuple[int, int, float]:
        with self._lock:
            return self.batches, self.samples, self.forward_busy_s


def _async_batcher_class() -> type[Any]:
    from async_batcher.batcher import AsyncBatcher

    class _ForwardBatcher(AsyncBatcher):  # type: ignore[misc]
        def __init__(self, fn: Callable[[list[Any]], list[Any]], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._fn = fn

        def process_batch(self, batch: list[Any]) -> list[Any]:  # sync: run in the executor
            return self._fn(batch)

    return _ForwardBatcher


class AsyncBatcherPeer:
    """``async-batcher`` around :meth:`Pipeline.forward`. Create and use it inside one loop."""

    def __init__(
        self, pipeline: Pipeline, max_batch_size: int, max_wait_ms: float, executor: Executor
    ) -> None:
        self.pipeline = pipeline
        self._batcher = _async_batcher_class()(
            pipeline.forward,
            max_batch_size=max(max_batch_size, 2),  # it refuses 1
            max_queue_time=max_wait_ms / 1000.0,
            concurrency=1,
            executor=executor,
        )

    async def predict(self, body: str) -> str:
        request, tile = await asyncio.to_thread(self.pipeline.prepare, body)
        output: SampleOutput = await self._batcher.process(tile)
        return self.pipeline.finish(request, output)

    async def aclose(self) -> None:
        # Its run loop polls for stop once a second; force-stopping an idle batcher is immediate.
        await self._batcher.stop(force=True)


class QueueBatcher:
    """A plain ``asyncio.Queue`` batcher, as a user writes one. Use it inside one loop."""

    def __init__(
        self,
        fn: Callable[[list[Any]], Sequence[Any]],
        max_batch_size: int,
        max_wait_ms: float,
        executor: Executor | None = None,
    ) -> None:
        self.fn = fn
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.queue: asyncio.Queue[tuple[Any, asyncio.Future[Any]]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self.task is None:
            self.task = loop.create_task(self._run())
        future: asyncio.Future[Any] = loop.create_future()
        await self.queue.put((item, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            while len(batch) < self.max_batch_size:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), timeout))
                except TimeoutError:
                    break
            items = [item for item, _ in batch]
            try:
                results = await loop.run_in_executor(self.executor, self.fn, items)
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None


class QueueBatcherPeer:
    """:class:`QueueBatcher` around :meth:`Pipeline.forward`."""

    def __init__(
        self, pipeline: Pipeline, max_batch_size: int, max_wait_ms: float, executor: Executor
    ) -> None:
        self.pipeline = pipeline
        self._batcher = QueueBatcher(pipeline.forward, max_batch_size, max_wait_ms, executor)

    async def predict(self, body: str) -> str:
        request, tile = await asyncio.to_thread(self.pipeline.prepare, body)
        output: SampleOutput = await self._batcher.submit(tile)
        return self.pipeline.finish(request, output)

    async def aclose(self) -> None:
        await self._batcher.aclose()
