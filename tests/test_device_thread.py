"""The device's one forward thread, and awaiting its results from asyncio and trio."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import anyio
import pytest
import torch
from concurrency_helpers import body, hooked_model, join_threads, start_threads

from histoinfer import InProcessClient, ServerModel
from histoinfer.batching import BatchScheduler, wait_future
from histoinfer.clients.cores import CoreShare
from histoinfer.clients.inprocess import _forward, _prepare
from histoinfer.models import build_server_model, shards
from histoinfer.models.device_thread import (
    DeviceThread,
    device_key,
    device_thread,
    helper_threads,
)
from histoinfer.models.openmp import per_thread_counts_supported, thread_count


def test_calls_run_in_order_on_one_thread_and_errors_reach_only_their_caller() -> None:
    worker = DeviceThread("test-device")
    seen: list[tuple[int, int]] = []

    def record(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    def fail() -> None:
        raise ValueError("bad batch")

    futures = [worker.submit(record, i) for i in range(20)]
    with pytest.raises(ValueError, match="bad batch"):
        worker.call(fail)
    assert worker.call(record, 20) == 400  # the thread survived the error
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(20)]
    assert [i for i, _ in seen] == list(range(21))
    assert {ident for _, ident in seen} == {worker.ident}
    assert worker.ident != threading.get_ident()


def _most_at_once(worker: DeviceThread, callers: int) -> int:
    """The most jobs that ever ran at once while ``callers`` threads each called 10."""
    running = 0
    most = 0
    guard = threading.Lock()

    def job() -> None:
        nonlocal running, most
        with guard:
            running += 1
            most = max(most, running)
        time.sleep(0.001)
        with guard:
            running -= 1

    threads, errors = start_threads([lambda: [worker.call(job) for _ in range(10)]] * callers)
    join_threads(threads, timeout=30)
    assert not errors
    return most


def test_calls_from_many_threads_never_overlap() -> None:
    assert _most_at_once(DeviceThread("test-device"), callers=6) == 1


def test_a_job_that_submits_another_runs_it_inline_instead_of_waiting_for_itself() -> None:
    worker = DeviceThread("test-device")
    outer: Future[int] = worker.submit(lambda: worker.call(lambda: threading.get_ident()))
    assert outer.result(timeout=10) == worker.ident


def test_one_thread_per_device_string() -> None:
    assert device_thread("cpu") is device_thread(torch.device("cpu"))
    assert device_thread("cpu") is not device_thread("meta")


def test_a_bare_cuda_is_the_current_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda`` and ``cuda:1`` (the current device) are one GPU: one thread, one lock."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert device_key("cuda") == device_key(torch.device("cuda:1")) == "cuda:1"
    assert device_thread("cuda") is device_thread("cuda:1")
    assert device_thread("cuda") is not device_thread("cuda:0")
    assert helper_threads("cuda", 1) == helper_threads("cuda:1", 1)
    assert device_key("cpu") == "cpu"


def test_every_cpu_index_is_the_one_cpu() -> None:
    """A model on "cpu:0" had a forward thread of its own beside "cpu"'s: two passes at once
    on the same cores (a user trial, with "cpu:7")."""
    assert device_key("cpu:0") == device_key(torch.device("cpu", 3)) == "cpu"
    assert device_thread("cpu:0") is device_thread("cpu")


def test_the_load_time_probe_runs_on_the_device_thread(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where: list[int] = []
    original = ServerModel._check_outputs

    def probe(self: ServerModel) -> None:
        where.append(threading.get_ident())
        original(self)

    monkeypatch.setattr(ServerModel, "_check_outputs", probe)
    build_server_model("h1", tiny_checkpoint)
    assert where == [device_thread("cpu").ident]


def _forward_threads(model: ServerModel) -> tuple[ServerModel, list[int]]:
    idents: list[int] = []
    watched, _ = hooked_model(model, lambda batch: idents.append(threading.get_ident()))
    return watched, idents


def test_explicit_batches_run_on_the_device_thread(tiny_model: ServerModel) -> None:
    model, idents = _forward_threads(tiny_model)
    with InProcessClient(model, max_batch_size=2, dynamic_batching=False) as client:
        client.predict_batch([body(i) for i in range(5)])  # three chunks
        client.predict(body(0))
    assert len(idents) == 4 and set(idents) == {device_thread("cpu").ident}


@pytest.mark.anyio
@pytest.mark.parametrize("dynamic", [True, False])
async def test_async_calls_run_on_the_device_thread(tiny_model: ServerModel, dynamic: bool) -> None:
    model, idents = _forward_threads(tiny_model)
    with anyio.fail_after(60):
        client = InProcessClient(model, max_batch_size=4, dynamic_batching=dynamic)
        async with client, anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(client.predict_async, body(i))
    assert idents and set(idents) == {device_thread("cpu").ident}


@pytest.mark.anyio
async def test_wait_future_returns_what_another_thread_completes() -> None:
    future: Future[str] = Future()
    threading.Timer(0.05, future.set_result, args=("done",)).start()
    with anyio.fail_after(10):
        assert await wait_future(future) == "done"
        failed: Future[str] = Future()
        failed.set_exception(KeyError("gone"))
        with pytest.raises(KeyError):
            await wait_future(failed)


@pytest.mark.anyio
async def test_a_waiter_cancelled_before_its_job_starts_cancels_it() -> None:
    """Behind another job on a busy thread: the cancelled caller leaves at once, and its job
    never runs."""
    worker = DeviceThread("test-device")
    release = threading.Event()
    ran: list[str] = []
    worker.submit(release.wait, 10)  # the thread is busy
    future = worker.submit(ran.append, "ran")
    with anyio.fail_after(10):
        with anyio.move_on_after(0.05) as scope:
            await wait_future(future)
        assert scope.cancelled_caught and future.cancelled()
        release.set()
        await anyio.to_thread.run_sync(worker.call, lambda: None)  # the queue has drained
    assert ran == []


@pytest.mark.anyio
async def test_a_waiter_cancelled_while_its_job_runs_leaves_at_once() -> None:
    """The job completes without it (a thread cannot be interrupted mid-job)."""
    worker = DeviceThread("test-device")
    release, started = threading.Event(), threading.Event()

    def job() -> str:
        started.set()
        return "result" if release.wait(10) else "timed out"

    future = worker.submit(job)
    with anyio.fail_after(10):
        await anyio.to_thread.run_sync(started.wait, 10)
        with anyio.move_on_after(0.05) as scope:
            await wait_future(future)
        assert scope.cancelled_caught and not future.done()
        release.set()
        assert await wait_future(future) == "result"


@pytest.mark.anyio
async def test_wait_future_start_by_times_out_only_a_job_not_yet_started() -> None:
    worker = DeviceThread("test-device")
    release, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def slow() -> str:
        started.set()
        release.wait(10)
        return "slow"

    first = worker.submit(slow)
    second = worker.submit(ran.append, "second")
    with anyio.fail_after(10):
        await anyio.to_thread.run_sync(started.wait, 10)
        with pytest.raises(TimeoutError):
            await wait_future(second, start_by=time.perf_counter() + 0.05)
        assert second.cancelled()
        # Started in time: waited for to the end, however long it takes.
        threading.Timer(0.1, release.set).start()
        assert await wait_future(first, start_by=time.perf_counter()) == "slow"
    assert ran == []


@pytest.mark.anyio
async def test_a_scheduler_runs_its_batches_on_the_thread_it_is_given() -> None:
    worker = DeviceThread("test-device")
    idents: list[int] = []

    def double(items: list[int]) -> list[int]:
        idents.append(threading.get_ident())
        if 13 in items:
            raise ValueError("13 is poison")
        return [2 * i for i in items]

    scheduler = BatchScheduler(double, max_batch_size=8, max_wait_ms=20, thread=worker.submit)
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            results[i] = await scheduler.submit(i)
        except ValueError as exc:
            results[i] = exc

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, i)
    await scheduler.aclose()
    assert {i: r for i, r in results.items() if i != 13} == {i: 2 * i for i in range(20) if i != 13}
    assert isinstance(results[13], ValueError)  # bisected: only the poisoned item failed
    assert set(idents) == {worker.ident}


def test_thread_count_changes_only_the_calling_thread_and_is_restored() -> None:
    if not per_thread_counts_supported():
        pytest.skip("torch's OpenMP runtime here is not libgomp: per-thread counts unsupported")
    full = torch.get_num_threads()
    seen: dict[str, int] = {}

    def inside() -> None:
        with thread_count(1):
            seen["inside"] = torch.get_num_threads()
            other = threading.Thread(target=lambda: seen.update(other=torch.get_num_threads()))
            other.start()
            other.join(10)
        seen["after"] = torch.get_num_threads()

    worker = DeviceThread("test-device")
    worker.call(inside)
    assert seen == {"inside": 1, "other": full, "after": full}
    assert torch.get_num_threads() == full


def test_a_loaded_cpu_forward_pass_leaves_the_decoders_their_cores(
    tiny_model: ServerModel,
) -> None:
    if not per_thread_counts_supported():
        pytest.skip("torch's OpenMP runtime here is not libgomp: per-thread counts unsupported")
    threads: list[int] = []
    model, _ = hooked_model(tiny_model, lambda batch: threads.append(torch.get_num_threads()))
    worker = device_thread("cpu")
    full = worker.call(torch.get_num_threads)
    share = CoreShare(decode_threads=1)
    share.record_decode(10, 0.010)  # 1 ms a tile
    share.record_forward(10, 0.001, full, full)  # 0.1 ms a tile: leaving a core pays
    size = tiny_model.assets.tile_size
    tile = torch.zeros(3, size, size, dtype=torch.uint8)
    for loaded in (True, False):
        worker.call(_forward, model, [tile], "predict", share, lambda v=loaded: v)
    assert threads == [max(1, full - 1), full]  # a lone pass gets every core
    assert worker.call(torch.get_num_threads) == full  # restored for the next pass


def test_a_loaded_sharded_pass_is_recorded(tiny_model: ServerModel) -> None:
    """A sharded pass keeps its workers (one thread each), but its cost is what a later
    one-tile pass of the same burst weighs leaving a core against: without it, a burst whose
    passes are all sharded would never know the forward pass's cost."""
    worker = device_thread("cpu")
    full = worker.call(torch.get_num_threads)
    if not shards.available(tiny_model, full):
        pytest.skip("passes are not sharded on this machine")
    threads: list[int] = []
    model, watch = hooked_model(
        tiny_model, lambda batch: threads.append(torch.get_num_threads()), sharded=True
    )
    size = tiny_model.assets.tile_size
    tiles = [torch.zeros(3, size, size, dtype=torch.uint8)] * 2
    share = CoreShare(decode_threads=1)
    worker.call(_forward, model, tiles, "predict", share, lambda: False)
    assert share._forward.per_tile() is None  # not loaded: nothing learned
    worker.call(_forward, model, tiles, "predict", share, lambda: True)
    per_tile = share._forward.per_tile()
    assert per_tile is not None and per_tile > 0
    assert watch.sizes == [1, 1, 1, 1]  # both passes in two parts of one tile (small batches)
    assert set(threads) == {1}  # every part on a single-threaded worker, both times


