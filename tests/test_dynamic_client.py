"""``InProcessClient`` in dynamic mode, on one loop: batching, isolation, cancellation, closing.

Every response is compared with the explicit-mode response to the same body (``expected``).
"""

from __future__ import annotations

import base64
import contextlib
import gc
import io
import json
import logging
import math
import random
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
import torch
from concurrency_helpers import (
    body,
    call,
    expected,
    gated_model,
    hooked_model,
    mode_of,
    start_calls,
    wait_until,
    watch_decoding,
)
from helpers import make_body, outputs_close, request_dict
from PIL import Image

from histoinfer.batching import BatchScheduler
from histoinfer.batching import scheduler as scheduler_module
from histoinfer.clients.inprocess import InProcessClient
from histoinfer.errors import (
    ClientClosedError,
    DeadlineExceededError,
    InvalidRequestError,
    ModelExecutionError,
    OverloadedError,
)
from histoinfer.models import ServerModel
from histoinfer.schema import MODES

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def _settled(client: InProcessClient) -> bool:
    """Nothing queued, preparing or in flight, in any mode."""
    return client._calls.active == 0 and all(s.queue_depth == 0 for s in client.stats().values())


def _ended(scheduler: BatchScheduler[Any, Any]) -> bool:
    return scheduler._finished is not None and scheduler._finished.is_set()


async def test_300_concurrent_calls_are_batched_and_match_explicit_mode(
    client: InProcessClient, tiny_model: ServerModel
) -> None:
    count = 300
    want = expected(tiny_model, range(count))
    got: list[str] = [""] * count

    async def one(i: int) -> None:
        got[i] = await call(client, i)

    with anyio.fail_after(100):
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)
    mismatched = [i for i in range(count) if not outputs_close(got[i], want[i])]
    assert mismatched == []
    stats = client.stats()
    for mode in MODES:
        snap = stats[mode]
        assert snap.samples == count // 3
        assert snap.mean_batch_size > 4, snap.batch_size_histogram  # well above 1
        assert max(snap.batch_size_histogram) <= client.max_batch_size
        assert sum(size * n for size, n in snap.batch_size_histogram.items()) == snap.samples
        assert snap.batches == sum(snap.batch_size_histogram.values())
        assert snap.errors == 0 and snap.queue_depth == 0
        assert 0 < snap.forward_ms["p50"] <= snap.forward_ms["p95"] <= snap.forward_ms["p99"]
        assert snap.queue_wait_ms["p50"] <= snap.queue_wait_ms["p95"] <= snap.queue_wait_ms["p99"]


async def test_a_cancellation_storm_leaves_the_scheduler_healthy(
    client: InProcessClient, tiny_model: ServerModel
) -> None:
    count = 150
    rng = random.Random(1234)
    doomed = {i: rng.uniform(0.0, 0.15) for i in range(count) if rng.random() < 0.5}
    got: dict[int, str] = {}
    cancelled: list[int] = []

    async def one(i: int) -> None:
        with anyio.CancelScope() as scope:
            if i in doomed:
                scope.deadline = anyio.current_time() + doomed[i]  # a random moment
            got[i] = await call(client, i)
        if scope.cancelled_caught:
            cancelled.append(i)

    with anyio.fail_after(100):
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)
        assert len(cancelled) >= 0.3 * count
        assert sorted([*got, *cancelled]) == list(range(count))  # nothing lost
        await wait_until(lambda: _settled(client))
        for i, answer in zip(got, expected(tiny_model, list(got)), strict=True):
            assert outputs_close(got[i], answer)
        # Healthy: nothing left queued or announced, and new calls are batched and right.
        for scheduler in client._loops.get().schedulers.values():
            assert scheduler._incoming == 0 and scheduler.queue_depth == 0
        fresh = list(range(count, count + 30))
        again: dict[int, str] = {}

        async def fresh_one(i: int) -> None:
            again[i] = await call(client, i)

        async with anyio.create_task_group() as tg:
            for i in fresh:
                tg.start_soon(fresh_one, i)
    for i, answer in zip(fresh, expected(tiny_model, fresh), strict=True):
        assert outputs_close(again[i], answer)


