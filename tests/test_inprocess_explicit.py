"""``InProcessClient`` in explicit mode (``dynamic_batching=False``): the whole Client protocol.

Forward passes are counted on a model wrapper, so "one forward pass", "batch size 1" and
"chunked by max_batch_size" are checked as facts, never inferred from timings.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import re
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
import torch
from helpers import make_body, outputs_close, request_dict, tile_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from histoinfer import Client, InProcessClient, ServerModel
from histoinfer.clients import inprocess, refusals
from histoinfer.errors import (
    ClientClosedError,
    InvalidRequestError,
    ModelExecutionError,
    OverloadedError,
    UnsupportedModeError,
)
from histoinfer.models import BatchOutput
from histoinfer.models.h1 import H1ServerModel
from histoinfer.schema import Mode

MODES: list[Mode] = ["predict", "embed", "predict_with_embedding"]


class CountingModel(H1ServerModel):
    """The tiny h1, recording every forward pass; white tiles fail once ``poison`` is on."""

    max_image_bytes = 400_000  # a small limit, so "oversized" is cheap to build
    shard_cpu_passes = False  # one forward_batch call a pass: the passes are what is counted

    def __init__(self, source: ServerModel) -> None:
        self.calls: list[tuple[int, Mode]] = []
        self.poison = False
        self.nan_on_white = False
        self.nan_on_black = False
        self.fail_above: int | None = None  # passes of more tiles fail, as out of memory
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self._lock = threading.Lock()
        super().__init__(source.checkpoint, source.assets)  # runs a probe forward pass

    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> BatchOutput:
        with self._lock:
            self.calls.append((int(batch.shape[0]), mode))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(timeout=20), "test gate never opened"
        white = (batch == 255).flatten(1).all(1)
        if self.poison and bool(white.any()):
            raise RuntimeError("poisoned tile")
        if self.fail_above is not None and batch.shape[0] > self.fail_above:
            raise RuntimeError(f"out of memory for {batch.shape[0]} tiles")
        output = super().forward_batch(batch, mode)
        spoilt = torch.zeros_like(white)
        if self.nan_on_white:
            spoilt |= white
        if self.nan_on_black:
            spoilt |= (batch == 0).flatten(1).all(1)
        if bool(spoilt.any()):

            def spoil(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else torch.where(spoilt[:, None], float("nan"), t)

            output = BatchOutput(spoil(output.predictions), spoil(output.embedding))
        return output

    def sizes(self) -> list[int]:
        with self._lock:
            return [size for size, _ in self.calls]

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.entered.clear()


@pytest.fixture
def model(tiny_model: ServerModel) -> CountingModel:
    counting = CountingModel(tiny_model)
    counting.reset()  # forget the load-time probe
    return counting


@pytest.fixture
def client(model: CountingModel) -> Iterator[InProcessClient]:
    with InProcessClient(model, max_batch_size=4, dynamic_batching=False) as c:
        yield c


def white_body(i: int, colour: tuple[int, int, int] = (255, 255, 255)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (224, 224), colour).save(buf, format="PNG")
    return make_body(i, image_data=base64.b64encode(buf.getvalue()).decode())


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


async def wait_until(predicate: Callable[[], bool]) -> None:
    with anyio.fail_after(20):
        while not predicate():
            await anyio.sleep(0.005)


# -- round trips ----------------------------------------------------------------------------


def test_satisfies_the_client_protocol(client: InProcessClient) -> None:
    assert isinstance(client, Client)


def test_metadata_is_json_with_the_batching_in_force(
    client: InProcessClient, tiny_model: ServerModel
) -> None:
    meta = json.loads(client.metadata())
    assert meta["name"] == "h1"
    assert meta["gene_names"] == tiny_model.metadata().gene_names
    assert meta["checkpoint_sha256"] == tiny_model.metadata().checkpoint_sha256
    assert meta["trained"] is False
    assert meta["batching"]["dynamic_batching"] is False
    assert meta["batching"]["max_batch_size"] == 4


@pytest.mark.parametrize("mode", MODES)
def test_sync_round_trip(client: InProcessClient, model: CountingModel, mode: Mode) -> None:
    response = json.loads(getattr(client, mode)(make_body(2)))
    meta = json.loads(client.metadata())
    expected = {k: v for k, v in request_dict(2).items() if k != "image_data"}
    assert {k: response[k] for k in expected} == expected
    size = meta["embedding_size"] if mode == "embed" else meta["output_size"]
    assert len(response["output"]) == size
    assert ("embedding" in response) == (mode == "predict_with_embedding")
    assert model.calls == [(1, mode)]


@pytest.mark.parametrize("mode", MODES)
def test_batch_round_trip(client: InProcessClient, model: CountingModel, mode: Mode) -> None:
    bodies = [make_body(i) for i in range(3)]
    responses = [json.loads(r) for r in getattr(client, f"{mode}_batch")(bodies)]
    assert [r["patch_idx"] for r in responses] == [0, 1, 2]
    assert all(("embedding" in r) == (mode == "predict_with_embedding") for r in responses)
    assert model.calls == [(3, mode)]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_async_round_trip_matches_sync(
    client: InProcessClient, model: CountingModel, mode: Mode
) -> None:
    with anyio.fail_after(30):
        got = await getattr(client, f"{mode}_async")(make_body(4), session=object())
    assert model.calls == [(1, mode)]
    # Same request, same batch size, same model: the same bytes.
    assert got == await anyio.to_thread.run_sync(getattr(client, mode), make_body(4))


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_concurrent_async_calls_run_at_batch_size_one(
    client: InProcessClient, model: CountingModel
) -> None:
    results: dict[int, str] = {}

    async def one(i: int) -> None:
        results[i] = await client.predict_async(make_body(i))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
    assert model.sizes() == [1] * 6
    assert {json.loads(r)["patch_idx"] for r in results.values()} == set(range(6))
    for i, response in results.items():
        assert json.loads(response)["patch_idx"] == i
    stats = client.stats()["predict"]
    assert stats.batches == 6 and stats.samples == 6 and stats.batch_size_histogram == {1: 6}
    # Nothing queued: no queue waits (counted as waits of 0 s, they dragged a p95 down).
    assert sum(stats.queue_wait_buckets) == 0 and stats.queue_wait_ms["p99"] == 0.0
    client.predict_batch([make_body(i) for i in range(3)])
    stats = client.stats()["predict"]
    assert stats.samples == 9 and sum(stats.queue_wait_buckets) == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_forward_time_of_concurrent_calls_at_batch_size_one_is_never_more_than_the_wall(
    client: InProcessClient,
) -> None:
    """The passes run one at a time on the device's thread: their time adds up to at most the
    wall time. Timed from each caller, it counted the wait behind the others' passes too (a
    bench measured 6.8 times the wall at 8 in flight)."""
    bodies = [make_body(i) for i in range(24)]
    await client.predict_async(bodies[0])  # loaded and warm
    before = client.stats()["predict"].forward_busy_s
    with anyio.fail_after(30):
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for body in bodies:
                tg.start_soon(client.predict_async, body)
        wall = time.perf_counter() - started
    busy = client.stats()["predict"].forward_busy_s - before
    assert 0 < busy <= wall


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_pass_while_other_calls_decode_leaves_them_their_cores(
    monkeypatch: pytest.MonkeyPatch, tiny_model: ServerModel
) -> None:
    """Batch size 1 under load: a pass that runs while another call of its loop is being
    decoded leaves the decoders their cores, as a dynamic client's small passes do (an OpenMP
    team beside busy decoders is several times slower); with nothing being decoded, a pass
    gets every thread."""
    from concurrency_helpers import hooked_model, wait_until

    from histoinfer.clients import inprocess
    from histoinfer.models.openmp import per_thread_counts_supported

    if not per_thread_counts_supported():
        pytest.skip("torch's OpenMP runtime here is not libgomp: per-thread counts unsupported")
    threads: list[int] = []
    # Passes of one tile are never sharded; a shardable model keeps its two decode threads
    # (one is held below, the other decodes body 2).
    model, _ = hooked_model(
        tiny_model, lambda batch: threads.append(torch.get_num_threads()), sharded=True
    )
    real_prepare = inprocess._prepare
    held, released = threading.Event(), threading.Event()

    def gated_prepare(*args: Any, **kwargs: Any) -> Any:
        if json.loads(args[1])["patch_idx"] == 1:  # body 1 is held in its worker thread
            held.set()
            released.wait(30)
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(inprocess, "_prepare", gated_prepare)
    with InProcessClient(model, dynamic_batching=False) as client, anyio.fail_after(30):
        full = client._device_thread.call(torch.get_num_threads)
        results: dict[int, str] = {}

        async def run(i: int) -> None:
            results[i] = await client.predict_async(make_body(i))

        device_busy = threading.Event()  # so that body 1 takes a worker thread
        client._device_thread.submit(device_busy.wait, 30)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 1)
            await wait_until(held.is_set)
            device_busy.set()
            await run(2)  # decoded and run while body 1 is still being decoded
            released.set()
        assert threads == [max(1, full - 1), full]
        for i in (1, 2):  # (a pass on fewer threads adds up in another order: close, not equal)
            assert outputs_close(results[i], client.predict_batch([make_body(i)])[0])


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_lone_async_call_is_decoded_on_the_device_thread(
    monkeypatch: pytest.MonkeyPatch, client: InProcessClient, model: CountingModel
) -> None:
    """Batch size 1 with nothing else in flight: one hop, the device's thread decodes; a bad
    body is refused with the worker thread's message and counts as nothing; with the device
    busy, the body is decoded in a worker thread as before."""
    from concurrency_helpers import watch_decoding

    decoded_on, real_prepare = watch_decoding(monkeypatch)
    device = client._device_thread.name
    with anyio.fail_after(30):
        got = await client.predict_async(make_body(1))
        assert decoded_on == [device]
        assert got == client.predict_batch([make_body(1)])[0]  # (decoded here, in this thread)
        bad = make_body(2, image_data="!!! not base64 !!!")
        with pytest.raises(InvalidRequestError) as refused:
            await client.predict_async(bad)
        with pytest.raises(InvalidRequestError) as worker:
            real_prepare(model, bad, "predict")
        assert str(refused.value) == str(worker.value)
        stats = client.stats()["predict"]
        assert stats.errors == 0 and stats.samples == 2  # the good call and predict_batch

        decoded_on.clear()
        device_busy = threading.Event()
        client._device_thread.submit(device_busy.wait, 30)
        here = threading.current_thread().name
        async with anyio.create_task_group() as tg:
            results: dict[int, str] = {}

            async def three() -> None:
                results[3] = await client.predict_async(make_body(3))

            tg.start_soon(three)
            await anyio.sleep(0.05)
            device_busy.set()
        assert len(decoded_on) == 1 and decoded_on[0] not in (device, here)  # a worker thread
        assert results[3] == client.predict_batch([make_body(3)])[0]

        decoded_on.clear()  # a big image in a small body (a flat PNG) alone: handed back
        buf = io.BytesIO()
        Image.new("RGB", (1000, 1000), (200, 120, 180)).save(buf, format="PNG")
        flat = base64.b64encode(buf.getvalue()).decode()
        assert len(flat) < client._lone_body_limit / 10
        before = client.stats()["predict"]
        got = await client.predict_async(make_body(4, size=1000, image_data=flat))
        assert decoded_on[0] == f"{device}:handed-back"  # parsed there, not decoded
        assert len(decoded_on) == 2 and decoded_on[1] not in (device, here)
        after = client.stats()["predict"]  # one batch of one: the hand-back counts as nothing
        assert (after.batches - before.batches, after.samples - before.samples) == (1, 1)
        assert got == client.predict_batch([make_body(4, size=1000, image_data=flat)])[0]


def test_predict_with_embedding_is_predict_plus_embed_from_one_pass(
    client: InProcessClient, model: CountingModel
) -> None:
    bodies = [make_body(i) for i in range(3)]
    both = client.predict_with_embedding_batch(bodies)
    assert model.calls == [(3, "predict_with_embedding")]
    predicted = client.predict_batch(bodies)
    embedded = client.embed_batch(bodies)
    for b, p, e in zip(both, predicted, embedded, strict=True):
        combined, prediction, embedding = json.loads(b), json.loads(p), json.loads(e)
        assert close(combined.pop("embedding"), embedding.pop("output"))
        assert close(combined.pop("output"), prediction.pop("output"))
        assert combined == prediction == embedding  # the echoed fields

    model.reset()
    single = json.loads(client.predict_with_embedding(bodies[0]))
    assert model.calls == [(1, "predict_with_embedding")]
    assert len(single["embedding"]) == json.loads(client.metadata())["embedding_size"]


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_equals_the_same_requests_sent_singly(client: InProcessClient, mode: Mode) -> None:
    bodies = [make_body(i) for i in range(4)]
    batched = getattr(client, f"{mode}_batch")(bodies)
    singly = [getattr(client, mode)(body) for body in bodies]
    for a, b in zip(batched, singly, strict=True):
        assert outputs_close(a, b)


def test_batches_are_chunked_by_max_batch_size(
    client: InProcessClient, model: CountingModel
) -> None:
    bodies = [make_body(i) for i in range(10)]
    responses = client.predict_batch(bodies)
    assert model.sizes() == [4, 4, 2]
    assert [json.loads(r)["patch_idx"] for r in responses] == list(range(10))
    # Chunk boundaries change nothing: positions 3 and 4 sit in different chunks.
    for i in (3, 4, 9):
        assert outputs_close(responses[i], client.predict(bodies[i]))


@pytest.mark.parametrize("decode_threads", [1, 2])
@pytest.mark.parametrize("stop_at", [2, 4, 5])
def test_a_batch_stops_where_its_check_cancelled_raises(
    monkeypatch: pytest.MonkeyPatch, model: CountingModel, decode_threads: int, stop_at: int
) -> None:
    """``check_cancelled`` runs in the caller's thread before every ``max_batch_size`` bodies
    are taken from decoding, and before each pass; what it raises leaves the call there:
    bodies not yet being decoded never are, and no later pass runs (the server stops a
    ``/batch`` whose client left)."""
    decoded: list[int] = []
    past_first_slice = threading.Event()  # bodies 4+ wait, so the pool cannot run ahead
    real_prepare = inprocess._prepare

    def counting_prepare(*args: Any, **kwargs: Any) -> Any:
        if args[3] >= 4:
            assert past_first_slice.wait(20), "never released"
        prepared = real_prepare(*args, **kwargs)
        decoded.append(args[3])
        return prepared

    monkeypatch.setattr(inprocess, "_prepare", counting_prepare)
    checks = itertools.count(1)

    class Left(Exception):
        pass

    def check_cancelled() -> None:
        if next(checks) == stop_at:
            past_first_slice.set()
            raise Left

    if stop_at > 2:
        past_first_slice.set()
    bodies = [make_body(i) for i in range(10)]  # 3 slices to take, then 3 passes
    with InProcessClient(
        model, max_batch_size=4, dynamic_batching=False, batch_decode_threads=decode_threads
    ) as client:
        with pytest.raises(Left):
            client.infer_batch(bodies, "predict", check_cancelled=check_cancelled)
        if stop_at == 2:  # before the second slice: the first slice, and what the pool had
            # started (one body a thread, held above), are decoded; nothing computed
            started = 4 if decode_threads == 1 else 4 + decode_threads
            assert set(range(4)) <= set(decoded) <= set(range(started))
            assert model.calls == []
        else:  # before the first or second pass: every body decoded, passes before it run
            assert sorted(decoded) == list(range(10))
            assert model.sizes() == [4] * (stop_at - 4)
        model.reset()
        assert len(client.infer_batch(bodies, "predict", check_cancelled=lambda: None)) == 10
        assert model.sizes() == [4, 4, 2]


def test_an_empty_batch_computes_nothing(client: InProcessClient, model: CountingModel) -> None:
    assert client.predict_batch([]) == []
    assert model.calls == []


def test_duplicate_requests_in_a_batch_get_their_own_answers(client: InProcessClient) -> None:
    body = make_body(1)
    first, second = client.embed_batch([body, body])
    assert first == second


# -- bad input ------------------------------------------------------------------------------


def _png(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def _bad_bodies() -> list[tuple[str, Any, type[Exception], list[str]]]:
    png = tile_bytes(6)
    b64 = base64.b64encode(png).decode()
    gif = io.BytesIO()
    Image.new("P", (224, 224)).save(gif, format="GIF")
    noisy = Image.frombytes(
        "RGB", (400, 400), torch.randint(0, 256, (400 * 400 * 3,)).byte().numpy().tobytes()
    )
    where = "patch_idx=6"
    return [
        ("invalid JSON", '{"slide_name": ', InvalidRequestError, ["not valid JSON"]),
        ("not a string", {"x": 1}, InvalidRequestError, ["JSON string"]),
        ("unknown field", make_body(6, stain="HE"), InvalidRequestError, ["'stain'", where]),
        ("missing field", json.dumps({k: v for k, v in request_dict(6).items() if k != "y"}),
         InvalidRequestError, ["'y'", where]),
        ("negative x", make_body(6, x=-5), InvalidRequestError, ["'x'", where]),
        ("wrong type", make_body(6, patch_idx="six"), InvalidRequestError, ["'patch_idx'"]),
        ("bool for int", make_body(6, height=True), InvalidRequestError, ["'height'", where]),
        ("tissue_ratio > 1", make_body(6, tissue_ratio=2.0), InvalidRequestError,
         ["'tissue_ratio'", where]),
        ("NaN", make_body(6, resolution=float("nan")), InvalidRequestError,
         ["'resolution'", where]),
        ("size mismatch", make_body(6, width=200), InvalidRequestError,
         ["200x224", "224x224", where]),
        ("bulk_rna to h1", make_body(6, bulk_rna=[1.0, 2.0]), UnsupportedModeError,
         ["'bulk_rna'", where]),
        ("bad base64", make_body(6, image_data="@@@@"), InvalidRequestError,
         ["'image_data'", "base64", where]),
        ("empty image", make_body(6, image_data=""), InvalidRequestError,
         ["'image_data'", "empty", where]),
        ("not an image", make_body(6, image_data=base64.b64encode(b"{}" * 50).decode()),
         InvalidRequestError, ["'image_data'", where]),
        ("GIF", make_body(6, image_data=base64.b64encode(gif.getvalue()).decode()),
         InvalidRequestError, ["GIF", where]),
        ("truncated PNG", make_body(6, image_data=b64[: len(b64) // 2]), InvalidRequestError,
         ["'image_data'", where]),
        ("oversized image", make_body(6, width=400, height=400, image_data=_png(noisy)),
         InvalidRequestError, ["byte limit", where]),
        ("float image", make_body(6, image_data=_png(Image.new("F", (224, 224)), "TIFF")),
         InvalidRequestError, ["pixel mode 'F'", where]),
    ]  # fmt: skip


BAD = _bad_bodies()


@pytest.mark.anyio
@pytest.mark.parametrize(("name", "body", "error", "fragments"), BAD, ids=[b[0] for b in BAD])
async def test_bad_input_fails_alone_and_the_client_keeps_working(
    client: InProcessClient,
    model: CountingModel,
    name: str,
    body: Any,
    error: type[Exception],
    fragments: list[str],
) -> None:
    with anyio.fail_after(30):
        # Alone: the error names the field and the tile.
        with pytest.raises(error) as info:
            await client.predict_async(body)
        # In a batch: the same error, at its position, and its valid neighbour not blamed.
        with pytest.raises(InvalidRequestError) as in_batch:
            await anyio.to_thread.run_sync(client.predict_batch, [make_body(0), body])
        assert model.calls == []  # refused before the device, both times
        response = await client.predict_async(make_body(1))
    assert isinstance(info.value, InvalidRequestError)
    for fragment in fragments:
        assert fragment in str(info.value), f"{name}: {fragment!r} not in {info.value}"
        assert fragment in str(in_batch.value), f"{name}: {fragment!r} not in {in_batch.value}"
    assert "batch position 1" in str(in_batch.value)
    assert "batch position 0" not in str(in_batch.value)
    assert json.loads(response)["patch_idx"] == 1
    assert model.calls == [(1, "predict")]


def test_batch_names_every_bad_position_and_computes_nothing(
    client: InProcessClient, model: CountingModel
) -> None:
    bodies = [
        make_body(0),
        make_body(1, x=-1),
        make_body(2),
        "not json",
        make_body(4, image_data="!!"),
        make_body(5),
    ]
    with pytest.raises(InvalidRequestError) as info:
        client.embed_batch(bodies)
    message = str(info.value)
    assert "3 of 6 requests are invalid (positions 1, 3-4), nothing was computed" in message
    for position in (1, 3, 4):
        assert f"batch position {position}" in message
    for position in (0, 2, 5):
        assert f"batch position {position}" not in message
    assert "patch_idx=1" in message and "patch_idx=4" in message
    assert model.calls == []
    # For a program to drop them and send the rest (a slide-workflow trial parsed the text).
    assert info.value.positions == [1, 3, 4]
    rest = [b for i, b in enumerate(bodies) if i not in info.value.positions]
    assert len(client.embed_batch(rest)) == 3


def test_a_batch_of_many_bad_requests_names_every_position_and_describes_the_first(
    client: InProcessClient, model: CountingModel
) -> None:
    """A body of a million tiny invalid elements must not answer with megabytes of message;
    every bad position is still named (SPEC §2.2), as runs."""
    with pytest.raises(InvalidRequestError) as info:
        client.predict_batch(["1"] * 1000)
    message = str(info.value)
    assert message.startswith("1000 of 1000 requests are invalid (positions 0-999)")
    assert "batch position 19:" in message and "batch position 20:" not in message
    assert message.endswith("; and 980 more") and len(message) < 5000
    assert model.calls == []


def test_bad_positions_past_the_listed_runs_are_counted(
    client: InProcessClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past :data:`LISTED_RUNS` runs (1,000; 4 here, as 4,000 bodies took 27 s to decode) the
    rest are counted, not listed."""
    monkeypatch.setattr(refusals, "LISTED_RUNS", 4)
    bodies = ["1" if i % 2 else make_body(i) for i in range(14)]  # 7 runs of one
    with pytest.raises(InvalidRequestError) as info:
        client.predict_batch(bodies)
    assert "(positions 1, 3, 5, 7 and 3 more after them)" in str(info.value)
    assert info.value.positions is None  # not all listed: none given, rather than some


