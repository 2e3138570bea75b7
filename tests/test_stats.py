"""``BatchStats``: what a user reads to learn why batches are small (Triton #3885)."""

from __future__ import annotations

import threading

import pytest

from histoinfer.batching import DURATION_BOUNDS, BatchStats
from histoinfer.batching.stats import _WINDOW


def test_an_empty_snapshot_is_all_zero() -> None:
    snap = BatchStats().snapshot()
    assert snap.batches == snap.samples == snap.errors == snap.cancelled == snap.queue_depth == 0
    assert snap.mean_batch_size == 0.0
    assert snap.batch_size_histogram == {}
    assert snap.queue_wait_ms == snap.forward_ms == {"p50": 0.0, "p95": 0.0, "p99": 0.0}


def test_batches_histogram_mean_and_percentiles() -> None:
    stats = BatchStats()
    # 100 batches: forward times 1..100 ms; sizes 1, 2, 3, 4 cycling; one wait per sample.
    for i in range(1, 101):
        size = (i - 1) % 4 + 1
        stats.record_batch(size, [i / 1000.0] * size, i / 1000.0)
    snap = stats.snapshot()
    assert snap.batches == 100
    assert snap.samples == 25 * (1 + 2 + 3 + 4)
    assert snap.mean_batch_size == pytest.approx(2.5)
    assert snap.batch_size_histogram == {1: 25, 2: 25, 3: 25, 4: 25}
    assert list(snap.batch_size_histogram) == [1, 2, 3, 4]  # sorted, for reading
    assert snap.forward_ms["p50"] == pytest.approx(51.0)  # nearest rank over 1..100 ms
    assert snap.forward_ms["p95"] == pytest.approx(95.0)
    assert snap.forward_ms["p99"] == pytest.approx(99.0)
    assert snap.queue_wait_ms["p50"] <= snap.queue_wait_ms["p95"] <= snap.queue_wait_ms["p99"]
    assert snap.queue_wait_ms["p99"] == pytest.approx(100.0)
    assert snap.forward_busy_s == pytest.approx(sum(range(1, 101)) / 1000.0)


def test_histograms_count_every_wait_and_pass_in_its_bucket() -> None:
    stats = BatchStats()
    assert stats.snapshot().queue_wait_buckets == [0] * (len(DURATION_BOUNDS) + 1)
    stats.record_batch(3, [0.0002, 0.001, 20.0], 0.03)  # 0.001 is in the bucket it bounds
    stats.record_batch(1, [0.004], 0.03)
    snap = stats.snapshot()
    waits = dict(zip([*DURATION_BOUNDS, "inf"], snap.queue_wait_buckets, strict=True))
    filled = {bound: n for bound, n in waits.items() if n}
    assert filled == {0.0005: 1, 0.001: 1, 0.005: 1, "inf": 1}
    assert snap.queue_wait_total_s == pytest.approx(20.0052)
    passes = dict(zip([*DURATION_BOUNDS, "inf"], snap.forward_buckets, strict=True))
    assert {bound: n for bound, n in passes.items() if n} == {0.05: 2}
    assert sum(snap.forward_buckets) == snap.batches and sum(snap.queue_wait_buckets) == 4


def test_a_snapshot_reads_short_and_keeps_its_figures() -> None:
    stats = BatchStats()
    stats.record_batch(3, [0.0002, 0.001, 0.0123456789], 0.0301234567)
    snap = stats.snapshot()
    shown = repr(snap)
    assert shown.startswith("StatsSnapshot(batches=1, samples=3, mean_batch_size=3.0,")
    assert "forward_ms={'p50': 30.123, 'p95': 30.123, 'p99': 30.123}" in shown
    assert f"queue_wait_buckets=<3 in {len(DURATION_BOUNDS) + 1} buckets>" in shown
    assert "forward_busy_s=0.030123," in shown
    assert len(shown) < 500 and snap.forward_ms["p50"] == pytest.approx(30.1234567)


def test_errors_cancellations_queue_depth_and_reset() -> None:
    stats = BatchStats()
    stats.record_error("ValueError")
    stats.record_error("ValueError")
    stats.record_error("deadline", count=3)
    stats.record_cancelled()
    stats.queue_changed(+5)
    stats.queue_changed(-2)
    snap = stats.snapshot()
    assert snap.errors == 5 and snap.error_kinds == {"ValueError": 2, "deadline": 3}
    assert snap.cancelled == 1 and snap.queue_depth == 3
    as_dict = snap.as_dict()
    assert as_dict["errors"] == 5 and as_dict["queue_wait_ms"]["p50"] == 0.0
    stats.reset()
    assert stats.snapshot() == BatchStats().snapshot()


def test_percentiles_cover_a_bounded_recent_window() -> None:
    stats = BatchStats()
    for _ in range(_WINDOW):
        stats.record_batch(1, [10.0], 10.0)  # old: 10 s
    for _ in range(_WINDOW):
        stats.record_batch(1, [0.001], 0.001)  # recent: 1 ms
    snap = stats.snapshot()
    assert snap.batches == 2 * _WINDOW  # counters are not windowed
    assert snap.forward_ms["p99"] == pytest.approx(1.0)
    assert snap.queue_wait_ms["p99"] == pytest.approx(1.0)


@pytest.mark.timeout(30)
def test_updates_from_many_threads_are_all_counted() -> None:
    stats = BatchStats()
    start = threading.Barrier(8, timeout=10)

    def hammer() -> None:
        start.wait()
        for i in range(2000):
            stats.queue_changed(+1)
            stats.record_batch(2, [0.0, 0.0], 0.0)
            stats.queue_changed(-1)
            stats.record_error("x")
            if i % 500 == 0:
                stats.snapshot()  # readers interleave with writers

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    snap = stats.snapshot()
    assert snap.batches == 16_000 and snap.samples == 32_000
    assert snap.errors == 16_000 and snap.queue_depth == 0
