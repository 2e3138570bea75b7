"""The FastAPI app in-process (httpx ASGITransport, lifespan run), on asyncio and trio.

Routes, problem+json, 413, 503 on a full queue, readiness while loading, draining, metrics,
/invocations in every mode, the batch route and the OpenAPI document.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
import pytest
from concurrency_helpers import gated_model, hooked_model
from helpers import make_body, outputs_close, request_dict, serving
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import Response

from histoinfer import InProcessClient
from histoinfer.batching.admission import deadline_exceeded
from histoinfer.errors import InvalidRequestError, OverloadedError
from histoinfer.models.h1 import H1ServerModel
from histoinfer.schema import Mode, ModelRequest, ModelResponse
from histoinfer.server import ServerState, create_app
from histoinfer.server import app as app_module
from histoinfer.server.problems import LogThrottle, log_answer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PROBLEM_KEYS = {"type", "title", "status", "detail"}


def fresh_client(model: Any, **tuning: Any) -> InProcessClient:
    tuning.setdefault("overload", "reject")
    return InProcessClient(model, max_batch_size=8, max_wait_ms=5.0, **tuning)


def assert_problem(r: httpx.Response, status: int, slug: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    # and a refused /batch call's bad positions, as its error has them
    assert set(problem) - {"positions"} == PROBLEM_KEYS
    positions = problem.get("positions", [])
    assert isinstance(positions, list) and all(type(p) is int for p in positions)
    assert problem["status"] == status
    assert isinstance(problem["title"], str) and problem["title"]
    assert isinstance(problem["detail"], str) and problem["detail"]
    if slug is not None:
        assert problem["type"] == f"https://histoinfer.dev/problems/{slug}"
    return dict(problem)


async def test_routes_answer_what_the_client_answers(tiny_model):
    client = fresh_client(tiny_model)
    async with serving(create_app(client)) as http:
        for mode in ("predict", "embed", "predict_with_embedding"):
            body = make_body(3)
            r = await http.post(f"/api/{mode}/h1", content=body)
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/json"
            assert outputs_close(r.text, client.infer_batch([body], mode)[0])
            assert ("embedding" in r.json()) == (mode == "predict_with_embedding")
        r = await http.get("/api/metadata/h1")
        assert r.status_code == 200 and r.text == client.metadata()


async def test_problem_json_for_every_kind_of_error(tiny_model):
    async with serving(create_app(fresh_client(tiny_model))) as http:
        p = assert_problem(await http.post("/api/predict/h1", content="{nope"), 422)
        assert p["type"].endswith("/invalid-request") and "not valid JSON" in p["detail"]
        bulk = make_body(0, bulk_rna=[1.0, 2.0])
        assert_problem(await http.post("/api/predict/h1", content=bulk), 400, "unsupported-mode")
        p = assert_problem(await http.post("/api/classify/h1", content="{}"), 400)
        assert "classify" in p["detail"]
        p = assert_problem(await http.post("/api/predict/h9", content="{}"), 404, "unknown-model")
        assert "h9" in p["detail"] and "h1" in p["detail"]
        assert_problem(await http.get("/api/metadata/h9"), 404, "unknown-model")
        p = assert_problem(await http.get("/no/such/route"), 404)
        assert p["type"] == "about:blank"
        assert_problem(await http.get("/api/predict/h1"), 405)
        for view in ("metadata", "stats"):  # GET views at /api/{name}/{model}, not modes
            wrong = await http.post(f"/api/{view}/h1", content="{}")
            assert_problem(wrong, 405)
            assert wrong.headers["allow"] == "GET, HEAD"
        # No 307 to an absolute http:// URL (wrong behind TLS termination): a 404 that says so.
        slash = await http.post("/api/predict/h1/", content=make_body(0))
        p = assert_problem(slash, 404)
        assert "no trailing slash: /api/predict/h1" in p["detail"]
        for path in ("/ping", "/health/ready", "/health/live"):
            assert (await http.head(path)).status_code == (await http.get(path)).status_code


async def test_read_only_routes_answer_head_and_name_both_methods_in_a_405(tiny_model):
    """Regression: HEAD /metrics and /api/metadata were 405s, and a 405 on a health route
    named HEAD alone (GET and HEAD were two routes)."""
    async with serving(create_app(fresh_client(tiny_model))) as http:
        for path in ("/metrics", "/api/metadata/h1", "/api/stats/h1", "/health/ready", "/ping"):
            r = await http.head(path)
            assert r.status_code == 200 and r.content == b"", path
        for path in ("/health/ready", "/health/live", "/ping", "/metrics"):
            r = await http.post(path, content="{}")
            assert_problem(r, 405)
            assert sorted(r.headers["allow"].split(", ")) == ["GET", "HEAD"], path


async def test_a_batch_of_a_read_only_view_is_no_route(tiny_model):
    """/api/metadata/{model} is a view with no batch: "unknown mode 'metadata'" was wrong."""
    async with serving(create_app(fresh_client(tiny_model))) as http:
        for view in ("metadata", "stats"):
            r = await http.post(f"/api/{view}/h1/batch", json=[json.loads(make_body(0))])
            p = assert_problem(r, 404)
            assert p["detail"] == f"no route for POST /api/{view}/h1/batch"


async def test_an_encoded_slash_reaches_no_route(tiny_model):
    """Starlette routes the decoded path: ``/api/predict/h1%2Fbatch`` was served by the batch
    route, which a gateway's rule on the raw path never saw (a fuzzing trial)."""
    async with serving(create_app(fresh_client(tiny_model))) as http:
        batch = [json.loads(make_body(0))]
        for path in ("/api/predict/h1%2Fbatch", "/api%2fpredict%2Fh1%2Fbatch", "/ping%2F"):
            r = await http.post(path, json=batch)
            p = assert_problem(r, 404)
            assert p["detail"].startswith(f"no route for POST {path}: an encoded slash (%2F)")
            assert r.headers["connection"] == "close"
        ok = await http.post("/api/predict/h1/batch", json=batch)  # the route itself: served
        assert ok.status_code == 200 and len(ok.json()) == 1
        families = text_string_to_metric_families((await http.get("/metrics")).text)
        answers = next(f for f in families if f.name == "histoinfer_http_responses")
        assert sum(s.value for s in answers.samples if s.labels.get("status") == "404") == 3


async def test_a_compressed_body_is_415_naming_the_encoding(tiny_model):
    """Regression: a gzip body was "not valid JSON (expected value at line 1 column 1)"."""
    async with serving(create_app(fresh_client(tiny_model))) as http:
        r = await http.post(
            "/api/predict/h1",
            content=gzip.compress(make_body(0).encode()),
            headers={"content-encoding": "gzip"},
        )
        p = assert_problem(r, 415)
        assert "'gzip' is not supported" in p["detail"]
        assert r.headers["accept-encoding"] == "identity"
        r = await http.post(
            "/api/predict/h1", content=make_body(0), headers={"content-encoding": "identity"}
        )
        assert r.status_code == 200


@pytest.mark.parametrize(
    ("accept", "ndjson"),
    [
        ("application/x-ndjson", True),
        ("application/json;q=0.5, application/x-ndjson", True),
        ("application/x-ndjson;q=0, application/json", False),
        ("application/x-ndjson; q=0.2, application/json", False),
        ("application/json", False),
        ("", False),
    ],
)
async def test_the_batch_route_answers_ndjson_only_when_preferred(tiny_model, accept, ndjson):
    """Regression: any Accept mentioning NDJSON got it, q=0 ("not acceptable") included."""
    async with serving(create_app(fresh_client(tiny_model))) as http:
        body = json.dumps([make_body(0), make_body(1)])
        r = await http.post("/api/embed/h1/batch", content=body, headers={"accept": accept})
        assert r.status_code == 200
        kind = "application/x-ndjson" if ndjson else "application/json"
        assert r.headers["content-type"].startswith(kind)


