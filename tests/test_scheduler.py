"""``BatchScheduler`` on its own, with plain Python batch functions, on asyncio and trio.

A held batch function (``HeldBatchFn``) plays a slow device: while it is held, requests pile up,
so each test arranges the exact next batch by counting, never by timing.
"""

from __future__ import annotations

import gc
import logging
import random
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import pytest
from concurrency_helpers import HeldBatchFn, spawn_submit, wait_until

from histoinfer.batching import BatchScheduler, BatchStats
from histoinfer.batching import scheduler as scheduler_module
from histoinfer.errors import (
    ClientClosedError,
    DeadlineExceededError,
    InferenceError,
    OverloadedError,
    ThreadAbortedError,
)
from histoinfer.models.device_thread import DeviceThread

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def _queued_behind_a_held_batch(
    fn: HeldBatchFn, sched: BatchScheduler[int, int], items: range, results: dict[int, Any]
) -> None:
    """Submit 100 alone, and ``items`` while its batch is held: they queue up, then all run."""
    async with anyio.create_task_group() as tg:
        spawn_submit(tg, sched.submit, 100, results)
        await wait_until(lambda: fn.calls == 1)
        for i in items:
            spawn_submit(tg, sched.submit, i, results)
        await wait_until(lambda: sched.queue_depth == len(items))
        fn.release_all()


async def test_batches_hold_at_most_max_batch_size() -> None:
    results: dict[int, Any] = {}
    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=4, max_wait_ms=5)
        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 0, results)
            await wait_until(lambda: fn.calls == 1)
            for i in range(1, 11):
                spawn_submit(tg, sched.submit, i, results)
            await wait_until(lambda: sched.queue_depth == 10)
            fn.release_all()
    assert results == {i: 10 * i for i in range(11)}
    assert [len(b) for b in fn.batches] == [1, 4, 4, 2]
    snap = sched.stats.snapshot()
    assert snap.batch_size_histogram == {1: 1, 2: 1, 4: 2}
    assert snap.batches == 4 and snap.samples == 11
    assert snap.mean_batch_size == pytest.approx(11 / 4)
    assert snap.queue_depth == 0


async def test_requests_arriving_during_a_batch_form_the_next_one() -> None:
    results: dict[int, Any] = {}
    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=16, max_wait_ms=5)
        await _queued_behind_a_held_batch(fn, sched, range(10), results)
    assert fn.batches[0] == [100]
    assert sorted(fn.batches[1]) == list(range(10))
    assert fn.calls == 2
    assert results[7] == 70


async def test_the_next_batch_is_handed_over_before_the_last_batch_callers_wake() -> None:
    """Woken first, the callers of a finished batch would run (and serialize their responses)
    while the device idles: they wake once the next batch is on its way to the thread."""
    results: dict[int, Any] = {}
    woken: dict[str, int] = {}
    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=16, max_wait_ms=5)

        async def first() -> None:
            results[100] = await sched.submit(100)
            woken["queued"] = sched.queue_depth

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await wait_until(lambda: fn.calls == 1)
            for i in range(3):
                spawn_submit(tg, sched.submit, i, results)
            await wait_until(lambda: sched.queue_depth == 3)
            fn.allow()  # the first batch ends; the second is held
            await wait_until(lambda: "queued" in woken)
            assert woken["queued"] == 0  # the second batch was dispatched before it woke
            assert results == {100: 1000}  # ... and still runs: its callers wait
            fn.release_all()
    assert fn.batches[0] == [100] and sorted(fn.batches[1]) == [0, 1, 2]  # trio: any order
    assert results == {100: 1000, 0: 0, 1: 10, 2: 20}


async def test_a_lone_batch_callers_are_not_held_for_a_next_batch() -> None:
    """With nothing queued behind it, a finished batch's callers wake at once."""
    with HeldBatchFn(held=False) as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=16, max_wait_ms=5)
        assert await sched.submit(3) == 30
        assert await sched.submit(4) == 40
        await sched.aclose()
    assert fn.batches == [[3], [4]]


async def test_order_is_fifo() -> None:
    order = list(range(1, 13))
    random.Random(3).shuffle(order)
    results: dict[int, Any] = {}
    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=3, max_wait_ms=5)
        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 100, results)
            await wait_until(lambda: fn.calls == 1)
            for queued, item in enumerate(order, start=1):
                spawn_submit(tg, sched.submit, item, results)
                await wait_until(lambda n=queued: sched.queue_depth == n)  # type: ignore[misc]
            fn.release_all()
    assert fn.seen() == [100, *order]
    assert [len(b) for b in fn.batches] == [1, 3, 3, 3, 3]


async def test_a_lone_request_is_not_held_for_the_whole_window() -> None:
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=64, max_wait_ms=10_000)
    with anyio.fail_after(5):  # far below the 10 s window
        assert await sched.submit(4) == 40
        assert await sched.submit(5) == 50
    assert fn.batches == [[4], [5]]


async def test_max_wait_ms_bounds_the_wait_for_an_announced_item() -> None:
    """A reserved item is waited for, but never past ``max_wait_ms``."""
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8, max_wait_ms=150)
    async with sched.reserve():  # announced, never submitted
        with anyio.fail_after(5):
            assert await sched.submit(3) == 30
    assert fn.batches == [[3]]


