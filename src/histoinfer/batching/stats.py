"""Thread-safe batching statistics, shared by every loop's scheduler of one mode.

Users who see batch size 1 under load need to know why (Triton #3885): the batch-size histogram,
queue wait and forward time percentiles, and the live queue depth answer that.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["DURATION_BOUNDS", "BatchStats", "StatsSnapshot"]

# Percentiles are computed over the most recent samples: bounded memory, recent behaviour.
_WINDOW = 20_000

#: Upper bounds, in seconds, of the queue-wait and forward-time histograms (every sample
#: since the start, unlike the percentiles): what Prometheus aggregates over replicas.
DURATION_BOUNDS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


def _percentiles(values: Iterable[float]) -> dict[str, float]:
    data = sorted(values)
    if not data:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}

    def pick(q: float) -> float:
        return data[min(len(data) - 1, round(q * (len(data) - 1)))] * 1000.0

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


@dataclass(frozen=True)
class StatsSnapshot:
    """A consistent copy of one mode's counters. Units are in the names: ``queue_wait_ms``
    and ``forward_ms`` (percentiles over recent requests and batches) in milliseconds,
    ``forward_busy_s`` and ``queue_wait_total_s`` in seconds; the ``*_buckets`` lists count
    per bucket of :data:`DURATION_BOUNDS` (seconds), the last above its largest bound."""

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
    #: requests by queue wait, per :data:`DURATION_BOUNDS` bucket (not cumulative; the last
    #: is above the largest bound), and the waits' sum in seconds
    queue_wait_buckets: list[int] = field(default_factory=list)
    queue_wait_total_s: float = field(default=0.0)
    #: batches by forward time, the same way (``forward_busy_s`` is their sum, plus the time
    #: of passes that failed)
    forward_buckets: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __repr__(self) -> str:
        # Short enough to read in a notebook: times to the microsecond (ms to 3 places, s to
        # 6), and the histograms' buckets (every sample since the start, for Prometheus) as
        # their count.
        shown = []
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name.endswith("_buckets"):
                text = f"<{sum(value)} in {len(value)} buckets>"
            elif isinstance(value, float):
                text = repr(round(value, 6 if spec.name.endswith("_s") else 3))
            elif spec.name.endswith("_ms"):
                text = repr({key: round(ms, 3) for key, ms in value.items()})
            else:
                text = repr(value)
            shown.append(f"{spec.name}={text}")
        return f"StatsSnapshot({', '.join(shown)})"


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
            self._wait_buckets = [0] * (len(DURATION_BOUNDS) + 1)
            self._wait_total = 0.0
            self._forward_buckets = [0] * (len(DURATION_BOUNDS) + 1)

    def record_batch(self, size: int, queue_waits: Iterable[float], forward_s: float) -> None:
        waits = list(queue_waits)
        places = [bisect_left(DURATION_BOUNDS, wait) for wait in waits]  # outside the lock
        with self._lock:
            self._batches += 1
            self._samples += size
            self._histogram[size] += 1
            self._queue_waits.extend(waits)
            self._forward_times.append(forward_s)
            self._forward_busy += forward_s
            buckets = self._wait_buckets
            for place in places:
                buckets[place] += 1
            self._wait_total += sum(waits)
            self._forward_buckets[bisect_left(DURATION_BOUNDS, forward_s)] += 1

    def record_failed_pass(self, forward_s: float) -> None:
        """A pass that raised (its batch is bisected): the device was busy, but it is no
        batch and answered nobody."""
        with self._lock:
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
                queue_wait_buckets=list(self._wait_buckets),
                queue_wait_total_s=self._wait_total,
                forward_buckets=list(self._forward_buckets),
            )
        return replace(
            counted,
            queue_wait_ms=_percentiles(queue_waits),
            forward_ms=_percentiles(forward_times),
        )