def _png_b64(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


_BAD_BODIES = [
    "this is not JSON",
    json.dumps({"x": 1}),
    make_body(1000, image_data="!!! not base64 !!!"),
    make_body(1001, image_data=base64.b64encode(b"\x89PNG\r\n\x1a\n truncated").decode()),
    json.dumps({**request_dict(1002), "patch_idx": "seven"}),
]


async def _outcome(
    results: dict[str, Any], key: str, client: InProcessClient, i: int, text: str | None
) -> None:
    """Store the response to ``call(client, i, text)``, or the exception it raised."""
    try:
        results[key] = await call(client, i, text)
    except Exception as exc:
        results[key] = exc


async def test_bad_requests_fail_alone(client: InProcessClient, tiny_model: ServerModel) -> None:
    good = list(range(24))
    results: dict[str, Any] = {}

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in good:
                tg.start_soon(_outcome, results, f"good{i}", client, i, None)
                if i < len(_BAD_BODIES):
                    tg.start_soon(_outcome, results, f"bad{i}", client, i, _BAD_BODIES[i])
    for i in range(len(_BAD_BODIES)):
        assert isinstance(results[f"bad{i}"], InvalidRequestError), results[f"bad{i}"]
    for i, answer in zip(good, expected(tiny_model, good), strict=True):
        assert outputs_close(results[f"good{i}"], answer)
    # They failed before batching: the scheduler saw only the good ones, and no error.
    stats = client.stats()
    assert sum(s.samples for s in stats.values()) == len(good)
    assert sum(s.errors for s in stats.values()) == 0
    assert _settled(client)


async def test_queued_bodies_are_decoded_in_chunks_and_a_bad_one_fails_alone(
    monkeypatch: pytest.MonkeyPatch, tiny_model: ServerModel
) -> None:
    """Bodies that queue up for the decode thread are decoded a chunk per thread hop; a bad
    body in a chunk fails alone, and a lone request is not held for company."""
    from histoinfer.clients import inprocess

    chunks: list[int] = []
    gate = threading.Event()
    real_decode = inprocess._decode_chunk

    def watched_decode(model: ServerModel, share: Any, jobs: list[Any]) -> list[Any]:
        chunks.append(len(jobs))
        gate.wait(30)  # the first chunk holds the decode thread while the others queue up
        return real_decode(model, share, jobs)

    monkeypatch.setattr(inprocess, "_decode_chunk", watched_decode)
    good = list(range(12))
    results: dict[str, Any] = {}

    with InProcessClient(tiny_model, max_batch_size=16, prepare_threads=1) as client:
        # A busy device: the first body is not alone, so it takes the decode stage too.
        device_busy = threading.Event()
        client._device_thread.submit(device_busy.wait, 30)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_outcome, results, "good0", client, 0, None)
                await wait_until(lambda: len(chunks) == 1)
                for i in good[1:]:
                    tg.start_soon(_outcome, results, f"good{i}", client, i, None)
                    if i <= len(_BAD_BODIES):
                        bad = _BAD_BODIES[i - 1]
                        tg.start_soon(_outcome, results, f"bad{i}", client, i, bad)
                [decoder] = client._loops.get().decoders
                await wait_until(lambda: decoder.queue_depth == len(good) - 1 + len(_BAD_BODIES))
                gate.set()
                device_busy.set()
            # The lone first body went alone; the 16 queued behind it went 8 to a hop.
            assert chunks == [1, inprocess.DECODE_CHUNK, inprocess.DECODE_CHUNK]
            for i in range(1, len(_BAD_BODIES) + 1):
                assert isinstance(results[f"bad{i}"], InvalidRequestError), results[f"bad{i}"]
            for i, answer in zip(good, expected(tiny_model, good), strict=True):
                assert outputs_close(results[f"good{i}"], answer)
            assert _settled(client)