async def test_a_reserved_item_joins_the_batch_it_was_announced_to() -> None:
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8, max_wait_ms=10_000)
    results: dict[int, Any] = {}
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg, sched.reserve() as slot:
            spawn_submit(tg, sched.submit, 1, results)
            await wait_until(lambda: sched.queue_depth == 1)
            await anyio.sleep(0.02)  # "preparing" while the runner holds the batch open
            results[2] = await slot.submit(2)
    assert fn.batches == [[1, 2]]
    assert results == {1: 10, 2: 20}


async def test_preparing_counts_reservations_until_they_submit_or_leave() -> None:
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8, max_wait_ms=0)
    with anyio.fail_after(5):
        assert sched.preparing == 0
        async with sched.reserve() as first, sched.reserve():
            assert sched.preparing == 2
            assert await first.submit(3) == 30
            assert sched.preparing == 1  # the second one is still "preparing"
        assert sched.preparing == 0  # it left without an item


async def test_an_abandoned_reservation_releases_the_waiting_batch() -> None:
    """A reservation that ends unused (e.g. its request was invalid) must wake the runner."""
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8, max_wait_ms=10_000)
    results: dict[int, Any] = {}
    with anyio.fail_after(5):  # the window is 10 s: waiting it out fails this test
        async with anyio.create_task_group() as tg, sched.reserve():
            spawn_submit(tg, sched.submit, 1, results)
            await wait_until(lambda: sched.queue_depth == 1)
    assert results == {1: 10}


async def test_a_reservation_expiring_before_submit_releases_the_waiting_batch() -> None:
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8, max_wait_ms=10_000)
    results: dict[int, Any] = {}
    with anyio.fail_after(5):  # the window is 10 s: waiting it out fails this test
        async with anyio.create_task_group() as tg, sched.reserve(timeout=0.05) as slot:
            remaining = slot.remaining()
            assert remaining is not None and 0 < remaining <= 0.05
            spawn_submit(tg, sched.submit, 1, results)
            await wait_until(lambda: sched.queue_depth == 1)
            await anyio.sleep(0.1)  # preparation outlives the deadline
            remaining = slot.remaining()
            assert remaining is not None and remaining < 0
            with pytest.raises(DeadlineExceededError):
                await slot.submit(2)
            await wait_until(lambda: 1 in results)
    assert results == {1: 10}


async def test_batch_fn_runs_in_a_worker_thread_with_its_own_limiter() -> None:
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8)
    default = anyio.to_thread.current_default_thread_limiter()
    saved = default.total_tokens
    release = threading.Event()
    default.total_tokens = 1
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                # Take the only token of the shared default limiter, as a busy app would.
                tg.start_soon(partial(anyio.to_thread.run_sync, release.wait, 10))
                await wait_until(lambda: default.borrowed_tokens == 1)
                assert await sched.submit(6) == 60
                release.set()
    finally:
        release.set()
        default.total_tokens = saved
    assert fn.threads and threading.get_ident() not in fn.threads


async def test_a_given_limiter_is_the_one_used() -> None:
    limiter = anyio.CapacityLimiter(1)
    seen: list[float] = []

    def batch_fn(items: list[int]) -> list[int]:
        seen.append(anyio.from_thread.run_sync(lambda: limiter.borrowed_tokens))
        return items

    sched = BatchScheduler(batch_fn, limiter=limiter)
    with anyio.fail_after(5):
        assert await sched.submit(1) == 1
    assert seen == [1]


async def test_bisection_isolates_a_poisoned_item(caplog: pytest.LogCaptureFixture) -> None:
    results: dict[int, Any] = {}
    with HeldBatchFn(poison=[7]) as fn, anyio.fail_after(10), caplog.at_level("WARNING"):
        sched = BatchScheduler(fn, max_batch_size=16)
        await _queued_behind_a_held_batch(fn, sched, range(12), results)
    assert isinstance(results.pop(7), ValueError)
    assert results == {i: 10 * i for i in [*range(7), *range(8, 12), 100]}
    assert sorted(fn.batches[1]) == list(range(12))  # tried as one batch first
    assert sum(7 in b for b in fn.batches) <= 5  # then halved: log2(12) + 1 tries at most
    snap = sched.stats.snapshot()
    assert snap.errors == 1 and snap.error_kinds == {"ValueError": 1}
    # Answered: [100] and 11 of the 12; the failing item is no sample. The 11 ran in the
    # halves' passes, and those are the batches counted (not one batch of 11, which never ran).
    passes = [len(b) for b in fn.batches if 7 not in b]
    assert snap.samples == 12 == sum(passes)
    assert snap.batches == len(passes) > 2
    assert snap.batch_size_histogram == dict(sorted(Counter(passes).items()))
    # One line for the batch, not one for every split (37 lines for 40 failures before).
    assert [r.getMessage() for r in caplog.records if "bisecting" in r.getMessage()] == [
        "batch: batch of 12 failed (ValueError('poisoned items [7]')); bisecting"
    ]


async def test_a_batch_function_that_always_fails_counts_no_batch() -> None:
    """A broken device: errors rise and batches stay flat (the alert in docs/server.md reads
    both); counted as batches, the failures looked like work done."""
    results: dict[int, Any] = {}
    with HeldBatchFn(poison=range(6)) as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=16)
        await _queued_behind_a_held_batch(fn, sched, range(6), results)
    assert all(isinstance(results[i], ValueError) for i in range(6))
    snap = sched.stats.snapshot()
    assert snap.errors == 6 and snap.batches == 1 and snap.samples == 1  # [100] alone


