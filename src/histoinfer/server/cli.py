"""``histoinfer serve``: load models and run the microservice under uvicorn or hypercorn.

Both servers get the same shutdown. On SIGTERM or SIGINT readiness fails at once; after
``--drain-delay`` seconds (0 by default; a second signal ends them, and does nothing more) of
serving as before, the app drains (new requests 503), the server stops accepting connections
and in-flight requests finish, up to ``--graceful-timeout``: just before it runs out the app
answers those still in flight 503 ``closed`` itself (the servers would cut them off). Then the
clients are closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from inspect import getattr_static
from pathlib import Path
from types import FrameType
from typing import Any

import anyio

from ..cli import CommandError, add_import_option, import_modules, unknown_model
from ..clients.inprocess import InProcessClient
from ..models import ServerModel
from ..models.assets import ASSETS_FILE
from ..models.base import assets_folder
from ..models.checkpoint import CheckpointError, in_the_folder, resolve_device
from ..models.registry import UnknownModelError, model_class
from .access import AccessLog
from .app import ClientSource, ServerState, create_app
from .environment import defaults_from_environment
from .logs import JsonFormatter, ThrottledInvalidRequests, formatter_for, uvicorn_log_config
from .metrics import UNKNOWN

__all__ = ["configure", "run"]

log = logging.getLogger("histoinfer.server")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options (called by ``histoinfer.cli`` only when ``serve`` is run)."""
    parser.description = (
        "Serve one or more models over HTTP (FastAPI). Repeat --model/--checkpoint "
        "(and --assets) to serve several models from one process; see docs/server.md."
    )
    add = parser.add_argument
    add(
        "--model",
        action="append",
        required=True,
        metavar="NAME[=KEY]",
        help="route name and registry key (h1), or NAME=KEY to serve registry key KEY under "
        "another name; repeat to serve several models",
    )
    add("--checkpoint", action="append", type=Path, required=True, help="the .pt2, per --model")
    add("--assets", action="append", type=Path, help="assets dir per --model (default: beside it)")
    add_import_option(parser)
    add("--device", default="cpu", help="torch device (default: %(default)s); one process per GPU")
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=_port, default=8080, help="port to bind (default: %(default)s)")
    add(
        "--server",
        choices=["uvicorn", "hypercorn"],
        default="uvicorn",
        help="the ASGI server to run under (default: %(default)s)",
    )
    add(
        "--backend",
        choices=["asyncio", "trio"],
        default="asyncio",
        help="the event loop (default: %(default)s); trio needs --server hypercorn",
    )
    add(
        "--max-batch-size",
        type=_count,
        default=64,
        help="the most tiles in one forward pass (default: %(default)s)",
    )
    add(
        "--max-wait-ms",
        type=_at_least_zero,
        default=5.0,
        help="the longest, in ms, a queued tile waits for others to batch with (default: "
        "%(default)s)",
    )
    add(
        "--max-queue",
        type=_count,
        default=1024,
        help="requests admitted per mode (decoding, queued or running); more get 503 "
        "(default: %(default)s)",
    )
    add(
        "--max-body-mb",
        type=_body_mb,
        default=64.0,
        help="the largest request body, in MiB (at least 0.001, about 1 KiB); larger bodies get "
        "413 (default: %(default)s)",
    )
    add(
        "--max-bodies-mb",
        type=_body_mb,
        default=None,
        help="the most MiB of request bodies held at once, over every request; a body that "
        "does not fit gets 503 (default: 1024, or 16 × --max-body-mb if more)",
    )
    add(
        "--max-batch-requests",
        type=_count,
        default=4096,
        help="the most requests in one /batch body; more get 413 (default: %(default)s)",
    )
    add(
        "--max-batch-calls",
        type=_count,
        default=4,
        help="the most /batch calls in progress at once; more get 503 at once, as a full "
        "queue answers (default: %(default)s)",
    )
    add(
        "--request-timeout",
        type=_above_zero,
        default=None,
        help="seconds from when a request's body has been read (parsing, decoding and queueing "
        "included) until its forward pass must start, or 503 deadline-exceeded (default: no "
        "limit)",
    )
    add(
        "--body-timeout",
        type=_at_least_zero,
        default=60.0,
        help="seconds a request's body may go with none of it arriving before 408; 0: no limit "
        "(default: %(default)s)",
    )
    add(
        "--retry-after",
        type=_zero_or_more,
        default=1,
        help="seconds sent in the Retry-After header of every 503 (default: %(default)s)",
    )
    add(
        "--graceful-timeout",
        type=_at_least_zero,
        default=30.0,
        help="seconds in-flight requests get at shutdown; just before they run out, those "
        "still in flight are answered 503 'closed' (default: %(default)s)",
    )
    add(
        "--drain-delay",
        type=_at_least_zero,
        default=0.0,
        help="seconds between SIGTERM and draining, with readiness failing and requests still "
        "served, while load balancers move away (Kubernetes: a few seconds; default: "
        "%(default)s)",
    )
    add(
        "--keep-alive-timeout",
        type=_at_least_zero,
        default=5.0,
        help="seconds an idle kept-alive connection stays open; make it longer than a load "
        "balancer's idle timeout in front (default: %(default)s)",
    )
    add("--no-warmup", action="store_true", help="report ready without a warm-up pass")
    add(
        "--no-cancel-on-disconnect",
        action="store_true",
        help="compute a request whose client hung up (by default it is cancelled: saves the "
        "device's time, costs the event loop ~0.1 ms a request)",
    )
    add("--access-log", action="store_true", help="log every request (costs throughput)")
    add(
        "--log-level",
        default="info",
        type=str.lower,  # INFO, as containers often spell it
        choices=["debug", "info", "warning", "error"],
        help="the server's log level (default: %(default)s)",
    )
    add(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="timestamped text lines, or one JSON object a line for a log pipeline "
        "(default: %(default)s)",
    )
    parser.epilog = (
        "Every option but --debug may be set in the environment instead: "
        "HISTOINFER_MAX_QUEUE=256 for --max-queue 256 (repeatable ones comma-separated, flags "
        "1 or 0); the command line wins, and a HISTOINFER_ variable that sets nothing is "
        "warned of."
    )
    parser.set_defaults(unknown_variables=defaults_from_environment(parser))


