"""The sync methods: portal calls from plain threads batch together, calls from anyio worker
threads use their host loop, a call on a running loop's thread works, and nothing hangs at exit.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from concurrency_helpers import (
    body,
    call,
    expected,
    join_threads,
    start_threads,
    wait_until,
)
from helpers import outputs_close

from histoinfer.clients.inprocess import InProcessClient
from histoinfer.errors import ClientClosedError
from histoinfer.models import ServerModel

TESTS = Path(__file__).parent


def _predict_indices(count: int) -> list[int]:
    return [3 * k for k in range(count)]  # mode_of(3k) == "predict"


@pytest.mark.timeout(120)
def test_sixteen_threads_calling_sync_predict_are_batched_together(
    client: InProcessClient, tiny_model: ServerModel
) -> None:
    indices = _predict_indices(64)
    want = dict(zip(indices, expected(tiny_model, indices), strict=True))
    got: dict[int, str] = {}
    start = threading.Barrier(16, timeout=30)

    def worker(mine: list[int]) -> None:
        start.wait()
        for i in mine:
            got[i] = client.predict(body(i))

    threads, errors = start_threads([partial(worker, indices[t::16]) for t in range(16)])
    join_threads(threads, 90)
    assert errors == []
    assert [i for i in indices if not outputs_close(got[i], want[i])] == []
    snap = client.stats()["predict"]
    assert snap.samples == len(indices)
    assert snap.mean_batch_size > 1.5, snap.batch_size_histogram  # batched in the portal loop


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_sync_call_on_a_running_loops_thread_works(
    client: InProcessClient, tiny_model: ServerModel
) -> None:
    """A notebook cell: predict() on the very thread whose loop has async calls in flight."""
    indices = list(range(9))
    got: dict[int, str] = {}

    async def one(i: int) -> None:
        got[i] = await call(client, i)

    with anyio.fail_after(50):
        async with anyio.create_task_group() as tg:
            for i in indices[1:]:
                tg.start_soon(one, i)
            await wait_until(lambda: client._calls.active == len(indices) - 1)
            got[0] = client.predict(body(0))  # blocks this loop; must not deadlock
    assert [i for i, a in zip(indices, expected(tiny_model, indices), strict=True)
            if not outputs_close(got[i], a)] == []  # fmt: skip


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_sync_call_in_a_worker_thread_batches_with_its_host_loop(
    client: InProcessClient, tiny_model: ServerModel
) -> None:
    sync_indices = _predict_indices(8)
    async_indices = [i + 300 for i in _predict_indices(8)]
    got: dict[int, str] = {}

    async def sync_in_thread(i: int) -> None:
        got[i] = await anyio.to_thread.run_sync(client.predict, body(i))

    async def direct(i: int) -> None:
        got[i] = await call(client, i)

    with anyio.fail_after(50):
        async with anyio.create_task_group() as tg:
            for i in sync_indices:
                tg.start_soon(sync_in_thread, i)
            for i in async_indices:
                tg.start_soon(direct, i)
    indices = sync_indices + async_indices
    assert [i for i, a in zip(indices, expected(tiny_model, indices), strict=True)
            if not outputs_close(got[i], a)] == []  # fmt: skip
    assert client._portal is None  # all went through this loop, none through the portal
    snap = client.stats()["predict"]
    assert snap.samples == len(indices) and snap.batches < len(indices)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_worker_thread_sync_call_whose_host_is_already_cancelled(
    client: InProcessClient,
) -> None:
    """The host task is cancelled before its worker thread calls predict(): the call must end
    cancelled, not hang (anyio 4.16 on asyncio never delivers that cancellation by itself).
    """
    started, go = threading.Event(), threading.Event()

    def worker() -> str:
        started.set()
        go.wait(10)
        return client.predict(body(0))

    with anyio.CancelScope() as scope:

        async def cancel_then_call() -> None:
            await wait_until(started.is_set)  # the host now waits for its worker thread
            scope.cancel()
            with anyio.CancelScope(shield=True):  # this task is in the cancelled scope too
                await anyio.sleep(0.05)  # the cancellation is delivered to what is there
                go.set()  # only now does the worker thread call predict()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_then_call)
            await anyio.to_thread.run_sync(worker)
    assert scope.cancelled_caught
    with anyio.fail_after(20):  # and the client is fine
        assert outputs_close(await call(client, 0), expected(client.server_model, [0])[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_sync_call_from_a_worker_thread_that_outlived_its_loop(
    client: InProcessClient, backend: str
) -> None:
    """A thread its host abandoned (``abandon_on_cancel=True``) calls predict() after the
    host's loop ended: it runs in the client's portal, as from any other thread, instead of
    failing with anyio's RunFinishedError."""
    outcome: list[object] = []
    done = threading.Event()

    def worker() -> None:
        time.sleep(0.3)  # meanwhile, the host gives up on this thread and its loop ends
        try:
            outcome.append(client.predict(body(0)))
        except BaseException as exc:  # reported below, whatever it is
            outcome.append(exc)
        done.set()

    async def host() -> None:
        with anyio.move_on_after(0.05):
            await anyio.to_thread.run_sync(worker, abandon_on_cancel=True)

    anyio.run(host, backend=backend)
    assert done.wait(30), "the abandoned thread's call never returned"
    [result] = outcome
    assert isinstance(result, str), result
    assert outputs_close(result, expected(client.server_model, [0])[0])


