"""RFC 9457 ``application/problem+json`` responses, and the errors only the server raises.

Every failure leaves the service as ``{type, title, status, detail}`` (and a failed ``/batch``
call's ``positions``: :attr:`~histoinfer.errors.InferenceError.positions`). For a histoinfer
error the ``type`` names its exception class and ``detail`` is its message, so
:class:`~histoinfer.HttpClient` raises the very class and message that
:class:`~histoinfer.InProcessClient` raises for the same input.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import InferenceError, InvalidRequestError, OverloadedError

__all__ = [
    "PROBLEM_JSON",
    "ModelNotReadyError",
    "PayloadTooLargeError",
    "Problem",
    "RequestIdMiddleware",
    "RequestTimeoutError",
    "UnknownModelError",
    "install_problem_handlers",
    "leave_body_unread",
    "problem_response",
]

log = logging.getLogger("histoinfer.server")

#: the header that names a request in the server's log and in its answer
REQUEST_ID = "x-request-id"
_REQUEST_ID_BYTES = REQUEST_ID.encode()
#: a request's own ID is used, and echoed, only if it is this short and printable: it goes
#: into log lines and headers
_LONGEST_ID = 128


def sent_request_id(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The request's own ``X-Request-ID`` (from the ASGI scope's headers), if usable."""
    for name, value in headers:
        if name == _REQUEST_ID_BYTES:
            ok = 0 < len(value) <= _LONGEST_ID and all(0x21 <= b <= 0x7E for b in value)
            return value if ok else None
    return None


class RequestIdMiddleware:
    """Echo a request's own ``X-Request-ID`` on its answer, whatever the answer (a request
    with none costs one scan of its headers)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = sent_request_id(scope["headers"]) if scope["type"] == "http" else None
        if sent is None:
            await self.app(scope, receive, send)
            return

        async def echo(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name == _REQUEST_ID_BYTES for name, _ in headers):  # a logged error's
                    message["headers"] = [*headers, (_REQUEST_ID_BYTES, sent)]
            await send(message)

        await self.app(scope, receive, echo)


def logged_request_id(request: Request, response: Response) -> str:
    """The ID a logged error answer is known by, set on ``response`` for the client: the
    request's own, else a new one. (An unhandled error's answer is sent from outside the
    app's middleware, so it is set here even when the request sent one.)"""
    sent = sent_request_id(request.scope["headers"])
    made = sent.decode() if sent is not None else uuid.uuid4().hex[:16]
    response.headers["X-Request-ID"] = made
    return made


PROBLEM_JSON = "application/problem+json"


class Problem(BaseModel):
    """The problem+json body (RFC 9457), for the OpenAPI document."""

    type: str = Field(description="URI naming the kind of problem (maps to an exception class)")
    title: str = Field(description="short summary of the kind of problem")
    status: int = Field(description="the HTTP status code")
    detail: str = Field(description="what went wrong with this request, and where")
    positions: list[int] | None = Field(
        default=None,
        description="a failed /batch call's: the batch positions of the requests that made it "
        "fail (absent for other errors, and past 1,000 runs or 100,000 positions)",
    )


class UnknownModelError(InvalidRequestError):
    """No model of that name is served here (404; clients see an ``InvalidRequestError``)."""

    problem_slug = "unknown-model"
    title = "Unknown model"
    http_status = 404


class PayloadTooLargeError(InvalidRequestError):
    """The request body is over the server's size limit (413)."""

    problem_slug = "payload-too-large"
    title = "Payload too large"
    http_status = 413


class RequestTimeoutError(InvalidRequestError):
    """The client sent nothing of its body for the server's body timeout (408): a stalled
    or deliberately slow client (slowloris) would otherwise hold its slot for ever."""

    problem_slug = "request-timeout"
    title = "Request timeout"
    http_status = 408


class ModelNotReadyError(OverloadedError):
    """The model is still loading or warming up (503 with ``Retry-After``: retry shortly)."""

    problem_slug = "not-ready"
    title = "Model not ready"
    http_status = 503


