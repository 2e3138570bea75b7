"""RFC 9457 ``application/problem+json`` responses, and the errors only the server raises.

Every failure leaves the service as ``{type, title, status, detail}``. For a histoinfer error the
``type`` names its exception class and ``detail`` is its message, so
:class:`~histoinfer.HttpClient` raises the very class and message that
:class:`~histoinfer.InProcessClient` raises for the same input.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Match

from ..errors import InferenceError, InvalidRequestError, OverloadedError

__all__ = [
    "PROBLEM_JSON",
    "ModelNotReadyError",
    "PayloadTooLargeError",
    "Problem",
    "UnknownModelError",
    "install_problem_handlers",
    "problem_response",
]

log = logging.getLogger("histoinfer.server")

PROBLEM_JSON = "application/problem+json"


class Problem(BaseModel):
    """The problem+json body (RFC 9457), for the OpenAPI document."""

    type: str = Field(description="URI naming the kind of problem (maps to an exception class)")
    title: str = Field(description="short summary of the kind of problem")
    status: int = Field(description="the HTTP status code")
    detail: str = Field(description="what went wrong with this request, and where")


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
) -> Response:
    """One problem+json response; 503s carry ``Retry-After`` so clients back off, not hammer."""
    body = json.dumps({"type": type_, "title": title, "status": status, "detail": detail})
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return Response(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


def error_response(exc: InferenceError, retry_after: int) -> Response:
    status = exc.http_status
    return problem_response(
        status,
        exc.title,
        str(exc),
        exc.problem_type(),
        retry_after=retry_after if status == 503 else None,
    )


#: the status recorded for a request whose client left before sending its body (nginx's)
CLIENT_CLOSED_REQUEST = 499


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

    async def inference_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InferenceError)
        return error_response(exc, retry_after)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        phrase = HTTPStatus(exc.status_code).phrase
        detail = exc.detail if isinstance(exc.detail, str) else phrase
        if exc.status_code == 404 and detail == phrase:
            detail = f"no route for {request.method} {request.url.path}"
        response = problem_response(exc.status_code, phrase, detail)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            allowed = _allowed_methods(request)
            if allowed:
                response.headers["Allow"] = ", ".join(sorted(allowed))
        return response

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(InvalidRequestError(f"invalid request: {exc.errors()}"), retry_after)

    async def unexpected(request: Request, exc: Exception) -> Response:
        # A bug, not a bad request: log the traceback here, tell the caller only what happened.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            InferenceError(f"internal server error ({type(exc).__name__}); see the server log"),
            retry_after,
        )

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
