"""A lone request: one call at a time, nothing else coming, ``max_wait_ms`` = 5.

The scheduler must not hold a lone request for its whole window. Compared, in each round:

* ``raw-forward-1``: ``forward_tiles`` of one pre-decoded tile (the model alone, the pass a
  lone request gets), with the same pause between calls as the callers below: a pass after a
  pause takes ~0.3 ms longer than one straight after another (caches, the CPU's idle states),
  and a lone request always comes after a pause;
* ``raw-forward-1-hot``: the same, calls back to back (the model's best case);
* ``pipeline-1``: ``predict_batch([body])`` on an explicit client (the same request's whole
  work, parse to JSON, with no scheduler and one hop, to the device's thread and back);
* ``dynamic-asyncio`` / ``dynamic-trio``: ``predict_async(body)`` on a dynamic client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from ..clients.inprocess import InProcessClient
from ..models.base import ServerModel
from ..models.device_thread import device_thread

__all__ = ["LoneLatency"]

#: between two calls of a lone caller: the scheduler and the device go idle
PAUSE_S = 0.002


class LoneLatency:
    """Sequential single requests on each variant; ``measure`` gives per-call latencies (s)."""

    def __init__(
        self, model: ServerModel, bodies: Sequence[str], tiles: Sequence[torch.Tensor]
    ) -> None:
        self.model = model
        self.bodies = bodies
        self.tiles = tiles
        self.dynamic = InProcessClient(model, max_wait_ms=5.0)
        self.explicit = InProcessClient(model, max_wait_ms=5.0, dynamic_batching=False)
        #: sent to the parent when the child is ready (bench/isolation.py)
        self.info: dict[str, Any] = {}

    def close(self) -> None:
        self.dynamic.close()
        self.explicit.close()

    def measure(self, variant: str, calls: int) -> list[float]:
        clock = time.perf_counter
        n = len(self.bodies)
        if variant.startswith("raw-forward-1"):
            batches = [[self.tiles[i % n]] for i in range(calls)]
            pause = 0.0 if variant.endswith("-hot") else PAUSE_S

            def forward_each() -> list[float]:
                out = []
                for batch in batches:
                    t0 = clock()
                    self.model.forward_tiles(batch, "predict")  # what a lone request's pass runs
                    out.append(clock() - t0)
                    if pause:
                        time.sleep(pause)
                return out

            # The clients' forward thread (same OpenMP team and regime), as in RawForward.
            return device_thread(self.model.device).call(forward_each)
        if variant == "pipeline-1":
            return self._timed(lambda body: self.explicit.predict_batch([body]), calls)
        backend = variant.removeprefix("dynamic-")

        async def run() -> list[float]:
            latencies = []
            for i in range(calls):
                t0 = clock()
                await self.dynamic.predict_async(self.bodies[i % n])
                latencies.append(clock() - t0)
                # A lone caller: let the scheduler go idle between calls, as a real one would.
                await anyio.sleep(PAUSE_S)
            return latencies

        return anyio.run(run, backend=backend)

    def _timed(self, call: Callable[[str], object], calls: int) -> list[float]:
        clock = time.perf_counter
        n = len(self.bodies)
        out = []
        for i in range(calls):
            t0 = clock()
            call(self.bodies[i % n])
            out.append(clock() - t0)
            time.sleep(PAUSE_S)
        return out