def test_a_pass_left_on_fewer_threads_is_not_sharded_by_their_count(
    tiny_model: ServerModel,
) -> None:
    """With more torch threads than passes are sharded for (5), a loaded pass that leaves the
    decoders a core runs on 4: whole, on torch's threads, not sharded as a 4-thread box's
    would be (the plan is made for every thread the pass could have had)."""
    if not per_thread_counts_supported():
        pytest.skip("torch's OpenMP runtime here is not libgomp: per-thread counts unsupported")
    wide = shards.MAX_WORKERS + 1
    threads: list[int] = []
    model, watch = hooked_model(
        tiny_model, lambda batch: threads.append(torch.get_num_threads()), sharded=True
    )
    size = tiny_model.assets.tile_size
    tiles = [torch.zeros(3, size, size, dtype=torch.uint8)] * 4
    share = CoreShare(decode_threads=1)  # nothing measured yet: a loaded pass leaves a core

    def loaded_pass_on_a_wide_box() -> None:
        with thread_count(wide):
            _forward(model, tiles, "predict", share, lambda: True)

    device_thread("cpu").call(loaded_pass_on_a_wide_box)
    assert watch.sizes == [4]  # one piece
    assert threads == [wide - 1]  # a core left to the decoders


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _threads_while(work: Callable[[], object]) -> int:
    """How many more OS threads the process has while a fresh thread that ran ``work`` lives."""
    done, release = threading.Event(), threading.Event()

    def run() -> None:
        work()
        done.set()
        release.wait(30)

    before = _os_threads()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert done.wait(30), "the work hung"
    during = _os_threads()
    release.set()
    thread.join(30)
    return during - before - 1  # not counting the thread itself


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
    reason="needs Linux's /proc and more than one torch thread to see an OpenMP team",
)
def test_decoding_a_body_runs_no_parallel_torch_op(tiny_model: ServerModel) -> None:
    """A parallel op on a decode thread gives it an OpenMP team of its own and puts the whole
    process in libgomp's slow regime (a lone request ~1.3x as long, measured: a
    ``.contiguous()`` copy of each tile did exactly that)."""
    big = torch.ones(4_000_000)
    assert _threads_while(lambda: big.add_(1)) >= 1  # the check sees a team being made
    bodies = [body(i) for i in range(4)]
    assert _threads_while(lambda: [_prepare(tiny_model, b, "predict") for b in bodies]) <= 0