async def test_a_lone_request_is_decoded_on_the_device_thread_in_one_hop(
    monkeypatch: pytest.MonkeyPatch, tiny_model: ServerModel
) -> None:
    """Nothing else in flight: the body skips the decode stage and is decoded by the device's
    thread just before its pass; a bad lone body is refused as the decode stage would, alone.
    Once the device is busy, a body takes the decode stage again."""
    from histoinfer.clients import inprocess

    expected(tiny_model, range(5))  # computed (decoded) before the watch starts, in any order
    decoded_on, real_prepare = watch_decoding(monkeypatch)
    # The decode stage's chunks wait while `released` is clear (it is set until needed).
    released, entered = threading.Event(), threading.Event()
    real_chunk = inprocess._decode_chunk

    def gated_chunk(model: ServerModel, share: Any, jobs: list[Any]) -> list[Any]:
        entered.set()
        released.wait(30)
        return real_chunk(model, share, jobs)

    released.set()
    monkeypatch.setattr(inprocess, "_decode_chunk", gated_chunk)
    with InProcessClient(tiny_model) as client, anyio.fail_after(60):
        device = client._device_thread.name
        for i in (0, 1):  # two modes: each has its scheduler
            assert outputs_close(await call(client, i), expected(tiny_model, [i])[0])
        assert decoded_on == [device, device]
        assert client._loops.get().decoders[0].stats.snapshot().samples == 0  # the stage never ran
        for bad in [*_BAD_BODIES, 123, None, ["not", "a", "body"]]:
            with pytest.raises(InvalidRequestError) as refused:
                await client.predict_async(bad)
            with pytest.raises(InvalidRequestError) as staged:
                real_prepare(tiny_model, bad, "predict")
            assert str(refused.value) == str(staged.value)
        assert outputs_close(await call(client, 2), expected(tiny_model, [2])[0])

        decoded_on.clear()
        device_busy = threading.Event()
        client._device_thread.submit(device_busy.wait, 30)
        async with anyio.create_task_group() as tg:
            results: dict[str, Any] = {}
            tg.start_soon(_outcome, results, "busy", client, 3, None)
            await wait_until(lambda: len(decoded_on) == 1)
            device_busy.set()
        assert decoded_on[0] != device
        assert outputs_close(results["busy"], expected(tiny_model, [3])[0])

        decoded_on.clear()  # another mode's call in flight: not alone
        released.clear()
        entered.clear()
        async with anyio.create_task_group() as tg:
            results = {}
            device_busy = threading.Event()
            client._device_thread.submit(device_busy.wait, 30)
            tg.start_soon(_outcome, results, "embed", client, 4, None)  # mode_of(4): embed
            await wait_until(entered.is_set)  # a busy device: the decode stage
            device_busy.set()
            await wait_until(lambda: client._device_thread.idle)
            tg.start_soon(_outcome, results, "predict", client, 3, None)
            await wait_until(lambda: client._loops.get().admitted() == 2)
            released.set()
        assert len(decoded_on) == 2 and device not in decoded_on
        for key, i in (("embed", 4), ("predict", 3)):
            assert outputs_close(results[key], expected(tiny_model, [i])[0])

        decoded_on.clear()  # a big body alone: the decode stage, not the device's thread
        rng = np.random.default_rng(0)
        big = _png_b64(rng.integers(0, 256, (500, 500, 3), dtype=np.uint8))
        assert len(big) > client._lone_body_limit
        json.loads(await client.predict_async(make_body(7, size=500, image_data=big)))
        assert len(decoded_on) == 1 and decoded_on[0] != device

        decoded_on.clear()  # a big image in a small body alone (a flat PNG): handed back by
        flat = _png_b64(np.full((1000, 1000, 3), 200, dtype=np.uint8))  # the device's thread
        assert len(flat) < client._lone_body_limit / 10
        before = client.stats()["predict"]
        flat_body = make_body(8, size=1000, image_data=flat)
        got = await client.predict_async(flat_body)
        assert decoded_on[0] == f"{device}:handed-back"
        assert len(decoded_on) == 2 and not decoded_on[1].startswith(device)
        after = client.stats()["predict"]  # one batch of one: the hand-back counts as nothing
        assert (after.batches - before.batches, after.samples - before.samples) == (1, 1)
        assert _settled(client)
        assert outputs_close(got, client.predict_batch([flat_body])[0])

        # Cancelled while its image waits for the decode stage after the hand-back: it was on
        # its way again (the runner waits for such a caller), and leaves nothing counted.
        decoded_on.clear()
        released.clear()
        entered.clear()
        scheduler = client._loops.get().schedulers["predict"]
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.predict_async, flat_body)
            await wait_until(entered.is_set)
            assert (scheduler.preparing, scheduler.admitted) == (1, 1)
            tg.cancel_scope.cancel()
        released.set()
        assert (scheduler.preparing, scheduler.admitted) == (0, 0) and _settled(client)
        await wait_until(lambda: len(decoded_on) == 2)  # the abandoned decode, finished
        assert decoded_on[0] == f"{device}:handed-back"

        decoded_on.clear()  # an image of twice a tile's area, alone: the device's thread
        edge = math.isqrt(2 * tiny_model.assets.tile_size**2)
        square = _png_b64(np.full((edge, edge, 3), 120, dtype=np.uint8))
        json.loads(await client.predict_async(make_body(9, size=edge, image_data=square)))
        assert decoded_on == [device]
    assert client.stats()["predict"].errors == 0