async def test_a_failed_pass_counts_as_busy_time_but_not_as_a_batch() -> None:
    """A GPU out of memory occupies the device as much as a pass that answers: utilization
    (forward_busy_s) counts it, the batches do not."""

    def slow_failure(items: list[int]) -> list[int]:
        time.sleep(0.05)
        raise MemoryError("out of memory")

    sched = BatchScheduler(slow_failure, max_batch_size=4)
    with anyio.fail_after(10), pytest.raises(MemoryError):
        await sched.submit(1)
    snap = sched.stats.snapshot()
    assert snap.batches == 0 and snap.errors == 1
    assert snap.forward_busy_s >= 0.05 and sum(snap.forward_buckets) == 0
    await sched.aclose()


class _UsersOwnBaseException(BaseException):
    pass


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt, _UsersOwnBaseException])
async def test_a_base_exception_from_the_batch_function_fails_only_its_item(
    raised: type[BaseException],
) -> None:
    """Off the main thread, SystemExit & co. are no signal and no cancellation of ours: taken
    for the loop's own cancellation, they failed every caller of the batch and killed the
    runner (trio: TrioInternalError). Now bisected like any failure, and the runner serves on."""
    results: dict[int, Any] = {}
    with HeldBatchFn(poison=[3], raises=raised) as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=16)
        await _queued_behind_a_held_batch(fn, sched, range(6), results)
        failed = results.pop(3)
        assert isinstance(failed, ThreadAbortedError), failed
        assert isinstance(failed.__cause__, raised), failed.__cause__
        assert f"raised {raised.__name__}(" in str(failed), failed
        assert results == {i: 10 * i for i in [0, 1, 2, 4, 5, 100]}
        assert await sched.submit(7) == 70  # the runner lives on
        await sched.aclose()
    assert sched.stats.snapshot().error_kinds == {"ThreadAbortedError": 1}


async def test_an_exception_returned_as_a_result_is_raised_to_its_caller_alone() -> None:
    """A refusal: no bisection, the neighbours get their results, and it is not a sample."""
    calls: list[list[int]] = []

    def refuses_odd(items: list[int]) -> list[int | BaseException]:
        calls.append(items)
        return [ValueError(f"odd {i}") if i % 2 else 10 * i for i in items]

    sched = BatchScheduler(refuses_odd, max_batch_size=16, max_wait_ms=100)
    results: dict[int, Any] = {}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(6):
                spawn_submit(tg, sched.submit, i, results)
        with pytest.raises(ValueError, match="odd 7"):
            await sched.submit(7)  # a batch of refusals only: nothing counted
    assert len(calls) == 2 and sorted(calls[0]) == list(range(6))
    for i in (1, 3, 5):
        assert str(results.pop(i)) == f"odd {i}"
    assert results == {0: 0, 2: 20, 4: 40}
    snap = sched.stats.snapshot()
    assert snap.batches == 1 and snap.samples == 3 and snap.errors == 0


async def test_a_reservation_reopens_after_a_refusal_and_submits_again() -> None:
    """A caller whose item was refused (prepare it otherwise first) takes its place again: it
    counts as on its way meanwhile, its second item runs, and nothing is left counted."""

    def refuses_odd(items: list[int]) -> list[int | BaseException]:
        return [ValueError(f"odd {i}") if i % 2 else 10 * i for i in items]

    sched = BatchScheduler(refuses_odd, max_batch_size=8, max_wait_ms=10_000)
    with anyio.fail_after(5):  # the window is 10 s: a runner waiting it out fails this test
        async with sched.reserve() as slot:
            assert slot.remaining() is None  # no deadline
            with pytest.raises(RuntimeError, match="reopen follows a refused submit"):
                slot.reopen()  # nothing submitted yet
            with pytest.raises(ValueError, match="odd 3"):
                await slot.submit(3)
            assert slot.refused and sched.preparing == 0
            slot.reopen()
            assert sched.preparing == 1 and sched.admitted == 1  # on its way again
            with pytest.raises(RuntimeError, match="reopen follows a refused submit"):
                slot.reopen()
            assert await slot.submit(4) == 40
            with pytest.raises(RuntimeError, match="reopen follows a refused submit"):
                slot.reopen()  # after a result
        assert (sched.preparing, sched.admitted, sched.queue_depth) == (0, 0, 0)
        with pytest.raises(RuntimeError, match="inside its reserve"):
            await slot.submit(6)  # the block is over
        async with sched.reserve() as slot:  # reopened, then left without a second item
            with pytest.raises(ValueError):
                await slot.submit(5)
            slot.reopen()
        assert (sched.preparing, sched.admitted, sched.queue_depth) == (0, 0, 0)
        assert await sched.submit(8) == 80  # the runner was not left waiting for anyone
    snap = sched.stats.snapshot()
    assert snap.batches == 2 and snap.samples == 2 and snap.errors == 0