def test_a_refused_batchs_positions_are_not_given_past_their_bound(
    client: InProcessClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run of bad positions can be millions long (a 30 MB batch of one-character bodies):
    listed, it cost 240 MB. Past the bound (100,000; 5 here) none are given."""
    monkeypatch.setattr(refusals, "GIVEN_POSITIONS", 5)
    for count, positions in ((5, [0, 1, 2, 3, 4]), (6, None)):
        with pytest.raises(InvalidRequestError) as info:
            client.predict_batch(["1"] * count)
        assert info.value.positions == positions
        assert f"(positions 0-{count - 1})" in str(info.value)  # the message still says them


def test_a_refused_batch_of_many_bodies_holds_no_error_per_body(client: InProcessClient) -> None:
    """Only the first problems are kept (each error holds its traceback and frames): every
    error of a 30 MB batch of six million one-character bodies took a process past 10 GB."""
    bodies = ["1"] * 40_000
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequestError) as info:
            client.predict_batch(bodies)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(info.value).startswith("40000 of 40000 requests are invalid (positions 0-39999)")
    assert peak < 8_000_000, f"{peak / 1e6:.0f} MB traced while refusing 40,000 bodies"


def test_a_batch_decoded_on_threads_runs_a_window_ahead_not_the_whole_batch(
    monkeypatch: pytest.MonkeyPatch, model: CountingModel
) -> None:
    """The decode threads run at most two slices ahead of the bodies taken: a future each
    for every body held gigabytes for huge batches, and a hang-up left them all queued."""
    decoded: list[int] = []
    real_prepare = inprocess._prepare

    def counting_prepare(*args: Any, **kwargs: Any) -> Any:
        decoded.append(args[3])
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(inprocess, "_prepare", counting_prepare)
    checks = itertools.count(1)

    class Left(Exception):
        pass

    def check_cancelled() -> None:
        if next(checks) == 2:  # the first slice of 4 taken: give the threads time to run on
            deadline = time.monotonic() + 1.0
            while len(decoded) <= 12 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise Left

    bodies = [make_body(i) for i in range(200)]
    with (
        InProcessClient(
            model, max_batch_size=4, dynamic_batching=False, batch_decode_threads=2
        ) as client,
        pytest.raises(Left),
    ):
        client.infer_batch(bodies, "predict", check_cancelled=check_cancelled)
    # 4 taken, 8 more ahead of them, and at most one a thread started as the window moved
    assert len(decoded) <= 4 + 8 + 2, f"{len(decoded)} of 200 bodies decoded"


GOOD = [make_body(i) for i in range(8)]
QUICK_BAD = [
    lambda i: make_body(i, x=-1),
    lambda i: make_body(i, unknown=True),
    lambda i: make_body(i, image_data="%%%"),
    lambda i: make_body(i, width=3),
    lambda i: "{",
]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(-1, len(QUICK_BAD) - 1), min_size=1, max_size=8))
def test_batch_errors_name_exactly_the_bad_positions(
    client: InProcessClient, model: CountingModel, kinds: list[int]
) -> None:
    model.reset()
    bodies = [GOOD[i] if kind < 0 else QUICK_BAD[kind](i) for i, kind in enumerate(kinds)]
    bad = {i for i, kind in enumerate(kinds) if kind >= 0}
    if not bad:
        responses = client.embed_batch(bodies)
        assert [json.loads(r)["patch_idx"] for r in responses] == list(range(len(bodies)))
        assert sum(model.sizes()) == len(bodies)
        return
    with pytest.raises(InvalidRequestError) as info:
        client.embed_batch(bodies)
    named = {int(m) for m in re.findall(r"batch position (\d+)", str(info.value))}
    assert named == bad
    assert f"{len(bad)} of {len(bodies)}" in str(info.value)
    assert model.calls == []


def test_bodies_must_be_a_list(client: InProcessClient) -> None:
    with pytest.raises(InvalidRequestError, match="list"):
        client.predict_batch(make_body(0))  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_mode_the_model_lacks_is_refused(tiny_model: ServerModel) -> None:
    class EmbedOnly(CountingModel):
        modes = ("embed",)

    model = EmbedOnly(tiny_model)
    model.reset()
    with InProcessClient(model, dynamic_batching=False) as c:
        with pytest.raises(UnsupportedModeError, match="'predict'"):
            c.predict_batch([make_body(0)])
        with anyio.fail_after(30), pytest.raises(UnsupportedModeError, match="'predict'"):
            await c.predict_async(make_body(0))
        assert model.calls == []
        assert json.loads(c.embed_batch([make_body(0)])[0])["patch_idx"] == 0
        # Statistics for the mode it serves only (every mode was listed, two always 0).
        assert list(c.stats()) == ["embed"] and c.stats()["embed"].samples == 1


# -- model failures -------------------------------------------------------------------------


def test_a_failing_tile_in_a_batch_is_named(client: InProcessClient, model: CountingModel) -> None:
    model.poison = True
    bodies = [make_body(0), white_body(1), make_body(2), white_body(3)]
    with pytest.raises(ModelExecutionError) as info:
        client.predict_batch(bodies)
    message = str(info.value)
    assert "batch position 1" in message and "batch position 3" in message
    assert "patch_idx=1" in message and "patch_idx=3" in message
    assert "batch position 0" not in message and "batch position 2" not in message
    assert client.stats()["predict"].errors >= 1
    assert len(client.predict_batch([bodies[0], bodies[2]])) == 2


def test_a_pass_that_fails_only_at_its_size_is_bisected_and_every_tile_answered(
    client: InProcessClient, model: CountingModel
) -> None:
    """As the scheduler does for a dynamic batch: a GPU out of memory at 4 tiles still
    answers every tile, in halves, instead of failing a batch whose tiles all work."""
    bodies = [make_body(i) for i in range(8)]
    expected = client.predict_batch(bodies)
    model.reset()
    model.fail_above = 2
    answers = client.predict_batch(bodies)
    # The same values up to float rounding: a pass of 2 need not round as one of 4 does (it
    # does on some CPUs, not on others: AVX2 kernels block by batch size).
    assert len(answers) == len(expected)
    assert all(outputs_close(a, b) for a, b in zip(answers, expected, strict=True))
    assert model.sizes() == [4, 2, 2, 4, 2, 2]
    model.fail_above = 0  # every pass fails: every tile named, once alone
    model.reset()
    with pytest.raises(ModelExecutionError) as info:
        client.predict_batch(bodies[:4])
    named = {int(m) for m in re.findall(r"batch position (\d+)", str(info.value))}
    assert named == {0, 1, 2, 3} and "out of memory for 1 tiles" in str(info.value)
    assert sorted(model.sizes()) == [1, 1, 1, 1, 2, 2, 4]


def test_non_finite_outputs_in_a_batch_name_every_position(
    client: InProcessClient, model: CountingModel
) -> None:
    model.nan_on_white = True
    bodies = [make_body(0), white_body(1), make_body(2), white_body(3)]  # one chunk
    before = client.stats()["predict"].errors
    with pytest.raises(ModelExecutionError) as info:
        client.predict_batch(bodies)
    message = str(info.value)
    assert "non-finite" in message
    for position in (1, 3):
        assert f"batch position {position} (patch_idx={position}" in message
    assert "batch position 0" not in message and "batch position 2" not in message
    assert client.stats()["predict"].errors == before + 1


def test_a_batch_names_its_failing_tiles_and_its_non_finite_ones_together(
    client: InProcessClient, model: CountingModel
) -> None:
    """A batch is all or nothing: naming only the tiles whose pass raised left the caller to
    fix them, send it again, and only then learn of the tiles answering NaN."""
    model.poison, model.nan_on_black = True, True
    bodies = [make_body(0), white_body(1), white_body(2, (0, 0, 0)), make_body(3)]  # one chunk
    with pytest.raises(ModelExecutionError) as info:
        client.predict_batch(bodies)
    message = str(info.value)
    failed, _, non_finite = message.partition("; and ")
    assert failed.startswith("model 'h1': forward pass failed for batch position 1 (patch_idx=1")
    assert "poisoned tile" in failed and "batch position 2" not in failed
    assert "non-finite" in non_finite and "batch position 2 (patch_idx=2" in non_finite
    assert "batch position 0" not in message and "batch position 3" not in message


@pytest.mark.anyio
async def test_a_failing_async_call_names_its_tile(
    client: InProcessClient, model: CountingModel
) -> None:
    model.poison = True
    with anyio.fail_after(30):
        with pytest.raises(ModelExecutionError, match="patch_idx=7"):
            await client.embed_async(white_body(7))
        assert json.loads(await client.embed_async(make_body(8)))["patch_idx"] == 8


@pytest.mark.anyio
async def test_non_finite_outputs_are_a_model_error_for_that_tile(
    client: InProcessClient, model: CountingModel
) -> None:
    # Regression: NaN was serialized as null, a response that violates the wire format.
    model.nan_on_white = True
    with anyio.fail_after(30):
        for mode in MODES:
            with pytest.raises(ModelExecutionError, match=r"non-finite.*patch_idx=5"):
                await getattr(client, f"{mode}_async")(white_body(5))
        with pytest.raises(ModelExecutionError, match="patch_idx=5"):
            await anyio.to_thread.run_sync(client.predict_batch, [make_body(4), white_body(5)])
        assert json.loads(await client.predict_async(make_body(4)))["output"]


@pytest.mark.anyio
@pytest.mark.parametrize("overload", ["reject", "wait"])
async def test_batch_size_1_calls_are_bounded_by_max_queue(
    model: CountingModel, overload: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPEC §5, "the queue is bounded", in explicit mode too: its async calls queue on the
    device's thread, ``max_queue`` per loop and mode; the next is refused at once, or waits for
    room before it is even decoded (unbounded, it would be decoded and queue for the device)."""
    decoded: list[int] = []
    real_prepare = inprocess._prepare

    def watched_prepare(model: ServerModel, body: str | bytes, *args: Any, **kw: Any) -> Any:
        prepared = real_prepare(model, body, *args, **kw)
        decoded.append(prepared[0].patch_idx)
        return prepared

    monkeypatch.setattr(inprocess, "_prepare", watched_prepare)
    gate = model.gate = threading.Event()
    client = InProcessClient(
        model,
        dynamic_batching=False,
        max_queue=2,
        overload=overload,
        name="slow",  # a route's name (the server's CLI passes it): errors say it
    )
    done: dict[int, int] = {}

    async def call(i: int) -> None:
        done[i] = json.loads(await client.predict_async(make_body(i)))["patch_idx"]

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, 0)
                await wait_until(model.entered.is_set)  # its pass holds the device
                tg.start_soon(call, 1)
                await wait_until(lambda: 1 in decoded)  # decoded, queued for the device
                if overload == "reject":
                    with pytest.raises(OverloadedError) as info:
                        await client.predict_async(make_body(2))
                    assert "slow:predict: queue full (2 requests admitted)" in str(info.value)
                else:
                    tg.start_soon(call, 2)
                    await wait_until(lambda: client._calls.active == 3)
                    await anyio.sleep(0.3)
                    assert 2 not in decoded  # call 2 waits for room, undecoded
                gate.set()
    finally:
        gate.set()
        await client.aclose()
    calls = [0, 1] if overload == "reject" else [0, 1, 2]
    assert done == {i: i for i in calls}