@pytest.mark.timeout(90)
def test_close_lets_sync_calls_in_flight_finish_then_refuses(tiny_model: ServerModel) -> None:
    client = InProcessClient(tiny_model, max_batch_size=8)
    indices = _predict_indices(24)
    got: dict[int, str] = {}
    refused: list[BaseException] = []
    start = threading.Barrier(9, timeout=30)

    def worker(mine: list[int]) -> None:
        start.wait()
        for i in mine:
            try:
                got[i] = client.predict(body(i))
            except ClientClosedError as exc:
                refused.append(exc)

    threads, errors = start_threads([partial(worker, indices[t::8]) for t in range(8)])
    start.wait()
    deadline = time.monotonic() + 30
    while client._calls.active == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    portal_thread = client._portal.thread if client._portal is not None else None
    client.close()
    assert client._calls.active == 0  # close() returned only once nothing was in flight
    join_threads(threads, 60)
    assert errors == []
    assert len(got) + len(refused) == len(indices) and got  # each either answered or refused
    want = dict(zip(indices, expected(tiny_model, indices), strict=True))
    assert [i for i in got if not outputs_close(got[i], want[i])] == []
    with pytest.raises(ClientClosedError, match="make a new client to go on"):
        client.predict(body(0))
    assert portal_thread is not None and not portal_thread.is_alive()
    assert client._portal is None  # a refused call did not start a new portal


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_close_on_a_loop_thread_does_not_wait_for_other_threads_sync_calls(
    tiny_model: ServerModel,
) -> None:
    """close() on a running loop's thread (a notebook cell, ``with client:`` in a coroutine)
    waits for nothing: it used to join the portal's thread, which lets another thread's sync
    call finish first, with this loop frozen meanwhile (up to 10 s)."""
    client = InProcessClient(tiny_model, max_batch_size=8)
    in_pass = threading.Event()
    release = threading.Event()
    real_forward = tiny_model.forward_tiles

    def held_forward(tiles, mode):  # type: ignore[no-untyped-def]
        in_pass.set()
        release.wait(30)
        return real_forward(tiles, mode)

    tiny_model.forward_tiles = held_forward  # type: ignore[method-assign]
    try:
        threads, errors = start_threads([partial(client.predict, body(0))])
        await anyio.to_thread.run_sync(in_pass.wait, 30)
        portal = client._portal
        assert portal is not None
        started = time.perf_counter()
        client.close()  # on this loop's thread; the portal's call is held in its pass
        took = time.perf_counter() - started
        assert portal.thread.is_alive()  # its call still runs: close() did not wait for it
        release.set()
        await anyio.to_thread.run_sync(partial(join_threads, threads, 30))
        assert errors == []
    finally:
        release.set()
        del tiny_model.forward_tiles
    assert took < 1.0, f"close() held the loop for {took:.2f} s"
    deadline = time.monotonic() + 20
    while portal.thread.is_alive() and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert not portal.thread.is_alive()  # it ended after its last call, by itself


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_cancelled_aclose_still_ends_the_clients_threads(tiny_model: ServerModel) -> None:
    """Regression: ``async with client`` left by a timeout (its aclose() cancelled before it
    stopped them) left the portal and batch-decode threads running while the client lived."""
    client = InProcessClient(tiny_model, max_batch_size=8, batch_decode_threads=2)
    in_pass = threading.Event()
    release = threading.Event()
    real_forward = tiny_model.forward_tiles

    def held_forward(tiles, mode):  # type: ignore[no-untyped-def]
        if len(tiles) == 1 and not release.is_set():
            in_pass.set()
            release.wait(30)
        return real_forward(tiles, mode)

    client.predict(body(0))  # on the loop's own thread: through the portal
    client.predict_batch([body(1), body(2)])  # starts the batch-decode threads
    portal, decoder = client._portal, client._batch_decoder
    assert portal is not None and decoder is not None
    tiny_model.forward_tiles = held_forward  # type: ignore[method-assign]
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.predict_async, body(3))  # in flight, held in its pass
                await anyio.to_thread.run_sync(in_pass.wait, 30)
                with anyio.move_on_after(0.05):  # aclose() cancelled while it waits
                    await client.aclose()
                assert client.closed and client._calls.active == 1
                release.set()
    finally:
        release.set()
        del tiny_model.forward_tiles
    deadline = time.monotonic() + 20
    while portal.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not portal.thread.is_alive()  # ended with the last call, no close() needed
    assert decoder._shutdown  # type: ignore[attr-defined]
    with pytest.raises(ClientClosedError):
        client.predict(body(0))


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_sync_calls_after_close_are_refused_from_any_thread(
    tiny_model: ServerModel,
) -> None:
    client = InProcessClient(tiny_model)
    await client.aclose()
    with anyio.fail_after(20):
        with pytest.raises(ClientClosedError):
            await anyio.to_thread.run_sync(client.predict, body(0))
        with pytest.raises(ClientClosedError):
            client.embed(body(1))
    assert client._portal is None


