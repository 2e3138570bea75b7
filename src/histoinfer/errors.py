"""The exceptions every backend raises.

Each class carries the RFC 9457 problem ``type`` slug and the HTTP status the microservice
answers with, so the server can render it and :class:`~histoinfer.HttpClient` can map a
problem+json body back to the very same class and message that :class:`InProcessClient` raises.
This module imports nothing else of ours: it is part of the contract.
"""

from __future__ import annotations

import threading

__all__ = [
    "ClientClosedError",
    "DeadlineExceededError",
    "InferenceError",
    "InvalidRequestError",
    "ModelExecutionError",
    "OverloadedError",
    "ThreadAbortedError",
    "UnsupportedModeError",
    "error_for_problem_type",
]

PROBLEM_TYPE_PREFIX = "https://histoinfer.dev/problems/"


class InferenceError(Exception):
    """Base of every error histoinfer raises on purpose."""

    problem_slug = "inference-error"
    title = "Inference error"
    #: The HTTP status the microservice answers this error with. On an error ``HttpClient``
    #: raised from an answer, the status that answer carried (a 404 for an unknown model is an
    #: ``InvalidRequestError`` whose ``http_status`` is 404, not the class's 422).
    http_status = 500
    #: Whether the same request, sent again unchanged a little later, may succeed: a full
    #: queue, a missed deadline, a server loading, draining or out of reach. False where it
    #: would fail the same way (a refused body, a failing pass) and for a client closed for
    #: good. ``HttpClient`` has already retried what its ``retries`` allow by the time it
    #: raises one.
    retryable = False
    #: The ``X-Request-ID`` of the HTTP answer that carried this error (``HttpClient``): the
    #: one the request sent, or the one the server made up to name it in its log (every
    #: error it logs: 500s, and 503s that shed load). None in-process.
    request_id: str | None = None
    #: For a failed ``*_batch`` call (or ``/batch`` request): the batch positions of the
    #: requests that made it fail, ascending, so that a caller can drop them and send the rest
    #: again (docs/wire-format.md says which); None for other errors, and past 1,000 runs or
    #: 100,000 positions (a list of millions would cost more than the call it describes).
    positions: list[int] | None = None

    @classmethod
    def problem_type(cls) -> str:
        return PROBLEM_TYPE_PREFIX + cls.problem_slug


class InvalidRequestError(InferenceError):
    """Bad JSON, a schema violation, an undecodable image, sizes that do not match."""

    problem_slug = "invalid-request"
    title = "Invalid request"
    http_status = 422


class UnsupportedModeError(InvalidRequestError):
    """The model does not offer this mode (or this input, e.g. ``bulk_rna``)."""

    problem_slug = "unsupported-mode"
    title = "Unsupported mode"
    http_status = 400


class ModelExecutionError(InferenceError):
    """The forward pass failed for this sample."""

    problem_slug = "model-execution"
    title = "Model execution failed"
    http_status = 500


class OverloadedError(InferenceError):
    """The queue is full, or the service is shedding load; try again later."""

    problem_slug = "overloaded"
    title = "Overloaded"
    http_status = 503
    retryable = True
    #: Seconds the server asked the caller to wait (its ``Retry-After``), where the error came
    #: from an HTTP answer that carried one (``HttpClient``); otherwise None.
    retry_after: float | None = None


class DeadlineExceededError(OverloadedError):
    """The request was not dispatched to the model before its deadline."""

    problem_slug = "deadline-exceeded"
    title = "Deadline exceeded"
    http_status = 503


class ClientClosedError(InferenceError):
    """The client (or the server) is closed or closing and takes no new work."""

    problem_slug = "closed"
    title = "Closed"
    http_status = 503


class ThreadAbortedError(RuntimeError):
    """Code run on a worker thread (a batch function, a model's pass) raised a
    ``BaseException`` that is not an ``Exception``: ``SystemExit``, ``KeyboardInterrupt``, a
    nested event loop's ``CancelledError``, a class of the user's own. Off the main thread none
    of them can be a signal or the caller's own cancellation, so it is carried as this
    ordinary error (``__cause__`` is the original): it fails only the requests it belongs to,
    and an event loop waiting for the thread never mistakes it for its own cancellation. Not an
    :class:`InferenceError`: it is not a refusal of the request."""

    @classmethod
    def contain(cls, exc: BaseException, what: str) -> BaseException:
        """``exc`` as it may leave the current thread: an ``Exception``, or anything on the
        main thread (where a ``KeyboardInterrupt`` is Ctrl-C), unchanged; else wrapped."""
        if isinstance(exc, Exception) or threading.current_thread() is threading.main_thread():
            return exc
        error = cls(f"{what} raised {exc!r}, which is not an Exception")
        error.__cause__ = exc
        return error


_ALL: tuple[type[InferenceError], ...] = (
    InferenceError,
    InvalidRequestError,
    UnsupportedModeError,
    ModelExecutionError,
    OverloadedError,
    DeadlineExceededError,
    ClientClosedError,
)


def error_for_problem_type(problem_type: str | None, status: int) -> type[InferenceError]:
    """The exception class for a problem+json ``type``, falling back on the HTTP status."""
    for cls in _ALL:
        if problem_type == cls.problem_type():
            return cls
    by_status: dict[int, type[InferenceError]] = {
        400: UnsupportedModeError,
        404: InvalidRequestError,
        408: InvalidRequestError,  # the body stalled (the server's --body-timeout)
        413: InvalidRequestError,
        415: InvalidRequestError,  # a compressed body (Content-Encoding): the caller's to change
        422: InvalidRequestError,
        429: OverloadedError,  # a gateway's or rate limiter's Too Many Requests: back off
        503: OverloadedError,
    }
    return by_status.get(status, InferenceError)
