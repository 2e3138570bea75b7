"""``PerLoop``: one value per running event loop, dropped (and the loop freed) when it ends."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import anyio
import pytest

from histoinfer.batching import PerLoop, current_loop_key


class _Made:
    """A value that remembers which loop it was made for."""

    def __init__(self, key: object) -> None:
        self.key_ref = weakref.ref(key)


def _counting_perloop() -> tuple[PerLoop[_Made], list[object]]:
    made: list[object] = []

    def factory(key: object) -> _Made:
        made.append(id(key))
        return _Made(key)

    return PerLoop(factory), made


@pytest.mark.anyio
@pytest.mark.timeout(20)
async def test_one_value_per_loop_however_many_tasks_ask(anyio_backend: str) -> None:
    per_loop, made = _counting_perloop()
    got: list[_Made] = []

    async def ask() -> None:
        await anyio.sleep(0)
        got.append(per_loop.get())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(ask)
    assert len(made) == 1 and len({id(v) for v in got}) == 1
    if anyio_backend == "asyncio":
        native: object = asyncio.get_running_loop()
    else:
        import trio

        native = trio.lowlevel.current_trio_token()
    assert current_loop_key() is native
    assert got[0].key_ref() is native
    assert per_loop.values() == [got[0]] and len(per_loop) == 1
    per_loop.discard(native)
    assert len(per_loop) == 0
    assert per_loop.get() is not got[0]  # a fresh one after discard


@pytest.mark.timeout(30)
def test_loops_on_several_threads_get_their_own_values_and_ends_are_purged() -> None:
    per_loop, made = _counting_perloop()
    backends = ["asyncio", "trio", "asyncio", "trio"]
    all_running = threading.Barrier(len(backends), timeout=10)
    seen: list[_Made] = []
    live_counts: list[int] = []
    key_refs: list[weakref.ref[Any]] = []
    errors: list[BaseException] = []

    async def main() -> None:
        value = per_loop.get()
        assert per_loop.get() is value
        seen.append(value)
        key_refs.append(weakref.ref(current_loop_key()))
        await anyio.to_thread.run_sync(all_running.wait)
        live_counts.append(len(per_loop))
        await anyio.to_thread.run_sync(all_running.wait)

    def thread_main(backend: str) -> None:
        try:
            anyio.run(main, backend=backend)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=thread_main, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors
    assert len({id(v) for v in seen}) == len(backends) == len(made)
    assert live_counts == [len(backends)] * len(backends)
    # Every loop has ended without calling discard(): the next lookup purges them all...
    assert len(per_loop) == 0 and per_loop.values() == []
    # ...and nothing keeps the finished loops alive.
    seen.clear()
    gc.collect()
    assert [ref() for ref in key_refs] == [None] * len(backends)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.timeout(20)
def test_a_new_loop_purges_the_finished_ones(backend: str) -> None:
    per_loop, made = _counting_perloop()
    values: list[_Made] = []

    async def main() -> None:
        values.append(per_loop.get())

    for _ in range(5):
        anyio.run(main, backend=backend)
        # get() in the next loop purges the previous one: the dict never grows.
        assert len(per_loop._values) == 1
    assert len(made) == 5 and len({id(v) for v in values}) == 5
    assert len(per_loop) == 0
