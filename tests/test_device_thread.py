"""Every forward pass on a device runs on that device's one thread (``models/device.py``)."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch
from concurrency_helpers import body, hooked_model, join_threads, start_threads

from histoinfer.clients.inprocess import InProcessClient
from histoinfer.models import ServerModel
from histoinfer.models.device import DeviceThread, device_thread

pytestmark = pytest.mark.timeout(60)


def _thread_recording_model(model: ServerModel) -> tuple[ServerModel, set[int]]:
    threads: set[int] = set()
    wrapped, _ = hooked_model(model, lambda batch: threads.add(threading.get_ident()))
    return wrapped, threads


@pytest.mark.anyio
async def test_every_path_runs_its_forward_passes_on_the_device_thread(
    tiny_model: ServerModel,
) -> None:
    model, threads = _thread_recording_model(tiny_model)
    with InProcessClient(model, max_batch_size=4) as client:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:  # dynamic batching
                for i in range(10):
                    tg.start_soon(client.predict_async, body(i))
            # Sync calls from plain threads (the portal) and from a worker thread (host loop).
            callers, errors = start_threads([lambda: client.predict(body(1))] * 3)
            await anyio.to_thread.run_sync(join_threads, callers)
            assert errors == []
            await anyio.to_thread.run_sync(client.predict, body(2))
        client.predict_batch([body(i) for i in range(6)])  # explicit, from this thread
    with InProcessClient(model, dynamic_batching=False) as explicit:
        await explicit.predict_async(body(3))  # batch size 1
    [thread] = threads
    assert thread != threading.get_ident()
    assert device_thread(tiny_model.device).run(threading.get_ident) == thread


def test_a_call_from_the_device_thread_runs_inline() -> None:
    device = DeviceThread("test-inline")

    def outer() -> tuple[int, int]:
        return threading.get_ident(), device.run(threading.get_ident)

    first, nested = device.run(outer)  # would wait for itself forever if it were queued
    assert first == nested != threading.get_ident()


def test_errors_reach_the_caller_and_the_thread_keeps_serving() -> None:
    device = DeviceThread("test-errors")

    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        device.run(fail)
    assert device.run(lambda: 41 + 1) == 42


def test_one_thread_per_device_name() -> None:
    assert device_thread("cpu") is device_thread(torch.device("cpu"))
    assert device_thread("cpu") is not device_thread("test-other")
