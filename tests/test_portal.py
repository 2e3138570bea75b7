"""``PortalThread``: one hand-off a call, and the bookkeeping anyio's BlockingPortal did (calls
in flight finish when it stops, later calls are refused, nobody is left waiting)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import anyio
import pytest
import sniffio

from histoinfer.clients.portal import PortalThread

seen_here: contextvars.ContextVar[str] = contextvars.ContextVar("seen_here", default="unset")


async def echo(value: int, delay: float = 0.0) -> int:
    await anyio.sleep(delay)
    return value


async def fail() -> None:
    await anyio.sleep(0)
    raise KeyError("inside")


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


@pytest.fixture
def portal() -> PortalThread:
    portal = PortalThread(name="test-portal")
    yield portal  # type: ignore[misc]
    portal.stop()


@pytest.mark.timeout(30)
def test_calls_return_their_results_and_raise_their_errors(portal: PortalThread) -> None:
    assert portal.call(echo, 7) == 7
    with pytest.raises(KeyError, match="inside"):
        portal.call(fail)
    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(lambda i: portal.call(echo, i, 0.001), range(200))) == list(range(200))


@pytest.mark.timeout(30)
def test_a_call_sees_the_callers_context_variables_but_not_its_async_library(
    portal: PortalThread,
) -> None:
    # A thread running a trio loop has sniffio's "trio" in its context: anyio in the portal's
    # asyncio task must not see it. The caller's own variables (a tracing id) it must see.
    async def what_runs_here() -> tuple[str, str]:
        return sniffio.current_async_library(), seen_here.get()

    def from_a_decorated_context() -> tuple[str, str]:
        seen_here.set("caller")
        token = sniffio.current_async_library_cvar.set("trio")
        try:
            return portal.call(what_runs_here)
        finally:
            sniffio.current_async_library_cvar.reset(token)

    assert contextvars.copy_context().run(from_a_decorated_context) == ("asyncio", "caller")


@pytest.mark.timeout(30)
def test_a_cancelled_call_fails_and_a_system_exit_reaches_its_caller_alone(
    portal: PortalThread,
) -> None:
    async def cancelled() -> None:
        raise asyncio.CancelledError

    async def exits() -> None:
        await anyio.sleep(0)
        raise SystemExit(3)

    with pytest.raises(RuntimeError, match="cancelled in the portal's event loop"):
        portal.call(cancelled)
    with pytest.raises(SystemExit):
        portal.call(exits)
    assert portal.call(echo, 5) == 5  # the loop still serves


@pytest.mark.timeout(30)
def test_a_call_from_the_portals_own_thread_is_refused(portal: PortalThread) -> None:
    async def call_back() -> str:
        try:
            portal.call(echo, 1)
        except RuntimeError as exc:
            return str(exc)
        return "waited"

    assert portal.call(call_back) == "a call from the portal's own thread would wait for itself"


@pytest.mark.timeout(30)
def test_callers_are_answered_when_the_loop_dies_under_them() -> None:
    portal = PortalThread(name="test-portal")
    outcome: list[BaseException] = []

    def slow() -> None:
        try:
            portal.call(echo, 1, 30.0)
        except RuntimeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=slow)
    thread.start()
    wait_for(lambda: len(portal._tasks) == 1)
    assert portal._loop is not None
    portal._loop.call_soon_threadsafe(portal._loop.stop)  # the loop ends, the call unanswered
    thread.join(10)
    assert not thread.is_alive()
    # Cancelled as the loop is torn down, or failed once it has ended: answered either way.
    assert len(outcome) == 1 and "the portal's event loop" in str(outcome[0]), outcome
    # While the loop is torn down a call may still get in and be answered, or fail: never wait.
    with contextlib.suppress(RuntimeError):
        assert portal.call(echo, 2) == 2
    portal.thread.join(10)
    with pytest.raises(RuntimeError, match="the portal is stopped"):
        portal.call(echo, 3)  # once the loop's thread has ended, the door is closed
    portal.stop()


@pytest.mark.timeout(30)
def test_stopping_lets_calls_in_flight_finish_and_refuses_later_ones() -> None:
    portal = PortalThread(name="test-portal")
    results: dict[int, int] = {}
    started = threading.Barrier(5)

    def slow(i: int) -> None:
        started.wait()
        results[i] = portal.call(echo, i, 0.3)

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    started.wait()
    wait_for(lambda: len(portal._tasks) == 4)  # the calls are in the loop
    portal.stop()  # returns once the loop has ended: every caller has its answer
    assert not portal.thread.is_alive()
    for thread in threads:
        thread.join(5)
    assert results == {0: 0, 1: 1, 2: 2, 3: 3}
    with pytest.raises(RuntimeError, match="the portal is stopped"):
        portal.call(echo, 1)
    portal.stop()  # idempotent


@pytest.mark.timeout(60)
def test_calls_racing_a_stop_are_answered_or_refused_never_left_waiting() -> None:
    for _ in range(20):
        portal = PortalThread(name="test-portal")
        answered: list[int] = []
        refused: list[int] = []

        def caller(
            portal: PortalThread = portal,
            answered: list[int] = answered,
            refused: list[int] = refused,
        ) -> None:
            for i in range(1_000_000):  # until the door closes
                try:
                    assert portal.call(echo, i) == i
                except RuntimeError:
                    refused.append(i)
                    return
                answered.append(i)

        threads = [threading.Thread(target=caller) for _ in range(4)]
        for thread in threads:
            thread.start()
        wait_for(lambda answered=answered: len(answered) > 0)
        portal.stop()
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive()  # nobody waits for an answer that never comes
        assert len(refused) == 4 and answered  # each thread refused once the portal stopped