async def test_a_failed_item_does_not_reopen_its_reservation() -> None:
    def fails(items: list[int]) -> list[int]:
        raise RuntimeError("the device fell over")

    sched = BatchScheduler(fails, max_batch_size=8, max_wait_ms=0)
    with anyio.fail_after(5):
        async with sched.reserve() as slot:
            with pytest.raises(RuntimeError, match="fell over"):
                await slot.submit(1)
            assert not slot.refused
            with pytest.raises(RuntimeError, match="reopen follows a refused submit"):
                slot.reopen()


async def test_a_wrong_result_count_fails_only_its_own_item() -> None:
    def drops_five(items: list[int]) -> list[int]:
        return [10 * i for i in items if i != 5]

    sched = BatchScheduler(drops_five, max_batch_size=16)
    results: dict[int, Any] = {}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                spawn_submit(tg, sched.submit, i, results)
        assert await sched.submit(9) == 90  # the next batch is fine
    error = results.pop(5)
    assert isinstance(error, RuntimeError)
    assert "returned 0 results for 1 items" in str(error)
    assert results == {i: 10 * i for i in range(8) if i != 5}


@pytest.mark.parametrize(
    "answer",
    [
        lambda items: {i: 10 * i for i in items},
        lambda items: (10 * i for i in items),
        set,
        lambda items: bytearray(len(items)),
    ],
    ids=["dict", "generator", "set", "bytearray"],
)
async def test_results_that_are_no_sequence_fail_naming_what_came_back(answer: Any) -> None:
    """A dict of the right length answered each caller with a key, silently (a user trial);
    a generator failed with "object of type 'generator' has no len()"."""
    sched = BatchScheduler(answer, max_batch_size=4)
    with anyio.fail_after(10):
        with pytest.raises(
            TypeError, match=r"must return one result per item.*got (dict|generator|set|bytearray)"
        ):
            await sched.submit(3)
    await sched.aclose()


@pytest.mark.parametrize("site", ["_collect", "_execute"])
async def test_a_scheduler_crash_fails_the_pending_and_the_next_call_works(
    site: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8)
    original = getattr(sched, site)
    crashes: list[int] = []

    async def crash_once(batch: list[Any], *args: Any) -> Any:
        # _collect crashes holding queued items; _execute crashes before running them.
        result = await original(batch, *args) if site == "_collect" else None
        if not crashes:
            crashes.append(1)
            raise RuntimeError(f"bug in {site}")
        return result if site == "_collect" else await original(batch, *args)

    monkeypatch.setattr(sched, site, crash_once)
    with anyio.fail_after(10):
        with pytest.raises(InferenceError, match=f"scheduler error.*bug in {site}"):
            await sched.submit(1)
        assert await sched.submit(2) == 20
    assert "scheduler error" in caplog.text
    assert sched.stats.snapshot().queue_depth == 0


async def test_a_failing_statistics_update_fails_no_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8)
    failed: list[int] = []
    original = sched.stats.record_batch

    def record_batch_fails_once(*args: Any) -> None:
        if not failed:
            failed.append(1)
            raise RuntimeError("stats bug")
        original(*args)

    monkeypatch.setattr(sched.stats, "record_batch", record_batch_fails_once)
    with anyio.fail_after(10):
        assert await sched.submit(1) == 10
        assert await sched.submit(2) == 20
    assert failed == [1]
    assert sched.stats.snapshot().batches == 1


class _BrittleStats(BatchStats):
    """Statistics whose runner-side updates all fail: a user's buggy subclass."""

    def queue_changed(self, delta: int) -> None:
        if delta < 0:
            raise RuntimeError("stats bug")
        super().queue_changed(delta)

    def record_batch(self, *args: Any) -> None:
        raise RuntimeError("stats bug")

    def record_error(self, *args: Any) -> None:
        raise RuntimeError("stats bug")


