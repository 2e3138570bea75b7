"""The paths a tile can take, each measured the same way over the same bodies.

Every path answers ``measure(bodies, concurrency) -> Sample``. ``concurrency`` is how many tiles
the caller has in flight (or in hand, for the paths that take batches): the explicit loop and the
raw forward take chunks of ``min(concurrency, max_batch_size)``, the others keep ``concurrency``
requests outstanding.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import anyio
import anyio.from_thread
import torch

from ..clients.inprocess import InProcessClient
from ..cpus import usable_cpus
from ..extras import install_hint
from ..models import shards
from ..models.base import ServerModel, stack_tiles
from ..models.device_thread import device_thread
from ..schema import Mode
from .loopback import ServerProcess, http_unavailable
from .measure import (
    Expected,
    Sample,
    check_responses,
    closed_loop_latencies,
    drive_async,
    drive_threads,
)
from .own import REFERENCE_BUILD, ModelBuild
from .peers import AsyncBatcherPeer, Pipeline, QueueBatcherPeer, forward_thread

__all__ = ["PATHS", "BenchContext", "BenchPath", "make_paths"]


@dataclass
class BenchContext:
    """What every path of one model shares."""

    model_size: str
    #: the model, loaded in this process; ``None`` where the path's model runs elsewhere (HTTP)
    model: ServerModel | None
    checkpoint: Path
    max_batch_size: int
    max_wait_ms: float
    #: body index -> prepared uint8 tile, for the raw path (filled by the runner).
    tiles: list[torch.Tensor]
    #: by mode and body index, what some bodies' responses must hold (``OpenPath.reference``)
    expected: dict[str, dict[int, Expected]] = field(default_factory=dict)
    #: how the model is built: its key, the modules that register it, its model.json's folder
    build: ModelBuild = REFERENCE_BUILD

    @property
    def server_model(self) -> ServerModel:
        if self.model is None:
            raise RuntimeError("this path's process has no model loaded (its needs_model is False)")
        return self.model


class BenchPath(ABC):
    """One way to get tiles through the model."""

    name: ClassVar[str]
    label: ClassVar[str]
    #: whether it reads ``ctx.tiles`` (decoding every body up front is wasted on the others)
    needs_tiles: ClassVar[bool] = False
    #: whether it runs the model in this process (loading one costs a process ~6 s of CPU)
    needs_model: ClassVar[bool] = True

    def __init__(self, ctx: BenchContext) -> None:
        self.ctx = ctx
        #: anything a reader of the results must know about how this path ran
        self.note: str | None = None
        #: the native id of the thread whose CPU counts as "main" (its event loop), if not the
        #: process's main thread
        self.loop_thread: int | None = None

    def unavailable(self) -> str | None:
        """Why this path cannot run here, or ``None``."""
        return None

    def open(self) -> None:  # noqa: B027 - most paths need nothing
        """Acquire what the path needs (clients, servers)."""

    def close(self) -> None:  # noqa: B027
        """Release it."""

    def external_cpu_s(self) -> float | None:
        """CPU seconds used so far by processes of this path other than ours (a server);
        ``None`` where they cannot be read."""
        return 0.0

    def get_ready(self, bodies: Sequence[str], concurrency: int, mode: Mode) -> None:  # noqa: B027
        """Before a measurement, outside its clocks (wall and CPU): what a long-running user
        would have done already (the HTTP path opens its connections)."""

    def finish(self, sample: Sample) -> Sample:
        """After a measurement, outside its clocks: ``sample`` with what the path reads only
        afterwards (the HTTP path: the server's batch counters)."""
        return sample

    @property
    def external(self) -> bool:
        """Whether part of it runs in another process (it overrides ``external_cpu_s``)."""
        return type(self).external_cpu_s is not BenchPath.external_cpu_s

    @abstractmethod
    def measure(self, bodies: Sequence[str], concurrency: int, mode: Mode) -> Sample: ...


def _chunks(n: int, size: int) -> list[range]:
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


class RawForward(BenchPath):
    """The forward pass over pre-decoded, pre-stacked tiles (as issue 5 defines the limit):
    no request handling.

    Run as the clients run it: ``models.shards.forward`` (a CPU batch of 2+ tiles is sharded)
    of the batch's rows, which ``ServerModel.forward_tiles`` normalizes straight into the
    float batch. A stacked batch would take ``forward_batch``'s three passes over memory
    instead: a batch of 64 of the tiny model 1.52-1.55 ms a tile against 1.43-1.49 (session
    15), so the limit ran below the clients' own passes."""

    name = "raw"
    label = "raw forward (pre-stacked tensors)"
    needs_tiles = True

    def measure(self, bodies: Sequence[str], concurrency: int, mode: Mode) -> Sample:
        model = self.ctx.server_model
        chunks = _chunks(len(bodies), min(concurrency, self.ctx.max_batch_size))
        tiles = self.ctx.tiles
        done: list[float] = []
        clock = time.perf_counter
        started = 0.0

        def run() -> float:
            nonlocal started
            # Stacked here, before the clock: a torch op on any other thread (this process's
            # main thread) would leave a second OpenMP team in the process, and every small
            # pass would run in the slow regime (models/device_thread.py): ~3x for one tile.
            # In the tiles' own layout (channels-last rows, where the model's batches are).
            stacks = [stack_tiles([tiles[i] for i in r], keep_layout=True) for r in chunks]
            batches = [list(stack) for stack in stacks]  # its rows: views, no copy
            started = clock()
            for batch in batches:
                shards.forward(model, batch, mode)
                done.extend([clock()] * len(batch))
            return clock() - started

        # On the device's thread, where the clients run every forward pass: the same OpenMP
        # team, so the limit is measured in the regime the clients get (models/device_thread).
        wall = device_thread(model.device).call(run)
        latencies = closed_loop_latencies(started, done, concurrency)
        # Busy for its whole wall time by definition (the report says so): nothing but passes.
        return Sample(len(bodies), wall, latencies, len(chunks), len(bodies), wall)


class _ClientPath(BenchPath):
    dynamic: ClassVar[bool] = True

    def client_options(self) -> dict[str, Any]:
        """Tuning beyond the shared settings, for paths that measure an option."""
        return {}

    def open(self) -> None:
        self.client = InProcessClient(
            self.ctx.server_model,
            max_batch_size=self.ctx.max_batch_size,
            max_wait_ms=self.ctx.max_wait_ms,
            dynamic_batching=self.dynamic,
            **self.client_options(),
        )

    def close(self) -> None:
        self.client.close()

    def _with_stats(
        self, mode: Mode, run: Callable[[], tuple[float, list[float], list[str | None]]]
    ) -> Sample:
        before = self.client.stats()[mode]
        wall, latencies, responses = run()
        after = self.client.stats()[mode]
        check_responses(responses, self.name, self.ctx.expected.get(mode))
        return Sample(
            len(responses),
            wall,
            latencies,
            after.batches - before.batches,
            after.samples - before.samples,
            after.forward_busy_s - before.forward_busy_s,
        )


class ExplicitLoop(_ClientPath):
    """``predict_batch`` called in a loop over chunks, as a user batching by hand does."""

    name = "explicit"
    label = "explicit predict_batch loop"
    dynamic = False

    def measure(self, bodies: Sequence[str], concurrency: int, mode: Mode) -> Sample:
        chunk = min(concurrency, self.ctx.max_batch_size)
        call = getattr(self.client, f"{mode}_batch")  # predict_batch, embed_batch, ...

        def run() -> tuple[float, list[float], list[str | None]]:
            responses: list[str | None] = []
            done: list[float] = []
            clock = time.perf_counter
            started = clock()
            for r in _chunks(len(bodies), chunk):
                responses.extend(call([bodies[i] for i in r]))
                done.extend([clock()] * len(r))
            wall = clock() - started
            return wall, closed_loop_latencies(started, done, concurrency), responses

        return self._with_stats(mode, run)


class ExplicitParallelDecode(ExplicitLoop):
    """The same loop with ``batch_decode_threads`` = the CPU count: a batch's bodies are decoded
    in parallel before its forward pass (an option, off by default)."""

    name = "explicit-parallel"
    label = "explicit predict_batch loop, batch_decode_threads = CPU count"

    def client_options(self) -> dict[str, Any]:
        return {"batch_decode_threads": usable_cpus()}


class DynamicAsync(_ClientPath):
    """Concurrent ``predict_async`` calls, dynamically batched, on one anyio backend."""

    backend: ClassVar[str] = "asyncio"

    def measure(self, bodies: Sequence[str], concurrency: int, mode: Mode) -> Sample:
        call = getattr(self.client, f"{mode}_async")  # predict_async, embed_async, ...
        return self._with_stats(
            mode, lambda: anyio.run(drive_async, call, bodies, concurrency, backend=self.backend)
        )


class DynamicAsyncio(DynamicAsync):
    name = "dynamic-asyncio"
    label = "dynamic batching, asyncio"


class DynamicAsyncioTwin(DynamicAsyncio):
    """``dynamic-asyncio`` again, in a process of its own: how far two identical processes
    measured in the same rounds differ (the run's noise floor: how much a round's ratio moves
    by chance alone; a target's verdict is read from its own rounds, runner.Check)."""

    name = "dynamic-asyncio-twin"
    label = "dynamic batching, asyncio: an identical second process (the noise floor)"


class DynamicTrio(DynamicAsync):
    name = "dynamic-trio"
    label = "dynamic batching, trio"
    backend = "trio"


class BatchSizeOne(DynamicAsync):
    """``dynamic_batching=False``: every async call is its own forward pass."""

    name = "bs1-asyncio"
    label = "async, batch size 1 (dynamic_batching=False), asyncio"
    dynamic = False


class BatchSizeOneTrio(BatchSizeOne):
    name = "bs1-trio"
    label = "async, batch size 1 (dynamic_batching=False), trio"
    backend = "trio"


class SyncThreads(_ClientPath):
    """Blocking ``predict`` from ``concurrency`` threads (batched together in the portal)."""

    name = "sync-threads"
    label = "sync predict from N threads"

    def measure(self, bodies: Sequence[str], concurrency: int, mode: Mode) -> Sample:
        call = getattr(self.client, mode)  # predict, embed, predict_with_embedding
        return self._with_stats(mode, lambda: drive_threads(call, bodies, concurrency))


class _PeerPath(BenchPath):
    """An external batcher running our pipeline, created fresh in each measurement's loop; its
    forward passes run on our device's thread (bench/peers.py says why)."""

    def open(self) -> None:
        self.forward_thread = forward_thread(self.ctx.server_model)

    @abstractmethod
    def make_peer(self, pipeline: Pipeline) -> AsyncBatcherPeer | QueueBatcherPeer: ...

    def measure(self, bodies: Sequence[str], concurrency: int, mode: Mode) -> Sample:
        pipeline = Pipeline(self.ctx.server_model, mode)

        async def run() -> tuple[float, list[float], list[str | None]]:
            peer = self.make_peer(pipeline)
            try:
                return await drive_async(peer.predict, bodies, concurrency)
            finally:
                await peer.aclose()

        wall, latencies, responses = anyio.run(run, backend="asyncio")
        batches, samples, forward_s = pipeline.counters()
        check_responses(responses, self.name, self.ctx.expected.get(mode))
        return Sample(len(bodies), wall, latencies, batches, samples, forward_s)


class AsyncBatcherPath(_PeerPath):
    name = "async-batcher"
    label = "peer: async-batcher, same pipeline"

    def unavailable(self) -> str | None:
        try:
            import async_batcher  # noqa: F401
        except ImportError:
            return f"async-batcher is not installed (the 'bench' extra: {install_hint('bench')})"
        return None

    def make_peer(self, pipeline: Pipeline) -> AsyncBatcherPeer:
        return AsyncBatcherPeer(
            pipeline, self.ctx.max_batch_size, self.ctx.max_wait_ms, self.forward_thread
        )


class QueueBatcherPath(_PeerPath):
    name = "asyncio-queue"
    label = "peer: plain asyncio.Queue batcher, same pipeline"

    def make_peer(self, pipeline: Pipeline) -> QueueBatcherPeer:
        return QueueBatcherPeer(
            pipeline, self.ctx.max_batch_size, self.ctx.max_wait_ms, self.forward_thread
        )


class HttpLoopback(BenchPath):
    """``HttpClient.predict_async`` against ``histoinfer serve`` on 127.0.0.1 (same machine)."""

    name = "http"
    label = "HTTP loopback (histoinfer serve + HttpClient)"
    needs_model = False  # the server loads it; the client only sends bodies

    def unavailable(self) -> str | None:
        return http_unavailable()

    def open(self) -> None:
        self.server = ServerProcess.for_checkpoint(
            self.ctx.checkpoint,
            max_batch_size=self.ctx.max_batch_size,
            max_wait_ms=self.ctx.max_wait_ms,
            build=self.ctx.build,
        )
        self.note = f"client: histoinfer.HttpClient; server: {' '.join(self.server.command[1:])}"
        self._counters: dict[str, float] = {}  # the server's, before a measurement
        # One client on one event loop for the path's life, as a service keeps one (a client
        # per measurement, on a loop of its own, timed opening its connections every time).
        self._portal_context = anyio.from_thread.start_blocking_portal("asyncio")
        try:
            self._portal = self._portal_context.__enter__()
            self._client = _http_client(self.server.base_url, self.ctx.build.key)
            # The client's event loop is the path's "main" thread (bench/measure.py, cpu_split).
            self.loop_thread = self._portal.call(threading.get_native_id)
        except BaseException:
            self._portal_context.__exit__(None, None, None)
            self.server.close()
            raise

    def close(self) -> None:
        try:
            self._portal.call(self._client.aclose)
        finally:
            self._portal_context.__exit__(None, None, None)
            self.server.close()

    def external_cpu_s(self) -> float | None:
        return self.server.cpu_s()

    def get_ready(self, bodies: Sequence[str], concurrency: int, mode: Mode) -> None:
        # As many connections open as the measurement will use, as a busy service's client
        # has: before every measurement, since an idle connection is closed after 5 s (httpx's
        # keep-alive expiry and the server's), and the other paths' turns take longer.
        wanted = min(concurrency, len(bodies))
        call = getattr(self._client, f"{mode}_async")
        self._portal.call(drive_async, call, bodies[:wanted], wanted)
        # The server's counters, read outside the CPU clocks: a read costs ~60 ms of this
        # process's CPU (a new httpx client each time), which was ~all of the HTTP path's
        # "other" CPU at 32 tiles (session 21's review).
        self._counters = self.server.metrics()

    def measure(self, bodies: Sequence[str], concurrency: int, mode: Mode) -> Sample:
        call = getattr(self._client, f"{mode}_async")
        wall, latencies, responses = self._portal.call(drive_async, call, bodies, concurrency)
        check_responses(responses, self.name, self.ctx.expected.get(mode))
        return Sample(len(bodies), wall, latencies)

    def finish(self, sample: Sample) -> Sample:
        before, after = self._counters, self.server.metrics()

        def delta(key: str) -> float | None:
            if key not in before or key not in after:
                return None
            return after[key] - before[key]

        batches, samples = delta("batches"), delta("samples")
        return replace(
            sample,
            batches=None if batches is None else round(batches),
            samples=None if samples is None else round(samples),
            forward_busy_s=delta("forward_s"),
        )


def _http_client(base_url: str, model: str) -> Any:
    """``HttpClient`` as shipped (its default pool of 256 connections): what users measure."""
    from ..clients.http import HttpClient

    return HttpClient(base_url, model)


PATHS: dict[str, type[BenchPath]] = {
    cls.name: cls
    for cls in (
        RawForward,
        ExplicitLoop,
        ExplicitParallelDecode,
        DynamicAsyncio,
        DynamicAsyncioTwin,
        DynamicTrio,
        BatchSizeOne,
        BatchSizeOneTrio,
        SyncThreads,
        HttpLoopback,
        AsyncBatcherPath,
        QueueBatcherPath,
    )
}


def make_paths(names: Sequence[str], ctx: BenchContext) -> list[BenchPath]:
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        raise ValueError(f"unknown paths: {', '.join(unknown)} (choose from {', '.join(PATHS)})")
    return [PATHS[n](ctx) for n in names]
