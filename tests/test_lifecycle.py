"""``InFlight``, the calls in flight that ``close()`` waits for (clients/lifecycle.py)."""

from __future__ import annotations

import logging
import threading

import pytest

from histoinfer.clients import lifecycle
from histoinfer.clients.lifecycle import InFlight
from histoinfer.errors import ClientClosedError


@pytest.mark.timeout(30)
def test_close_says_what_it_waits_for_and_returns_when_the_last_call_ends(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a call left in a loop stopped before it finished kept close() waiting
    without a word."""
    monkeypatch.setattr(lifecycle, "_WAIT_WARNING_S", 0.05)
    calls, done = InFlight(), []
    calls.enter()
    calls.close()
    with pytest.raises(ClientClosedError):
        calls.enter()  # closed: no new call
    waiter = threading.Thread(target=lambda: (calls.wait_idle(), done.append(True)))
    with caplog.at_level(logging.WARNING, logger="histoinfer.client"):
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and not done  # still waiting for the call in flight
        calls.exit()
        waiter.join(10)
    assert done == [True]
    warnings = [r.getMessage() for r in caplog.records if r.name == "histoinfer.client"]
    assert warnings and "still waiting for 1 call(s) in flight" in warnings[0]


def test_steps_after_close_run_once_as_the_last_call_ends_and_a_failing_one_harms_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``close(then=...)`` runs its steps when the last call in flight ends, in that call's
    ``finally``: a step that raises must not replace the call's own outcome, nor keep the
    next step from running."""
    ran: list[str] = []

    def failing() -> None:
        ran.append("failing")
        raise OSError("a transport that cannot close")

    calls = InFlight(when_done=lambda: ran.append("when_done"))
    # The call ends normally, whatever the steps do.
    with caplog.at_level(logging.ERROR, logger="histoinfer.client"), calls.call():
        calls.close(then=failing)
        calls.close(then=lambda: ran.append("second"))
        assert ran == []  # a call is in flight
    assert ran == ["when_done", "failing", "second"]
    assert any("failed" in r.getMessage() for r in caplog.records)
    calls.close(then=lambda: ran.append("at once"))  # none in flight: here and now
    assert ran[-2:] == ["when_done", "at once"]


@pytest.mark.timeout(30)
def test_a_call_entered_on_one_thread_and_ended_on_another_is_counted_out() -> None:
    """A suspended call may be ended on another thread (its abandoned loop's tasks collected
    there): it must still leave the count (a review: an AttributeError skipped exit(), and
    close() would have waited for ever), and count toward its own thread only."""
    calls = InFlight()

    def one_call():  # type: ignore[no-untyped-def]
        with calls.call():
            yield

    call = one_call()
    entered = threading.Thread(target=next, args=(call,))
    entered.start()
    entered.join(10)
    assert calls.active == 1 and not calls.held_here()  # held by the other thread
    call.close()  # ended here
    assert calls.active == 0 and not calls.held_here()
    with calls.call():
        assert calls.held_here()
    assert not calls.held_here()