# Option types: a bad value is refused by argparse with a usage line, never accepted and then
# turned into a 500, a 413 or a 503 on every request.


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'an int' if kind is int else 'a number'}"
        ) from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _option(
    kind: type[int] | type[float], ok: Callable[[float], bool], rule: str
) -> Callable[[str], Any]:
    """An argparse type: ``text`` as ``kind``, refused with ``rule`` unless ``ok``."""

    def convert(text: str) -> Any:
        value = kind(_number(text, kind))
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {value}")
        return value

    return convert


_count = _option(int, lambda v: v >= 1, "must be at least 1")
_zero_or_more = _option(int, lambda v: v >= 0, "must be 0 or more")
_port = _option(int, lambda v: 0 <= v <= 65535, "a port is 0-65535")
_at_least_zero = _option(float, lambda v: v >= 0, "must be 0 or more")
_above_zero = _option(float, lambda v: v > 0, "must be more than 0")
# Under 1 KiB no request fits (0.0000001 MiB was a 0-byte limit: 413 for every request).
_body_mb = _option(float, lambda v: v * 1024 >= 1, "must be at least 0.001 (1 KiB)")


def model_sources(args: argparse.Namespace) -> dict[str, ClientSource]:
    """``{route name: factory}`` from the repeated --model/--checkpoint/--assets options."""
    models: list[str] = args.model
    checkpoints: list[Path] = args.checkpoint
    assets: list[Path | None] = args.assets or [None] * len(models)
    if len(checkpoints) != len(models) or len(assets) != len(models):
        raise CommandError(
            f"give one --checkpoint (and none or one --assets) per --model: got "
            f"{len(models)} --model, {len(checkpoints)} --checkpoint, "
            f"{len(args.assets or [])} --assets"
        )
    sources: dict[str, ClientSource] = {}
    try:  # a device this process cannot use is refused before the port is bound, too
        resolve_device(args.device, checkpoints[0])
    except CheckpointError as exc:
        raise CommandError(str(exc)) from None
    for spec, checkpoint, assets_dir in zip(models, checkpoints, assets, strict=True):
        name, _, key = spec.partition("=")
        key = key or name
        if not name or "/" in name:
            raise CommandError(f"model name {name!r} must be non-empty, without '/' (a route)")
        if name in sources:
            raise CommandError(f"model name {name!r} given twice; use NAME=KEY to rename one")
        if name == UNKNOWN:
            raise CommandError(
                f"model name {name!r} is /metrics' label for paths naming no model served "
                f"here; serve it as NAME={key}"
            )
        if not checkpoint.is_file():
            raise CommandError(
                f"checkpoint {checkpoint} for model {name!r} is not a file"
                f"{in_the_folder(checkpoint)}"
            )
        try:
            cls = model_class(key)  # an unknown key is refused before the port is bound
        except UnknownModelError as exc:
            raise unknown_model(f"--model {spec}", exc) from exc
        # So is a missing model.json, where ServerModel.from_files would look for it (a class
        # with a loader of its own may not need one): else it failed seconds after binding.
        found = assets_folder(checkpoint, assets_dir)
        stock = getattr_static(ServerModel, "from_files")
        if getattr_static(cls, "from_files") is stock and not (found / ASSETS_FILE).is_file():
            raise CommandError(
                f"model assets {found / ASSETS_FILE} for model {name!r} not found (give --assets "
                "DIR per --model if they are elsewhere)"
            )
        sources[name] = partial(
            InProcessClient.from_checkpoint,
            key,
            checkpoint,
            args.device,
            assets_dir,
            max_batch_size=args.max_batch_size,
            max_wait_ms=args.max_wait_ms,
            max_queue=args.max_queue,
            request_timeout=args.request_timeout,
            overload="reject",  # the server answers 503 at once rather than queueing forever
            name=name,  # errors and logs name the route
        )
    return sources


