"""A failed call leaves no reference cycle through histoinfer's frames.

An exception's traceback holds the frames it passed through, and each frame its locals: a frame
that also holds the exception (a future, a list of results) is a cycle that reference counting
never frees. Until the collector's next full pass it kept the failed call's bodies, tiles and
batch: a stream of refused requests held 120-280 MB of garbage in one process (a soak trial).
Each test fails a call one way and asserts that the collector finds none of our frames.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
import torch
from concurrency_helpers import hooked_model
from helpers import make_body, serving

import histoinfer
from histoinfer.batching import BatchScheduler
from histoinfer.clients.inprocess import InProcessClient
from histoinfer.errors import InferenceError, ModelExecutionError
from histoinfer.models import ServerModel
from histoinfer.server.app import create_app

pytestmark = pytest.mark.timeout(120)

OURS = str(Path(histoinfer.__file__).parent)


@contextmanager
def cyclic_frames() -> Iterator[list[str]]:
    """Frames of histoinfer's code that the block left in cyclic garbage, named. No log
    records are made meanwhile: pytest keeps them, and a record of a warning whose arguments
    hold an error (the scheduler's "bisecting") would keep a cycle reachable, and hide it."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found: list[str] = []
    was_disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield found
    finally:
        logging.disable(was_disabled)
        gc.collect()
        found += [
            f"{o.f_code.co_name} ({Path(o.f_code.co_filename).name})"
            for o in gc.garbage
            if isinstance(o, FrameType) and o.f_code.co_filename.startswith(OURS)
        ]
        gc.garbage.clear()
        gc.set_debug(0)


async def _error_of(call: Awaitable[object]) -> str:
    """The call's error class. Only its name is kept: the error itself, held by this test's
    live frame, would keep every frame of its traceback reachable, and hide a cycle."""
    try:
        await call
    except (InferenceError, ValueError) as exc:
        return type(exc).__name__
    return "none"


def _sync_error_of(call: Callable[[], object]) -> str:
    try:
        call()
    except InferenceError as exc:
        return type(exc).__name__
    return "none"


async def _again_watched(step: Callable[[], Awaitable[None]]) -> list[str]:
    """``step()`` once to warm up, then again within :func:`cyclic_frames`: what it found."""
    await step()
    with cyclic_frames() as found:
        await step()
    return found


async def _twice(call: Callable[[], Awaitable[object]], expected: str) -> list[str]:
    """``call()`` fails with ``expected``: once to warm up, then within :func:`cyclic_frames`."""

    async def fails() -> None:
        assert await _error_of(call()) == expected

    return await _again_watched(fails)


GOOD = make_body(0)
WRONG_SIZE = make_body(1, width=200)  # the tile is 224 px
NOT_JSON = GOOD[:-20]
# More pixels than a lone request is decoded with on the device's thread: the decode stage's.
BIG_WRONG_SIZE = make_body(2, size=512, width=500)

REFUSALS = {
    "wrong size": lambda c: c.predict_async(WRONG_SIZE),
    "not JSON": lambda c: c.embed_async(NOT_JSON),
    "big image, decode stage": lambda c: c.predict_async(BIG_WRONG_SIZE),
    "batch with a bad body": lambda c: c.predict_batch_async([GOOD, WRONG_SIZE]),
}


@pytest.mark.anyio
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "explicit"])
@pytest.mark.parametrize("kind", list(REFUSALS))
async def test_a_refused_request_leaves_no_cycle(
    tiny_model: ServerModel, kind: str, dynamic: bool
) -> None:
    async with InProcessClient(tiny_model, dynamic_batching=dynamic) as client:
        with anyio.fail_after(60):
            found = await _twice(lambda: REFUSALS[kind](client), "InvalidRequestError")
    assert not found, found


@pytest.mark.anyio
async def test_refusals_among_concurrent_requests_leave_no_cycle(tiny_model: ServerModel) -> None:
    async with InProcessClient(tiny_model, max_batch_size=8) as client:
        errors: list[str] = []

        async def one(i: int) -> None:
            errors.append(await _error_of(client.predict_async(WRONG_SIZE if i % 2 else GOOD)))

        with anyio.fail_after(60), cyclic_frames() as found:
            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(one, i)
    assert sorted(errors) == ["InvalidRequestError"] * 8 + ["none"] * 8
    assert not found, found


_POISON = 13  # a tile whose every byte is 13 makes the forward pass raise


def _raise_on_poison(batch: torch.Tensor) -> None:
    if bool((batch.reshape(batch.shape[0], -1) == _POISON).all(dim=1).any()):
        raise RuntimeError("the device choked on a poisoned tile")