async def test_the_runner_survives_a_crash_while_handling_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On trio the runner is a system task: anything escaping it would kill the whole run."""
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, stats=_BrittleStats(), max_batch_size=4)
    original = sched._collect
    crashes: list[int] = []

    async def crash_once_holding_items(batch: list[Any]) -> bool:
        more = await original(batch)
        if not crashes:
            crashes.append(1)
            raise RuntimeError("bug in _collect")
        return more

    monkeypatch.setattr(sched, "_collect", crash_once_holding_items)
    results: dict[int, Any] = {}
    scope = anyio.CancelScope()

    async def cancelled_while_queued() -> None:
        with scope:
            await sched.submit(3)

    with fn, anyio.fail_after(10):
        with pytest.raises(InferenceError, match="scheduler error"):
            await sched.submit(1)
        assert await sched.submit(2) == 20
        # A cancelled caller is not turned into a statistics error either.
        fn._held = True
        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 4, results)
            await wait_until(lambda: fn.calls == 2)
            tg.start_soon(cancelled_while_queued)
            await wait_until(lambda: sched.queue_depth == 1)
            scope.cancel()
            await wait_until(lambda: sched.queue_depth == 0)
            fn.release_all()
    assert scope.cancelled_caught
    assert results == {4: 40}
    assert 3 not in fn.seen()


async def test_backpressure_callers_wait_for_room(caplog: pytest.LogCaptureFixture) -> None:
    results: dict[int, Any] = {}
    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=2, max_queue=3)
        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 0, results)
            await wait_until(lambda: fn.calls == 1)
            spawn_submit(tg, sched.submit, 1, results)
            spawn_submit(tg, sched.submit, 2, results)
            await wait_until(lambda: sched.queue_depth == 2)
            with pytest.raises(OverloadedError, match="queue full"):
                await sched.submit(9, wait=False)
            with pytest.raises(OverloadedError):
                async with sched.reserve(wait=False):
                    pass
            spawn_submit(tg, sched.submit, 3, results)  # must wait for room
            await anyio.sleep(0.05)
            assert sched.queue_depth == 2 and 3 not in results
            fn.release_all()
    assert results == {0: 0, 1: 10, 2: 20, 3: 30}
    assert 9 not in fn.seen()


def test_a_queue_bound_below_the_batch_size_is_warned_about_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler_module, "_WARNED_QUEUE_BOUNDS", set())
    with caplog.at_level(logging.WARNING, logger="histoinfer.batching"):
        BatchScheduler(list, max_batch_size=32, max_queue=8, name="tiny-queue:predict")
        BatchScheduler(list, max_batch_size=32, max_queue=8, name="tiny-queue:embed")
        BatchScheduler(list, max_batch_size=32, max_queue=8, name="other")  # its own owner
    assert "tiny-queue:predict" in caplog.text and caplog.text.count("max_queue=8") == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="histoinfer.batching"):
        BatchScheduler(list, max_batch_size=8, max_queue=8)
    assert caplog.text == ""


def test_invalid_settings_are_refused() -> None:
    for bad in (0, 2.5, True, "8"):  # 2.5 was taken (a user trial)
        with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
            BatchScheduler(list, max_batch_size=bad)  # type: ignore[arg-type]
    for wait in (float("nan"), float("inf"), -1):
        with pytest.raises(ValueError, match="max_wait_ms must be a finite number >= 0"):
            BatchScheduler(list, max_wait_ms=wait)
    for queue in (0, 1.5):
        with pytest.raises(ValueError, match="max_queue must be an int >= 1 or None"):
            BatchScheduler(list, max_queue=queue)  # type: ignore[arg-type]
    BatchScheduler(list, max_batch_size=2, max_wait_ms=0, max_queue=None)


def test_a_coroutine_batch_function_is_refused_at_once() -> None:
    """Run in a worker thread it would return coroutines, never awaited: every item failed
    with "object of type 'coroutine' has no len()", after a whole bisection."""

    async def doubled(items: list[int]) -> list[int]:
        return [2 * i for i in items]

    class Model:
        async def __call__(self, items: list[int]) -> list[int]:
            return items

    for fn in (doubled, partial(doubled), Model()):
        with pytest.raises(TypeError, match="batch_fn must be a plain function"):
            BatchScheduler(fn)  # type: ignore[arg-type]
    BatchScheduler(lambda items: items)  # a plain one is fine, a callable object too
    BatchScheduler(HeldBatchFn(held=False))


async def test_a_request_not_dispatched_by_its_deadline_fails_clearly() -> None:
    results: dict[int, Any] = {}
    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=8)
        async with anyio.create_task_group() as tg:
            # Dispatched at once, then outlives its deadline while running: it still completes.
            spawn_submit(tg, sched.submit, 1, results, timeout=0.05)
            await wait_until(lambda: fn.calls == 1)
            # Queued behind the batch out: the message says so (it said "0 other requests
            # still queued" alone, behind a pass of 30 s).
            with pytest.raises(
                DeadlineExceededError,
                match=r"not dispatched within its deadline: 0 other requests still queued, "
                r"behind a batch out for \d+\.\d s",
            ):
                await sched.submit(2, timeout=0.05)
            spawn_submit(tg, sched.submit, 3, results, timeout=30)
            await wait_until(lambda: sched.stats.snapshot().queue_depth == 1)
            fn.release_all()
    assert results == {1: 10, 3: 30}
    assert 2 not in fn.seen()
    snap = sched.stats.snapshot()
    assert snap.error_kinds == {"deadline": 1} and snap.queue_depth == 0


def _on_a_thread_busy_with_other_work(
    name: str,
) -> tuple[BatchScheduler[int, int], HeldBatchFn, threading.Event]:
    """A scheduler whose batches run on a thread that someone else's job holds until the
    returned event is set (e.g. another client's pass on a shared device)."""
    worker = DeviceThread(name)
    release = threading.Event()
    fn = HeldBatchFn(held=False)
    worker.submit(release.wait, 10)
    return BatchScheduler(fn, max_batch_size=8, thread=worker.submit), fn, release


async def test_a_batch_waiting_for_a_busy_thread_runs_without_those_whose_deadline_passed() -> None:
    """Dispatched to a thread busy with other work (e.g. another client's pass on a shared
    device), an item has not reached the batch function: its caller fails at its deadline,
    not when the thread gets to it, and the batch runs without it."""
    sched, fn, release = _on_a_thread_busy_with_other_work("test-busy-device")
    results: dict[int, Any] = {}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 1, results, timeout=0.05)
            spawn_submit(tg, sched.submit, 2, results)
            await wait_until(lambda: 1 in results)  # long before the thread is free
            assert fn.calls == 0 and sched.queue_depth == 0  # dispatched, not started
            release.set()
    assert isinstance(results[1], DeadlineExceededError)
    assert "waiting for its thread" in str(results[1])
    assert results[2] == 20 and fn.batches == [[2]]
    snap = sched.stats.snapshot()
    assert snap.samples == 1 and snap.error_kinds == {"deadline": 1}


