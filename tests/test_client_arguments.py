"""Constructor arguments of both clients: a mistake is a ValueError (or TypeError) naming the
argument at once, not a wait for the whole timeout, nor an error from inside a later call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from histoinfer import HttpClient, InProcessClient, ServerModel

URL = "http://127.0.0.1:1"  # never contacted: every case fails in the constructor


@pytest.mark.parametrize(
    ("argument", "bad", "allowed"),
    [
        *[("max_in_flight", v, "an int >= 1 or None") for v in (0, -1, 2.5, True, "8")],
        *[("max_connections", v, "an int >= 1") for v in (0, -5, None, 1.5)],
        *[("retries", v, "an int >= 0") for v in (-1, None, "3", False)],
        *[("timeout", v, "a finite number > 0 or None") for v in (0, -1, float("inf"), "5")],
        *[("backoff", v, "a finite number >= 0") for v in (-1, float("nan"))],
        *[("max_backoff", v, "a finite number >= 0") for v in (-0.5, "1")],
    ],
)
def test_http_client_arguments_are_checked(argument: str, bad: Any, allowed: str) -> None:
    with pytest.raises(ValueError, match=f"^{argument} must be {allowed}, got "):
        HttpClient(URL, **{argument: bad})


def test_http_client_model_must_be_a_route_name() -> None:
    for bad in ("", "h1/batch", 7):
        with pytest.raises(ValueError, match="model must be a route name"):
            HttpClient(URL, model=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("base_url", "said"),
    [
        ("127.0.0.1:8080", "(did you mean 'http://127.0.0.1:8080'?)"),
        ("localhost:8080", "(did you mean 'http://localhost:8080'?)"),
        ("ftp://host", "got 'ftp://host'"),
        ("http://", "got 'http://'"),
        ("http:/host", "got 'http:/host'"),  # no "did you mean 'http://http:/host'"
        ("//host:8080", "got '//host:8080'"),
    ],
)
def test_http_client_base_url_must_be_an_http_url(base_url: str, said: str) -> None:
    """It was taken, and every call failed with httpx's UnsupportedProtocol (a user trial)."""
    with pytest.raises(ValueError, match=r"^base_url must be an http:// or https:// URL") as info:
        HttpClient(base_url)
    assert str(info.value).endswith(said)
    with pytest.raises(TypeError, match="base_url must be a str, got NoneType"):
        HttpClient(None)  # type: ignore[arg-type]


def test_good_http_client_arguments_are_kept() -> None:
    client = HttpClient(URL, timeout=2, retries=0, backoff=0, max_connections=1, max_in_flight=None)
    assert (client.timeout, client.retries, client.max_in_flight) == (2, 0, None)
    client.close()
    # httpx's own forms of a timeout, and numpy's ints, as before the checks
    for timeout in (None, httpx.Timeout(30), httpx.Timeout(5, pool=None)):
        HttpClient(URL, timeout=timeout, max_connections=np.int64(8)).close()


def test_inprocess_flags_take_what_python_takes_for_a_bool(tiny_model: ServerModel) -> None:
    for flag in (np.True_, 1, 0, False):
        with InProcessClient(tiny_model, dynamic_batching=flag) as client:  # type: ignore[arg-type]
            assert client.dynamic_batching is bool(flag)


@pytest.mark.parametrize(
    ("argument", "bad", "allowed"),
    [
        ("max_batch_size", 0, "an int >= 1"),
        ("max_wait_ms", -1, "a finite number >= 0"),
        ("max_queue", 0, "an int >= 1 or None"),
        ("request_timeout", 0, "a finite number > 0 or None"),
        ("dynamic_batching", "no", "True or False"),
        ("dynamic_batching", 2, "True or False"),
    ],
)
def test_inprocess_client_arguments_are_checked(
    tiny_model: ServerModel, argument: str, bad: Any, allowed: str
) -> None:
    with pytest.raises(ValueError, match=f"^{argument} must be {allowed}, got "):
        InProcessClient(tiny_model, **{argument: bad})
    # from_checkpoint refuses it before loading anything: here there is nothing to load.
    with pytest.raises(ValueError, match=f"^{argument} must be {allowed}, got "):
        InProcessClient.from_checkpoint("h1", "no-such-dir/model.pt2", **{argument: bad})


def test_from_checkpoint_refuses_a_misspelt_setting_before_loading() -> None:
    with pytest.raises(TypeError, match=r"^InProcessClient.from_checkpoint\(\): .*'max_batchsize'"):
        InProcessClient.from_checkpoint("h1", "no-such-dir/model.pt2", max_batchsize=32)


@pytest.mark.parametrize("path", ["model.pt2", Path("model.pt2")])
def test_a_checkpoint_path_points_to_from_checkpoint(path: Any) -> None:
    with pytest.raises(TypeError, match=r"takes a loaded ServerModel.*from_checkpoint"):
        InProcessClient(path)


def test_another_object_is_named() -> None:
    with pytest.raises(TypeError, match=r"takes a loaded ServerModel, got dict$"):
        InProcessClient({})  # type: ignore[arg-type]


def test_from_checkpoints_typed_tuning_is_the_constructors_other_settings() -> None:
    """``**tuning`` is typed by ``ClientTuning`` (a type checker then catches ``max_queu=``):
    it must name every keyword the constructor takes beyond from_checkpoint's own, with the
    same types, or a checker would refuse a valid call."""
    from typing import get_type_hints

    from histoinfer.clients.inprocess import ClientTuning

    init = get_type_hints(InProcessClient.__init__)
    own = set(get_type_hints(InProcessClient.from_checkpoint)) - {"tuning", "return"}
    others = {name: hint for name, hint in init.items() if name not in own | {"return"}}
    del others["server_model"]
    assert get_type_hints(ClientTuning) == others