def run(args: argparse.Namespace) -> int:
    if args.server == "uvicorn" and args.backend == "trio":
        raise CommandError("uvicorn runs on asyncio only; use --server hypercorn --backend trio")
    if args.access_log and args.log_level in ("warning", "error"):
        # Access lines are info lines: with both, none was written, and nothing said why.
        raise CommandError(
            f"--access-log writes info lines, which --log-level {args.log_level} leaves out: "
            "use --log-level info (the default) or debug with it"
        )
    if args.max_bodies_mb is not None and args.max_bodies_mb < args.max_body_mb:
        raise CommandError(
            f"--max-bodies-mb ({args.max_bodies_mb:g}) must be at least --max-body-mb "
            f"({args.max_body_mb:g}): a body the server takes must fit in what it holds"
        )
    import_modules(args.imports)  # before the keys are looked up: they may register them
    sources = model_sources(args)
    _check_bindable(args.host, args.port)
    logging.getLogger("histoinfer").setLevel(args.log_level.upper())
    _format_log(args.log_format)
    for said in args.unknown_variables:
        _say(args, logging.WARNING, said)
    app = create_app(
        sources,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        retry_after=args.retry_after,
        warmup=not args.no_warmup,
        cancel_on_disconnect=not args.no_cancel_on_disconnect,
        body_timeout=args.body_timeout or None,
        max_batch_requests=args.max_batch_requests,
        max_batch_calls=args.max_batch_calls,
        max_held_bytes=None if args.max_bodies_mb is None else int(args.max_bodies_mb * 2**20),
    )
    state: ServerState = app.state.histoinfer
    state.on_loaded = freeze_startup_heap
    names = ", ".join(state.models)
    # Port 0: the server picks a free one, and its own log line names it.
    where = f"http://{_authority(args.host, args.port)}" if args.port else "a free port"
    _say(
        args,
        logging.INFO,
        f"serving {names} on {where} ({args.server}, {args.backend}); ready at /health/ready "
        "once loaded",
    )
    # What is in force, wherever it came from (the command line, a variable, a default): the
    # environment of a container is not in its log.
    shown = {name: getattr(args, name) for name in _SETTINGS}
    if state.max_held_bytes is not None:  # its default is worked out from --max-body-mb
        shown["max_bodies_mb"] = f"{state.max_held_bytes / 2**20:g}"
    settings = " ".join(filter(None, (_setting(name, value) for name, value in shown.items())))
    _say(args, logging.INFO, f"settings: {settings}")
    served = AccessLog(app) if args.access_log else app  # the servers' own access logs off
    if args.server == "uvicorn":
        _run_uvicorn(served, state, args)
    else:
        _run_hypercorn(served, state, args)
    failed = {name: m.error for name, m in state.models.items() if m.status == "failed"}
    for name, error in failed.items():
        _say(args, logging.ERROR, f"model {name!r} failed to load: {error}")
    return 1 if failed else 0


