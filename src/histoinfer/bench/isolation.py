"""Each measured path (or lone-latency variant) in a process of its own.

Why: torch's CPU build runs its parallel ops on libgomp, which keeps one team of OpenMP worker
threads *per thread that has run a parallel op*, alive as long as that thread. Once a process
holds more OpenMP threads than CPUs, libgomp stops spin-waiting between parallel regions
(``GOMP_SPINCOUNT``: 300,000 spins become 100), and every team pays a futex wake-up per region.
Measured here (docs/benchmarks-history.md, "Session 3"): the explicit ``predict_batch`` loop
ran at 470 tiles/s in a process where only its own thread had run torch ops and at 431 once one
more thread had, and a forward pass of one tile took 2.0 ms instead of 3.0. Measuring every
path in one process let the paths measured before (whose worker threads linger: trio's thread
cache keeps them 10 s) slow down the ones after — the explicit loop and the raw forward most,
which made dynamic batching look up to ~10% better than it is. A user runs one of these paths
in their process, not all.

The parent keeps the interleaved rounds (every ratio is still taken within a round); a child
process builds its own model, bodies and path from the on-disk cache, and answers calls over a
pipe. Children start with ``spawn``: a fork would inherit the parent's torch state.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Factory", "Isolated", "Local", "Unavailable", "resolve"]

# Long enough to import torch and load a model on a loaded 2-core machine.
START_TIMEOUT_S = 300.0
# Long enough for the slowest measurement (the small model: 256 tiles at ~20 tiles/s, loaded);
# a child that hangs must not hang the whole run.
CALL_TIMEOUT_S = 900.0


#: a module-level function, or its "module:name"
Factory = Callable[..., Any] | str


def resolve(factory: Factory) -> Callable[..., Any]:
    """The function a :data:`Factory` names."""
    if callable(factory):
        return factory
    module, _, name = factory.partition(":")
    function: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return function


class Unavailable(Exception):
    """Raised by a factory in the child: this path cannot run here (the message says why)."""


class Isolated:
    """An object built by ``factory(*args)`` in a child process; ``call`` runs its methods there.

    ``factory`` must be a module-level function (it is imported by name in the child), or its
    ``"module:name"`` (then this process need not import that module, nor what it imports),
    returning an object with a ``close()`` method, and optionally an ``info`` dict (sent back
    once it is ready).
    """

    def __init__(self, factory: Factory, *args: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_conn, factory, args), daemon=True
        )
        self._process.start()
        child_conn.close()
        self._closed = False
        self._busy = False  # a call sent, its answer not read (an interrupted call's)
        self.info: dict[str, Any] = {}
        self.unavailable: str | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the child has built its object; sets ``info`` or ``unavailable``.
        Once it has answered, waiting again returns at once (handles may be shared)."""
        if self.info or self.unavailable is not None:
            return  # answered already: ready ("pid" at least) or unavailable
        kind, payload = self._receive(timeout, "start")
        if kind == "ready":
            self.info = payload
        elif kind == "unavailable":
            self.unavailable = payload
            self.close()
        else:
            self.close()
            raise RuntimeError(f"the bench child process failed to start: {payload}")

    def call(self, method: str, *args: Any, timeout: float | None = CALL_TIMEOUT_S) -> Any:
        """``obj.method(*args)`` in the child; its exception comes back as a RuntimeError, and
        a child that does not answer within ``timeout`` seconds is killed (TimeoutError)."""
        self._conn.send(("call", method, args))
        self._busy = True
        kind, payload = self._receive(timeout, method)
        self._busy = False
        if kind != "ok":
            raise RuntimeError(f"{method} failed in the bench child process: {payload}")
        return payload

    def close(self, *, kill: bool = False) -> None:
        """Ask the child to close its object and exit (``kill``: do not ask, it is stuck)."""
        if self._closed:
            return
        self._closed = True
        if not kill and not self._busy:  # busy: its call was interrupted (Ctrl-C): no waiting
            with contextlib.suppress(OSError, ValueError):  # the child may be gone already
                self._conn.send(("close",))
            self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    def _receive(self, timeout: float | None, what: str) -> tuple[str, Any]:
        if timeout is not None and not self._conn.poll(timeout):
            self.close(kill=True)
            raise TimeoutError(f"the bench child process did not answer {what} in {timeout:g} s")
        try:
            message: tuple[str, Any] = self._conn.recv()
        except EOFError:
            code = self._process.exitcode
            self.close()
            raise RuntimeError(f"the bench child process exited (code {code})") from None
        return message


def _leave_it_to_the_parent(signum: int, frame: object) -> None:
    """SIGINT in a child: the parent decides (system calls resume: PEP 475)."""


def _serve(conn: Connection, factory: Factory, args: tuple[Any, ...]) -> None:
    """The child: build the object, then answer calls until told to close."""
    # Ctrl-C reaches the whole process group: the parent stops the run and closes this child
    # (or goes away: EOF below). Interrupted too, the child printed its own traceback. A
    # handler that does nothing, not SIG_IGN, which the servers it starts would inherit.
    signal.signal(signal.SIGINT, _leave_it_to_the_parent)
    # The report says the checkpoints are untrained; each child need not say it again.
    logging.getLogger("histoinfer.untrained").disabled = True
    try:
        obj = resolve(factory)(*args)
    except Unavailable as exc:
        conn.send(("unavailable", str(exc)))
        return
    except BaseException as exc:  # reported to the parent, which raises
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    # Freeze the start-up heap (~330k objects from torch, the model and the bodies): a full
    # garbage collection scans it in ~170 ms, and one landing inside a measurement of ~1 s cost
    # that path alone 10-15% (seen: the explicit loop 408 vs 470 tiles/s in one of 4 reps).
    # Services can do the same once their models are loaded (docs/benchmarks-history.md).
    gc.collect()
    gc.freeze()
    conn.send(("ready", {**getattr(obj, "info", {}), "pid": os.getpid()}))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the parent went away
                return
            if message[0] == "close":
                return
            _, method, call_args = message
            try:
                result = getattr(obj, method)(*call_args)
            except Exception as exc:
                answer: tuple[str, Any] = ("error", f"{type(exc).__name__}: {exc}")
            else:
                answer = ("ok", result)
            try:
                conn.send(answer)
            except OSError:  # the parent went away while this ran (interrupted)
                return
    finally:
        obj.close()


class Local:
    """:class:`Isolated`'s interface, with the object built in this process (``--shared-process``
    and fast tests): cheaper to start, measured in the shared OpenMP regime described above."""

    def __init__(self, factory: Factory, *args: Any) -> None:
        self._factory, self._args = resolve(factory), args
        self._obj: Any = None
        self.info: dict[str, Any] = {}
        self.unavailable: str | None = None
        self.pid = os.getpid()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        if self.info or self.unavailable is not None:
            return  # built already (handles may be shared)
        try:
            self._obj = self._factory(*self._args)
        except Unavailable as exc:
            self.unavailable = str(exc)
        else:
            self.info = {**getattr(self._obj, "info", {}), "pid": self.pid}

    def call(self, method: str, *args: Any, timeout: float | None = CALL_TIMEOUT_S) -> Any:
        return getattr(self._obj, method)(*args)

    def close(self) -> None:
        obj, self._obj = self._obj, None
        if obj is not None:
            obj.close()