async def test_forward_time_is_the_batch_functions_not_a_wait_for_its_thread() -> None:
    """The statistics' forward time is timed on the batch function's thread: a batch that
    waited for a thread busy with other work does not count that wait as its own time."""
    sched, _, release = _on_a_thread_busy_with_other_work("test-timed-device")
    results: dict[int, Any] = {}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 1, results)
            await wait_until(lambda: sched.queue_depth == 0)  # dispatched, waiting
            await anyio.sleep(0.3)
            release.set()
    assert results[1] == 10
    snap = sched.stats.snapshot()
    assert snap.batches == 1
    assert snap.forward_busy_s < 0.1  # not the 0.3 s it waited for the thread
    assert snap.forward_ms["p50"] < 100


async def test_a_finished_batchs_callers_do_not_wait_behind_other_work_on_its_thread() -> None:
    """A finished batch's callers are woken as the next batch starts on the thread (so that
    handing it over comes first). When the thread is busy with other work (another loop's
    pass on a shared device: one image per thread), the next batch waits behind it, and they
    would too: ``thread_idle`` says so, and they are woken at once."""
    worker = DeviceThread("test-shared-device")
    first, other = threading.Event(), threading.Event()
    calls: list[list[int]] = []

    def fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        if items == [1]:
            assert first.wait(10)
        return [10 * i for i in items]

    sched = BatchScheduler(
        fn, max_batch_size=8, max_wait_ms=0, thread=worker.submit, thread_idle=lambda: worker.idle
    )
    results: dict[int, Any] = {}
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                spawn_submit(tg, sched.submit, 1, results)
                await wait_until(lambda: calls == [[1]])  # batch 1 holds the thread
                worker.submit(other.wait, 10)  # another loop's pass, next in line
                spawn_submit(tg, sched.submit, 2, results)  # and this loop's next batch
                await wait_until(lambda: sched.queue_depth == 1)
                first.set()
                await wait_until(lambda: 1 in results)  # the other pass still holds the thread
                assert 2 not in results and calls == [[1]]
                other.set()
    finally:
        first.set()
        other.set()
    assert results == {1: 10, 2: 20} and calls == [[1], [2]]


async def test_a_caller_cancelled_while_its_batch_waits_for_its_thread_is_left_out() -> None:
    worker = DeviceThread("test-busy-device")
    release = threading.Event()
    results: dict[int, Any] = {}
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8, thread=worker.submit)
    scope = anyio.CancelScope()
    left = anyio.Event()

    async def doomed() -> None:
        with scope:
            results[1] = await sched.submit(1)
        left.set()

    with anyio.fail_after(10):
        worker.submit(release.wait, 10)
        async with anyio.create_task_group() as tg:
            tg.start_soon(doomed)
            spawn_submit(tg, sched.submit, 2, results)
            await wait_until(lambda: sched.queue_depth == 0 and sched.admitted == 2)
            scope.cancel()
            await left.wait()  # at once, with the thread still busy
            release.set()
    assert results == {2: 20} and fn.batches == [[2]]
    assert sched.stats.snapshot().cancelled == 1


async def test_an_item_that_reached_the_batch_function_is_rerun_after_a_bisection() -> None:
    """Its batch failed because of a neighbour, and its half waits behind other work to rerun:
    its deadline has passed, but it reached the model in time, so it runs to completion; and a
    neighbour that left before the batch started is out of the bisection (the failing item
    runs alone once, not once per neighbour that left)."""
    # (Not a DeviceThread: a job submitting to its own DeviceThread runs the work inline.)
    worker = ThreadPoolExecutor(1)
    calls: list[list[int]] = []

    def fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        if 17 in items:
            worker.submit(time.sleep, 0.6)  # other work reaches the thread meanwhile
            raise ValueError("poison")
        return [10 * i for i in items]

    release = threading.Event()
    sched = BatchScheduler(fn, max_batch_size=8, max_wait_ms=50, thread=worker.submit)
    results: dict[int, Any] = {}
    scope = anyio.CancelScope()

    async def leaves() -> None:
        with scope:
            results[2] = await sched.submit(2)

    with anyio.fail_after(20):
        worker.submit(release.wait, 10)  # so that the batch waits, and 2 can leave first
        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 1, results, timeout=0.3)
            tg.start_soon(leaves)
            spawn_submit(tg, sched.submit, 17, results)
            await wait_until(lambda: sched.queue_depth == 0 and sched.admitted == 3)
            scope.cancel()
            await wait_until(lambda: sched.admitted == 2)
            release.set()
    assert results[1] == 10 and isinstance(results[17], ValueError) and 2 not in results
    assert sorted(calls[0]) == [1, 17]  # 2 left before the batch started
    assert sorted(map(sorted, calls[1:])) == [[1], [17]]  # then each alone, once


async def test_the_deadline_also_bounds_the_wait_for_room() -> None:
    """Backpressure must not hold a caller past its deadline: it is not dispatched in time."""
    results: dict[int, Any] = {}
    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=1, max_queue=1)
        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 1, results)
            await wait_until(lambda: fn.calls == 1)  # item 1 holds the only place
            with pytest.raises(DeadlineExceededError, match="deadline"):
                await sched.submit(2, timeout=0.05)
            with pytest.raises(DeadlineExceededError, match="deadline"):
                async with sched.reserve(timeout=0.05):
                    pass
            fn.release_all()
        async with sched.reserve(timeout=0.05) as slot:  # room now; the deadline carries over
            await anyio.sleep(0.1)  # preparation outlives it
            with pytest.raises(DeadlineExceededError):
                await slot.submit(3)
        async with sched.reserve(timeout=30) as slot:
            assert await slot.submit(4) == 40
    assert results == {1: 10}
    assert fn.seen() == [1, 4]
    assert sched.stats.snapshot().error_kinds == {"deadline": 3}
    assert sched.queue_depth == 0