def test_forward_jobs_decodes_bodies_refuses_bad_ones_alone_and_keeps_tiles(
    tiny_model: ServerModel,
) -> None:
    """The batch function of a dynamic forward scheduler: jobs that came as bodies are decoded
    there (a bad one refused alone, and one whose image declares more than two tiles' pixels
    left undecoded), and keep their tile for a bisected re-run."""
    from histoinfer.clients.inprocess import _forward_jobs, _Job, _prepare, _TooBigHere

    a, b, c = (i for i in range(9) if mode_of(i) == "predict")  # expected() is per mode
    request, tile = _prepare(tiny_model, body(b), "predict")
    flat = _png_b64(np.full((700, 700, 3), 200, dtype=np.uint8))  # 700² > 2 x 224²
    jobs = [
        _Job(body=body(a)),
        _Job(body=_BAD_BODIES[0]),
        _Job(request, tile),
        _Job(body=body(c)),
        _Job(body=make_body(9, size=700, image_data=flat)),
    ]
    results = _forward_jobs(tiny_model, jobs, "predict")
    assert isinstance(results[1], InvalidRequestError)
    assert isinstance(results[4], _TooBigHere) and jobs[4].tile is None
    results = results[:4]
    answers = expected(tiny_model, [a, b, c])
    for job, result, answer in zip(
        (jobs[0], jobs[2], jobs[3]), (results[0], results[2], results[3]), answers, strict=True
    ):
        assert job.request is not None and job.tile is not None and job.body is None
        assert not isinstance(result, InvalidRequestError)
        finished = tiny_model.postprocess(job.request, result, "predict").model_dump_json()
        assert outputs_close(finished, answer)
    assert jobs[1].tile is None and jobs[1].request is None


async def test_a_lone_poisoned_request_names_itself(tiny_model: ServerModel) -> None:
    model, _ = hooked_model(tiny_model, _raise_on_poison)
    poison_body = make_body(
        1000, image_data=_png_b64(np.full((224, 224, 3), _POISON, dtype=np.uint8))
    )
    with InProcessClient(model) as client, anyio.fail_after(60):
        with pytest.raises(ModelExecutionError, match=r"patch_idx=1000.*poisoned tile"):
            await client.predict_async(poison_body)
        assert outputs_close(await call(client, 0), expected(tiny_model, [0])[0])


_POISON = 13  # a tile whose every byte is 13 makes the forward pass raise