#: the options the start-up's "settings:" line shows (the models have a line of their own)
_SETTINGS = (
    "device", "max_batch_size", "max_wait_ms", "max_queue", "request_timeout", "max_body_mb",
    "max_bodies_mb", "max_batch_requests", "max_batch_calls", "body_timeout", "retry_after",
    "graceful_timeout", "drain_delay", "keep_alive_timeout", "no_warmup",
    "no_cancel_on_disconnect", "access_log", "log_level", "log_format",
)  # fmt: skip


def _setting(name: str, value: object) -> str:
    option = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return option if value else ""
    return f"{option} {'none' if value is None else value}"


def _say(args: argparse.Namespace, level: int, message: str) -> None:
    """A line the command says whatever the log level: "histoinfer: ..." (``error: ...``), or
    with ``--log-format json`` a JSON object, so that every line of the stream is one."""
    if args.log_format == "json":
        said = logging.LogRecord(log.name, level, __file__, 0, message, None, None)
        print(JsonFormatter().format(said), file=sys.stderr, flush=True)
    else:
        kind = (
            "error: " if level >= logging.ERROR else "warning: " if level >= logging.WARNING else ""
        )
        print(f"histoinfer: {kind}{message}", file=sys.stderr, flush=True)


def freeze_startup_heap() -> None:
    """Move everything allocated so far (torch, the models: ~330k objects) out of the garbage
    collector's reach: a full collection otherwise scans it all, a ~125-170 ms pause that
    lands on whichever requests are in flight (docs/benchmarks-history.md, "Session 4")."""
    gc.collect()
    gc.freeze()
    log.info("start-up heap frozen: %d objects out of the collector's scans", gc.get_freeze_count())


def _format_log(log_format: str) -> None:
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:  # the CLI's (basicConfig), no one else's
            handler.setFormatter(formatter_for(log_format))
    if log_format == "json":  # a Python warning, too, as an object (logger py.warnings)
        logging.captureWarnings(True)


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _http_protocol() -> Any:
    """uvicorn's httptools protocol with a request's head bounded (server/guarded_http.py);
    without httptools, uvicorn's choice (h11, which bounds a head at 16 KiB)."""
    try:
        from .guarded_http import GuardedHttpToolsProtocol
    except ImportError:
        return "auto"
    return GuardedHttpToolsProtocol


