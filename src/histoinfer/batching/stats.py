"""Thread-safe batching statistics, shared by every loop's scheduler of one mode.

Users who see batch size 1 under load need to know why (Triton #3885): the batch-size histogram,
queue wait and forward time percentiles, and the live queue depth answer that.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = ["BatchStats", "StatsSnapshot"]

# Percentiles are computed over the most recent samples: bounded memory, recent behaviour.
_WINDOW = 20_000


def _percentiles(values: Iterable[float]) -> dict[str, float]:
    data = sorted(values)
    if not data:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}

    def pick(q: float) -> float:
        return data[min(len(data) - 1, round(q * (len(data) - 1)))] * 1000.0

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


@dataclass(frozen=True)
class StatsSnapshot:
    """A consistent copy of one mode's counters. Times are in milliseconds."""

    batches: int
    samples: int
    mean_batch_size: float
    batch_size_histogram: dict[int, int]
    queue_wait_ms: dict[str, float]
    forward_ms: dict[str, float]
    errors: int
    error_kinds: dict[str, int]
    cancelled: int
    queue_depth: int
    forward_busy_s: float = field(default=0.0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BatchStats:
    """Counters for one mode; safe to update from any thread and any event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._batches = 0
            self._samples = 0
            self._histogram: Counter[int] = Counter()
            self._queue_waits: deque[float] = deque(maxlen=_WINDOW)
            self._forward_times: deque[float] = deque(maxlen=_WINDOW)
            self._errors: Counter[str] = Counter()
            self._cancelled = 0
            self._queue_depth = 0
            self._forward_busy = 0.0

    def record_batch(self, size: int, queue_waits: Iterable[float], forward_s: float) -> None:
        with self._lock:
            self._batches += 1
            self._samples += size
            self._histogram[size] += 1
            self._queue_waits.extend(queue_waits)
            self._forward_times.append(forward_s)
            self._forward_busy += forward_s

    def record_error(self, kind: str, count: int = 1) -> None:
        with self._lock:
            self._errors[kind] += count

    def record_cancelled(self) -> None:
        with self._lock:
            self._cancelled += 1

    def queue_changed(self, delta: int) -> None:
        with self._lock:
            self._queue_depth += delta

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            # The windows copied under the lock, sorted outside it: sorting 2 x 20,000 floats
            # took ~5 ms, during which the device thread's record_batch (and every submit) waited.
            queue_waits, forward_times = list(self._queue_waits), list(self._forward_times)
            counted = StatsSnapshot(
                batches=self._batches,
                samples=self._samples,
                mean_batch_size=self._samples / self._batches if self._batches else 0.0,
                batch_size_histogram=dict(sorted(self._histogram.items())),
                queue_wait_ms={},
                forward_ms={},
                errors=sum(self._errors.values()),
                error_kinds=dict(self._errors),
                cancelled=self._cancelled,
                queue_depth=self._queue_depth,
                forward_busy_s=self._forward_busy,
            )
        return replace(
            counted,
            queue_wait_ms=_percentiles(queue_waits),
            forward_ms=_percentiles(forward_times),
        )