def _raise_on_poison(batch: torch.Tensor) -> None:
    if bool((batch.reshape(batch.shape[0], -1) == _POISON).all(dim=1).any()):
        raise RuntimeError("the device choked on a poisoned tile")


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
async def test_a_poisoned_sample_fails_alone_in_its_batch(
    tiny_model: ServerModel, sharded: bool
) -> None:
    # Sharded (what a CPU box with 2-4 threads runs): a failing part fails the pass, which
    # is bisected like any other.
    model, watch = hooked_model(tiny_model, _raise_on_poison, sharded=sharded)
    poisoned = 1000  # not one of the good indices
    poison_body = make_body(
        poisoned, image_data=_png_b64(np.full((224, 224, 3), _POISON, dtype=np.uint8))
    )
    indices = [i for i in range(24) if mode_of(i) == "predict"] + [poisoned]
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        try:
            text = poison_body if i == poisoned else body(i)
            results[i] = await client.predict_async(text)
        except Exception as exc:
            results[i] = exc

    with InProcessClient(model, max_batch_size=16, max_wait_ms=50) as client:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in indices:
                    tg.start_soon(one, i)
        snap = client.stats()["predict"]
    error = results.pop(poisoned)
    assert isinstance(error, ModelExecutionError)
    assert f"patch_idx={poisoned}" in str(error) and "poisoned tile" in str(error)
    good = sorted(results)
    for i, answer in zip(good, expected(tiny_model, good), strict=True):
        assert outputs_close(results[i], answer)
    assert max(watch.sizes) > 1  # it was batched with others, then isolated by bisection
    assert snap.errors == 1 and snap.error_kinds == {"RuntimeError": 1}


@pytest.mark.parametrize("max_queue", [4096, 1], ids=["queued", "waiting-for-room"])
async def test_a_request_not_dispatched_in_time_gets_a_deadline_error(
    tiny_model: ServerModel, max_queue: int
) -> None:
    model, watch, gate = gated_model(tiny_model)
    results: dict[int, Any] = {}
    client = InProcessClient(model, max_batch_size=4, max_queue=max_queue, request_timeout=0.2)
    with client:
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    start_calls(tg, client, [0], results)
                    await wait_until(lambda: watch.calls == 1)  # request 0 holds the device
                    start_calls(tg, client, [3], results)
                    await wait_until(lambda: 3 in results)
                    gate.set()
        finally:
            gate.set()
    assert isinstance(results[3], DeadlineExceededError)
    assert "deadline" in str(results[3])
    assert outputs_close(results[0], expected(tiny_model, [0])[0])  # dispatched: it completes


@pytest.mark.parametrize("dynamic_batching", [True, False], ids=["dynamic", "batch-size-1"])
async def test_a_deadline_past_on_arrival_is_not_called_a_full_queue(
    tiny_model: ServerModel, dynamic_batching: bool
) -> None:
    """Regression: with room in the queue, a deadline already past on arrival was reported as
    'still waiting for room in a full queue' (anyio's wait for room is a checkpoint that the
    expired deadline cancels); at batch size 1, as 'the device was busy with other work'."""
    client = InProcessClient(tiny_model, request_timeout=1e-9, dynamic_batching=dynamic_batching)
    with client, anyio.fail_after(30):
        for _ in range(3):
            with pytest.raises(DeadlineExceededError) as info:
                await client.predict_async(make_body(0))
            message = str(info.value)
            assert "full queue" not in message and "busy" not in message, message
            assert "expired before the request was queued" in message
        assert client.stats()["predict"].samples == 0


@pytest.mark.parametrize("dynamic_batching", [True, False], ids=["dynamic", "batch-size-1"])
async def test_a_deadline_past_on_arrival_beside_a_busy_device_is_worded_alike(
    tiny_model: ServerModel, dynamic_batching: bool
) -> None:
    """With the device busy the body takes the decode stage, whose error said 'still waiting to
    be decoded' for a deadline that had passed before it waited for anything."""
    model, watch, gate = gated_model(tiny_model)
    busy = InProcessClient(model, dynamic_batching=dynamic_batching)
    late = InProcessClient(model, request_timeout=1e-9, dynamic_batching=dynamic_batching)
    results: dict[int, Any] = {}
    with busy, late:
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    start_calls(tg, busy, [0], results)
                    await wait_until(lambda: watch.calls == 1)  # the device is held
                    with pytest.raises(DeadlineExceededError) as info:
                        await late.predict_async(make_body(1))
                    gate.set()
        finally:
            gate.set()
    message = str(info.value)
    assert "expired before the request was queued" in message, message
    assert outputs_close(results[0], expected(tiny_model, [0])[0])