def _poisoned_body() -> str:
    from test_dynamic_client import _png_b64

    return make_body(3, image_data=_png_b64(np.full((224, 224, 3), _POISON, dtype=np.uint8)))


@pytest.mark.anyio
async def test_a_failed_forward_pass_leaves_no_cycle(tiny_model: ServerModel) -> None:
    model, _ = hooked_model(tiny_model, _raise_on_poison)
    poisoned = _poisoned_body()
    async with InProcessClient(model, max_batch_size=8) as client:
        with anyio.fail_after(60):
            found = await _twice(lambda: client.predict_async(poisoned), "ModelExecutionError")
            found_in_call = await _twice(
                lambda: client.predict_batch_async([GOOD, poisoned]), "ModelExecutionError"
            )

            async def alongside() -> list[str]:  # bisected out of a batch of others
                errors: list[str] = []

                async def one(body: str) -> None:
                    errors.append(await _error_of(client.predict_async(body)))

                async with anyio.create_task_group() as tg:
                    for i in range(7):
                        tg.start_soon(one, make_body(10 + i))
                    tg.start_soon(one, poisoned)
                return errors

            with cyclic_frames() as found_in_batch:
                errors = await alongside()
    assert sorted(errors) == ["ModelExecutionError"] + ["none"] * 7
    assert not found, "\n".join(found)
    assert not found_in_call, "\n".join(found_in_call)
    assert not found_in_batch, "\n".join(found_in_batch)


@pytest.mark.anyio
async def test_a_caller_that_leaves_during_its_failing_pass_leaves_no_cycle(
    tiny_model: ServerModel,
) -> None:
    def slow_poison(batch: torch.Tensor) -> None:
        time.sleep(0.2)
        _raise_on_poison(batch)

    model, _ = hooked_model(tiny_model, slow_poison)
    poisoned = _poisoned_body()
    async with InProcessClient(model, max_batch_size=8) as client:

        async def leave_mid_pass() -> None:
            async def one() -> None:
                with anyio.move_on_after(0.1):
                    await _error_of(client.predict_async(poisoned))

            async with anyio.create_task_group() as tg:
                tg.start_soon(one)
                tg.start_soon(one)
            await anyio.sleep(0.8)  # the passes fail, for nobody

        with anyio.fail_after(60):
            found = await _again_watched(leave_mid_pass)
    assert not found, found


@pytest.mark.anyio
async def test_a_cancelled_batch_call_leaves_no_cycle(tiny_model: ServerModel) -> None:
    model, _ = hooked_model(tiny_model, lambda batch: time.sleep(0.2))
    async with InProcessClient(model, max_batch_size=1) as client:

        async def cancel_mid_call() -> None:
            with anyio.move_on_after(0.05):
                await client.predict_batch_async([make_body(i) for i in range(3)])
            await anyio.sleep(0.8)  # its thread stops at its next pass, for nobody

        with anyio.fail_after(60):
            found = await _again_watched(cancel_mid_call)
    assert not found, found


@pytest.mark.anyio
async def test_a_sync_call_refused_in_a_worker_thread_leaves_no_cycle(
    tiny_model: ServerModel,
) -> None:
    # What a sync endpoint of a FastAPI app does: the call runs in the host's loop.
    async with InProcessClient(tiny_model) as client:

        def both() -> list[str]:
            single = _sync_error_of(lambda: client.predict(WRONG_SIZE))
            return [single, _sync_error_of(lambda: client.predict_batch([GOOD, WRONG_SIZE]))]

        with anyio.fail_after(60):
            await anyio.to_thread.run_sync(both)
            with cyclic_frames() as found:
                errors = await anyio.to_thread.run_sync(both)
    assert errors == ["InvalidRequestError"] * 2
    assert not found, found


@pytest.mark.anyio
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "explicit"])
async def test_a_bug_in_prepare_sample_keeps_its_traceback(
    tiny_model: ServerModel, tiny_checkpoint: Path, dynamic: bool
) -> None:
    # A refusal returned as a batch result drops its tracebacks (a cycle otherwise); where
    # the model's own code failed, where it failed is kept, as a note.
    class Buggy(type(tiny_model)):  # type: ignore[misc]
        def prepare_sample(self, request: Any, where: str | None = None) -> Any:
            return {}["the user's bug"]

    model = Buggy.from_files(tiny_checkpoint, device="cpu")
    async with InProcessClient(model, dynamic_batching=dynamic) as client:
        for call in (client.predict_async(GOOD), client.predict_batch_async([GOOD, GOOD])):
            with anyio.fail_after(60), pytest.raises(ModelExecutionError) as caught:
                await call
            shown = "".join(traceback.format_exception(caught.value))
            assert "in prepare_sample" in shown and "the user's bug" in shown