async def test_aclose_finishes_queued_work_then_refuses() -> None:
    results: dict[int, Any] = {}
    exits: list[int] = []
    closed = anyio.Event()
    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=2, on_exit=lambda: exits.append(1))

        async def close() -> None:
            await sched.aclose()
            closed.set()

        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 1, results)
            await wait_until(lambda: fn.calls == 1)
            for i in range(2, 6):
                spawn_submit(tg, sched.submit, i, results)
            await wait_until(lambda: sched.queue_depth == 4)
            tg.start_soon(close)
            await wait_until(lambda: sched._closing)
            with pytest.raises(ClientClosedError):
                await sched.submit(9)
            assert not closed.is_set()
            fn.release_all()
    assert closed.is_set()
    assert results == {i: 10 * i for i in range(1, 6)}
    assert exits == [1]
    with pytest.raises(ClientClosedError):
        await sched.submit(10)
    with pytest.raises(ClientClosedError):
        async with sched.reserve():
            pass
    assert 9 not in fn.seen() and 10 not in fn.seen()


async def test_aclose_while_the_runner_waits_for_an_announced_item() -> None:
    """The stream ends while the runner is waiting for company: what it holds still runs."""
    fn = HeldBatchFn(held=False)
    sched = BatchScheduler(fn, max_batch_size=8, max_wait_ms=10_000)
    results: dict[int, Any] = {}
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg, sched.reserve() as slot:
            spawn_submit(tg, sched.submit, 1, results)
            await wait_until(lambda: sched.queue_depth == 1)
            await sched.aclose()
            with pytest.raises(ClientClosedError):
                await slot.submit(2)
    assert results == {1: 10}
    assert fn.batches == [[1]]


async def test_close_soon_from_another_thread_ends_the_runner() -> None:
    exits: list[int] = []
    results: dict[int, Any] = {}
    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=8, on_exit=lambda: exits.append(1))
        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 1, results)
            await wait_until(lambda: fn.calls == 1)
            spawn_submit(tg, sched.submit, 2, results)
            await wait_until(lambda: sched.queue_depth == 1)
            await anyio.to_thread.run_sync(sched.close_soon)
            with pytest.raises(ClientClosedError):
                await sched.submit(3)
            fn.release_all()
        await wait_until(lambda: exits == [1])  # queued work done, then the runner ended
    assert results == {1: 10, 2: 20}
    BatchScheduler(fn).close_soon()  # never started: nothing to wait for