@pytest.mark.parametrize("dynamic_batching", [True, False], ids=["dynamic", "batch-size-1"])
async def test_a_pass_whose_caller_left_during_it_is_counted_when_it_ends(
    tiny_model: ServerModel, dynamic_batching: bool
) -> None:
    """Regression (batch size 1): the pass ran, but the statistics never said so."""
    model, watch, gate = gated_model(tiny_model)
    client = InProcessClient(model, dynamic_batching=dynamic_batching)
    with client:
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:

                    async def leaves_during_its_pass() -> None:
                        with anyio.CancelScope() as scope:
                            tg.start_soon(_cancel_when, scope, lambda: watch.calls == 1)
                            await client.predict_async(make_body(0))

                    tg.start_soon(leaves_during_its_pass)
                gate.set()
                await wait_until(lambda: client.stats()["predict"].batches == 1)
        finally:
            gate.set()
        snapshot = client.stats()["predict"]
        assert (snapshot.samples, snapshot.cancelled, snapshot.errors) == (1, 0, 0)


async def _cancel_when(scope: anyio.CancelScope, condition: Callable[[], bool]) -> None:
    await wait_until(condition)
    scope.cancel()


async def test_a_body_whose_deadline_passes_while_it_waits_for_the_decode_stage_is_not_decoded(
    monkeypatch: pytest.MonkeyPatch, tiny_model: ServerModel
) -> None:
    """Under overload, decoding a body that can no longer reach the model in time would take
    CPU from the calls that still can: it is refused with the call's own deadline error."""
    from histoinfer.clients import inprocess

    released, entered = threading.Event(), threading.Event()
    chunks: list[int] = []  # the patch_idx of every body a decode chunk got
    real_chunk = inprocess._decode_chunk

    def gated_chunk(model: ServerModel, share: Any, jobs: list[Any]) -> list[Any]:
        chunks.extend(json.loads(job_body)["patch_idx"] for job_body, _ in jobs)
        entered.set()
        released.wait(30)
        return real_chunk(model, share, jobs)

    monkeypatch.setattr(inprocess, "_decode_chunk", gated_chunk)
    results: dict[int, Any] = {}
    client = InProcessClient(tiny_model, prepare_threads=1, request_timeout=0.2)
    device_busy = threading.Event()
    try:
        with anyio.fail_after(30):
            client._device_thread.submit(device_busy.wait, 30)  # nobody is alone
            async with anyio.create_task_group() as tg:
                start_calls(tg, client, [0], results)
                await wait_until(entered.is_set)  # 0 is being decoded; 3 waits for its turn
                start_calls(tg, client, [3], results)
                await anyio.sleep(0.3)  # past both deadlines
                released.set()
                device_busy.set()
    finally:
        released.set()
        device_busy.set()
        client.close()
    assert chunks == [request_dict(0)["patch_idx"]]  # 3 was never decoded
    for i, detail in ((0, "expired before the request was queued"), (3, "waiting to be decoded")):
        assert isinstance(results[i], DeadlineExceededError), results[i]
        assert detail in str(results[i]) and str(results[i]).startswith("h1:")
    snap = client.stats()[mode_of(3)]
    assert snap.error_kinds == {"deadline": 2} and snap.samples == 0