def test_a_refused_sync_call_leaves_no_cycle(tiny_model: ServerModel) -> None:
    with InProcessClient(tiny_model) as client:
        for call in (
            lambda: client.predict(WRONG_SIZE),
            lambda: client.predict_batch([GOOD, NOT_JSON]),
        ):
            assert _sync_error_of(call) == "InvalidRequestError"
            with cyclic_frames() as found:
                assert _sync_error_of(call) == "InvalidRequestError"
            assert not found, found


def _fails_on_negatives(items: list[int]) -> list[int]:
    if any(i < 0 for i in items):
        raise ValueError("a negative item")
    return [2 * i for i in items]


def _refuses_negatives(items: list[int]) -> list[int | ValueError]:
    return [ValueError("a negative item") if i < 0 else 2 * i for i in items]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "batch_fn", [_fails_on_negatives, _refuses_negatives], ids=["raises", "returns"]
)
async def test_a_scheduler_item_that_fails_leaves_no_cycle(batch_fn: Callable[..., Any]) -> None:
    scheduler = BatchScheduler(batch_fn, max_batch_size=8, max_wait_ms=20)
    try:
        results: list[object] = []

        async def one(i: int) -> None:
            try:
                results.append(await scheduler.submit(i))
            except ValueError as exc:
                results.append(type(exc).__name__)

        with anyio.fail_after(30), cyclic_frames() as found:
            async with anyio.create_task_group() as tg:
                for i in (1, 2, -3, 4):
                    tg.start_soon(one, i)
    finally:
        await scheduler.aclose()
    assert sorted(map(str, results)) == ["2", "4", "8", "ValueError"]
    assert not found, found


SERVED = {
    "wrong size": ("/api/predict/h1", WRONG_SIZE),
    "not JSON": ("/api/embed/h1", NOT_JSON),
    "batch with a bad body": ("/api/predict/h1/batch", f"[{GOOD},{WRONG_SIZE}]"),
    "batch not JSON": ("/api/predict/h1/batch", f"[{GOOD}"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("kind", list(SERVED))
async def test_a_refused_http_request_leaves_no_cycle(tiny_model: ServerModel, kind: str) -> None:
    path, body = SERVED[kind]
    app = create_app({"h1": InProcessClient(tiny_model)}, warmup=False)
    async with serving(app) as http:
        with anyio.fail_after(60):
            headers = {"content-type": "application/json"}
            assert (await http.post(path, content=body, headers=headers)).status_code == 422
            with cyclic_frames() as found:
                assert (await http.post(path, content=body, headers=headers)).status_code == 422
    assert not found, found


HTTP_CLIENT_REFUSALS = {
    "wrong size": ("h1", lambda c: c.predict_async(WRONG_SIZE)),
    "batch with a bad body": ("h1", lambda c: c.predict_batch_async([GOOD, WRONG_SIZE])),
    "unknown model": ("nope", lambda c: c.predict_async(GOOD)),
}


def _unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


@pytest.mark.anyio
async def test_an_http_client_call_that_cannot_connect_leaves_no_cycle() -> None:
    from histoinfer import HttpClient

    transport = httpx.MockTransport(_unreachable)
    async with HttpClient("http://down", transport=transport, retries=0) as client:
        with anyio.fail_after(60):
            found = await _twice(lambda: client.predict_async(GOOD), "InferenceError")
            found_in_batch = await _twice(
                lambda: client.predict_batch_async([GOOD, GOOD]), "InferenceError"
            )
    assert not found, found
    assert not found_in_batch, found_in_batch


@pytest.mark.anyio
@pytest.mark.parametrize("kind", list(HTTP_CLIENT_REFUSALS))
async def test_a_refused_http_client_call_leaves_no_cycle(
    tiny_model: ServerModel, kind: str
) -> None:
    from histoinfer import HttpClient

    model, call = HTTP_CLIENT_REFUSALS[kind]
    app = create_app({"h1": InProcessClient(tiny_model)}, warmup=False)
    transport = httpx.ASGITransport(app=app)
    async with serving(app), HttpClient("http://asgi", model, transport=transport, retries=0) as c:
        with anyio.fail_after(60):
            found = await _twice(lambda: call(c), "InvalidRequestError")
    assert not found, found
