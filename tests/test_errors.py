"""The error hierarchy (SPEC §2) and its HTTP mapping (SPEC §3.4), which both backends share."""

from __future__ import annotations

import pytest

import histoinfer.errors as errors_module
from histoinfer.errors import (
    ClientClosedError,
    DeadlineExceededError,
    InferenceError,
    InvalidRequestError,
    ModelExecutionError,
    OverloadedError,
    UnsupportedModeError,
    error_for_problem_type,
)

# SPEC §3.4: the HTTP status each error is answered with.
SPEC_STATUS: list[tuple[type[InferenceError], int]] = [
    (InvalidRequestError, 422),
    (UnsupportedModeError, 400),
    (ModelExecutionError, 500),
    (OverloadedError, 503),
    (DeadlineExceededError, 503),
    (ClientClosedError, 503),
]
ALL = [InferenceError, *(cls for cls, _ in SPEC_STATUS)]


@pytest.mark.parametrize("cls", ALL[1:])
def test_every_error_is_an_inference_error(cls: type[InferenceError]) -> None:
    assert issubclass(cls, InferenceError)
    assert issubclass(cls, Exception)


def test_unsupported_mode_is_an_invalid_request() -> None:
    # SPEC §2: callers catching InvalidRequestError also catch a mode the model lacks.
    assert issubclass(UnsupportedModeError, InvalidRequestError)
    assert not issubclass(ModelExecutionError, InvalidRequestError)
    assert not issubclass(ClientClosedError, InvalidRequestError)


@pytest.mark.parametrize(("cls", "status"), SPEC_STATUS)
def test_http_status_follows_the_spec(cls: type[InferenceError], status: int) -> None:
    assert cls.http_status == status


def test_only_what_may_pass_later_is_retryable() -> None:
    """``retryable`` by class, as ``InProcessClient`` raises them: a full queue and a missed
    deadline may pass; a refused body, a failing pass, a closed client would fail again."""
    assert [cls for cls in ALL if cls.retryable] == [OverloadedError, DeadlineExceededError]
    assert OverloadedError("queue full").retryable and not ClientClosedError("closed").retryable


def test_problem_types_are_distinct_urls() -> None:
    types = [cls.problem_type() for cls in ALL]
    assert len(set(types)) == len(types)
    assert all(t.startswith("https://") for t in types)


@pytest.mark.parametrize("cls", ALL)
def test_problem_type_maps_back_to_the_same_class(cls: type[InferenceError]) -> None:
    # HttpClient relies on this to raise exactly what InProcessClient raises.
    assert error_for_problem_type(cls.problem_type(), cls.http_status) is cls


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, UnsupportedModeError),
        (404, InvalidRequestError),
        (408, InvalidRequestError),
        (413, InvalidRequestError),
        (415, InvalidRequestError),
        (422, InvalidRequestError),
        (503, OverloadedError),
        (500, InferenceError),
        (502, InferenceError),
    ],
)
def test_unknown_problem_type_falls_back_on_status(
    status: int, expected: type[InferenceError]
) -> None:
    # A foreign server speaking the wire format may send no (or another) problem type.
    assert error_for_problem_type(None, status) is expected
    assert error_for_problem_type("about:blank", status) is expected


def test_errors_module_exports_what_it_defines() -> None:
    for name in errors_module.__all__:
        assert hasattr(errors_module, name), name
    assert {cls.__name__ for cls in ALL} <= set(errors_module.__all__)