async def test_a_body_goes_to_an_idle_decode_thread_not_behind_a_busy_one(
    monkeypatch: pytest.MonkeyPatch, tiny_model: ServerModel
) -> None:
    """Two decode threads, one decoding: the next body goes to the other at once."""
    from histoinfer.clients import inprocess

    released = threading.Event()
    decoding: list[int] = []  # the thread of every chunk that started
    real_chunk = inprocess._decode_chunk

    def gated_chunk(model: ServerModel, share: Any, jobs: list[Any]) -> list[Any]:
        decoding.append(threading.get_ident())
        released.wait(30)
        return real_chunk(model, share, jobs)

    monkeypatch.setattr(inprocess, "_decode_chunk", gated_chunk)
    results: dict[int, Any] = {}
    device_busy = threading.Event()
    with InProcessClient(tiny_model, prepare_threads=2) as client:
        try:
            with anyio.fail_after(30):
                client._device_thread.submit(device_busy.wait, 30)  # nobody is alone
                async with anyio.create_task_group() as tg:
                    start_calls(tg, client, [0], results)
                    await wait_until(lambda: len(decoding) == 1)
                    start_calls(tg, client, [3], results)
                    await wait_until(lambda: len(decoding) == 2)  # both decoding at once
                    released.set()
                    device_busy.set()
        finally:
            released.set()
            device_busy.set()
    assert decoding[0] != decoding[1]
    for i, answer in zip((0, 3), expected(tiny_model, [0, 3]), strict=True):
        assert outputs_close(results[i], answer)


async def test_overload_reject_mode_answers_overloaded_instead_of_waiting(
    tiny_model: ServerModel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler_module, "_WARNED_QUEUE_BOUNDS", set())
    model, watch, gate = gated_model(tiny_model)
    results: dict[int, Any] = {}
    with caplog.at_level(logging.WARNING, logger="histoinfer.batching"):
        client = InProcessClient(model, max_batch_size=4, max_queue=2, overload="reject")
    # Said when the client is made (a server's start-up), not at its first call.
    assert caplog.text.count("max_queue=2 is below max_batch_size=4") == 1
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                start_calls(tg, client, [0], results)
                await wait_until(lambda: watch.calls == 1)
                start_calls(tg, client, [3], results)
                await wait_until(lambda: client._calls.active == 2)
                with pytest.raises(OverloadedError):
                    await client.predict_async(body(6))
                gate.set()
    finally:
        gate.set()
        await client.aclose()
    assert caplog.text.count("max_queue=2 is below max_batch_size=4") == 1  # not again
    want = expected(tiny_model, [0, 3])
    assert outputs_close(results[0], want[0]) and outputs_close(results[3], want[1])


async def test_aclose_finishes_in_flight_work_then_refuses(tiny_model: ServerModel) -> None:
    client = InProcessClient(tiny_model, max_batch_size=8)
    indices = list(range(40))
    results: dict[int, Any] = {}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            start_calls(tg, client, indices, results)
            await wait_until(lambda: client._calls.active == len(indices))
            schedulers = list(client._loops.get().schedulers.values())
            await client.aclose()
            assert len(results) == len(indices)  # aclose returned after all of them
        with pytest.raises(ClientClosedError):
            await client.predict_async(body(0))
        # This loop lives on, but the client's runner tasks in it have ended.
        await wait_until(lambda: all(_ended(s) for s in schedulers))
        assert client._loops._values == {}
    with pytest.raises(ClientClosedError):
        client.predict(body(0))
    with pytest.raises(ClientClosedError):
        client.predict_batch([body(0)])
    for i, answer in zip(indices, expected(tiny_model, indices), strict=True):
        assert outputs_close(results[i], answer)


@pytest.mark.parametrize("where", ["worker thread", "loop thread"])
async def test_sync_close_during_async_calls(tiny_model: ServerModel, where: str) -> None:
    """From a worker thread close() waits; on the loop's own thread it must not (deadlock)."""
    client = InProcessClient(tiny_model, max_batch_size=8)
    indices = list(range(12))
    results: dict[int, Any] = {}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            start_calls(tg, client, indices, results)
            await wait_until(lambda: client._calls.active == len(indices))
            if where == "worker thread":
                await anyio.to_thread.run_sync(client.close)
                assert len(results) == len(indices)
            else:
                client.close()
            assert client.closed
            with pytest.raises(ClientClosedError):
                await client.predict_async(body(0))
    for i, answer in zip(indices, expected(tiny_model, indices), strict=True):
        assert outputs_close(results[i], answer)