_EXIT_WHILE_BUSY = """
import sys, threading, torch
from histoinfer.models import build_server_model
from histoinfer.models.device_thread import device_thread
model = build_server_model("h1", sys.argv[1])
size = model.assets.tile_size
batch = torch.zeros(64, 3, size, size, dtype=torch.uint8)
started = threading.Event()
def work():
    started.set()
    for _ in range(10):
        model.forward_batch(batch, "predict")
device_thread("cpu").submit(work)
started.wait()
sys.exit(3)  # e.g. a script whose main thread raised while a batch runs
"""


def test_the_process_exits_cleanly_while_a_forward_pass_runs(tiny_checkpoint: Path) -> None:
    """A daemon thread still inside torch when the interpreter exits aborts the process (exit
    status 134); the device thread lets its pass finish first."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WHILE_BUSY, str(tiny_checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_a_stopped_device_thread_runs_later_work_in_the_caller() -> None:
    worker = DeviceThread("test-device")
    assert worker.call(threading.get_ident) == worker.ident
    queued_behind = threading.Event()

    def slow() -> None:
        queued_behind.wait(10)

    first = worker.submit(slow)
    second = worker.submit(lambda: "queued before stop")
    queued_behind.set()
    worker.stop(timeout=10)  # finishes what was queued before it, then ends the thread
    assert first.result(timeout=10) is None
    assert second.result(timeout=10) == "queued before stop"
    assert worker.call(threading.get_ident) == threading.get_ident()


def test_jobs_run_one_at_a_time_even_after_stop_when_callers_run_them() -> None:
    worker = DeviceThread("test-device")
    worker.call(lambda: None)
    worker.stop(timeout=10)  # from now on every caller runs its job in its own thread
    assert worker.call(threading.get_ident) == threading.get_ident()
    assert _most_at_once(worker, callers=4) == 1


def test_a_loaded_pass_on_the_whole_team_is_not_recorded(tiny_model: ServerModel) -> None:
    """Beside busy decoders such a pass measures the team's contention, not its own cost;
    recorded, it kept the choice on the team for good (batch-size-1 calls, session 8)."""
    if not per_thread_counts_supported():
        pytest.skip("torch's OpenMP runtime here is not libgomp: per-thread counts unsupported")
    worker = device_thread("cpu")
    full = worker.call(torch.get_num_threads)
    if full < 2:
        pytest.skip("one torch thread: there is no core to leave")
    size = tiny_model.assets.tile_size
    tile = torch.zeros(3, size, size, dtype=torch.uint8)
    share = CoreShare(decode_threads=1)
    share.record_decode(10, 0.010)  # 1 ms a tile
    share.record_forward(10, 10.0, full, full)  # 1 s a tile: stays on the team
    assert share.cores_to_leave(full) == 0
    before = share._forward.per_tile()
    worker.call(_forward, tiny_model, [tile], "predict", share, lambda: True)
    assert share._forward.per_tile() == before