# -- lifecycle ------------------------------------------------------------------------------


def _every_call(c: InProcessClient) -> list[tuple[str, Callable[[], object]]]:
    body = make_body(0)
    calls: list[tuple[str, Callable[[], object]]] = []
    for mode in MODES:
        calls.append((mode, lambda m=mode: getattr(c, m)(body)))
        calls.append((f"{mode}_batch", lambda m=mode: getattr(c, f"{m}_batch")([body])))
    return calls


def test_every_call_after_close_raises_client_closed(model: CountingModel) -> None:
    c = InProcessClient(model, dynamic_batching=False)
    assert c.predict(make_body(0))
    c.close()
    c.close()  # idempotent
    assert c.closed
    for name, call in _every_call(c):
        with pytest.raises(ClientClosedError):
            call()
        assert name  # for the traceback
    assert "closed" in repr(c)


@pytest.mark.anyio
async def test_async_calls_after_aclose_raise_client_closed(model: CountingModel) -> None:
    async with InProcessClient(model, dynamic_batching=False) as c:
        with anyio.fail_after(30):
            assert json.loads(await c.predict_async(make_body(0)))["patch_idx"] == 0
    assert c.closed
    for mode in MODES:
        with pytest.raises(ClientClosedError):
            await getattr(c, f"{mode}_async")(make_body(0))
    await c.aclose()  # idempotent