async def test_body_over_the_limit_is_413(tiny_model):
    app = create_app(fresh_client(tiny_model), max_body_bytes=512 * 1024)
    async with serving(app) as http:
        assert (await http.post("/api/predict/h1", content=make_body(1))).status_code == 200
        big = make_body(1, slide_name="s" * (600 * 1024))
        p = assert_problem(await http.post("/api/predict/h1", content=big), 413)
        assert p["type"].endswith("/payload-too-large") and str(512 * 1024) in p["detail"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
            for _ in range(20):
                yield b" " * (64 * 1024)

        r = await http.post("/api/predict/h1/batch", content=chunks())
        assert "content-length" not in r.request.headers
        assert_problem(r, 413, "payload-too-large")
        assert (await http.post("/api/embed/h1", content=make_body(2))).status_code == 200


async def test_a_batch_of_more_requests_than_the_limit_is_413_and_computes_nothing(tiny_model):
    """A /batch body of millions of tiny elements took minutes of CPU and gigabytes (every
    element refused one by one): past ``max_batch_requests`` it is refused as it is."""
    model, watch = hooked_model(tiny_model)
    app = create_app(fresh_client(model), max_batch_requests=3)
    async with serving(app) as http:
        passes = watch.calls  # the warm-up's
        bodies = [json.loads(make_body(i)) for i in range(4)]
        p = assert_problem(await http.post("/api/predict/h1/batch", json=bodies), 413)
        assert p["type"].endswith("/payload-too-large")
        assert "4 requests" in p["detail"] and "at most 3" in p["detail"]
        assert "--max-batch-requests" in p["detail"]
        assert watch.calls == passes  # nothing computed
        r = await http.post("/api/predict/h1/batch", json=bodies[:3])
        assert r.status_code == 200 and len(r.json()) == 3
        assert_problem(await http.post("/api/predict/h1/batch", json=[1] * 10), 413)


@pytest.mark.parametrize(
    "junk",
    [b"{}", b"[]", b'""', b'{"a":""}', b"0"],
    ids=["objects", "arrays", "strings", "pairs", "numbers"],
)
async def test_a_long_batch_of_more_than_its_requests_can_hold_is_413_unparsed(
    tiny_model, monkeypatch, junk: bytes
):
    """64 MiB of ``[{},{},...]`` took 1.7 GB and 3 s of a GIL-holding parse before its 413
    (and 60 MB of ``[0,0,...]`` 1-3 s: a fuzzing trial): a body over 1 MiB holding more
    objects, arrays, strings or values than ``max_batch_requests`` requests can is refused
    counted, not parsed. Valid batches over 1 MiB, inline or as JSON
    strings, are not."""
    parsed: list[int] = []
    real = app_module.pydantic_core.from_json

    def recording(data: Any, **kwargs: Any) -> Any:
        parsed.append(len(data))
        return real(data, **kwargs)

    monkeypatch.setattr(app_module.pydantic_core, "from_json", recording)
    app = create_app(fresh_client(tiny_model), max_batch_requests=16)
    async with serving(app) as http:
        raw = b"[" + b",".join([junk] * (2**20 // len(junk))) + b"]"
        p = assert_problem(await http.post("/api/embed/h1/batch", content=raw), 413)
        assert "--max-batch-requests" in p["detail"] and "at most 16 requests" in p["detail"]
        assert not [n for n in parsed if n >= 2**20]  # refused before any parse
        bodies = [make_body(i, slide_name='a "quoted" {slide} [name]') for i in range(8)]
        assert sum(map(len, bodies)) > 2**20  # ~0.2 MB each
        inline = [json.loads(body) for body in bodies]
        for batch in (inline, bodies):  # objects, and JSON strings (their quotes escaped)
            r = await http.post("/api/embed/h1/batch", json=batch)
            assert r.status_code == 200 and len(r.json()) == 8, r.text
    # At the limit: as many requests as allowed, each with its bulk_rna list and braces,
    # brackets and quotes in its slide name, are counted in (the model then refuses bulk_rna).
    async with serving(create_app(fresh_client(tiny_model), max_batch_requests=8)) as http:
        full = [make_body(i, slide_name='{x} "y" [z]', bulk_rna=[0.5, 1.0]) for i in range(8)]
        for batch in ([json.loads(body) for body in full], full):
            p = assert_problem(await http.post("/api/embed/h1/batch", json=batch), 400)
            assert "bulk_rna" in p["detail"] and p["positions"] == list(range(8))
        # Slide names with commas: 100 each, as a request in-process may hold (a review).
        named = [make_body(i, slide_name="a," * 100) for i in range(8)]
        assert sum(map(len, named)) > 2**20
        r = await http.post("/api/embed/h1/batch", json=named)
        assert r.status_code == 200 and len(r.json()) == 8, r.text


async def test_a_long_body_of_too_many_values_is_refused_as_in_process(tiny_model):
    """Counted, not parsed (pydantic took ~20 times such a body), over HTTP as in-process."""
    client = fresh_client(tiny_model)
    body = json.dumps({**json.loads(make_body(1)), "bulk_rna": [0] * 300_000})
    with pytest.raises(InvalidRequestError) as in_process:
        await client.predict_async(body)
    async with serving(create_app(client)) as http:
        p = assert_problem(await http.post("/api/predict/h1", content=body), 422)
        assert p["detail"] == str(in_process.value)
        assert f"body has {body.count(','):,} commas" in p["detail"]


async def test_a_model_cannot_be_served_as_the_label_of_unserved_paths(tiny_model):
    with pytest.raises(ValueError, match="cannot be served as 'unknown'"):
        create_app({"unknown": fresh_client(tiny_model)})


async def test_a_batch_body_is_parsed_off_the_event_loop(tiny_model, monkeypatch):
    """Parsing a 60 MB batch and writing its bodies back to JSON held the loop, every other
    request, for 50-240 ms: it runs on the batch's worker thread."""
    parsed_on: list[int] = []
    real = app_module._batch_bodies

    def recording(*args: Any) -> Any:
        parsed_on.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(app_module, "_batch_bodies", recording)
    async with serving(create_app(fresh_client(tiny_model))) as http:
        bodies = [json.loads(make_body(i)) for i in range(2)]
        r = await http.post("/api/embed/h1/batch", json=bodies)
        assert r.status_code == 200 and len(r.json()) == 2
        assert_problem(await http.post("/api/embed/h1/batch", content=b"[1,"), 422)
    assert len(parsed_on) == 2
    assert threading.get_ident() not in parsed_on


async def test_batch_bodies_are_parsed_one_at_a_time(tiny_model, monkeypatch):
    """A parse holds the GIL, and can briefly take ~16x its body: several batches arriving
    at once are parsed one after another, not one per worker thread at once."""
    inside = 0
    most = 0
    guard = threading.Lock()
    real = app_module._batch_bodies

    def slow(*args: Any) -> Any:
        nonlocal inside, most
        with guard:
            inside += 1
            most = max(most, inside)
        time.sleep(0.05)  # long enough for the others' threads to arrive meanwhile
        try:
            return real(*args)
        finally:
            with guard:
                inside -= 1

    monkeypatch.setattr(app_module, "_batch_bodies", slow)
    async with serving(create_app(fresh_client(tiny_model))) as http:
        bodies = [json.loads(make_body(i)) for i in range(2)]
        answers: list[int] = []

        async def post() -> None:
            answers.append((await http.post("/api/embed/h1/batch", json=bodies)).status_code)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(post)
    assert answers == [200] * 4
    assert most == 1


async def test_batch_calls_past_the_limit_get_503_at_once_and_places_come_back(tiny_model):
    """Each ``/batch`` call holds its body and then every tile it decoded: past
    ``max_batch_calls`` in progress another is refused at once, as a full queue refuses a
    tile, rather than held on a worker thread with its body."""
    model = gated(tiny_model)
    app = create_app(fresh_client(model, prepare_threads=2), max_batch_calls=1, retry_after=7)
    path = "/api/predict/h1/batch"
    held, other = [json.loads(make_body(0, slide_name="gate"))], [json.loads(make_body(1))]
    statuses: list[int] = []
    async with serving(app) as http:

        async def hold() -> None:
            statuses.append((await http.post(path, json=held)).status_code)

        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(hold)
                    while model.entered < 1:  # admitted, and stuck decoding its tile
                        await anyio.sleep(0.01)
                    for refused in (path, "/api/embed/h1/batch"):  # across modes
                        r = await http.post(refused, json=other)
                        p = assert_problem(r, 503, "overloaded")
                        assert r.headers["retry-after"] == "7"
                        assert "1 /batch calls" in p["detail"]
                        assert "--max-batch-calls" in p["detail"]
                    # a single tile is not a batch call: served meanwhile
                    r = await http.post("/api/predict/h1", content=make_body(2))
                    assert r.status_code == 200
                    model.gate.set()
        finally:
            model.gate.set()
        assert statuses == [200]
        # The place comes back after an answer, and after a refusal.
        assert_problem(await http.post(path, content=b"[1,"), 422)
        r = await http.post(path, json=other)
        assert r.status_code == 200 and len(r.json()) == 1
    assert app.state.histoinfer.batch_calls == 0


async def test_max_batch_calls_must_be_a_count(tiny_model):
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_batch_calls must be at least 1"):
            create_app(fresh_client(tiny_model), max_batch_calls=bad)


async def test_max_batch_requests_must_be_a_count(tiny_model):
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_batch_requests must be at least 1"):
            create_app(fresh_client(tiny_model), max_batch_requests=bad)


def post_scope(path: str, content_length: int) -> dict[str, Any]:
    """The ASGI scope of a POST to ``path``, as a server passes it to the app."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-length", str(content_length).encode()), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }


async def post_raw(
    app: Any, messages: list[dict[str, Any]], headers: list[tuple[bytes, bytes]]
) -> tuple[list[dict[str, Any]], int]:
    """POST ``messages`` to the single-tile route with exactly ``headers``; what was sent back,
    and how many times the app called ``receive``."""
    scope = {**post_scope("/api/predict/h1", 0), "headers": [(b"host", b"test"), *headers]}
    sent: list[dict[str, Any]] = []
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent, received


@pytest.mark.parametrize("parts", [1, 2], ids=["one-chunk", "last-chunk-crosses"])
async def test_a_streamed_body_whose_last_chunk_crosses_the_limit_is_413(tiny_model, parts):
    """Regression: uvicorn answered 500 ("Stream consumed"): the rest of the body was drained
    through a second request.stream(), which Starlette refuses once the last chunk is in."""
    app = create_app(fresh_client(tiny_model), max_body_bytes=1000)
    chunks = [b" " * 600] * parts if parts == 2 else [b" " * 1200]
    messages = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    async with serving(app):
        with anyio.fail_after(30):
            sent, _ = await post_raw(app, messages, [(b"transfer-encoding", b"chunked")])
    assert sent[0]["status"] == 413, sent


async def test_a_declared_body_over_the_limit_with_expect_100_continue_is_refused_unread(
    tiny_model,
):
    """Regression: the app read the body to drain it, so the server sent "100 Continue" and the
    client uploaded all of it (curl: 200 MB) only to get the 413."""
    app = create_app(fresh_client(tiny_model), max_body_bytes=1000)
    declared = [(b"content-length", b"5000000")]
    async with serving(app):
        with anyio.fail_after(30):
            sent, received = await post_raw(app, [], [*declared, (b"expect", b"100-continue")])
            assert (sent[0]["status"], received) == (413, 0)
            assert (b"connection", b"close") in sent[0]["headers"]  # its body never read
            body = [{"type": "http.request", "body": b" " * 2000, "more_body": False}]
            sent, received = await post_raw(app, body, declared)  # no Expect: drained first
            assert (sent[0]["status"], received) == (413, 1)
            assert (b"connection", b"close") not in sent[0]["headers"]  # read to its end


async def leave_mid_body(app: Any, path: str) -> list[dict[str, Any]]:
    """POST to ``path`` as a client that disconnects after part of its body; what was sent."""
    messages = [
        {"type": "http.request", "body": b'{"image_data": "', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(post_scope(path, 1000), receive, send)
    return sent


async def test_a_client_leaving_mid_body_is_no_server_error(tiny_model, caplog):
    """Counted as 499, not as a 500, and not logged: any client could send thousands."""
    app = create_app(fresh_client(tiny_model))
    async with serving(app) as http:
        with caplog.at_level("WARNING"):
            for path in ("/api/predict/h1", "/api/predict/h1/batch"):
                sent = await leave_mid_body(app, path)
                assert sent[0]["status"] == 499, sent
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
        metrics = (await http.get("/metrics")).text
        assert 'status="499"' in metrics and 'status="500"' not in metrics


async def post_stalled(
    app: Any, path: str, first: bytes, then: anyio.Event, rest: bytes = b""
) -> list[dict[str, Any]]:
    """POST to ``path`` as a client that sends ``first`` and stalls until ``then`` (at most
    10 s: a fail-fast bound), then sends ``rest``; what was sent back."""
    messages = [{"type": "http.request", "body": first, "more_body": True}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        with anyio.move_on_after(10):
            await then.wait()
            return {"type": "http.request", "body": rest, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(post_scope(path, len(first) + len(rest)), receive, send)
    return sent


async def start_upload(
    tg: anyio.abc.TaskGroup, app: Any, first: bytes, then: anyio.Event, rest: bytes = b""
) -> list[dict[str, Any]]:
    """``post_stalled`` to the single-tile route, started in ``tg`` and returned from once
    the request is in flight: the list its answer will be in."""
    sent: list[dict[str, Any]] = []

    async def upload() -> None:
        sent.extend(await post_stalled(app, "/api/predict/h1", first, then, rest))

    tg.start_soon(upload)
    with anyio.fail_after(5):
        while not app.state.histoinfer.in_flight:
            await anyio.sleep(0.01)
    return sent


def sent_problem(sent: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The status and problem body of an answer ``post_stalled`` collected."""
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


async def test_a_body_that_stalls_is_answered_408(tiny_model):
    """A slow-loris client held its slot (and shutdown) for ever: no body timeout."""
    app = create_app(fresh_client(tiny_model), warmup=False, body_timeout=0.3)
    async with serving(app):
        for path in ("/api/predict/h1", "/api/predict/h1/batch", "/invocations"):
            with anyio.fail_after(5):
                sent = await post_stalled(app, path, b'{"image_data": "', anyio.Event())
            status, problem = sent_problem(sent)
            assert status == 408 and problem["type"].endswith("/request-timeout"), sent
            assert "0.3 s" in problem["detail"]
            assert (b"connection", b"close") in sent[0]["headers"]  # the body's rest unread
        assert not app.state.histoinfer.in_flight


async def test_a_request_uploading_when_the_graceful_timeout_runs_out_gets_503_closed(
    tiny_model,
):
    """Until session 21 only requests past their upload were in flight: one still uploading
    got the ASGI server's bare 500 (uvicorn) or a dropped connection (hypercorn)."""
    app = create_app(fresh_client(tiny_model), warmup=False)
    async with serving(app):
        state: ServerState = app.state.histoinfer
        async with anyio.create_task_group() as tg:
            sent = await start_upload(tg, app, b"{", anyio.Event())
            state.expire_in_flight()
        status, problem = sent_problem(sent)
        assert status == 503 and problem["type"].endswith("/closed")
        assert "graceful timeout ran out" in problem["detail"]


async def test_a_request_uploading_when_draining_begins_is_answered(tiny_model):
    """In flight at SIGTERM (its headers in, its body on the way): it finishes, as the
    requests past their upload do; one arriving after is refused."""
    app = create_app(fresh_client(tiny_model), warmup=False)
    body = make_body(0).encode()
    async with serving(app) as http:
        state: ServerState = app.state.histoinfer
        rest = anyio.Event()
        async with anyio.create_task_group() as tg:
            sent = await start_upload(tg, app, body[:10], rest, body[10:])
            state.begin_drain()
            late = await http.post("/api/predict/h1", content=body)
            rest.set()
        assert sent[0]["status"] == 200, sent
        assert_problem(late, 503, "closed")


class GatedModel(H1ServerModel):
    """Decoding a tile of slide ``gate`` blocks until the test opens the gate."""

    gate: threading.Event
    entered: int

    def prepare_sample(self, request, where=None):  # type: ignore[no-untyped-def]
        if request.slide_name == "gate":
            self.entered += 1
            self.gate.wait(30)
        return super().prepare_sample(request, where)


def gated(tiny_model: Any) -> GatedModel:
    model = GatedModel(tiny_model.checkpoint, tiny_model.assets, "cpu")
    model.gate, model.entered = threading.Event(), 0
    return model


@pytest.mark.parametrize("overload", ["reject", "wait"])
async def test_full_queue_answers_503_at_once(tiny_model, overload, caplog):
    """Whatever the client does for its in-process callers (regression: a client built with
    the default overload="wait" made HTTP requests wait for room)."""
    model = gated(tiny_model)
    # Two decode threads, so that both held requests are admitted and decoding at once.
    client = fresh_client(model, max_queue=2, prepare_threads=2, overload=overload)
    app = create_app(client, retry_after=7)
    statuses: list[int] = []
    async with serving(app) as http:

        async def held(i: int) -> None:
            r = await http.post("/api/predict/h1", content=make_body(i, slide_name="gate"))
            statuses.append(r.status_code)

        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(held, 0)
                    tg.start_soon(held, 1)
                    while model.entered < 2:  # both admitted and stuck in decoding
                        await anyio.sleep(0.01)
                    with caplog.at_level("WARNING", logger="histoinfer.server"):
                        r = await http.post("/api/predict/h1", content=make_body(2))
                    p = assert_problem(r, 503, "overloaded")
                    assert r.headers["retry-after"] == "7"
                    assert "queue full" in p["detail"]
                    # Shedding load is logged (throttled), or an operator without an access
                    # log sees nothing of it.
                    assert "answered 503 (request " in caplog.text and "queue full" in caplog.text
                    model.gate.set()
        finally:
            model.gate.set()
        assert statuses == [200, 200]
        assert (await http.post("/api/predict/h1", content=make_body(3))).status_code == 200


async def test_bodies_past_the_servers_room_get_503_and_their_bytes_come_back(tiny_model):
    """Every body is held until its request is answered: past ``max_held_bytes`` over every
    request, another is refused at once (a declared length before any of it is read, a
    chunked one as it comes) instead of taking the server's memory with it."""
    model = gated(tiny_model)
    held_body = make_body(0, slide_name="gate").encode()
    size = len(held_body)
    app = create_app(
        fresh_client(model, prepare_threads=2),
        max_body_bytes=size + 100,
        max_held_bytes=2 * size + 100,
        retry_after=7,
    )
    state = app.state.histoinfer
    statuses: list[int] = []
    async with serving(app) as http:

        async def held() -> None:
            r = await http.post("/api/predict/h1", content=held_body)
            statuses.append(r.status_code)

        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(held)
                    tg.start_soon(held)
                    while model.entered < 2:  # both read, and stuck decoding
                        await anyio.sleep(0.01)
                    assert state.http.bodies_held == 2 * size
                    assert (await scrape(http))["histoinfer_http_request_body_bytes"][()] == (
                        2 * size
                    )
                    refused = make_body(1).encode()
                    r = await http.post("/api/predict/h1", content=refused)
                    p = assert_problem(r, 503, "overloaded")
                    assert r.headers["retry-after"] == "7"
                    assert "--max-bodies-mb" in p["detail"]
                    # Its figures as it was refused, the body's own size among them.
                    assert (
                        f"holds {2 * size} bytes of request bodies, and {len(refused)} more"
                        in (p["detail"])
                    )
                    assert f"limit of {2 * size + 100} bytes" in p["detail"]
                    # Chunked, with no length to refuse it by: refused once it does not fit.
                    chunks = [held_body[:100], held_body[100:]]
                    messages = [
                        {"type": "http.request", "body": c, "more_body": i == 0}
                        for i, c in enumerate(chunks)
                    ]
                    sent, _ = await post_raw(app, messages, [(b"transfer-encoding", b"chunked")])
                    assert sent[0]["status"] == 503, sent
                    assert state.http.bodies_held == 2 * size  # the refused ones hold nothing
                    model.gate.set()
        finally:
            model.gate.set()
        assert statuses == [200, 200]
        assert state.http.bodies_held == 0
        assert (await http.post("/api/predict/h1", content=make_body(2))).status_code == 200
        assert state.http.bodies_held == 0


async def test_a_declared_body_holds_only_what_has_arrived(tiny_model):
    """A client declaring a large body and sending little of it pins only what it sent (it
    reserved the whole declared length: 16 such clients held a server's room for a minute
    each, answering everyone else 503; a review). One that cannot fit now is still refused
    before any of it is read, and a /batch call takes its place only once its body is in."""
    body = make_body(0).encode()
    app = create_app(fresh_client(tiny_model), max_body_bytes=len(body), max_held_bytes=len(body))
    state = app.state.histoinfer
    async with serving(app) as http:
        go_on = anyio.Event()
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                sent = await start_upload(tg, app, body[:100], go_on, body[100:])
                while state.http.bodies_held < 100:
                    await anyio.sleep(0.01)
                assert state.http.bodies_held == 100  # not the declared len(body)
                assert state.batch_calls == 0
                # Another whole body does not fit beside those 100 bytes: refused at once.
                r = await http.post("/api/predict/h1", content=body)
                assert_problem(r, 503, "overloaded")
                go_on.set()
        assert sent[0]["status"] == 200
        assert state.http.bodies_held == 0


async def test_max_held_bytes_must_hold_one_body(tiny_model):
    with pytest.raises(ValueError, match=r"max_held_bytes \(999\) must be at least max_body"):
        create_app(fresh_client(tiny_model), max_body_bytes=1000, max_held_bytes=999)
    state = create_app(fresh_client(tiny_model), max_body_bytes=1000).state.histoinfer
    assert state.max_held_bytes == 2**30
    state = create_app(fresh_client(tiny_model), max_body_bytes=2**27).state.histoinfer
    assert state.max_held_bytes == 2**31


async def post_then_hang_up(app: Any, path: str, body: bytes, hang_up: anyio.Event) -> list[Any]:
    """POST a whole ``body`` to ``path`` as a client that disconnects when ``hang_up`` is set
    (the next ASGI message, as a server sends it once the connection closes); what was sent."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(post_scope(path, len(body)), receive, send)
    return sent


@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled", "opted-out"])
@pytest.mark.parametrize("path", ["/api/predict/h1", "/invocations"])
async def test_a_request_whose_client_hangs_up_while_queued_is_never_computed(
    tiny_model, path, cancel
):
    """Regression: servers do not cancel a handler whose client left, so every abandoned
    request was still decoded and computed, and live callers waited behind them. With
    cancel_on_disconnect=False, it is computed (as before)."""
    model = gated(tiny_model)
    client = fresh_client(model, prepare_threads=1)
    app = create_app(client, cancel_on_disconnect=cancel)
    body = make_body(1).encode()
    if path == "/invocations":
        body = json.dumps({**request_dict(1), "model_name": "h1", "mode": "prediction"}).encode()
    async with serving(app) as http:
        before = client.stats()["predict"]
        statuses: list[int] = []
        hang_up = anyio.Event()

        async def held() -> None:  # holds the device's thread (a lone tile decodes there)
            r = await http.post("/api/predict/h1", content=make_body(0, slide_name="gate"))
            statuses.append(r.status_code)

        async def leaver() -> None:
            sent = await post_then_hang_up(app, path, body, hang_up)
            statuses.append(sent[0]["status"])

        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(held)
                    while model.entered < 1:
                        await anyio.sleep(0.01)
                    tg.start_soon(leaver)
                    while client.stats()["predict"].queue_depth < 1:  # decoded, and queued
                        await anyio.sleep(0.01)
                    hang_up.set()
                    if cancel:
                        while len(statuses) < 1:
                            await anyio.sleep(0.01)
                    model.gate.set()
        finally:
            model.gate.set()
        after = client.stats()["predict"]
        if cancel:
            assert sorted(statuses) == [200, 499]
            assert after.samples - before.samples == 1  # the held request only
            assert after.cancelled - before.cancelled == 1
        else:
            assert statuses == [200, 200]
            assert (after.samples - before.samples, after.cancelled - before.cancelled) == (2, 0)
        # the next request is served as ever
        assert (await http.post(path, content=body)).status_code == 200


async def during_its_first_pass(
    call: Callable[[], Awaitable[None]], watch: Any, gate: threading.Event, act: Callable[[], None]
) -> None:
    """Run ``call``; while its first forward pass is held at ``gate``, ``act()``, and once every
    task has seen it (the hang-up watch, the cancelled request), open the gate."""
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                while watch.calls < 1:
                    await anyio.sleep(0.01)
                act()
                await anyio.wait_all_tasks_blocked()
                gate.set()
    finally:
        gate.set()


@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled", "opted-out"])
async def test_a_batch_whose_client_hangs_up_stops_at_its_next_pass(tiny_model, cancel):
    """Regression: a ``/batch`` request ran every pass of its batch after its client left (a
    client that timed out and retried doubled the load). Now the batch stops before its next
    pass; opted out, it runs to its end."""
    model, watch, gate = gated_model(tiny_model)
    client = fresh_client(model)  # 8 tiles a pass: 24 bodies are 3 passes
    app = create_app(client, warmup=False, cancel_on_disconnect=cancel)
    body = json.dumps([make_body(i) for i in range(24)]).encode()
    async with serving(app) as http:
        hang_up = anyio.Event()
        sent: list[Any] = []

        async def leaver() -> None:
            sent.extend(await post_then_hang_up(app, "/api/predict/h1/batch", body, hang_up))

        await during_its_first_pass(leaver, watch, gate, hang_up.set)
        assert sent[0]["status"] == (499 if cancel else 200)
        assert watch.sizes == ([8] if cancel else [8, 8, 8])
        r = await http.post("/api/predict/h1/batch", content=body)  # the next one, as ever
        assert r.status_code == 200 and len(r.json()) == 24


async def test_a_batch_whose_client_hangs_up_keeps_its_place_until_its_pass_ends(tiny_model):
    """A hung-up ``/batch`` request is answered at once now (its thread is abandoned, for the
    graceful timeout's sake), but its place among ``max_batch_calls`` is kept until its pass
    ends: a client hanging up and sending again could otherwise run any number at once."""
    model, watch, gate = gated_model(tiny_model)
    app = create_app(fresh_client(model), warmup=False, max_batch_calls=1)
    body = json.dumps([make_body(i) for i in range(16)]).encode()
    async with serving(app) as http:
        hang_up = anyio.Event()
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(post_then_hang_up, app, "/api/predict/h1/batch", body, hang_up)
                    while watch.calls < 1:
                        await anyio.sleep(0.01)
                    hang_up.set()
                    await anyio.wait_all_tasks_blocked()
                    r = await http.post("/api/predict/h1/batch", content=body)
                    assert_problem(r, 503, "overloaded")  # its pass still holds the place
                    gate.set()
                r = await http.post("/api/predict/h1/batch", content=body)
                assert r.status_code == 200 and len(r.json()) == 16
        finally:
            gate.set()
        assert watch.sizes == [8, 8, 8]  # the leaver's one pass, then the last call's two


@pytest.mark.parametrize("path", ["/api/predict/h1/batch", "/api/predict/h1"])
async def test_a_request_in_a_long_pass_is_answered_503_before_the_graceful_deadline(
    tiny_model, path
):
    """Regression (a user trial): a ``/batch`` request waited for the pass under way before it
    answered 503 ``closed``; a pass longer than the time left (seconds on a ViT) let the ASGI
    server cut it off with a bare 500. Now it is answered while the pass is still held."""
    model, watch, gate = gated_model(tiny_model)
    app = create_app(fresh_client(model), warmup=False)
    body = json.dumps([make_body(i) for i in range(16)]) if "batch" in path else make_body(0)
    async with serving(app) as http:
        state: ServerState = app.state.histoinfer
        answers: list[httpx.Response] = []
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:

                    async def call() -> None:
                        answers.append(await http.post(path, content=body))

                    tg.start_soon(call)
                    while watch.calls < 1:
                        await anyio.sleep(0.01)
                    state.expire_in_flight()
                    while not answers:
                        await anyio.sleep(0.01)
                    assert not gate.is_set()  # answered with the pass still held
                    gate.set()
        finally:
            gate.set()
        p = assert_problem(answers[0], 503, "closed")
        assert "graceful timeout ran out" in p["detail"]


async def test_a_server_that_answers_receive_at_once_does_not_make_the_watch_spin(tiny_model):
    """An ASGI server whose receive() returns an empty request message without waiting (not
    uvicorn's or hypercorn's way): the hang-up watch stops watching, and the request is served."""
    app = create_app(fresh_client(tiny_model))
    body = make_body(1).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:  # never waits: a loop over it would never yield
        return messages.pop(0) if messages else {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async with serving(app):
        with anyio.fail_after(30):
            await app(post_scope("/api/predict/h1", len(body)), receive, send)
    assert sent[0]["status"] == 200


async def test_ready_only_once_loaded_and_warm(tiny_model):
    loading = threading.Event()

    def load() -> InProcessClient:
        loading.wait(30)
        return fresh_client(tiny_model)

    app = create_app({"h1": load, "also": fresh_client(tiny_model)})
    async with serving(app, ready=False) as http:
        assert (await http.get("/health/live")).status_code == 200
        r = await http.get("/health/ready")
        assert r.status_code == 503 and r.json()["models"]["h1"] == "loading"
        assert (await http.get("/ping")).status_code == 503
        r = await http.post("/api/predict/h1", content=make_body(0))
        p = assert_problem(r, 503, "not-ready")
        assert "h1" in p["detail"] and r.headers["retry-after"] == "1"
        loading.set()
        with anyio.fail_after(30):
            while (await http.get("/health/ready")).status_code != 200:
                await anyio.sleep(0.02)
        assert (await http.get("/ping")).status_code == 200
        for name in ("h1", "also"):
            assert (await http.post(f"/api/embed/{name}", content=make_body(1))).status_code == 200


async def test_on_loaded_runs_once_every_model_is_ready(tiny_model):
    app = create_app({"h1": lambda: fresh_client(tiny_model), "also": fresh_client(tiny_model)})
    state: ServerState = app.state.histoinfer
    seen: list[dict[str, str]] = []
    state.on_loaded = lambda: seen.append({n: m.status for n, m in state.models.items()})
    async with serving(app) as http:
        assert (await http.get("/health/ready")).status_code == 200
    assert seen == [{"h1": "ready", "also": "ready"}]


async def test_a_model_that_fails_to_load_is_reported(tiny_model):
    def broken() -> InProcessClient:
        raise RuntimeError("checkpoint exploded")

    app = create_app({"h1": broken})
    state: ServerState = app.state.histoinfer
    fatal = threading.Event()
    state.on_fatal = fatal.set
    state.on_loaded = lambda: pytest.fail("on_loaded ran although a model failed")
    async with serving(app, ready=False) as http:
        with anyio.fail_after(30):
            while not fatal.is_set():
                await anyio.sleep(0.02)
        r = await http.get("/health/ready")
        assert r.status_code == 503 and "checkpoint exploded" in r.json()["errors"]["h1"]
        p = assert_problem(await http.post("/api/predict/h1", content=make_body(0)), 503)
        assert "checkpoint exploded" in p["detail"]


async def test_without_on_fatal_a_model_that_fails_to_load_leaves_the_others_serving(
    tiny_model,
):
    """Regression (create_app without the CLI): the models after a failed one stayed "loading"
    for good, their callers told to retry shortly, forever."""

    def broken() -> InProcessClient:
        raise RuntimeError("checkpoint exploded")

    app = create_app({"broken": broken, "h1": lambda: fresh_client(tiny_model)})
    async with serving(app, ready=False) as http:
        with anyio.fail_after(30):
            while app.state.histoinfer.models["h1"].status == "loading":
                await anyio.sleep(0.02)
        r = await http.get("/health/ready")
        assert r.status_code == 503, r.text
        assert r.json()["models"] == {"broken": "failed", "h1": "ready"}
        assert "checkpoint exploded" in r.json()["errors"]["broken"]
        assert (await http.post("/api/predict/h1", content=make_body(0))).status_code == 200
        p = assert_problem(await http.post("/api/predict/broken", content=make_body(0)), 503)
        assert "checkpoint exploded" in p["detail"]


async def test_the_models_route_lists_every_model_its_status_and_metadata(tiny_model):
    """An evaluator coming from Triton found no model listing (``/api/models`` was a 404)."""
    loading = threading.Event()

    def broken() -> InProcessClient:
        raise RuntimeError("checkpoint exploded")

    def slow() -> InProcessClient:
        loading.wait(30)
        return fresh_client(tiny_model)

    app = create_app({"h1": fresh_client(tiny_model), "broken": broken, "slow": slow})
    try:
        async with serving(app, ready=False) as http:
            with anyio.fail_after(30):
                while app.state.histoinfer.models["broken"].status == "loading":
                    await anyio.sleep(0.02)
            r = await http.get("/api/models")
            assert r.status_code == 200
            listed = r.json()["models"]
            assert [(m["name"], m["status"]) for m in listed] == [
                ("h1", "ready"),
                ("broken", "failed"),
                ("slow", "loading"),
            ]
            meta = json.loads((await http.get("/api/metadata/h1")).text)
            assert listed[0]["metadata"] == meta and "error" not in listed[0]
            assert listed[1]["metadata"] is None and "checkpoint exploded" in listed[1]["error"]
            assert listed[2]["metadata"] is None
            assert (await http.head("/api/models")).status_code == 200
    finally:
        loading.set()


class KnownSlidesOnly(H1ServerModel):
    """Refuses tiles of slides it does not know, and answers only for tiles full of tissue:
    the server's made-up warm-up request is neither."""

    def prepare_sample(self, request: ModelRequest) -> Any:  # type: ignore[override]
        if not request.slide_name.startswith("TCGA-"):
            raise InvalidRequestError(f"unknown slide {request.slide_name!r}")
        return super().prepare_sample(request)


class MostlyTissueOnly(H1ServerModel):
    def postprocess(self, request: ModelRequest, output: Any, mode: Mode) -> ModelResponse:
        if request.tissue_ratio is None or request.tissue_ratio < 2:  # never, here
            raise InvalidRequestError("too little tissue")
        return super().postprocess(request, output, mode)


@pytest.mark.parametrize("kind", [KnownSlidesOnly, MostlyTissueOnly])
async def test_a_model_refusing_the_warm_up_request_is_warmed_up_and_served(
    tiny_model, kind, caplog
):
    """Regression: the warm-up's flat tile without a resolution went through the model's own
    prepare_sample and postprocess, and a model that refused it failed to load."""
    model = kind(tiny_model.checkpoint, tiny_model.assets)
    app = create_app({"h1": lambda: fresh_client(model)})
    with caplog.at_level(logging.WARNING, logger="histoinfer.server"):
        async with serving(app) as http:  # ready
            body = make_body(0, slide_name="TCGA-01", tissue_ratio=0.9)
            r = await http.post("/api/predict/h1", content=body)
            assert r.status_code == (200 if kind is KnownSlidesOnly else 422), r.text
    assert any("warm-up" in m and "refused" in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("cancel", [True, False], ids=["watched", "opted-out"])
@pytest.mark.parametrize("path", ["/api/predict/h1", "/api/predict/h1/batch"])
async def test_requests_in_flight_when_the_graceful_timeout_runs_out_get_503_closed(
    tiny_model, path, cancel
):
    """expire_in_flight (the CLI calls it just before the graceful timeout): every request in
    flight is answered 503 closed with Retry-After, not cut off by the server."""
    model, watch, gate = gated_model(tiny_model)
    app = create_app(fresh_client(model), warmup=False, cancel_on_disconnect=cancel)
    body = json.dumps([make_body(i) for i in range(16)]) if "batch" in path else make_body(0)
    async with serving(app) as http:
        state: ServerState = app.state.histoinfer
        answers: list[httpx.Response] = []

        async def call() -> None:
            answers.append(await http.post(path, content=body))

        await during_its_first_pass(call, watch, gate, state.expire_in_flight)
        p = assert_problem(answers[0], 503, "closed")
        assert "graceful timeout ran out" in p["detail"] and "retry-after" in answers[0].headers
        assert watch.calls == 1  # a batch stopped before its second pass
        assert not state.in_flight
        assert (await http.get("/health/ready")).status_code == 503


async def test_draining_refuses_new_requests(tiny_model):
    app = create_app(fresh_client(tiny_model))
    async with serving(app) as http:
        app.state.histoinfer.begin_drain()
        r = await http.post("/api/predict/h1", content=make_body(0))
        p = assert_problem(r, 503, "closed")
        assert "shutting down" in p["detail"] and "retry-after" in r.headers
        r = await http.get("/health/ready")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        assert (await http.get("/health/live")).status_code == 200


async def test_invocations_in_every_mode(tiny_model):
    client = fresh_client(tiny_model)
    async with serving(create_app(client)) as http:
        for mode, route in (
            ("prediction", "predict"),
            ("embedding", "embed"),
            ("prediction_with_embedding", "predict_with_embedding"),
        ):
            body = request_dict(4, model_name="h1", mode=mode)
            r = await http.post("/invocations", content=json.dumps(body))
            assert r.status_code == 200, r.text
            direct = await http.post(f"/api/{route}/h1", content=make_body(4))
            assert outputs_close(r.text, direct.text)
        r = await http.post("/invocations", content='{"model_name": "h1", "mode": "metadata"}')
        assert r.status_code == 200 and r.text == client.metadata()
        # A whole request beside the dispatch fields, as SPEC §4 writes every invocation body
        # (a SageMaker caller sends one envelope for every mode; it was refused): validated,
        # not computed.
        whole = json.dumps(request_dict(4, model_name="h1", mode="metadata"))
        r = await http.post("/invocations", content=whole)
        assert r.status_code == 200 and r.text == client.metadata()
        # Unknown fields are refused there too (they were ignored), and so is part of a tile's
        # request (naming what it lacks), or a whole one that is invalid.
        part = f'"image_data": "{request_dict(0)["image_data"][:40]}"'
        bad_x = json.dumps(request_dict(4, model_name="h1", mode="metadata", x=-3))
        for content, named in (
            ('{"model_name": "h1", "mode": "metadata", "junk": 1}', "junk"),
            (f'{{"model_name": "h1", "mode": "metadata", {part}}}', "slide_name"),
            (bad_x, "'x'"),
        ):
            p = assert_problem(await http.post("/invocations", content=content), 422)
            assert named in p["detail"], p["detail"]

        bad_mode = json.dumps(request_dict(0, model_name="h1", mode="classify"))
        p = assert_problem(
            await http.post("/invocations", content=bad_mode), 400, "unsupported-mode"
        )
        assert "'classify'" in p["detail"] and "prediction_with_embedding" in p["detail"]
        no_model = json.dumps(request_dict(0, mode="prediction"))
        p = assert_problem(await http.post("/invocations", content=no_model), 422)
        assert "model_name" in p["detail"]
        unknown = json.dumps(request_dict(0, model_name="h9", mode="prediction"))
        assert_problem(await http.post("/invocations", content=unknown), 404, "unknown-model")
        bad_x = json.dumps(request_dict(5, model_name="h1", mode="embedding", x=-3))
        p = assert_problem(await http.post("/invocations", content=bad_x), 422)
        assert "'x'" in p["detail"] and "(patch_idx=5)" in p["detail"]  # as /api/... words it
        extra = json.dumps(request_dict(0, model_name="h1", mode="embedding", colour="red"))
        p = assert_problem(await http.post("/invocations", content=extra), 422)
        assert "colour" in p["detail"]
        bulk = json.dumps(request_dict(0, model_name="h1", mode="prediction", bulk_rna=[1.0]))
        assert_problem(await http.post("/invocations", content=bulk), 400, "unsupported-mode")


async def test_invocations_name_a_mode_the_model_does_not_serve_as_the_caller_did(tiny_model):
    class EmbedOnly(H1ServerModel):
        modes = ("embed",)

    model = EmbedOnly(tiny_model.checkpoint, tiny_model.assets, "cpu")
    async with serving(create_app(fresh_client(model))) as http:
        body = json.dumps(request_dict(0, model_name="h1", mode="prediction"))
        p = assert_problem(await http.post("/invocations", content=body), 400, "unsupported-mode")
        assert "invocation mode 'prediction'" in p["detail"]
        assert "(supported: embedding, metadata)" in p["detail"]
        body = json.dumps(request_dict(0, model_name="h1", mode="embedding"))
        assert (await http.post("/invocations", content=body)).status_code == 200


async def test_batch_route_takes_objects_or_bodies(tiny_model):
    client = fresh_client(tiny_model)
    bodies = [make_body(i) for i in range(5)]
    expected = client.infer_batch(bodies, "embed")
    async with serving(create_app(client)) as http:
        objects = json.dumps([json.loads(b) for b in bodies])  # what a curl user sends
        r = await http.post("/api/embed/h1/batch", content=objects)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        got = [json.dumps(item) for item in r.json()]
        assert all(outputs_close(a, b) for a, b in zip(got, expected, strict=True))

        r = await http.post(
            "/api/embed/h1/batch",
            content=json.dumps(bodies),  # bodies as JSON strings, one response per line back
            headers={"content-type": "application/vnd.histoinfer.bodies+json",
                     "accept": "application/x-ndjson"},
        )  # fmt: skip
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = r.text.split("\n")
        assert lines[-1] == "" and len(lines) == 6
        assert all(outputs_close(a, b) for a, b in zip(lines[:-1], expected, strict=True))

        mixed = [bodies[0], '{"nope": 1}', bodies[2], make_body(3, x=-1)]
        with pytest.raises(InvalidRequestError) as in_process:
            client.infer_batch(mixed, "predict")
        r = await http.post("/api/predict/h1/batch", content=json.dumps(mixed))
        problem = assert_problem(r, 422)
        assert problem["detail"] == str(in_process.value)
        assert problem["positions"] == in_process.value.positions == [1, 3]

        r = await http.post("/api/predict/h1/batch", content='{"not": "a list"}')
        assert assert_problem(r, 422)["detail"] == (
            "invalid batch: the body must be a JSON list of requests (objects, or JSON "
            "strings), got an object"
        )
        r = await http.post("/api/predict/h1/batch", content="[{")
        assert "not valid JSON" in assert_problem(r, 422)["detail"]
        r = await http.post("/api/predict/h1/batch", content="[]")
        assert r.status_code == 200 and r.json() == []


async def test_metrics_read_the_client_stats(tiny_model):
    async with serving(create_app(fresh_client(tiny_model, max_queue=64))) as http:
        before = await scrape(http)

        async def one(i: int) -> None:
            assert (await http.post("/api/predict/h1", content=make_body(i))).status_code == 200

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(one, i)
        await http.post("/api/predict/h1", content="{bad")
        after = await scrape(http)
    key = ("h1", "predict")
    assert after["histoinfer_samples_total"][key] - before["histoinfer_samples_total"][key] == 6
    assert after["histoinfer_batch_size_count"][key] == after["histoinfer_batches_total"][key]
    assert after["histoinfer_batch_size_sum"][key] == after["histoinfer_samples_total"][key]
    assert after["histoinfer_model_ready"][("h1",)] == 1.0
    assert after["histoinfer_queue_depth"][key] == 0.0
    assert after["histoinfer_http_responses_total"][("h1", "predict", "200")] == 6
    assert after["histoinfer_http_responses_total"][("h1", "predict", "422")] == 1
    # Quantiles of what was measured; NaN where nothing was (0.0 read as zero latency).
    for quantiles in ("histoinfer_forward_seconds", "histoinfer_queue_wait_seconds"):
        assert math.isnan(before[quantiles][("h1", "predict", "0.99")]), quantiles
        assert after[quantiles][("h1", "predict", "0.99")] > 0, quantiles
        assert math.isnan(after[quantiles][("h1", "embed", "0.5")]), quantiles
    # Histograms of every wait and pass, for aggregating over replicas.
    waits, passes = "histoinfer_queue_wait_duration_seconds", "histoinfer_forward_duration_seconds"
    assert after[f"{waits}_count"][key] == after["histoinfer_samples_total"][key]
    assert after[f"{passes}_count"][key] == after["histoinfer_batches_total"][key]
    assert after[f"{passes}_sum"][key] == pytest.approx(
        after["histoinfer_forward_busy_seconds_total"][key]
    )
    for name in (waits, passes):
        counts = [v for k, v in after[f"{name}_bucket"].items() if k[:2] == key]
        assert counts == sorted(counts) and counts[-1] == after[f"{name}_count"][key]
        assert after[f"{name}_bucket"][(*key, "+Inf")] == counts[-1]
    assert key in after["histoinfer_errors_total"]
    # There before any deadline was missed, at 0: an expression over it reads 0, not no data.
    assert before["histoinfer_errors_by_kind_total"][("h1", "predict", "deadline")] == 0.0


async def test_a_failing_device_counts_no_batches_and_is_logged_once_with_its_traceback(
    tiny_model, caplog
):
    """An operator saw nothing in the log (the client got the message), and failed passes
    counted as batches: the documented alert (errors up, batches flat) could not fire."""

    def broken(batch: Any) -> None:
        raise RuntimeError("CUDA error: device lost")

    model, _ = hooked_model(tiny_model, broken)
    app = create_app(fresh_client(model), warmup=False)
    async with serving(app) as http:
        before = await scrape(http)
        named: list[str] = []
        with caplog.at_level("DEBUG", logger="histoinfer.server"):
            for i in range(3):
                r = await http.post("/api/predict/h1", content=make_body(i))
                assert_problem(r, 500, "model-execution")
                named.append(r.headers.get("x-request-id", ""))
        after = await scrape(http)
    key = ("h1", "predict")
    for name, grew in (("batches", 0), ("samples", 0), ("errors", 3)):
        total = f"histoinfer_{name}_total"
        assert after[total][key] - before[total][key] == grew, name
    # One line for three (throttled). At WARNING and above: an earlier test's in-process
    # `serve` may have left the histoinfer logger at INFO ("model 'h1' is ready").
    server_log = [r for r in caplog.records if r.name == "histoinfer.server"]
    [logged] = [r for r in server_log if r.levelno >= logging.WARNING]
    assert logged.levelname == "ERROR" and "POST /api/predict/h1 answered 500" in logged.message
    assert logged.exc_info is not None and "device lost" in caplog.text  # the traceback
    # The client can name the logged one to the operator: the ID its answer carried.
    assert f"(request {named[0]}):" in logged.message and len(named[0]) == 16
    assert logged.request_id == named[0]  # type: ignore[attr-defined]  # a JSON log's field
    # The two left out are named too, and said at DEBUG (they carried no ID until session 31).
    left_out = [r.message for r in server_log if r.levelno == logging.DEBUG]
    left_out = [m for m in left_out if "answered 500" in m]
    assert len(left_out) == 2
    assert all(f"(request {n}):" in m for m, n in zip(left_out, named[1:], strict=True))
    assert len(set(named)) == 3 and all(len(n) == 16 for n in named)


async def test_a_request_id_is_echoed_and_names_its_logged_error(tiny_model, caplog):
    def broken(batch: Any) -> None:
        raise RuntimeError("device lost")

    model, _ = hooked_model(tiny_model, broken)
    async with serving(create_app(fresh_client(model), warmup=False)) as http:
        ok = await http.get("/health/live", headers={"X-Request-ID": "trace-7"})
        assert ok.headers.get_list("x-request-id") == ["trace-7"]
        bad = await http.post("/api/predict/h1", content="{", headers={"X-Request-ID": "r-1"})
        assert bad.status_code == 422 and bad.headers.get_list("x-request-id") == ["r-1"]
        assert "x-request-id" not in (await http.get("/health/live")).headers  # none made up
        for junk in ("has space", "x" * 129):  # not echoed, nor put in a log line
            r = await http.get("/health/live", headers={"X-Request-ID": junk})
            assert "x-request-id" not in r.headers
        with caplog.at_level("WARNING", logger="histoinfer.server"):
            r = await http.post(
                "/api/predict/h1", content=make_body(0), headers={"X-Request-ID": "job-42"}
            )
        assert r.status_code == 500 and r.headers.get_list("x-request-id") == ["job-42"]
        assert "(request job-42):" in caplog.text


async def test_an_unhandled_error_names_its_request_in_the_log_and_the_answer(
    tiny_model, monkeypatch, caplog
):
    """A bug's answer is sent from outside the app's middleware: it carries the ID itself."""

    def bug(mode: str) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(app_module, "_mode", bug)
    app = create_app(fresh_client(tiny_model))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            with caplog.at_level("ERROR", logger="histoinfer.server"):
                for sent in ({}, {"X-Request-ID": "mine"}):
                    r = await http.post("/api/predict/h1", content=make_body(0), headers=sent)
                    p = assert_problem(r, 500)
                    assert "internal server error (ZeroDivisionError)" in p["detail"]
                    [named] = r.headers.get_list("x-request-id")
                    assert named == sent.get("X-Request-ID", named)
                    assert f"(request {named})" in caplog.records[-1].message


def test_the_log_throttle_says_how_many_it_left_out() -> None:
    now = [0.0]
    throttle = LogThrottle(every=60.0, clock=lambda: now[0])
    assert throttle.due("overloaded") == (0, 0.0)  # the first: logged
    assert throttle.due("overloaded") is None and throttle.due("overloaded") is None
    assert throttle.due("ModelExecutionError") == (0, 0.0)  # each kind on its own
    now[0] = 134.0
    # Logged, saying two were left out since the last line, 134 s ago (not "in the last 60 s").
    assert throttle.due("overloaded") == (2, 134.0)
    assert throttle.due("overloaded") is None


def test_refusals_of_different_kinds_are_throttled_apart(caplog) -> None:
    """A full queue and a server out of room for bodies are both 503 overloaded, but an
    operator tunes different limits: one line stood for both, quoting only the first (a user
    trial). The same kind with other figures is the same kind."""
    throttle = LogThrottle(every=60.0)
    request = Request({"type": "http", "method": "POST", "path": "/api/predict/h1", "headers": []})
    refusals = [
        OverloadedError("h1:predict: queue full (8 requests admitted); retry later"),
        OverloadedError("h1:predict: queue full (8 requests admitted); retry later"),
        OverloadedError(
            "the server holds 4000000 bytes of request bodies, and 201251 more of this one's do "
            "not fit in its limit of 4194304 bytes (--max-bodies-mb, create_app's max_held_bytes); "
            "retry later"
        ),
        OverloadedError(
            "the server holds 3990000 bytes of request bodies, and 201251 more of this one's do "
            "not fit in its limit of 4194304 bytes (--max-bodies-mb, create_app's max_held_bytes); "
            "retry later"
        ),
    ]
    with caplog.at_level("WARNING", logger="histoinfer.server"):
        for refusal in refusals:
            log_answer(request, refusal, Response(), throttle)
    # Another model's full queue (a name differing by a digit) is a kind of its own too.
    other = OverloadedError("h0:predict: queue full (8 requests admitted); retry later")
    # A model's deadline is one kind, whatever held each request (a burst's were logged as
    # four kinds in 0.4 s: a trial).
    missed = [
        deadline_exceeded("h1:predict", why)
        for why in (
            "it expired before the request was queued",
            "it was still waiting to be decoded",
            "3 other requests still queued, behind a batch out for 0.4 s",
            "its batch was still waiting for its thread",
        )
    ]
    with caplog.at_level("WARNING", logger="histoinfer.server"):
        for refusal in [other, *missed]:
            log_answer(request, refusal, Response(), throttle)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert "h1:predict: queue full" in lines[0] and "--max-bodies-mb" in lines[1]
    assert "h0:predict: queue full" in lines[2]
    assert "h1:predict: request not dispatched within its deadline" in lines[3]


async def scrape(http: httpx.AsyncClient) -> dict[str, dict[tuple[str, ...], float]]:
    """``/metrics`` as {sample name: {label values (le/quantile last): value}}."""
    r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = s.labels
            key = tuple(labels[k] for k in ("model", "mode", "kind", "status") if k in labels)
            key += tuple(labels[k] for k in ("le", "quantile") if k in labels)
            out.setdefault(s.name, {})[key] = s.value
    return out


async def test_openapi_documents_the_routes(tiny_model):
    async with serving(create_app(fresh_client(tiny_model))) as http:
        spec = (await http.get("/openapi.json")).json()
        paths = set(spec["paths"])
        assert {
            "/api/{mode}/{model}",
            "/api/{mode}/{model}/batch",
            "/api/metadata/{model}",
            "/invocations",
            "/health/ready",
            "/health/live",
            "/ping",
            "/metrics",
        } <= paths
        post = spec["paths"]["/api/{mode}/{model}"]["post"]
        body_schema = post["requestBody"]["content"]["application/json"]["schema"]
        assert "image_data" in body_schema["properties"]
        assert "application/problem+json" in post["responses"]["422"]["content"]
        # Every status the routes answer (408 and 415 were missing: a user trial).
        for route in ("/api/{mode}/{model}", "/api/{mode}/{model}/batch", "/invocations"):
            answers = spec["paths"][route]["post"]["responses"]
            assert {"400", "404", "408", "413", "415", "422", "500", "503"} <= set(answers)
        assert [p["name"] for p in post["parameters"]] == ["mode", "model"]
        for probe in ("/health/ready", "/ping"):  # what a load balancer must expect
            assert set(spec["paths"][probe]["get"]["responses"]) >= {"200", "503"}
        docs = await http.get("/docs")
        assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_the_single_tile_route_is_served_without_fastapis_route_handling(tiny_model):
    """Every request's route is a plain Starlette route (FastAPI's handling cost a sixth of
    the event loop's CPU a request); it precedes the APIRoute that documents it, so a POST
    there reaches it first."""
    from fastapi.routing import APIRoute
    from starlette.routing import Match

    app = create_app(fresh_client(tiny_model))
    scope = {"type": "http", "method": "POST", "path": "/api/predict/h1", "root_path": ""}
    served = next(r for r in app.router.routes if r.matches(scope)[0] is Match.FULL)
    assert not isinstance(served, APIRoute)
    child = served.matches(scope)[1]
    assert child["path_params"] == {"mode": "predict", "model": "h1"}
    assert child["route"] is served  # as FastAPI's routes do: middleware reads the template


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_create_app_refuses_a_body_timeout_that_is_no_time(tiny_model, timeout):
    """0 made the body watchdog sleep 0 s in a loop: the event loop spun at 100%."""
    refused = pytest.raises(ValueError, match="body_timeout must be more than 0 s")
    with fresh_client(tiny_model) as client, refused:
        create_app(client, body_timeout=timeout)


def test_create_app_needs_a_model():
    with pytest.raises(ValueError, match="at least one model"):
        create_app({})


async def test_the_warm_up_runs_on_the_device_thread(tiny_model):
    """Run on the loading worker thread, the warm-up would leave it an OpenMP team."""
    from concurrency_helpers import hooked_model

    from histoinfer.models.device_thread import device_thread

    idents: list[int] = []
    model, watch = hooked_model(tiny_model, lambda batch: idents.append(threading.get_ident()))
    async with serving(create_app(fresh_client(model))):
        pass
    assert watch.calls == 3  # one pass per mode
    assert set(idents) == {device_thread("cpu").ident}


async def test_an_app_runs_once_and_a_second_start_says_so(tiny_model):
    """Started again, it closed nothing and loaded nothing, and its readiness said "draining"
    for ever (a user trial, with a test fixture reusing the app)."""
    app = create_app(fresh_client(tiny_model))
    async with app.router.lifespan_context(app):
        pass
    with pytest.raises(RuntimeError, match=r"an app runs once: call create_app\(\) again"):
        async with app.router.lifespan_context(app):
            pass


async def test_a_mounted_app_whose_lifespan_never_ran_says_so(tiny_model):
    """Regression (an embedding trial): mounted in another app, whose lifespan does not run a
    mounted app's, it said "loading" for ever and logged nothing. Readiness and every route
    now say the lifespan has not run, and how to run it; run from the parent's, it serves."""
    from fastapi import FastAPI

    histo = create_app(fresh_client(tiny_model))
    parent = FastAPI()
    parent.mount("/histo", histo)
    transport = httpx.ASGITransport(app=parent)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        ready = await http.get("/histo/health/ready")
        assert ready.status_code == 503
        assert ready.json()["models"] == {"h1": "not started"}
        assert "lifespan has not run" in ready.json()["reason"]
        answer = await http.post("/histo/api/predict/h1", content=make_body(0))
        assert answer.status_code == 503
        assert "the app's lifespan has not run" in answer.json()["detail"]
        assert "'Embedding the app'" in answer.json()["detail"]
        async with histo.router.lifespan_context(histo):  # as a parent's lifespan would
            with anyio.fail_after(30):
                while (await http.get("/histo/health/ready")).status_code != 200:
                    await anyio.sleep(0.02)
            answer = await http.post("/histo/api/predict/h1", content=make_body(0))
            assert answer.status_code == 200


async def test_a_lifespan_started_twice_at_once_says_so(tiny_model):
    """include_router() runs an included app's lifespan itself: run by hand too, it started
    twice at once, and the refusal said the app had run and closed its clients."""
    app = create_app(fresh_client(tiny_model))
    async with app.router.lifespan_context(app):
        with pytest.raises(RuntimeError, match=r"already running: started twice\?.*mount the app"):
            async with app.router.lifespan_context(app):
                pass
