"""Drop-in equivalence: InProcessClient and HttpClient (against ``histoinfer serve`` in a
subprocess on loopback) give the same JSON and raise the same exceptions with the same messages.

The server and the in-process clients run the same checkpoint with the same batching settings;
a second model (``flaky``) fails its forward pass on an all-white tile, for model errors.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from helpers import make_body, outputs_close, request_dict, tile_bytes
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from test_server_support import FlakyModel, serve, white_body

from histoinfer import HttpClient, InProcessClient
from histoinfer.bench.loopback import ServerProcess
from histoinfer.errors import InferenceError

pytestmark = pytest.mark.timeout(120)

SETTINGS: dict[str, Any] = {"max_batch_size": 16, "max_wait_ms": 5.0, "max_queue": 256}
MODES = ("predict", "embed", "predict_with_embedding")


def _body(**fields: Any) -> str:
    return json.dumps(request_dict(7, **fields))


def _without(field: str) -> str:
    d = request_dict(8)
    del d[field]
    return json.dumps(d)


def _tile(fmt: str = "PNG", mode: str = "RGB", size: int = 224, seed: int = 3) -> str:
    return base64.b64encode(tile_bytes(seed, size, fmt, mode)).decode()


GOOD: dict[str, str] = {
    "png": make_body(0),
    "jpeg": _body(image_data=_tile("JPEG")),
    "rgba": _body(image_data=_tile(mode="RGBA")),
    "grayscale": _body(image_data=_tile(mode="L")),
    "resized": make_body(5, size=112),
    "nulls": _body(tissue_ratio=None, resolution=None),
    "unicode slide": _body(slide_name="échantillon-✓ \u2028 /x"),
    "big coordinates": _body(x=2**40, y=123456789, patch_idx=10**9),
}

BAD: dict[str, Any] = {
    "not json": "{not json",
    "empty body": "",
    "a list": "[1, 2]",
    "missing field": _without("slide_name"),
    "unknown field": _body(colour="red"),
    "wrong type": _body(x="12"),
    "negative coordinate": _body(y=-1),
    "tissue ratio over 1": _body(tissue_ratio=1.5),
    "zero resolution": _body(resolution=0.0),
    "NaN": _body().replace('"tissue_ratio": 0.75', '"tissue_ratio": NaN'),
    "not base64": _body(image_data="!!! not base64 !!!"),
    "not an image": _body(image_data=base64.b64encode(b"hello, world").decode()),
    "size mismatch": _body(width=100),
    "bulk_rna on h1": _body(bulk_rna=[1.0, 2.0]),
    "not a string": 42,
    "a dict": {"slide_name": "S1"},
    "not UTF-8": b'{"slide_name": "\xff\xfe"}',
    # A str that is not valid Unicode: no UTF-8 exists for it (HttpClient sends it as "$str").
    "a lone surrogate": _body(slide_name="S").replace('"S"', '"\ud800"'),
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Any) -> Iterator[ServerProcess]:
    args = ["--model", "h1", "--checkpoint", str(tiny_checkpoint)]
    args += ["--model", "flaky=h1-flaky", "--checkpoint", str(tiny_checkpoint)]
    args += ["--max-batch-size", "16", "--max-wait-ms", "5", "--max-queue", "256"]
    with serve(args, script=True) as s:
        yield s


@pytest.fixture(scope="module")
def pair(server: ServerProcess, tiny_model: Any) -> Iterator[tuple[InProcessClient, HttpClient]]:
    with InProcessClient(tiny_model, **SETTINGS) as local, HttpClient(server.base_url) as remote:
        yield local, remote


@pytest.fixture(scope="module")
def flaky_pair(
    server: ServerProcess, tiny_model: Any
) -> Iterator[tuple[InProcessClient, HttpClient]]:
    model = FlakyModel(tiny_model.checkpoint, tiny_model.assets, "cpu")
    with (
        InProcessClient(model, **SETTINGS) as local,
        HttpClient(server.base_url, "flaky") as remote,
    ):
        yield local, remote


# ("ok", the result, None, None) or ("error", its class, its message, its positions)
Outcome = tuple[str, Any, Any, Any]


def outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return ("ok", call(), None, None)
    except InferenceError as exc:
        return ("error", type(exc), str(exc), exc.positions)


async def aoutcome(call: Callable[[], Awaitable[Any]]) -> Outcome:
    try:
        with anyio.fail_after(60):
            return ("ok", await call(), None, None)
    except InferenceError as exc:
        return ("error", type(exc), str(exc), exc.positions)


def assert_same(local: Outcome, remote: Outcome) -> None:
    assert local[0] == remote[0], (local, remote)
    if local[0] == "error":
        assert remote[1] is local[1]
        assert remote[2] == local[2]
        assert remote[3] == local[3]  # a refused batch's positions, for a program to use
        return
    a, b = local[1], remote[1]
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        assert all(outputs_close(x, y) for x, y in zip(a, b, strict=True))
    else:
        assert outputs_close(a, b), (a[:200], b[:200])


def test_metadata_is_identical(pair, flaky_pair):
    for local, remote in (pair, flaky_pair):
        assert remote.metadata() == local.metadata()


@pytest.mark.parametrize("mode", MODES)
def test_good_requests_sync(pair, mode):
    local, remote = pair
    for body in GOOD.values():
        expected = outcome(partial(getattr(local, mode), body))
        assert expected[0] == "ok"
        assert_same(expected, outcome(partial(getattr(remote, mode), body)))


@pytest.mark.anyio
async def test_good_requests_async(pair):
    local, remote = pair
    for mode in MODES:
        for body in GOOD.values():
            expected = await aoutcome(partial(getattr(local, f"{mode}_async"), body))
            assert_same(expected, await aoutcome(partial(getattr(remote, f"{mode}_async"), body)))


@pytest.mark.parametrize("mode", MODES)
def test_batches(pair, mode):
    local, remote = pair
    bodies = list(GOOD.values())
    expected = outcome(lambda: getattr(local, f"{mode}_batch")(bodies))
    assert expected[0] == "ok" and len(expected[1]) == len(bodies)
    assert_same(expected, outcome(lambda: getattr(remote, f"{mode}_batch")(bodies)))
    assert_same(outcome(lambda: local.embed_batch([])), outcome(lambda: remote.embed_batch([])))


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_sync(pair, name):
    local, remote = pair
    body = BAD[name]
    expected = outcome(lambda: local.predict(body))
    assert expected[0] == "error"
    assert_same(expected, outcome(lambda: remote.predict(body)))


@pytest.mark.anyio
async def test_bad_input_async(pair):
    local, remote = pair
    for body in BAD.values():
        for mode in ("embed", "predict_with_embedding"):
            expected = await aoutcome(partial(getattr(local, f"{mode}_async"), body))
            assert expected[0] == "error"
            assert_same(expected, await aoutcome(partial(getattr(remote, f"{mode}_async"), body)))


def test_bad_input_in_batches(pair):
    local, remote = pair
    good = list(GOOD.values())[:3]
    mixed = [good[0], *BAD.values(), good[1]]
    for bodies in (mixed, [BAD["missing field"]], [good[2], BAD["not a string"], {"a": 1}]):
        expected = outcome(partial(local.predict_batch, bodies))
        assert expected[0] == "error"
        assert_same(expected, outcome(partial(remote.predict_batch, bodies)))
    # What JSON cannot carry (tiles passed where bodies go, a tuple): every bad position is
    # named, in the same words (HttpClient used to refuse these itself, naming only the first).
    foreign = [
        good[0],
        np.zeros((4, 4, 3), np.uint8),
        Image.new("RGB", (4, 4)),
        good[1],
        ("a", "tuple"),
        np.int64(3),
        BAD["not a string"],
    ]
    expected = outcome(partial(local.predict_batch, foreign))
    assert expected[0] == "error" and "positions 1-2, 4-6" in expected[2], expected
    assert expected[3] == [1, 2, 4, 5, 6]
    assert "got ndarray: make one with histoinfer.tile_body(" in expected[2]
    assert_same(expected, outcome(partial(remote.predict_batch, foreign)))
    for not_a_list in (tuple(good), good[0], None):
        assert_same(
            outcome(partial(local.embed_batch, not_a_list)),
            outcome(partial(remote.embed_batch, not_a_list)),
        )


def test_model_failures(flaky_pair):
    local, remote = flaky_pair
    white = white_body(3)
    for mode in MODES:
        expected = outcome(partial(getattr(local, mode), white))
        assert expected[0] == "error" and "white tile" in expected[2]
        assert_same(expected, outcome(partial(getattr(remote, mode), white)))
    bodies = [make_body(0), white_body(1), make_body(2), white_body(3)]
    expected = outcome(partial(local.predict_batch, bodies))
    assert expected[0] == "error" and "batch position 3" in expected[2]
    assert expected[3] == [1, 3]  # the white tiles, which fail the pass alone
    assert_same(expected, outcome(partial(remote.predict_batch, bodies)))
    assert_same(
        outcome(lambda: local.embed(make_body(4))), outcome(lambda: remote.embed(make_body(4)))
    )


@pytest.mark.anyio
async def test_model_failures_async(flaky_pair):
    local, remote = flaky_pair
    expected = await aoutcome(lambda: local.predict_async(white_body(2)))
    assert expected[0] == "error"
    assert_same(expected, await aoutcome(lambda: remote.predict_async(white_body(2))))


def test_closed_clients(server, tiny_model):
    local = InProcessClient(tiny_model, **SETTINGS)
    remote = HttpClient(server.base_url)
    local.close()
    remote.close()
    body = make_body(0)
    assert_same(outcome(lambda: local.predict(body)), outcome(lambda: remote.predict(body)))
    assert_same(
        outcome(lambda: local.embed_batch([body])), outcome(lambda: remote.embed_batch([body]))
    )


def scrape(base_url: str) -> dict[str, float]:
    """Sample name -> value for the predict mode of h1."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels == {"model": "h1", "mode": "predict"}:
                out[s.name] = s.value
    return out


@pytest.mark.anyio
async def test_64_concurrent_calls_are_batched_by_the_server(server, pair):
    local, remote = pair
    bodies = [make_body(i) for i in range(64)]
    expected = local.predict_batch(bodies)
    got: list[str | None] = [None] * 64
    before = scrape(server.base_url)

    async def one(i: int) -> None:
        got[i] = await remote.predict_async(bodies[i])

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)
    after = scrape(server.base_url)
    for i, response in enumerate(got):
        assert response is not None and json.loads(response)["patch_idx"] == i
        assert outputs_close(response, expected[i])
    samples = after["histoinfer_samples_total"] - before["histoinfer_samples_total"]
    batches = after["histoinfer_batches_total"] - before["histoinfer_batches_total"]
    assert samples == 64
    assert batches < samples  # the server put concurrent requests into shared batches