@pytest.mark.timeout(60)
def test_a_dropped_client_ends_its_runners_and_its_portal(
    tiny_model: ServerModel, caplog: pytest.LogCaptureFixture
) -> None:
    """Never closed, just dropped: the loops outlive it, and must not be left with runner tasks
    that only the garbage collector can end ("Task was destroyed but it is pending!").
    """
    client = InProcessClient(tiny_model)
    client.predict(body(0))  # the portal loop gets a scheduler
    assert client._portal is not None
    portal_thread = client._portal.thread
    client_ref = weakref.ref(client)
    used, dropped = threading.Event(), threading.Event()
    outcome: list[bool] = []

    async def outliving_loop() -> None:
        own = client_ref()
        assert own is not None
        await own.predict_async(body(3))
        finished = [s._finished for s in own._loops.get().schedulers.values()]
        del own
        used.set()
        await anyio.to_thread.run_sync(dropped.wait, 20)
        with anyio.move_on_after(20):
            while not all(f is not None and f.is_set() for f in finished):
                await anyio.sleep(0.01)
        outcome.append(all(f is not None and f.is_set() for f in finished))

    loop_thread = threading.Thread(target=asyncio.run, args=(outliving_loop(),))
    loop_thread.start()
    assert used.wait(30)
    del client
    gc.collect()
    assert client_ref() is None  # nothing but the caller kept it alive
    dropped.set()
    loop_thread.join(30)
    portal_thread.join(20)
    assert outcome == [True]  # its runner ended while its loop still ran
    assert not portal_thread.is_alive()
    assert "Task was destroyed" not in caplog.text


_EXIT_SCRIPT = """
import asyncio, sys, threading
sys.path.insert(0, {tests!r})
import trio
from helpers import make_body
from histoinfer.clients.inprocess import InProcessClient

client = InProcessClient.from_checkpoint("h1", {checkpoint!r})
assert '"patch_idx":0' in client.predict(make_body(0)).replace(" ", "")

async def one(i):
    return await client.predict_async(make_body(i))

assert '"patch_idx":1' in asyncio.run(one(1)).replace(" ", "")
assert '"patch_idx":2' in trio.run(one, 2).replace(" ", "")

def forever():  # a daemon thread still calling when the interpreter exits
    while True:
        try:
            client.predict(make_body(3))
        except Exception:
            return

threading.Thread(target=forever, daemon=True).start()
print("done", flush=True)
"""


@pytest.mark.timeout(120)
def test_the_process_exits_without_close(tiny_checkpoint: Path) -> None:
    script = _EXIT_SCRIPT.format(tests=str(TESTS), checkpoint=str(tiny_checkpoint))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "done"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(90)
