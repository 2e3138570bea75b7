"""The server returns a burst's freed memory to the system once idle (server/memory.py): a
soak trial's server kept ~3x its idle size after one burst of 2,000 requests."""

from __future__ import annotations

import sys
from typing import Any

import anyio
import pytest
from helpers import serving

from histoinfer.clients.inprocess import InProcessClient
from histoinfer.server import app as app_module
from histoinfer.server import create_app, memory

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

MB = 1024 * 1024


class Process:
    """A fake process: its resident size, whether it is idle, and the trims asked of it."""

    def __init__(self) -> None:
        self.size = 400 * MB
        self.idle = True
        self.trims = 0

    def trim(self, pad: int) -> int:
        assert pad == 0
        self.trims += 1
        self.size = 420 * MB
        return 1


async def test_an_idle_server_that_grew_is_trimmed_once() -> None:
    process = Process()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: memory.return_freed_memory(
                    lambda: process.idle,
                    trim=process.trim,
                    resident=lambda: process.size,
                    every=0.01,
                )
            )
            await anyio.sleep(0.05)
            assert process.trims == 0  # not grown
            process.size, process.idle = 900 * MB, False
            await anyio.sleep(0.05)
            assert process.trims == 0  # grown, but busy
            process.idle = True
            while not process.trims:
                await anyio.sleep(0.01)
            await anyio.sleep(0.05)
            assert process.trims == 1 and process.size == 420 * MB  # not again: not grown
            process.size = 420 * MB + memory.WORTH_TRIMMING
            while process.trims < 2:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux")
def test_this_c_library_can_trim_and_proc_says_the_size() -> None:
    size = memory._resident_bytes()
    assert size is not None and size > 10 * MB
    trim = memory._malloc_trim()
    assert trim is not None
    trim(0)


async def test_the_app_returns_freed_memory_while_it_runs(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []

    async def watching(idle: Any) -> None:
        calls.append(idle())
        await anyio.sleep_forever()

    monkeypatch.setattr(app_module, "return_freed_memory", watching)
    app = create_app({"h1": InProcessClient(tiny_model)}, warmup=False)
    async with serving(app):
        pass
    assert calls == [True]  # started with the app, and told it is idle