def test_a_scheduler_never_used_leaves_nothing_unclosed() -> None:
    """Made and dropped (closed or not) without a loop ever using it: no streams were made,
    so none is left unclosed (a ResourceWarning when collected)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        BatchScheduler(HeldBatchFn(held=False))
        BatchScheduler(HeldBatchFn(held=False)).close_soon()
        gc.collect()
    assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


async def test_aclose_of_an_unused_scheduler() -> None:
    sched = BatchScheduler(HeldBatchFn(held=False))
    with anyio.fail_after(5):
        await sched.aclose()
        await sched.aclose()  # idempotent
    with pytest.raises(ClientClosedError):
        await sched.submit(1)


@pytest.mark.parametrize("when", ["queued", "running"])
async def test_a_cancelled_caller_leaves_without_disturbing_the_others(when: str) -> None:
    """Cancelled while queued: never dispatched. While running: the batch completes anyway."""
    results: dict[int, Any] = {}
    scope = anyio.CancelScope()
    left = anyio.Event()

    with HeldBatchFn() as fn, anyio.fail_after(10):
        sched = BatchScheduler(fn, max_batch_size=8)

        async def doomed() -> None:
            with scope:
                results[2] = await sched.submit(2)
            left.set()

        async with anyio.create_task_group() as tg:
            spawn_submit(tg, sched.submit, 1, results)
            await wait_until(lambda: fn.calls == 1)
            tg.start_soon(doomed)
            spawn_submit(tg, sched.submit, 3, results)
            await wait_until(lambda: sched.queue_depth == 2)
            if when == "running":
                fn.allow(1)  # batch [1] returns; [2, 3] starts and is held
                await wait_until(lambda: fn.calls == 2)
            scope.cancel()
            await left.wait()  # the caller leaves at once, even while its batch runs
            fn.release_all()
    assert results == {1: 10, 3: 30}
    if when == "queued":
        assert fn.batches == [[1], [3]]
        assert sched.stats.snapshot().cancelled == 1
    else:
        assert fn.calls == 2 and sorted(fn.batches[1]) == [2, 3]  # neither cancelled nor re-run
    assert sched.queue_depth == 0 and sched.stats.snapshot().queue_depth == 0


async def test_using_a_scheduler_from_a_second_loop_is_a_clear_error(anyio_backend: str) -> None:
    sched = BatchScheduler(HeldBatchFn(held=False))
    with anyio.fail_after(10):
        assert await sched.submit(1) == 10
        other = "trio" if anyio_backend == "asyncio" else "asyncio"
        for backend in (anyio_backend, other):

            async def elsewhere() -> None:
                await sched.submit(2)

            with pytest.raises(RuntimeError, match="another event loop"):
                await anyio.to_thread.run_sync(partial(anyio.run, elsewhere, backend=backend))
            # aclose() from there: refused before it touches this loop's stream (it used to
            # close it first: trio's internals asserted, and the scheduler ended all the same)
            with pytest.raises(RuntimeError, match="must run in the scheduler's own loop"):
                await anyio.to_thread.run_sync(partial(anyio.run, sched.aclose, backend=backend))
        assert await sched.submit(3) == 30  # its own loop is unaffected
        await sched.aclose()
        with pytest.raises(ClientClosedError):
            await sched.submit(4)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_scheduler_made_outside_a_loop_ends_with_the_loop_it_served(backend: str) -> None:
    exits: list[int] = []
    sched = BatchScheduler(HeldBatchFn(held=False), max_queue=4, on_exit=lambda: exits.append(1))

    async def main() -> int:
        with anyio.fail_after(5):
            return await sched.submit(3)

    assert anyio.run(main, backend=backend) == 30
    assert exits == [1]
    with pytest.raises(ClientClosedError):
        anyio.run(main, backend=backend)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("first", "second"), [("asyncio", "trio"), ("trio", "asyncio")])
def test_a_scheduler_whose_loop_ended_says_so(first: str, second: str) -> None:
    """Not 'the scheduler is closed': nobody closed it. It served one loop, which ended."""
    scheduler: BatchScheduler[int, int] = BatchScheduler(lambda xs: xs, max_wait_ms=1)

    async def use() -> int:
        return await scheduler.submit(5)

    assert anyio.run(use, backend=first) == 5
    with pytest.raises(ClientClosedError, match=r"the event loop it served has ended.*PerLoop"):
        anyio.run(use, backend=second)


def test_a_keyboard_interrupt_in_the_runner_leaves_the_scheduler_serving_its_loop() -> None:
    """Ctrl-C landing in the runner's task on asyncio ends that task and the loop's
    run_until_complete, not the loop: IPython's and nest_asyncio's loops run on. The scheduler
    took it for the loop's end and refused every later call, and callers it held waited for
    ever (a user trial). Asyncio only, driven by hand: trio never raises KeyboardInterrupt in
    the system task the runner is there."""
    import asyncio

    class Interrupting(BatchStats):
        armed = True

        def record_batch(self, *args: Any) -> None:  # on the loop, in the runner's task
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt
            super().record_batch(*args)

    scheduler = BatchScheduler(
        lambda items: [2 * x for x in items], max_batch_size=4, max_wait_ms=1, stats=Interrupting()
    )

    async def many(n: int) -> list[Any]:
        calls = (scheduler.submit(i) for i in range(n))
        return await asyncio.gather(*calls, return_exceptions=True)

    loop = asyncio.new_event_loop()
    try:
        first = loop.create_task(many(40))
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(first)
        # The loop goes on (the next cell): every caller is answered or told why, none hangs.
        answered = loop.run_until_complete(asyncio.wait_for(asyncio.shield(first), 10))
        for i, result in enumerate(answered):
            told = "KeyboardInterrupt interrupted the scheduler" in str(result)
            assert result == 2 * i or (isinstance(result, InferenceError) and told), repr(result)
        held = [r for r in answered if isinstance(r, BaseException)]
        assert held, "no caller was held by the interrupted runner: the test tests nothing"
        # ...and the scheduler serves new calls on the same loop, then closes.
        assert loop.run_until_complete(asyncio.wait_for(many(10), 10)) == list(range(0, 20, 2))
        loop.run_until_complete(asyncio.wait_for(scheduler.aclose(), 10))
    finally:
        loop.close()


def test_an_item_the_interrupted_runner_had_taken_off_its_queue_is_failed_not_lost() -> None:
    """Ctrl-C landing just after the runner took an item off its stream, before the item was
    in its batch: the item was in neither, and its caller waited for ever (a review)."""
    import asyncio

    scheduler = BatchScheduler(lambda items: [2 * x for x in items], max_batch_size=4)

    class Interrupted:
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def receive_nowait(self) -> Any:
            self.stream.receive_nowait()  # taken off, then Ctrl-C
            raise KeyboardInterrupt

        def __getattr__(self, name: str) -> Any:
            return getattr(self.stream, name)

    async def one() -> Any:
        scheduler._ensure_runner()
        scheduler._receive = Interrupted(scheduler._receive)  # type: ignore[assignment]
        return await scheduler.submit(1)

    loop = asyncio.new_event_loop()
    try:
        first = loop.create_task(one())
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(first)
        with pytest.raises(InferenceError, match="KeyboardInterrupt interrupted the scheduler"):
            loop.run_until_complete(asyncio.wait_for(asyncio.shield(first), 10))
        assert loop.run_until_complete(asyncio.wait_for(scheduler.submit(3), 10)) == 6
        assert (scheduler.queue_depth, scheduler.admitted) == (0, 0)
        loop.run_until_complete(asyncio.wait_for(scheduler.aclose(), 10))
    finally:
        loop.close()