@pytest.mark.skipif(sys.platform == "win32", reason="no SIGUSR1 on Windows")
@pytest.mark.parametrize("call_name", ["predict", "predict_batch"])
def test_close_in_a_signal_handler_does_not_wait_for_the_call_it_interrupted(
    tiny_model: ServerModel, call_name: str
) -> None:
    """Regression (a trial): a SIGTERM handler that closed the client while the main thread
    was in ``predict_batch`` hung for ever (close() waited for the very call the handler had
    interrupted, which goes on only once the handler returns); in ``predict``, 10 s (the
    portal's join). It returns at once; the call finishes; later calls are refused."""
    client = InProcessClient(tiny_model, max_batch_size=8)
    in_pass, release = threading.Event(), threading.Event()
    real_forward = tiny_model.forward_tiles
    took: list[float] = []

    def held_forward(tiles, mode):  # type: ignore[no-untyped-def]
        in_pass.set()
        release.wait(30)  # set by the handler, once close() has returned
        return real_forward(tiles, mode)

    def on_signal(signum: int, frame: object) -> None:
        started = time.perf_counter()
        client.close()
        took.append(time.perf_counter() - started)
        release.set()

    def signal_in_the_pass() -> None:
        if in_pass.wait(30):
            os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    tiny_model.forward_tiles = held_forward  # type: ignore[method-assign]
    threading.Thread(target=signal_in_the_pass, daemon=True).start()
    try:
        if call_name == "predict":
            answer = client.predict(body(0))
        else:
            [answer] = client.predict_batch([body(0)])
    finally:
        release.set()
        del tiny_model.forward_tiles
        signal.signal(signal.SIGUSR1, previous)
    assert '"patch_idx":0' in answer.replace(" ", "")
    assert took and took[0] < 5, f"close() in the handler took {took}"
    with pytest.raises(ClientClosedError):
        client.predict(body(1))


@pytest.mark.timeout(90)
@pytest.mark.skipif(sys.platform == "win32", reason="no SIGUSR1 on Windows")
def test_a_pass_whose_sync_batch_call_was_interrupted_is_counted(tiny_model: ServerModel) -> None:
    """Regression (a trial): Ctrl-C in a sync ``predict_batch`` left its pass running on the
    device's thread, and the pass was never counted (``stats()`` read 2 batches for 3 run)."""
    client = InProcessClient(tiny_model, max_batch_size=4, dynamic_batching=False)
    in_pass, release, ended = threading.Event(), threading.Event(), threading.Event()
    real_forward = tiny_model.forward_tiles

    def held_forward(tiles, mode):  # type: ignore[no-untyped-def]
        in_pass.set()
        release.wait(30)
        try:
            return real_forward(tiles, mode)
        finally:
            ended.set()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def signal_in_the_pass() -> None:
        if in_pass.wait(30):
            os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    tiny_model.forward_tiles = held_forward  # type: ignore[method-assign]
    threading.Thread(target=signal_in_the_pass, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            client.predict_batch([body(i) for i in range(8)])  # 2 passes of 4: the first cut
        release.set()
        assert ended.wait(30)
        deadline = time.monotonic() + 10
        while client.stats()["predict"].batches < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        release.set()
        del tiny_model.forward_tiles
        signal.signal(signal.SIGUSR1, previous)
    counted = client.stats()["predict"]
    assert (counted.batches, counted.samples) == (1, 4)
    client.close()


@pytest.mark.timeout(120)
def test_a_sync_call_as_the_interpreter_exits_is_refused_not_hung(tiny_checkpoint: Path) -> None:
    """Regression (a trial): a ``__del__`` calling ``predict`` as the interpreter exited hung
    for ever (a portal thread started then never runs), or raised a bare RuntimeError."""
    script = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from helpers import make_body
from histoinfer.clients.inprocess import InProcessClient

client = InProcessClient.from_checkpoint("h1", {str(tiny_checkpoint)!r})
BODY = make_body(0)
if sys.argv[1] == "warm":
    client.predict(BODY)  # its portal started

class Holder:
    def __del__(self):
        try:
            client.predict(BODY)
        except Exception as exc:
            print(type(exc).__name__, exc, flush=True)

keep = Holder()
"""
    for warm in ("cold", "warm"):
        proc = subprocess.run(
            [sys.executable, "-c", script, warm], capture_output=True, text=True, timeout=90
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("ClientClosedError the interpreter is exiting"), (
            warm,
            proc.stdout,
            proc.stderr[-3000:],
        )


@pytest.mark.timeout(60)
def test_close_while_this_thread_starts_the_portal_refuses_the_call(
    tiny_model: ServerModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal handler's close() that runs while its thread starts the client's portal (the
    first sync call) deadlocked on the lock that start holds (a review); now the call is
    refused, and the portal started for it stopped."""
    from histoinfer.clients import inprocess

    client = InProcessClient(tiny_model, max_batch_size=8)
    started: list[inprocess.PortalThread] = []

    class InterruptedStart(inprocess.PortalThread):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            started.append(self)
            client.close()  # as a signal handler would, on this thread, mid-start

    monkeypatch.setattr(inprocess, "PortalThread", InterruptedStart)
    with pytest.raises(ClientClosedError):
        client.predict(body(0))
    [portal] = started
    portal.thread.join(20)
    assert not portal.thread.is_alive() and client._portal is None