def problem_response(
    status: int,
    title: str,
    detail: str,
    type_: str = "about:blank",
    *,
    retry_after: int | None = None,
    positions: list[int] | None = None,
) -> Response:
    """One problem+json response; 503s carry ``Retry-After`` so clients back off, not hammer.
    A refused ``/batch`` call's bad ``positions`` go in an extension member of that name."""
    problem: dict[str, object] = {"type": type_, "title": title, "status": status}
    problem["detail"] = detail
    if positions is not None:
        problem["positions"] = positions
    body = json.dumps(problem)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return Response(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


def leave_body_unread(request: Request) -> None:
    """Mark ``request`` as answered before its body was read to its end: its answer says
    ``Connection: close``, and the server closes the connection after it (RFC 9110 §15.5.9).
    Left open, the rest of the body would be read as the connection's next request, and a
    client that had stalled kept its connection with no timeout at all (a user trial: open
    after three minutes)."""
    request.state.body_unread = True


def _closing_if_unread(request: Request, response: Response) -> Response:
    if getattr(request.state, "body_unread", False):
        response.headers["Connection"] = "close"
    return response


def error_response(exc: InferenceError, retry_after: int) -> Response:
    status = exc.http_status
    return problem_response(
        status,
        exc.title,
        str(exc),
        exc.problem_type(),
        retry_after=retry_after if status == 503 else None,
        positions=exc.positions,
    )


#: the status recorded for a request whose client left before sending its body (nginx's)
CLIENT_CLOSED_REQUEST = 499


class LogThrottle:
    """At most one log line a key every ``every`` seconds, which says how many it left out:
    a failing device or a shedding server answers thousands of requests a minute alike, and
    an operator needs to see that it happens (and one traceback), not each of them."""

    def __init__(self, every: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self._clock = clock
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def due(self, key: str) -> tuple[int, float] | None:
        """None to leave this one out; else how many of ``key`` were left out since the last
        line logged for it, and how many seconds ago that was."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now < last + self.every:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._left_out.pop(key, 0), (now - last if last is not None else 0.0)


def since(left_out: int, seconds: float) -> str:
    # Since that line, not "in the last minute": a quiet spell makes it longer (a user trial
    # read 1,102 refusals "in the last 60 s" that had come over 134).
    if not left_out:
        return ""
    return f" ({left_out} more like it since the last such line, {seconds:.0f} s ago)"


def _kind(exc: InferenceError) -> str:
    """What a throttled line stands for: the error's words less their figures. A full queue
    and a server out of room for bodies are both 503 ``overloaded``, but an operator tunes
    different limits for them, and one line standing for both named only the first."""
    said = str(exc)
    if exc.problem_slug == "deadline-exceeded":
        # Why each request missed it (others ahead, still decoding, a batch out) varies from
        # request to request of one burst: a model's deadline is one kind (a trial counted 4
        # lines in 0.4 s).
        said = said.partition(" within its deadline")[0]
    return f"{exc.problem_slug}: {_FIGURES.sub('#', said)}"


_FIGURES = re.compile(r"\b\d+(\.\d+)?\b")  # not the digits of a name ("h1", "h0")


def log_answer(
    request: Request, exc: InferenceError, response: Response, throttle: LogThrottle
) -> None:
    """Log what the operator must hear of an error answer, throttled by kind: a 500 (the model
    failed: with its traceback, which the client never sees) and a 503 that sheds load or
    misses a deadline (queue full, a device that hangs). A 4xx is the client's business and
    is not logged; neither are the 503s of a server starting or shutting down."""
    status = exc.http_status
    if status >= 500 and status != 503:
        key, level, trace = type(exc).__name__, logging.ERROR, True
    elif status == 503 and exc.problem_slug in ("overloaded", "deadline-exceeded"):
        key, level, trace = _kind(exc), logging.WARNING, False
    else:
        return
    due = throttle.due(key)
    if due is None:
        # Left out at the line's level, but said at DEBUG, and a 500 named whatever the
        # level: the ID the client's error carries leads somewhere (an evaluator's second and
        # third 500s of a minute carried none). Not so a shed 503 with DEBUG off: the ID
        # would lead nowhere, and naming it cost ~9 µs of the loop a refusal, when the server
        # is already overloaded (a review).
        if level == logging.WARNING and not log.isEnabledFor(logging.DEBUG):
            return
        level, trace, left_out, seconds = logging.DEBUG, False, 0, 0.0
    else:
        left_out, seconds = due
    named = logged_request_id(request, response)
    log.log(
        level,
        "%s %s answered %d (request %s): %s%s",
        request.method,
        request.scope["path"],
        status,
        named,
        exc,
        since(left_out, seconds),
        exc_info=exc if trace else None,
        extra={"request_id": named},  # a field of its own in --log-format json
    )


def _allowed_methods(request: Request) -> set[str]:
    """Every method some route takes at this path but not with this method. Starlette's 405
    names those of the first such route only (GET and HEAD on one path are two routes here)."""
    allowed: set[str] = set()
    for route in request.app.router.routes:
        methods = getattr(route, "methods", None)
        if methods and route.matches(request.scope)[0] == Match.PARTIAL:
            allowed |= methods
    return allowed


def install_problem_handlers(app: FastAPI, retry_after: int) -> None:
    """Render every error as problem+json: ours, Starlette's (404, 405) and unexpected ones."""

    throttle = LogThrottle()

    async def inference_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InferenceError)
        response = error_response(exc, retry_after)
        log_answer(request, exc, response, throttle)
        return _closing_if_unread(request, response)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        phrase = HTTPStatus(exc.status_code).phrase
        detail = exc.detail if isinstance(exc.detail, str) else phrase
        if exc.status_code == 404 and detail == phrase:
            path = request.url.path
            detail = f"no route for {request.method} {path}"
            if len(path) > 1 and path.endswith("/"):
                detail += f" (routes take no trailing slash: {path.rstrip('/')})"
        response = problem_response(exc.status_code, phrase, detail)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            allowed = _allowed_methods(request)
            if allowed:
                response.headers["Allow"] = ", ".join(sorted(allowed))
        return _closing_if_unread(request, response)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(InvalidRequestError(f"invalid request: {exc.errors()}"), retry_after)

    async def unexpected(request: Request, exc: Exception) -> Response:
        # A bug, not a bad request: log the traceback here, tell the caller only what happened.
        response = error_response(
            InferenceError(f"internal server error ({type(exc).__name__}); see the server log"),
            retry_after,
        )
        named = logged_request_id(request, response)
        path = request.url.path
        log.exception(
            "unhandled error on %s %s (request %s)",
            request.method,
            path,
            named,
            extra={"request_id": named},
        )
        return response

    async def client_gone(request: Request, exc: Exception) -> Response:
        # The client closed its connection before its body arrived: nothing failed here, and
        # nobody reads the answer. Not logged (anyone could fill the log with them); counted
        # under nginx's 499, "client closed request", not as a server error.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(InferenceError, inference_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