def test_loops_that_used_fewer_decoders_than_allowed_leave_nothing_unclosed(
    tiny_model: Any,
) -> None:
    """A decode scheduler never used in a loop kept its streams open past the loop's end (a
    ResourceWarning when collected); schedulers now make their streams when they start."""

    async def lone() -> None:
        with anyio.fail_after(60):
            await client.predict_async(make_body(0))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with InProcessClient(tiny_model, prepare_threads=3) as client:
            for backend in ("asyncio", "trio"):
                anyio.run(lone, backend=backend)
        gc.collect()
    assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.mark.anyio
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "batch-size-1"])
async def test_a_call_waiting_for_a_busy_device_meets_its_deadline_and_its_cancellation(
    tiny_model: ServerModel, dynamic: bool
) -> None:
    """The device's thread busy with other work (another client's pass, a big ``*_batch``):
    ``request_timeout`` fails a call at its deadline, and a cancelled call leaves at once; in
    both cases its tile never reaches the model. Both modes."""
    model, watch = hooked_model(tiny_model)
    with InProcessClient(model, dynamic_batching=dynamic, request_timeout=0.2) as client:
        with anyio.fail_after(30):
            release = threading.Event()
            client._device_thread.submit(release.wait, 20)
            started = time.perf_counter()
            with pytest.raises(DeadlineExceededError, match="within its deadline"):
                await client.predict_async(body(0))
            assert time.perf_counter() - started < 5  # at its deadline, not when the device frees
            with anyio.move_on_after(0.05) as scope:
                await client.predict_async(body(1))
            assert scope.cancelled_caught
            release.set()
            assert outputs_close(await call(client, 3), expected(tiny_model, [3])[0])
        assert watch.calls == 1  # only the last call reached the model
        assert client.stats()["predict"].error_kinds == {"deadline": 1}


class _RecordingLock:
    """A ``device_lock`` that counts the passes that took it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered = 0

    def __enter__(self) -> None:
        self.lock.acquire()
        self.entered += 1

    def __exit__(self, *exc_info: object) -> None:
        self.lock.release()


@pytest.mark.anyio
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "batch-size-1"])
async def test_device_lock_is_held_by_every_forward_pass_and_only_by_them(
    tiny_model: ServerModel, dynamic: bool
) -> None:
    """SPEC §2.2's "device lock": every pass of the client (async calls, ``*_batch``) takes
    it, so the caller's own work on the device under the same lock never overlaps one."""
    lock = _RecordingLock()
    with InProcessClient(
        tiny_model, dynamic_batching=dynamic, max_batch_size=4, device_lock=lock
    ) as client:
        with anyio.fail_after(60):
            indices = list(range(6))
            async with anyio.create_task_group() as tg:
                answers: dict[int, str] = {}

                async def one(i: int) -> None:
                    answers[i] = await call(client, i)

                for i in indices:
                    tg.start_soon(one, i)
            assert all(
                outputs_close(answers[i], e)
                for i, e in zip(indices, expected(tiny_model, indices), strict=True)
            )
            async_passes = sum(s.batches for s in client.stats().values())
            assert lock.entered == async_passes > 0
            await anyio.to_thread.run_sync(client.predict_batch, [body(0)] * 9)  # 3 chunks
            assert lock.entered == async_passes + 3
            # The caller's own work holds the lock: the call's pass waits for it.
            lock.lock.acquire()
            released_at = time.perf_counter() + 0.3
            threading.Timer(0.3, lock.lock.release).start()
            answer = await client.predict_async(body(0))
            assert time.perf_counter() >= released_at - 0.01
            assert outputs_close(answer, expected(tiny_model, [0])[0])


def test_device_lock_must_be_a_context_manager(tiny_model: ServerModel) -> None:
    with pytest.raises(TypeError, match=r"device_lock must be a lock .* got int"):
        InProcessClient(tiny_model, device_lock=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"device_lock must be a lock .* got ABCMeta"):
        InProcessClient(tiny_model, device_lock=contextlib.nullcontext)  # the class