def _run_uvicorn(app: Any, state: ServerState, args: argparse.Namespace) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        draining: asyncio.TimerHandle | None = None
        stopped_by: int | None = None
        failed = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.stopped_by = sig
            # On the event loop (uvicorn's signal handler). Readiness fails at once; requests
            # are still served for --drain-delay, then new ones get 503 "closed" while those in
            # flight finish, and just before the graceful timeout the app answers the rest.
            # uvicorn installs this with signal.signal: it runs between two bytecodes of the
            # main thread, perhaps inside a write to the log. The line goes through the loop.
            said = _signal_said(sig, state, args)
            asyncio.get_running_loop().call_soon_threadsafe(log.info, said)
            if state.stopping:  # a second signal ends the delay, and goes no further: to
                # uvicorn a second SIGINT is a force quit, which cuts off the requests in flight
                # (a bare 500 or a dropped connection) instead of letting them finish
                if self.draining is not None:
                    self.draining.cancel()
                    self.drain(sig, frame)
                return
            if args.drain_delay > 0:
                state.begin_stopping()
                loop = asyncio.get_running_loop()
                self.draining = loop.call_later(args.drain_delay, self.drain, sig, frame)
                return
            self.drain(sig, frame)

        def drain(self, sig: int, frame: FrameType | None) -> None:
            self.draining = None
            state.begin_stopping()  # now: a second signal must find it stopping
            loop = asyncio.get_running_loop()
            # Its line through the loop too, so after the signal's own (a trial read the
            # effect logged before its cause), and not from inside a signal handler.
            loop.call_soon_threadsafe(state.begin_drain, True)
            loop.call_later(_before_the_deadline(args.graceful_timeout), state.expire_in_flight)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        lifespan="on",
        log_level=args.log_level,
        log_config=uvicorn_log_config(args.log_format),
        access_log=False,
        # Annotated int, but uvicorn only waits them out (call_later, wait_for), which take any
        # number of seconds: as given, not rounded up to whole seconds as they were.
        timeout_graceful_shutdown=args.graceful_timeout,  # type: ignore[arg-type]
        timeout_keep_alive=args.keep_alive_timeout,  # type: ignore[arg-type]
        backlog=_BACKLOG,
        http=_http_protocol(),
    )
    server = Server(config)
    uvicorn_log = logging.getLogger("uvicorn.error")  # configured by Config just now
    for logger in (uvicorn_log, logging.getLogger("asyncio")):
        for old in [f for f in logger.filters if isinstance(f, ThrottledInvalidRequests)]:
            logger.removeFilter(old)  # a second serve in this process (tests)
        logger.addFilter(ThrottledInvalidRequests())

    def stop() -> None:
        server.should_exit = True
        server.failed = True  # a model failed: its exit status, not a later signal's

    state.on_fatal = stop
    server.run()
    # uvicorn re-raises the stop signal once it has stopped, which ends the process as that
    # signal does. One inherited ignored (SIGINT, by a background job of a script) ends it
    # nowhere: the process went on to exit 0, as if nothing had stopped it (a user trial).
    if server.failed:
        return
    if server.stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
    if server.stopped_by == signal.SIGTERM:
        raise SystemExit(128 + signal.SIGTERM)


def _signal_said(sig: int, state: ServerState, args: argparse.Namespace) -> str:
    """The operator's record of a stop signal and what follows it (before session 25 nothing
    was logged until the server had stopped, or, under hypercorn, at all): worked out as the
    signal arrives, logged from the event loop."""
    name = signal.Signals(sig).name
    if state.draining:
        return f"{name} again: already draining; nothing more to do (SIGKILL stops at once)"
    if state.stopping:
        return f"{name} again: the drain delay ends; draining now"
    if args.drain_delay > 0:
        return (
            f"{name}: readiness fails now; new requests are refused after {args.drain_delay:g} "
            f"s (--drain-delay), and those in flight then have {args.graceful_timeout:g} s "
            "(--graceful-timeout)"
        )
    graceful = args.graceful_timeout
    return f"{name}: draining; requests in flight have {graceful:g} s (--graceful-timeout)"


def _before_the_deadline(graceful_timeout: float) -> float:
    """When the app answers the requests still in flight itself: a little before the server's
    graceful timeout, at which it would cancel their handlers (a bare 500, a dropped
    connection)."""
    return max(0.0, graceful_timeout - min(0.5, 0.2 * graceful_timeout))


def _check_bindable(host: str, port: int) -> None:
    """Both servers bind only after the app's start-up has run (the models start loading), and
    hypercorn's failure there ends in a traceback from the lifespan's shutdown: try the address
    first, for one line and exit status 1 from either."""
    failure: OSError | None = None
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        found, failure = [], exc
    for family, kind, proto, _, address in found:  # one that binds is enough, as for servers
        try:
            with socket.socket(family, kind, proto) as probe:
                if (option := _probe_option()) is not None:
                    probe.setsockopt(socket.SOL_SOCKET, option, 1)
                probe.bind(address)
            return
        except OSError as exc:
            failure = exc
    why = (failure.strerror or str(failure)) if failure is not None else "no address"
    raise CommandError(f"cannot listen on {_authority(host, port)}: {why}")


def _probe_option() -> int | None:
    """The socket option ``_check_bindable`` binds with. SO_REUSEADDR, as the servers bind (a
    port a stopped server left in TIME_WAIT is free to them), except on Windows: there it lets
    a second socket bind a port in use, so the probe would pass; SO_EXCLUSIVEADDRUSE fails on
    any socket already bound to the port."""
    if sys.platform == "win32":
        return getattr(socket, "SO_EXCLUSIVEADDRUSE", None)
    return socket.SO_REUSEADDR