def test_sync_context_manager_closes(model: CountingModel) -> None:
    with InProcessClient(model, dynamic_batching=False) as c:
        assert c.embed(make_body(0))
    assert c.closed
    with pytest.raises(ClientClosedError):
        c.embed_batch([make_body(0)])


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_aclose_finishes_work_in_flight_and_refuses_new(model: CountingModel) -> None:
    c = InProcessClient(model, dynamic_batching=False)
    model.gate = threading.Event()
    results: list[str] = []
    closed = anyio.Event()

    async def call() -> None:
        results.append(await c.predict_async(make_body(3)))

    async def close() -> None:
        await c.aclose()
        closed.set()

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await wait_until(model.entered.is_set)
                tg.start_soon(close)
                await wait_until(lambda: c.closed)
                with pytest.raises(ClientClosedError):
                    await c.predict_async(make_body(4))
                await anyio.sleep(0.05)
                assert not closed.is_set(), "aclose returned while a call was still running"
                model.gate.set()
    finally:
        model.gate.set()
    assert closed.is_set()
    assert [json.loads(r)["patch_idx"] for r in results] == [3]


def test_from_checkpoint_builds_an_explicit_client(tiny_checkpoint: Any) -> None:
    with InProcessClient.from_checkpoint(
        "h1",
        tiny_checkpoint,
        max_batch_size=3,
        dynamic_batching=False,
        max_queue=10,
        request_timeout=2.5,
    ) as c:
        meta = json.loads(c.metadata())
        assert meta["batching"] == {
            "dynamic_batching": False,
            "max_batch_size": 3,
            "max_wait_ms": 5.0,
            "max_queue": 10,
            "request_timeout": 2.5,  # an evaluator: the settings in force lacked it
        }
        assert meta["device"] == "cpu" and meta["checkpoint_kind"] == "torch.export"
        assert len(c.predict_batch([make_body(i) for i in range(4)])) == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_batch_size": 0},
        {"max_batch_size": 2.5},
        {"max_batch_size": "8"},
        {"max_batch_size": True},
        {"max_wait_ms": -1.0},
        {"max_wait_ms": float("nan")},
        {"max_wait_ms": float("inf")},
        {"max_queue": 0},
        {"prepare_threads": -1},
        {"request_timeout": 0},
        {"request_timeout": -1.0},
        {"request_timeout": float("nan")},
        {"overload": "drop"},
    ],
    ids=repr,
)
@pytest.mark.parametrize("dynamic", [True, False])
def test_bad_settings_are_refused_naming_them(
    tiny_model: ServerModel, kwargs: dict[str, Any], dynamic: bool
) -> None:
    """At construction, naming the argument: accepted, each would fail every call later (a
    bare ValueError from the scheduler, a deadline that has always passed)."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        InProcessClient(tiny_model, dynamic_batching=dynamic, **kwargs)


def test_numpy_and_none_settings_are_accepted(tiny_model: ServerModel) -> None:
    import numpy as np

    with InProcessClient(
        tiny_model,
        max_batch_size=np.int64(8),
        max_wait_ms=np.float32(0.0),
        max_queue=None,
        prepare_threads=None,
        request_timeout=np.float64(30),
    ) as client:
        assert json.loads(client.predict(make_body(1)))["patch_idx"] == 1


def test_metadata_after_close_raises_like_every_other_method(tiny_model: Any) -> None:
    client = InProcessClient(tiny_model, dynamic_batching=False)
    assert json.loads(client.metadata())["name"] == "h1"
    client.close()
    with pytest.raises(ClientClosedError):
        client.metadata()


@pytest.mark.anyio
async def test_unknown_mode_is_unsupported_not_a_key_error(tiny_model: Any) -> None:
    async with InProcessClient(tiny_model) as client:
        with pytest.raises(UnsupportedModeError, match="'segment'"):
            await client.infer_async(make_body(0), "segment")  # type: ignore[arg-type]
        assert json.loads(await client.predict_async(make_body(1)))["patch_idx"] == 1


def test_batch_of_only_bulk_rna_problems_is_unsupported_like_a_single_request(
    explicit_client: Any,
) -> None:
    with pytest.raises(UnsupportedModeError) as single:
        explicit_client.predict(make_body(0, bulk_rna=[1.0]))
    with pytest.raises(UnsupportedModeError, match="batch position 1") as batch:
        explicit_client.predict_batch([make_body(0), make_body(1, bulk_rna=[1.0])])
    assert "bulk_rna" in str(single.value) and "bulk_rna" in str(batch.value)
    # Mixed kinds of problem: the general class, naming both positions.
    with pytest.raises(InvalidRequestError) as mixed:
        explicit_client.predict_batch([make_body(0, bulk_rna=[1.0]), make_body(1, x=-1)])
    assert type(mixed.value) is InvalidRequestError
    assert "batch position 0" in str(mixed.value) and "batch position 1" in str(mixed.value)


# -- batch_decode_threads ------------------------------------------------------------------


def test_batch_decode_threads_decode_in_parallel_with_the_same_results(
    monkeypatch: pytest.MonkeyPatch, model: CountingModel
) -> None:
    from histoinfer.clients import inprocess

    real_prepare = inprocess._prepare
    # The first two decodes wait for each other: decoded one after another, the first would
    # wait alone, and the call would fail (BrokenBarrierError) instead of hanging.
    together = threading.Barrier(2, timeout=20)
    calls = itertools.count()
    threads: set[int] = set()

    def watched_prepare(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.get_ident())
        if next(calls) < 2:
            together.wait()
        return real_prepare(*args, **kwargs)

    bodies = [make_body(i) for i in range(10)]
    with InProcessClient(model, max_batch_size=4, dynamic_batching=False) as serial:
        expected = serial.predict_with_embedding_batch(bodies)
    monkeypatch.setattr(inprocess, "_prepare", watched_prepare)
    with InProcessClient(
        model, max_batch_size=4, dynamic_batching=False, batch_decode_threads=3
    ) as parallel:
        got = parallel.predict_with_embedding_batch(bodies)
        decoder = parallel._batch_decoder
        assert decoder is not None
    assert len(threads) >= 2 and threading.get_ident() not in threads
    assert got == expected  # same chunks, same order: byte-identical
    assert parallel._batch_decoder is None and decoder._shutdown  # close() stopped its threads


def test_batch_decode_threads_still_name_every_bad_position(model: CountingModel) -> None:
    bodies = [make_body(0), make_body(1, x=-1), make_body(2), "not json", make_body(4)]
    with InProcessClient(model, dynamic_batching=False, batch_decode_threads=2) as client:
        with pytest.raises(InvalidRequestError) as info:
            client.predict_batch(bodies)
        assert len(client.predict_batch([bodies[0], bodies[2]])) == 2
    named = {int(m) for m in re.findall(r"batch position (\d+)", str(info.value))}
    assert named == {1, 3}
    assert "2 of 5" in str(info.value)
    assert model.sizes() == [2]  # only the good batch was computed


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_batch_decode_threads_is_checked(model: CountingModel, value: Any) -> None:
    with pytest.raises(ValueError, match="batch_decode_threads"):
        InProcessClient(model, batch_decode_threads=value)


@pytest.mark.parametrize("value", ["", 3])
def test_name_is_checked(model: CountingModel, value: Any) -> None:
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        InProcessClient(model, name=value)


# -- explicit batches from async code -------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_an_async_batch_runs_beside_the_loop_and_answers_as_the_sync_one(
    model: CountingModel, client: InProcessClient, mode: Mode
) -> None:
    """``*_batch_async``: the sync call blocked the loop for the whole batch (every other task
    waited); here the loop opens the model's gate while the batch's first pass waits on it,
    which a blocked loop never would."""
    bodies = [make_body(i) for i in range(10)]
    want = getattr(client, f"{mode}_batch")(bodies)
    model.reset()
    model.gate = threading.Event()
    got: list[str] = []

    async def batch() -> None:
        got.extend(await getattr(client, f"{mode}_batch_async")(bodies))

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(batch)
                await wait_until(model.entered.is_set)
                model.gate.set()
    finally:
        model.gate.set()
    assert got == want
    assert [size for size, _ in model.calls] == [4, 4, 2]


@pytest.mark.anyio
async def test_a_cancelled_async_batch_stops_after_the_pass_it_is_in(
    model: CountingModel, client: InProcessClient
) -> None:
    """Cancelled, the call answers nothing and starts no further pass (as a hung-up /batch
    request): of 5 passes of 4, the one in progress finishes and no other runs."""
    model.gate = threading.Event()
    try:
        with anyio.fail_after(30):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client.predict_batch_async, [make_body(i) for i in range(20)])
                    await wait_until(model.entered.is_set)
                    scope.cancel()
                    model.gate.set()
            assert scope.cancelled_caught
    finally:
        model.gate.set()
    assert model.calls == [(4, "predict")]
    # The client is unharmed: the next call is answered.
    assert len(await client.embed_batch_async([make_body(1)])) == 1


@pytest.mark.anyio
async def test_a_cancelled_async_batch_returns_before_the_pass_it_is_in_ends(
    model: CountingModel, client: InProcessClient
) -> None:
    """Regression (a user trial): anyio's cancellation (``fail_after``, a cancel scope, Ctrl-C
    on trio) waited out the pass under way, seconds on a ViT, where asyncio's own returned at
    once. The caller is back while the pass is still held; the pass then ends, no other
    starts, and ``aclose()`` waits for it."""
    model.gate = threading.Event()
    try:
        with anyio.fail_after(30):
            with anyio.move_on_after(30) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client.predict_batch_async, [make_body(i) for i in range(20)])
                    await wait_until(model.entered.is_set)
                    scope.cancel()
            # Back while the pass is held at its gate, that is, before it could end.
            assert scope.cancelled_caught and not model.gate.is_set()
            model.gate.set()
            await client.aclose()
            assert model.calls == [(4, "predict")]
    finally:
        model.gate.set()


@pytest.mark.anyio
async def test_an_async_batch_refuses_as_the_sync_one(client: InProcessClient) -> None:
    bodies = [make_body(0), "{not json", make_body(2), make_body(3, width=100)]
    with pytest.raises(InvalidRequestError) as sync_info:
        client.predict_batch(bodies)
    with anyio.fail_after(30), pytest.raises(InvalidRequestError) as info:
        await client.predict_batch_async(bodies)
    assert (str(info.value), info.value.positions) == (str(sync_info.value), [1, 3])


@pytest.mark.anyio
async def test_aclose_waits_for_an_async_batch_not_yet_on_its_thread(
    model: CountingModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (a review): the call was counted in flight only once a worker thread took
    it, so an ``aclose()`` in between closed the client under it (ClientClosedError), against
    "finish the work in flight"."""
    client = InProcessClient(model, max_batch_size=4, dynamic_batching=False)
    real = anyio.to_thread.run_sync
    on_its_way, go = anyio.Event(), anyio.Event()

    async def late(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not on_its_way.is_set():  # the batch's hop to its thread, held back
            on_its_way.set()
            await go.wait()
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", late)
    got: list[str] = []

    async def batch() -> None:
        got.extend(await client.predict_batch_async([make_body(i) for i in range(6)]))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(batch)
            await on_its_way.wait()
            tg.start_soon(client.aclose)
            await wait_until(lambda: client.closed)
            go.set()
    assert [json.loads(r)["patch_idx"] for r in got] == list(range(6))
    with pytest.raises(ClientClosedError):
        await client.predict_batch_async([make_body(0)])


@pytest.mark.anyio
async def test_an_async_batch_cancelled_natively_stops_and_aclose_waits_for_it(
    model: CountingModel, anyio_backend: str
) -> None:
    """Regression (a user trial): asyncio's own cancellation (``task.cancel()``,
    ``asyncio.timeout``, Ctrl-C in ``asyncio.run``) ended the await at once, which
    ``check_cancelled`` cannot see: the thread computed the whole batch, past ``aclose()``.
    Now it stops after the pass it is in, and ``aclose()`` waits for that. (On trio, its own
    cancel scope: anyio's check sees it.)"""
    client = InProcessClient(model, max_batch_size=4, dynamic_batching=False)
    bodies = [make_body(i) for i in range(20)]  # 5 passes of 4
    model.gate = threading.Event()
    try:
        with anyio.fail_after(30):
            if anyio_backend == "asyncio":
                import asyncio

                task = asyncio.ensure_future(client.predict_batch_async(bodies))
                await wait_until(model.entered.is_set)
                task.cancel()
                model.gate.set()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                import trio

                async with trio.open_nursery() as nursery:
                    scope = trio.CancelScope()

                    async def batch() -> None:
                        with scope:
                            await client.predict_batch_async(bodies)

                    nursery.start_soon(batch)
                    await wait_until(model.entered.is_set)
                    scope.cancel()
                    model.gate.set()
            await client.aclose()
            assert model.calls == [(4, "predict")]
            await anyio.sleep(0.3)  # nothing more runs
    finally:
        model.gate.set()
    assert model.calls == [(4, "predict")]