#: connections the kernel queues for accept() (uvicorn's default; the kernel caps it at
#: net.core.somaxconn)
_BACKLOG = 2048


def _run_hypercorn(app: Any, state: ServerState, args: argparse.Namespace) -> None:
    from hypercorn.config import Config

    config = Config()
    config.bind = [_authority(args.host, args.port)]
    # uvicorn's listen backlog, not hypercorn's 100: a burst of 2,000 connections lost 823
    # (reset, in no log or metric) where uvicorn answered the excess 503 (a soak trial).
    config.backlog = _BACKLOG
    config.graceful_timeout = args.graceful_timeout
    config.keep_alive_timeout = args.keep_alive_timeout
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # one handler: the root's
    config.loglevel = args.log_level.upper()
    logging.getLogger("hypercorn.error").setLevel(args.log_level.upper())

    async def main() -> None:
        stop = anyio.Event()  # the server stops accepting connections and drains
        state.on_fatal = stop.set

        async def drain(hurry: anyio.Event) -> None:
            with anyio.move_on_after(args.drain_delay):
                await hurry.wait()
            state.begin_drain(announce=True)
            stop.set()
            await anyio.sleep(_before_the_deadline(args.graceful_timeout))
            state.expire_in_flight()

        async def on_signals(tg: anyio.abc.TaskGroup) -> None:
            hurry = anyio.Event()  # a second signal: drain now
            with contextlib.ExitStack() as stack:
                async for sig in _receive_signals(stack, signal.SIGTERM, signal.SIGINT):
                    log.info(_signal_said(sig, state, args))
                    if state.stopping:
                        hurry.set()
                    else:
                        state.begin_stopping()  # readiness fails at once
                        tg.start_soon(drain, hurry)

        if args.backend == "trio":
            from hypercorn.trio import serve
        else:
            from hypercorn.asyncio import serve  # type: ignore[assignment]

        async def serving(tg: anyio.abc.TaskGroup) -> None:
            await serve(app, config, shutdown_trigger=stop.wait)
            tg.cancel_scope.cancel()  # the signal watcher and the drain's timer

        # serve runs in a child task, not the host: hypercorn's asyncio serve leaves its task a
        # cancellation request (Python 3.11's asyncio.TaskGroup does not withdraw it), so in the
        # host anyio took the task group's cancel for one from outside and re-raised it: exit
        # status 1 and a CancelledError traceback on every SIGTERM. A child task just ends.
        async with anyio.create_task_group() as tg:
            tg.start_soon(on_signals, tg)
            tg.start_soon(serving, tg)

    anyio.run(main, backend=args.backend)


def _receive_signals(stack: contextlib.ExitStack, *signums: signal.Signals) -> AsyncIterator[int]:
    """anyio's signal receiver, entered on ``stack``; where the event loop cannot watch signals
    (asyncio on Windows has no add_signal_handler: NotImplementedError), ``_handled_signals``."""
    try:
        return stack.enter_context(anyio.open_signal_receiver(*signums))
    except NotImplementedError:
        return stack.enter_context(_handled_signals(*signums))


@contextlib.contextmanager
def _handled_signals(*signums: signal.Signals) -> Iterator[AsyncIterator[int]]:
    """The signals as Python's own handlers get them (Windows delivers SIGINT, Ctrl+C, and
    SIGTERM so), each handed over to the asyncio loop; the previous handlers are put back."""
    loop = asyncio.get_running_loop()
    send, receive = anyio.create_memory_object_stream[int](math.inf)

    def put(signum: int) -> None:
        with contextlib.suppress(anyio.ClosedResourceError):  # came as the watch ended
            send.send_nowait(signum)

    def deliver(signum: int, frame: FrameType | None) -> None:
        # Runs on the loop's thread, between two bytecodes of whatever it ran: the loop takes
        # it from here (call_soon_threadsafe also wakes it, as asyncio's Ctrl+C handler does).
        loop.call_soon_threadsafe(put, signum)

    previous: dict[signal.Signals, Any] = {}
    try:
        for signum in signums:
            previous[signum] = signal.signal(signum, deliver)
        yield receive
    finally:
        for signum, handler in previous.items():  # None: one not set from Python
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        send.close()
        receive.close()
