"""HttpClient against a real server on loopback (uvicorn in a thread of this process).

Threads and loops, the ``session`` parameter, retries (connection errors and 503, never 4xx
or 500), closing, and that importing it leaves torch out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import pickle
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
import sniffio
from helpers import make_body, outputs_close, serving
from PIL import Image
from test_server_support import FlakyModel, ThreadServer, free_port, thread_server, white_body

import histoinfer.clients.http as http_module
from histoinfer import Client, HttpClient, InProcessClient
from histoinfer.errors import (
    ClientClosedError,
    InferenceError,
    InvalidRequestError,
    ModelExecutionError,
    OverloadedError,
)
from histoinfer.server import create_app

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[ThreadServer]:
    flaky = FlakyModel(tiny_model.checkpoint, tiny_model.assets, "cpu")
    app = create_app(
        {
            "h1": InProcessClient(tiny_model, max_batch_size=16, overload="reject"),
            "flaky": InProcessClient(flaky, max_batch_size=16, overload="reject"),
        }
    )
    with thread_server(app) as s:
        yield s


class Counter:
    """An httpx event hook counting the requests a session sends."""

    def __init__(self) -> None:
        self.n = 0

    async def __call__(self, request: httpx.Request) -> None:
        self.n += 1


def test_importing_it_leaves_torch_out():
    code = (
        "import sys, histoinfer\n"
        "from histoinfer import HttpClient\n"
        "HttpClient('http://127.0.0.1:1').close()\n"
        "heavy = [m for m in ('torch', 'histoinfer.models', 'histoinfer.batching', 'fastapi')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_it_is_a_client():
    with HttpClient("http://127.0.0.1:1") as client:
        assert isinstance(client, Client)


def test_wire_constants_match_the_server():
    from histoinfer.server import app

    assert http_module.BATCH_BODIES_JSON == app.BATCH_BODIES_JSON
    assert http_module.NDJSON == app.NDJSON
    assert http_module.BYTES_KEY == app.BYTES_KEY
    assert http_module.STR_KEY == app.STR_KEY
    assert http_module.CHECKPOINT_HEADER == app.CHECKPOINT_HEADER


class Swapped(httpx.AsyncBaseTransport):
    """Sends each request to ``apps[0]`` until :attr:`swap` is set, then to ``apps[1]``: a
    server restarted on another checkpoint, or a load balancer's other replica."""

    def __init__(self, *apps: Any) -> None:
        self.transports = [httpx.ASGITransport(app=a) for a in apps]
        self.swap = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.transports[self.swap].handle_async_request(request)


def with_checkpoint_sha256(model: Any, sha256: str) -> Any:
    checkpoint = dataclasses.replace(model.checkpoint, sha256=sha256)
    return type(model)(checkpoint, model.assets, "cpu")


@pytest.mark.anyio
async def test_answers_from_another_checkpoint_are_warned_of_or_refused_when_pinned(
    tiny_model: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (a chaos trial): a server restarted on another checkpoint mid-job mixed
    the new model's answers into the job unsaid (884 of 1,500). Every inference answer names
    its checkpoint; a client warns when it changes, and one pinned to a checkpoint refuses
    any other's answer (or one that does not say)."""
    old_sha, new_sha = tiny_model.checkpoint.sha256, "f" * 64
    swapped = with_checkpoint_sha256(tiny_model, new_sha)
    apps = [create_app({"h1": InProcessClient(m)}, warmup=False) for m in (tiny_model, swapped)]
    async with serving(apps[0]) as http, serving(apps[1]):
        single = await http.post("/api/predict/h1", content=make_body(0))
        batch = await http.post("/api/embed/h1/batch", content=json.dumps([make_body(1)]))
        assert single.headers["histoinfer-checkpoint-sha256"] == old_sha
        assert batch.headers["histoinfer-checkpoint-sha256"] == old_sha
        assert "histoinfer-checkpoint-sha256" not in (await http.get("/api/metadata/h1")).headers

        transport = Swapped(*apps)
        caplog.set_level(logging.WARNING, logger="histoinfer.http")
        async with HttpClient("http://asgi", transport=transport, retries=0) as free:
            with anyio.fail_after(30):
                await free.predict_async(make_body(0))
                transport.swap = True
                await free.predict_async(make_body(1))
                await free.embed_batch_async([make_body(2)])  # the same again: said once
                for i in range(6):  # a load balancer alternating: no new change (a review)
                    transport.swap = not transport.swap
                    await free.predict_async(make_body(i))
        said = [r.getMessage() for r in caplog.records if "now answers" in r.getMessage()]
        assert said == [
            f"model 'h1' at http://asgi now answers from checkpoint {new_sha[:12]}…, not only "
            f"{old_sha[:12]}… as before: this client's results mix them (pass "
            "checkpoint_sha256= to refuse any other)"
        ]

        transport.swap = False
        pinned = HttpClient("http://asgi", transport=transport, checkpoint_sha256=old_sha)
        async with pinned:
            with anyio.fail_after(30):
                assert json.loads(await pinned.predict_async(make_body(3)))["patch_idx"] == 3
                transport.swap = True
                for call in (pinned.predict_async, pinned.predict_batch_async):
                    with pytest.raises(InferenceError, match="answered from checkpoint") as e:
                        await call(make_body(4) if call == pinned.predict_async else [make_body(4)])
                    assert f"not checkpoint {old_sha[:12]}…" in str(e.value)
                    assert not e.value.retryable
        assert pinned.checkpoint_sha256 == old_sha
        with pytest.raises(AttributeError):  # read-only: a pin set later was never checked
            pinned.checkpoint_sha256 = None  # type: ignore[misc]


def test_an_answer_that_does_not_name_its_checkpoint_is_refused_only_when_pinned() -> None:
    ok = {"slide_name": "S1", "x": 0, "y": 0, "patch_idx": 0, "output": [0.5]}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=ok))
    with HttpClient("http://h", transport=transport) as free:
        assert json.loads(free.predict(make_body(0)))["output"] == [0.5]
    with (
        HttpClient("http://h", transport=transport, checkpoint_sha256="0" * 64) as pinned,
        pytest.raises(InferenceError, match="answered from no checkpoint"),
    ):
        pinned.predict(make_body(0))


@pytest.mark.parametrize("sha", ["0" * 63, "A" * 64, 12, "sha256:" + "0" * 64])
def test_a_pinned_checkpoint_must_be_a_sha256(sha: Any) -> None:
    with pytest.raises(ValueError, match="checkpoint_sha256 must be the 64 lowercase hex"):
        HttpClient("http://h", checkpoint_sha256=sha)


def test_sync_calls_from_many_threads(server, reference):
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    with HttpClient(server.base_url) as client:

        def worker(t: int) -> None:
            try:
                for i in range(t * 3, t * 3 + 3):
                    results[i] = client.predict(make_body(i))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors
    expected = reference.predict_batch([make_body(i) for i in range(18)])
    for i in range(18):
        assert json.loads(results[i])["patch_idx"] == i
        assert outputs_close(results[i], expected[i])


def test_one_client_serves_many_loops_in_many_threads(server, reference):
    """Each thread runs its own asyncio or trio loop: every loop gets its own pool."""
    client = HttpClient(server.base_url)
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    async def slide(first: int) -> None:
        async def one(i: int) -> None:
            results[i] = await client.embed_async(make_body(i))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(first, first + 4):
                    tg.start_soon(one, i)

    def thread(first: int, backend: str) -> None:
        try:
            anyio.run(slide, first, backend=backend)
        except BaseException as exc:
            errors.append(exc)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        threads = [
            threading.Thread(target=thread, args=(4 * k, ("asyncio", "trio")[k % 2]))
            for k in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert client._pools == {}  # each loop's pool was closed as its loop ended
        client.close()
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    expected = reference.embed_batch([make_body(i) for i in range(16)])
    assert all(outputs_close(results[i], expected[i]) for i in range(16))


@pytest.mark.anyio
async def test_async_calls_and_the_session_parameter(server, reference):
    body = make_body(5)
    expected = reference.predict_with_embedding_batch([body])[0]
    counter = Counter()
    async with HttpClient(server.base_url) as client:
        assert outputs_close(await client.predict_with_embedding_async(body), expected)
        # The session's own 1 µs timeout would fail every request: HttpClient's applies.
        hooks = {"request": [counter]}
        async with httpx.AsyncClient(timeout=1e-6, event_hooks=hooks) as session:
            got = await client.predict_with_embedding_async(body, session=session)
            assert outputs_close(got, expected)
            assert counter.n == 1  # sent through the caller's session
        with pytest.raises(TypeError, match=r"httpx\.AsyncClient"):
            await client.predict_async(body, session=object())


@pytest.mark.anyio
async def test_4xx_and_500_are_never_retried(server):
    counter = Counter()
    async with (
        httpx.AsyncClient(event_hooks={"request": [counter]}) as session,
        HttpClient(server.base_url, retries=5, backoff=0.01) as client,
        HttpClient(server.base_url, "flaky", retries=5, backoff=0.01) as flaky,
        HttpClient(server.base_url, "h9", retries=5, backoff=0.01) as unknown,
    ):
        with pytest.raises(InvalidRequestError, match="missing required field") as bad:
            await client.predict_async("{}", session=session)
        assert counter.n == 1
        with pytest.raises(InvalidRequestError, match="unknown model 'h9'") as unknown_model:
            await unknown.embed_async(make_body(0), session=session)
        assert counter.n == 2
        with pytest.raises(ModelExecutionError, match="white tile") as failed:
            await flaky.predict_async(white_body(), session=session)
        assert counter.n == 3
        # Each error carries the status its answer did (the 404 is no 422), and none of
        # them would succeed if sent again.
        answered = [(e.value.http_status, e.value.retryable) for e in (bad, unknown_model, failed)]
        assert answered == [(422, False), (404, False), (500, False)]
        # The flaky model fails only the white tile; its batch neighbours succeed.
        assert json.loads(await flaky.embed_async(make_body(1), session=session))["patch_idx"] == 1


@pytest.mark.anyio
async def test_connection_errors_are_retried_then_reported():
    port = free_port()  # nothing listens there
    counter = Counter()
    async with (
        httpx.AsyncClient(event_hooks={"request": [counter]}) as session,
        HttpClient(f"http://127.0.0.1:{port}", retries=3, backoff=0.01) as client,
    ):
        with pytest.raises(InferenceError, match="after 4 attempts: cannot reach") as err:
            await client.predict_async(make_body(0), session=session)
        assert counter.n == 4
        assert isinstance(err.value.__cause__, httpx.ConnectError)
        assert err.value.retryable  # a server out of reach may be back later
    url = f"http://127.0.0.1:{port}/api/metadata/h1"
    with (
        HttpClient(f"http://127.0.0.1:{port}", retries=2, backoff=0.01) as client,
        pytest.raises(InferenceError, match="after 3 attempts") as sync_err,
    ):
        client.metadata()
    # Worded alike, sync or async, on asyncio or trio (each library words a refusal its own
    # way: "[Errno 111] Connection refused", "All connection attempts failed", ...).
    refused = "cannot reach the server (ConnectError: Connection refused)"
    assert str(sync_err.value) == f"GET {url} failed after 3 attempts: {refused}"
    assert str(err.value).endswith(f"failed after 4 attempts: {refused}")


@pytest.mark.parametrize(
    ("raised", "words", "said"),
    [
        (httpx.ReadTimeout, "", "no answer within 5 s (ReadTimeout)"),
        (httpx.WriteTimeout, "timed out", "could not send the request within 5 s (WriteTimeout:"),
        (httpx.ConnectTimeout, "", "could not connect within 5 s (ConnectTimeout)"),
        (httpx.ConnectError, "refused", "cannot reach the server (ConnectError: refused)"),
        (httpx.ReadError, "reset", "the connection was lost before the answer (ReadError: reset)"),
        (
            httpx.RemoteProtocolError,
            "peer closed",
            "the connection was lost before the answer (RemoteProtocolError: peer closed)",
        ),
    ],
)
def test_a_failed_request_says_which_step_failed(
    raised: type[httpx.HTTPError], words: str, said: str
) -> None:
    """Regression (a chaos trial): a reset after the request went out said "cannot reach the
    server", a request that could not be sent said "no answer", and an async timeout said
    "(ReadTimeout: )", httpx's async timeouts having no words."""

    def fail(request: httpx.Request) -> httpx.Response:
        # Made here: an instance made by the parametrization, raised, would hold its request
        # for the whole session (the tests counting live requests below see it).
        raise raised(words)

    transport = httpx.MockTransport(fail)
    with (
        HttpClient("http://h", transport=transport, retries=0, timeout=5) as client,
        pytest.raises(InferenceError) as info,
    ):
        client.predict(make_body(0))
    assert f"failed after 1 attempt: {said}" in str(info.value)
    assert info.value.retryable


def test_a_password_in_the_url_is_shown_nowhere(caplog):
    """httpx sends a URL's user and password as basic auth; the client's repr, its
    connection errors and its retry log showed the password (into tracebacks and logs)."""
    port = free_port()  # nothing listens there
    caplog.set_level(logging.DEBUG, logger="histoinfer")
    with HttpClient(f"http://user:s3cret@127.0.0.1:{port}", retries=1, backoff=0.01) as client:
        assert repr(client) == f"<HttpClient 'h1' at http://127.0.0.1:{port}>"
        with pytest.raises(InferenceError, match="cannot reach the server") as err:
            client.metadata()
    assert "s3cret" not in str(err.value) and f"GET http://127.0.0.1:{port}/api/" in str(err.value)
    assert "s3cret" not in repr(client)
    transport = httpx.MockTransport(lambda request: httpx.Response(503))
    with (
        HttpClient("http://user:s3cret@h", transport=transport, retries=1, backoff=0.01) as c,
        pytest.raises(InferenceError),
    ):
        c.metadata()
    assert caplog.records and not any("s3cret" in r.getMessage() for r in caplog.records)
    for refused in ("ftp://user:s3cret@h", "http://user:s3cret@"):  # and in the refusals
        with pytest.raises(ValueError, match="http:// or https:// URL") as bad:
            HttpClient(refused)
        assert "s3cret" not in str(bad.value)


@pytest.mark.timeout(60)
def test_a_live_client_still_answers_at_exit() -> None:
    """A dropped client's connections are closed by a finalizer, but not at exit: there it
    closed a live client under an atexit handler registered before it (a review: httpx's
    "Cannot send a request, as the client has been closed")."""
    script = """
import atexit
import httpx
atexit.register(lambda: print("at exit:", client.metadata(), flush=True))
from histoinfer import HttpClient
answer = lambda request: httpx.Response(200, json={"name": "x"})
client = HttpClient("http://h", transport=httpx.MockTransport(answer), retries=0)
client.metadata()
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0 and done.stdout == 'at exit: {"name":"x"}\n', done.stderr


def test_a_client_dropped_without_close_closes_its_connections(server):
    """Regression (a soak trial): each HttpClient dropped without close() left its sync
    connections to the garbage collector, a ResourceWarning for each socket."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            client = HttpClient(server.base_url)
            json.loads(client.predict(make_body(i)))
            del client
            gc.collect()
    unclosed = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == [], [str(w.message) for w in unclosed]


def _raised(error: BaseException, *under: BaseException) -> httpx.ConnectError:
    """httpx's ConnectError raised from ``error``, itself raised from each of ``under``."""
    if under:  # one reason, or several (trio's group of one per address)
        error.__cause__ = under[0] if len(under) == 1 else ExceptionGroup("failed", list(under))
    outer = httpx.ConnectError(str(error))
    outer.__cause__ = error
    return outer


def test_only_a_connection_errors_own_words_replace_the_libraries():
    refused = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 9)")
    assert http_module._os_reason(_raised(OSError("All attempts failed"), refused)) == (
        "Connection refused"
    )
    # A name that does not resolve, a refused certificate, or two addresses failing in two
    # ways keep their own words (a resolver's -2 read "Unknown error -2").
    unresolved = socket.gaierror(-2, "Name or service not known")
    certificate = ssl.SSLCertVerificationError(1, "certificate verify failed")
    unreachable = OSError(101, "Network is unreachable")
    for error in (
        _raised(unresolved),
        _raised(certificate),
        _raised(OSError("all failed"), refused, ConnectionResetError(104, "reset")),
        _raised(OSError("all failed"), unreachable),
    ):
        assert http_module._os_reason(error) is None


@pytest.mark.anyio
async def test_503_is_retried_until_the_server_is_ready(tiny_model):
    """A server still loading answers 503 + Retry-After; the client waits and retries."""
    loaded = threading.Event()
    statuses: list[int] = []

    def load() -> InProcessClient:
        loaded.wait(30)
        return InProcessClient(tiny_model, overload="reject")

    async def on_response(response: httpx.Response) -> None:
        statuses.append(response.status_code)
        if len(statuses) == 3:
            loaded.set()

    app = create_app({"h1": load}, warmup=False)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with (
                httpx.AsyncClient(
                    transport=transport, event_hooks={"response": [on_response]}
                ) as session,
                HttpClient("http://asgi", retries=500, backoff=0.01, max_backoff=0.01) as client,
            ):
                with anyio.fail_after(30):
                    got = await client.embed_async(make_body(2), session=session)
    finally:
        loaded.set()
    assert json.loads(got)["patch_idx"] == 2
    assert statuses[-1] == 200 and set(statuses[:-1]) == {503} and len(statuses) > 3


@pytest.mark.anyio
@pytest.mark.parametrize("trained", [False, True])
async def test_an_untrained_models_answers_say_so_and_the_client_warns_once(
    tiny_model: Any, trained: bool, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """In-process users are warned that a reference checkpoint is untrained; an HttpClient
    user, whose server's log is not theirs, heard nothing (its answers said nothing). Once a
    process: a notebook re-running the cell that makes its client heard it each time."""
    monkeypatch.setattr(http_module, "_announced", set())
    assets = tiny_model.assets.model_copy(update={"trained": trained})
    model = type(tiny_model)(tiny_model.checkpoint, assets, "cpu")
    app = create_app({"h1": InProcessClient(model)}, warmup=False)
    caplog.set_level(logging.WARNING, logger="histoinfer.untrained")
    async with serving(app) as http:
        single = await http.post("/api/predict/h1", content=make_body(0))
        batch = await http.post("/api/embed/h1/batch", content=json.dumps([make_body(1)]))
        transport = httpx.ASGITransport(app=app)
        async with HttpClient("http://asgi", transport=transport, retries=0) as client:
            caplog.clear()
            with anyio.fail_after(30):
                await client.predict_async(make_body(2))
                await client.predict_with_embedding_async(make_body(3))
        async with HttpClient("http://asgi", transport=transport, retries=0) as again:
            with anyio.fail_after(30):
                await again.predict_async(make_body(4))
    assert single.status_code == batch.status_code == 200
    said = [r.getMessage() for r in caplog.records if r.name == "histoinfer.untrained"]
    if trained:
        assert (
            "histoinfer-trained" not in single.headers and "histoinfer-trained" not in batch.headers
        )
        assert said == []
    else:
        assert (
            single.headers["histoinfer-trained"] == batch.headers["histoinfer-trained"] == "false"
        )
        assert len(said) == 1 and "UNTRAINED" in said[0] and "'h1' at http://asgi" in said[0]


def test_retry_policy_honours_retry_after_capped():
    client = HttpClient("http://127.0.0.1:1", retries=2, backoff=0.5, max_backoff=4.0)
    request = httpx.Request("POST", "http://127.0.0.1:1/api/predict/h1")
    problem = {"type": "https://histoinfer.dev/problems/overloaded", "title": "Overloaded",
               "status": 503, "detail": "queue full; retry later"}  # fmt: skip

    def answer(status: int, retry_after: str | None = None) -> httpx.Response:
        headers = {"content-type": "application/problem+json"}
        if retry_after is not None:
            headers["retry-after"] = retry_after
        return httpx.Response(status, headers=headers, json=problem, request=request)

    attempt = http_module._Attempt(client, "POST", str(request.url))
    assert 3.0 <= attempt.answered(answer(503, "3")) <= 4.0  # capped at 4 of 4.5
    # Capped under Retry-After: spread below the cap, not all at it (they came back together).
    assert 4.0 * 2 / 3 <= attempt.answered(answer(503, "60")) <= 4.0
    with pytest.raises(OverloadedError, match="queue full; retry later"):
        attempt.answered(answer(503, "1"))  # retries exhausted: the mapped error
    fresh = http_module._Attempt(client, "POST", str(request.url))
    assert 0.25 <= fresh.answered(answer(502)) <= 0.5  # no Retry-After: backoff with jitter
    assert 0.5 <= fresh.answered(answer(504)) <= 1.0
    assert http_module._retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert http_module._retry_after("soon") is None
    client.close()


def test_callers_refused_together_do_not_retry_together():
    """Retry-After: 1 brought every refused caller back at one instant, wave after wave (a
    user trial: 5 calls within 25 ms at 0.3, 1.3, 2.3 and 3.3 s). Never before the server's
    time; spread over half as much again."""
    client = HttpClient("http://127.0.0.1:1", retries=3, backoff=0.1, max_backoff=10.0)
    request = httpx.Request("POST", "http://127.0.0.1:1/api/predict/h1")
    busy = httpx.Response(503, headers={"retry-after": "1"}, content=b"busy", request=request)
    delays = [
        http_module._Attempt(client, "POST", str(request.url)).answered(busy) for _ in range(200)
    ]
    assert min(delays) >= 1.0 and max(delays) <= 1.5
    assert max(delays) - min(delays) > 0.3  # spread, not one instant (P(fail) ~ 1e-60)
    client.close()


def test_errors_without_problem_json_keep_their_status(server):
    request = httpx.Request("GET", server.base_url)
    html = httpx.Response(502, text="<html>bad gateway</html>", request=request)
    error = http_module._error_from(html)
    assert (
        type(error) is InferenceError and "HTTP 502" in str(error) and "bad gateway" in str(error)
    )
    error = http_module._error_from(httpx.Response(413, text="too big", request=request))
    assert isinstance(error, InvalidRequestError)


def test_stats_from_a_newer_server_with_more_fields_are_read() -> None:
    """A client of this version against a server that reports fields it does not know (this
    version's server broke the last version's client.stats() so: a review)."""
    from histoinfer.batching import BatchStats

    stats = BatchStats()
    stats.record_batch(2, [0.001, 0.002], 0.01)
    sent = json.loads(json.dumps({**stats.snapshot().as_dict(), "a_new_field": [1, 2]}))
    snapshot = http_module._snapshot(sent)
    assert snapshot == stats.snapshot() and snapshot.batch_size_histogram == {2: 1}


def test_an_error_carries_its_answers_request_id(server):
    """What the caller quotes to whoever reads the server's log."""
    client = HttpClient(server.base_url, "h1", headers={"X-Request-ID": "notebook-3"})
    with client, pytest.raises(InvalidRequestError) as info:
        client.predict("{")
    assert info.value.request_id == "notebook-3"
    request = httpx.Request("GET", server.base_url)
    made = httpx.Response(500, text="boom", headers={"x-request-id": "ab12"}, request=request)
    assert http_module._error_from(made).request_id == "ab12"
    assert http_module._error_from(httpx.Response(500, request=request)).request_id is None


def test_batches_go_through_the_batch_route(server, reference):
    bodies = [make_body(i) for i in range(5)]
    with HttpClient(server.base_url) as client:
        got = client.embed_batch(bodies)
        assert client.predict_batch([]) == []
    assert all(outputs_close(a, b) for a, b in zip(got, reference.embed_batch(bodies), strict=True))


def test_stats_are_the_servers_in_process_stats(tiny_model):
    """``HttpClient.stats()`` (SPEC §5: every backend) gives what the server's client gives."""
    served = InProcessClient(tiny_model, max_batch_size=16, overload="reject")
    with thread_server(create_app({"h1": served}, warmup=False)) as s:
        with HttpClient(s.base_url) as client:
            client.predict(make_body(0))
            client.embed_batch([make_body(i) for i in range(3)])
            with pytest.raises(InvalidRequestError):
                client.predict(make_body(1, x=-1))
            remote = client.stats()
        local = served.stats()
        assert remote == local
        assert remote["predict"].samples == 1 and remote["embed"].samples == 3
        assert remote["embed"].batch_size_histogram == {3: 1}


@pytest.mark.anyio
async def test_a_closed_client_refuses_every_call(server):
    client = HttpClient(server.base_url)
    assert json.loads(client.metadata())["name"] == "h1"
    await client.aclose()
    assert client.closed
    for call in (
        lambda: client.predict(make_body(0)),
        lambda: client.embed_batch([make_body(0)]),
        client.metadata,
    ):
        with pytest.raises(ClientClosedError, match="the client is closed"):
            call()
    with pytest.raises(ClientClosedError, match=r"closed \(for good: make a new client") as e:
        await client.embed_async(make_body(0))
    assert not e.value.retryable  # unlike a draining server's "closed" answer
    with HttpClient(server.base_url) as sync_client:
        sync_client.embed(make_body(0))
    with pytest.raises(ClientClosedError):
        sync_client.embed(make_body(0))
    client.close()  # closing twice is fine


def test_a_body_over_the_limit_is_refused_with_413_over_a_real_socket(tiny_model):
    app = create_app(InProcessClient(tiny_model, overload="reject"), max_body_bytes=256 * 1024)
    big = make_body(0, slide_name="s" * (4 * 1024 * 1024))
    counter = Counter()
    with thread_server(app) as small, HttpClient(small.base_url, retries=2) as client:
        with pytest.raises(InvalidRequestError, match="262144"):
            client.predict(big)
        with pytest.raises(InvalidRequestError, match="262144"):
            client.embed_batch([make_body(1), big])

        async def through_session() -> None:
            async with httpx.AsyncClient(event_hooks={"request": [counter]}) as session:
                with pytest.raises(InvalidRequestError, match="262144"):
                    await client.embed_async(big, session=session)

        anyio.run(through_session)
        assert counter.n == 1  # a 413 is final: not retried
        assert json.loads(client.embed(make_body(2)))["patch_idx"] == 2


def until_closed(conn: socket.socket, within: float) -> bytes:
    """All the server sends until it closes the connection: a timeout if it keeps it open."""
    conn.settimeout(within)
    received = b""
    while chunk := conn.recv(65536):
        received += chunk
    return received


def one_response(conn: socket.socket) -> bytes:
    """One whole response (headers and its Content-Length of body) read from ``conn``."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += conn.recv(65536) or b"<closed>"
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += conn.recv(65536) or b"<closed>"
    return head + b"\r\n\r\n" + body


POST_HEAD = b"POST /api/predict/h1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_body_declared_over_the_limit_but_never_sent_gets_its_413_at_once_and_a_close(
    tiny_model,
):
    """A client that declares more than it sends: the server drains while the body keeps
    coming, then answers and closes the connection (the body's rest would be read as the next
    request). Until session 27 it waited the whole 5 s drain for a body that had stopped."""
    app = create_app(InProcessClient(tiny_model, overload="reject"), max_body_bytes=1024)
    with (
        thread_server(app) as small,
        socket.create_connection(("127.0.0.1", small.port), timeout=20) as conn,
    ):
        started = time.monotonic()
        conn.sendall(POST_HEAD + b"Content-Length: 99999999999\r\n\r\n{}")
        answer = until_closed(conn, within=10)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"\r\nconnection: close\r\n" in answer.lower(), answer[:400]
        assert time.monotonic() - started < 4


def test_a_body_that_stalls_gets_its_408_and_its_connection_closed(tiny_model):
    """Regression (a user trial): the 408 left the connection open, holding the unread body's
    place, and a byte sent after it kept the connection open with no timeout at all."""
    app = create_app(InProcessClient(tiny_model), warmup=False, body_timeout=0.5)
    with (
        thread_server(app) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=20) as conn,
    ):
        conn.sendall(POST_HEAD + b"Content-Length: 1000\r\n\r\n{")
        answer = until_closed(conn, within=15)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"\r\nconnection: close\r\n" in answer.lower(), answer[:400]


def test_a_body_over_the_limit_sent_whole_keeps_its_connection(tiny_model):
    """Drained to its end, the body leaves the connection ready for the next request."""
    app = create_app(InProcessClient(tiny_model), warmup=False, max_body_bytes=1024)
    with (
        thread_server(app) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=20) as conn,
    ):
        conn.sendall(POST_HEAD + b"Content-Length: 2000\r\n\r\n" + b" " * 2000)
        answer = one_response(conn)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"connection: close" not in answer.lower(), answer[:400]
        conn.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert one_response(conn).startswith(b"HTTP/1.1 200"), "the connection was not kept"


# -- max_in_flight -------------------------------------------------------------------------


class PeakCounter:
    """An ASGI app that answers every request after ``delay`` s, counting those in progress.

    A request stops counting before its answer is sent, so the count never runs ahead of the
    client's own: a peak above ``max_in_flight`` is the client's doing.
    """

    def __init__(self, delay: float = 0.05) -> None:
        self.delay = delay
        self.now = 0
        self.peak = 0
        self.set_cookie: bytes | None = None  # sent with every answer while set
        self.cookies: list[bytes | None] = []  # each request's Cookie header

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.cookies.append(dict(scope["headers"]).get(b"cookie"))
        try:
            while (await receive()).get("more_body"):
                pass
            await anyio.sleep(self.delay)
        finally:
            self.now -= 1
        headers = [] if self.set_cookie is None else [(b"set-cookie", self.set_cookie)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})


@pytest.fixture(scope="module")
def counting_server() -> Iterator[tuple[ThreadServer, PeakCounter]]:
    app = PeakCounter()
    with thread_server(app) as s:
        yield s, app


@contextlib.contextmanager
def answering_after(app: PeakCounter, seconds: float) -> Iterator[None]:
    """The counting server answers after ``seconds`` for the block (then as before)."""
    app.delay = seconds
    try:
        yield
    finally:
        app.delay = 0.05


def predicting_into(client: HttpClient, results: list[object]) -> Callable[[], None]:
    """A thread's target: one ``predict``, its response (or exception) recorded."""

    def call() -> None:
        try:
            results.append(client.predict(make_body(0)))
        except Exception as exc:  # recorded, to be asserted on
            results.append(exc)

    return call


def test_close_lets_the_calls_in_flight_finish(counting_server):
    """SPEC §5: closing finishes the work in flight and refuses new calls (before, close()
    shut the pools under them: ReadError, or ClientClosedError after a retry)."""
    server, app = counting_server
    with answering_after(app, 0.3):
        client = HttpClient(server.base_url, retries=0)
        results: list[object] = []
        threads = [threading.Thread(target=predicting_into(client, results)) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while app.now < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.now == 3
        client.close()  # returns once they are done
        assert results == ['{"ok": true}'] * 3
        with pytest.raises(ClientClosedError):
            client.predict(make_body(0))
        for t in threads:
            t.join(10)


@pytest.mark.anyio
async def test_aclose_lets_the_calls_in_flight_finish(counting_server):
    server, app = counting_server
    with answering_after(app, 0.3):
        client = HttpClient(server.base_url, retries=0)
        results: list[object] = []

        async def call() -> None:
            results.append(await client.predict_async(make_body(0)))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(call)
                while app.now < 5:
                    await anyio.sleep(0.01)
                await client.aclose()
                assert results == ['{"ok": true}'] * 5
                if sniffio.current_async_library() == "asyncio":  # no task outlives it
                    names = {task.get_name() for task in asyncio.all_tasks()}
                    assert "histoinfer-http-pool" not in names, names
        with pytest.raises(ClientClosedError):
            await client.predict_async(make_body(0))


@pytest.mark.anyio
async def test_close_on_a_running_loop_lets_every_call_in_flight_finish(counting_server):
    """A notebook cell's ``with client:``: close() cannot wait on the loop whose calls it
    would wait for. It returns at once, as InProcessClient's does, and the calls in flight, on
    this loop and on other threads, finish; the pools close after the last one. (Before, it
    closed the pools under them: each failed with ClientClosedError.)"""
    server, app = counting_server
    with answering_after(app, 0.3):
        client = HttpClient(server.base_url, retries=0)
        results: list[object] = []

        async def async_call() -> None:
            try:
                results.append(await client.predict_async(make_body(0)))
            except Exception as exc:
                results.append(exc)

        threads = [threading.Thread(target=predicting_into(client, results)) for _ in range(2)]
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for t in threads:
                    t.start()
                for _ in range(2):
                    tg.start_soon(async_call)
                while app.now < 4:
                    await anyio.sleep(0.01)
                client.close()  # on this loop's thread
                assert app.now == 4 and not results  # returned with every call still out
                assert client.closed and not client._released
                with pytest.raises(ClientClosedError):
                    await client.predict_async(make_body(0))
            for t in threads:
                await anyio.to_thread.run_sync(t.join, 10)
        assert results == ['{"ok": true}'] * 4
        assert client._released and client._sync is None and not client._pools


@pytest.mark.anyio
async def test_aclose_can_be_cancelled_while_it_waits(counting_server):
    server, app = counting_server
    with answering_after(app, 1.0):
        client = HttpClient(server.base_url, retries=0)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.predict_async, make_body(0))
                while app.now < 1:
                    await anyio.sleep(0.01)
                started = time.monotonic()
                with anyio.move_on_after(0.1):
                    await client.aclose()
                assert time.monotonic() - started < 0.5  # not the 1 s the call still takes
                assert client.closed
                assert not client._released  # the call in flight keeps its pool
        assert client._released  # and the pools closed after it


def connections_to(port: int) -> int:
    """Established TCP connections to 127.0.0.1:``port`` (Linux's socket table): the clients'
    ends, not the server's, whose local port it is."""
    to = f"0100007F:{port:04X}"  # 127.0.0.1, as the table writes it
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for line in lines if line.split()[2:4] == [to, "01"])


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
@pytest.mark.parametrize("how", ["close", "cancelled aclose", "close from a thread", "aclose"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_client_closed_with_calls_in_flight_leaves_no_connection_when_its_loop_ends(
    backend: str, how: str
) -> None:
    """Closed while calls were in flight, the pools closed after the last one, on their loop;
    on asyncio the loop (``asyncio.run``) could end first, cancelling the close midway: every
    connection stayed open until garbage-collected (ResourceWarning: unclosed transport).
    The last call on a loop now returns once its loop's pool is closed."""
    app = PeakCounter(delay=0.3)
    with thread_server(app) as server:
        client = HttpClient(server.base_url, retries=0)
        results: list[str] = []

        async def call(body: str) -> None:
            results.append(await client.predict_async(body))

        async def main() -> None:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for i in range(8):
                        tg.start_soon(call, make_body(i))
                    while app.now < 8:
                        await anyio.sleep(0.01)
                    assert connections_to(server.port) == 8
                    if how == "close":
                        client.close()  # on the loop's thread: returns at once
                    elif how == "cancelled aclose":
                        with anyio.move_on_after(0.05):
                            await client.aclose()
                    elif how == "close from a thread":
                        await anyio.to_thread.run_sync(client.close)
                    else:
                        await client.aclose()
            # Returns as the calls do (or aclose): the loop ends at once.

        anyio.run(main, backend=backend)
        assert results == ['{"ok": true}'] * 8
        assert connections_to(server.port) == 0


def test_an_aclose_cut_short_by_asyncio_still_closes_every_other_pool(counting_server):
    """asyncio's own cancellation (``asyncio.timeout`` around ``aclose()``) passes anyio's
    shield: cut short while this loop's pool closed, aclose() left the sync pool (and other
    loops') open for good, the client already marked released."""
    server, _ = counting_server
    client = HttpClient(server.base_url, retries=0)
    client.predict(make_body(0))
    assert client._sync is not None
    sync_clients = [c for c in client._sync._clients if c is not None]

    async def main() -> None:
        await client.predict_async(make_body(0))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0):
                await client.aclose()

    asyncio.run(main())
    assert sync_clients and all(c.is_closed for c in sync_clients)
    assert client._released and not client._pools


async def run_concurrently(call: Any, n: int) -> None:
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(call, make_body(i))


@pytest.mark.anyio
@pytest.mark.parametrize("max_in_flight", [1, 8, 24])
async def test_max_in_flight_bounds_the_requests_on_the_wire(counting_server, max_in_flight):
    """200 concurrent calls, real sockets: the server never sees more than the bound at once
    (24 spans six connection shards of 4), and sees the bound reached."""
    server, app = counting_server
    app.peak = 0
    async with HttpClient(server.base_url, max_in_flight=max_in_flight) as client:
        await run_concurrently(client.predict_async, 200 if max_in_flight > 1 else 20)
        pool = next(iter(client._pools.values()))
        assert pool.slots is not None and pool.slots.value == max_in_flight  # all given back
    assert app.peak == max_in_flight


@pytest.mark.anyio
async def test_max_in_flight_none_is_unbounded(counting_server):
    server, app = counting_server
    app.peak, app.delay = 0, 1.0  # long enough for all 200 to arrive while the first waits
    try:
        async with HttpClient(server.base_url, max_in_flight=None) as client:
            await run_concurrently(client.predict_async, 200)
            assert next(iter(client._pools.values())).slots is None
    finally:
        app.delay = 0.05
    assert app.peak > 64  # past the default bound: only the pool's 256 connections limit it


def _predict_from_threads(client: HttpClient, threads: int) -> list[BaseException]:
    """Three ``predict`` calls from each of ``threads`` threads; what they raised."""
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for i in range(3):
                client.predict(make_body(i))
        except BaseException as exc:
            errors.append(exc)

    running = [threading.Thread(target=worker) for _ in range(threads)]
    for t in running:
        t.start()
    for t in running:
        t.join(60)
    return errors


def test_max_in_flight_bounds_sync_calls_across_threads(counting_server):
    server, app = counting_server
    app.peak = 0
    with HttpClient(server.base_url, max_in_flight=4) as client:
        assert not _predict_from_threads(client, 32)
    assert app.peak == 4


def test_sync_calls_are_split_over_shards_and_all_closed(counting_server):
    """Threads' calls go through several httpx clients of at most 4 connections (one pool of
    64 costs the client about twice the CPU a request), each made once, all closed by close()."""
    server, app = counting_server
    app.peak = 0
    client = HttpClient(server.base_url, max_in_flight=12)
    assert not _predict_from_threads(client, 24)
    assert app.peak == 12
    shards = client._sync
    assert shards is not None
    made = [c for c in shards._clients if c is not None]
    assert 2 <= len(made) <= 3 and len(set(map(id, made))) == len(made)
    assert shards._active == [0, 0, 0]  # every lease given back
    client.close()
    assert all(c.is_closed for c in made)
    with pytest.raises(ClientClosedError):
        client.predict(make_body(0))


@pytest.mark.anyio
async def test_a_callers_unbounded_limits_are_one_client(counting_server):
    """``limits`` with no connection bound: one httpx client, as configured, sync and async."""
    server, _ = counting_server
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with HttpClient(server.base_url, max_in_flight=None, limits=limits) as client:
        await run_concurrently(client.predict_async, 8)
        await anyio.to_thread.run_sync(client.predict, make_body(0))
        assert len(client._options.shards) == 1


def test_connections_are_split_into_shards_no_larger_than_the_bound():
    assert http_module._shard_sizes(64) == [4] * 16
    assert http_module._shard_sizes(10) == [4, 3, 3]
    assert http_module._shard_sizes(1) == [1]
    sizes = [
        o["limits"].max_connections for o in HttpClient("http://h", max_in_flight=8)._options.shards
    ]
    assert sizes == [4, 4]
    with HttpClient("http://h", transport=httpx.MockTransport(lambda r: httpx.Response(200))) as c:
        assert len(c._options.shards) == 1  # the caller's transport: one client, not shards


def _contexts(client: HttpClient) -> list[object]:
    """The TLS context each httpx client of ``client`` would be built with."""
    client._options.share()  # what happens before the first httpx client is made
    return [options.get("verify") for options in client._options.shards]


def test_every_httpx_client_shares_one_tls_context():
    """Building a TLS context loads the CA bundle (~50 ms); a loop's pool makes several httpx
    clients, so they share one, built once and honouring ``verify``."""
    contexts = _contexts(HttpClient("http://h"))
    assert len(contexts) == 16 and isinstance(contexts[0], ssl.SSLContext)
    assert all(context is contexts[0] for context in contexts)
    assert contexts[0].verify_mode == ssl.CERT_REQUIRED
    unverified = _contexts(HttpClient("http://h", verify=False))[0]
    assert isinstance(unverified, ssl.SSLContext) and unverified.verify_mode == ssl.CERT_NONE
    own = ssl.create_default_context()
    assert all(context is own for context in _contexts(HttpClient("http://h", verify=own)))
    # ALPN is httpcore's to set, per connection: http2 shares the context too.
    assert len({id(c) for c in _contexts(HttpClient("http://h", http2=True))}) == 1
    # The caller's transport decides its own TLS.
    mock = httpx.MockTransport(lambda r: httpx.Response(200))
    assert _contexts(HttpClient("http://h", transport=mock)) == [None]


@pytest.mark.anyio
async def test_calls_through_a_session_build_no_client_of_ours(server):
    """Calls that all go through the caller's ``session`` make no httpx client of ours, so
    options only those would use (here a CA file that does not exist) cost and break
    nothing."""
    async with (
        HttpClient(server.base_url, verify="/nonexistent/ca.pem") as client,
        httpx.AsyncClient() as session,
    ):
        assert json.loads(await client.embed_async(make_body(2), session=session))
        assert not client._options.shared
        assert all(c is None for pool in client._pools.values() for c in pool._shards._clients)


@pytest.mark.anyio
async def test_a_cookie_the_server_sets_reaches_every_shard(counting_server):
    """One cookie jar for all the httpx clients: a load balancer's stickiness cookie (or a
    gateway's session) set on one answer goes with every later request, async and sync,
    whichever shard sends it."""
    server, app = counting_server
    app.set_cookie = b"AWSALB=sticky-1; Path=/"
    try:
        async with HttpClient(server.base_url, max_in_flight=16) as client:
            await client.predict_async(make_body(0))
            app.set_cookie, app.cookies = None, []
            await run_concurrently(client.predict_async, 32)
            await anyio.to_thread.run_sync(_predict_from_threads, client, 8)
            assert len(client._sync._clients) == 4 and len(app.cookies) == 32 + 24
            assert app.cookies == [b"AWSALB=sticky-1"] * (32 + 24)
    finally:
        app.set_cookie, app.cookies = None, []


@pytest.mark.anyio
async def test_shards_built_on_first_use_share_the_tls_context(counting_server):
    server, _ = counting_server
    async with HttpClient(server.base_url, max_in_flight=12) as client:
        await run_concurrently(client.predict_async, 48)
        pool = next(iter(client._pools.values()))
        made = [c for c in pool._shards._clients if c is not None]
        assert len(made) >= 2  # 12 in flight need three shards of 4
        transports = [c._transport._pool._ssl_context for c in made]  # type: ignore[attr-defined]
        assert all(context is transports[0] for context in transports)


@pytest.mark.anyio
async def test_an_async_clients_first_request_builds_its_tls_context_off_the_loop(
    counting_server, monkeypatch
):
    """Building the TLS context (and httpx's first transport importing httpcore, and trio
    with it) held the loop 70-270 ms at a client's first async call: it runs on a worker
    thread, once."""
    server, _ = counting_server
    threads: list[int] = []
    share = http_module._ClientOptions.share

    def recording_share(options: http_module._ClientOptions) -> None:
        if not options.shared:  # the call that builds it
            threads.append(threading.get_ident())
        share(options)

    monkeypatch.setattr(http_module._ClientOptions, "share", recording_share)
    async with HttpClient(server.base_url) as client:
        await client.predict_async(make_body(0))
        await client.predict_async(make_body(1))
    assert threads and threading.get_ident() not in threads
    assert len(threads) == 1


class Gate:
    """A MockTransport handler: every request waits until ``open`` is set; counts them."""

    def __init__(self) -> None:
        self.started = 0
        self.open: anyio.Event | None = None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.started += 1
        assert self.open is not None
        await self.open.wait()
        return httpx.Response(200, content=request.content)


@pytest.mark.anyio
async def test_a_cancelled_waiter_leaves_no_slot_behind():
    gate = Gate()
    gate.open = anyio.Event()
    transport = httpx.MockTransport(gate)
    async with HttpClient("http://mock", max_in_flight=2, transport=transport) as client:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(2):  # these two hold both slots
                    tg.start_soon(client.predict_async, make_body(i))
                while gate.started < 2:
                    await anyio.sleep(0.01)
                slots = next(iter(client._pools.values())).slots
                assert slots is not None
                with anyio.move_on_after(0.2) as waited:  # this one waits for a slot...
                    await client.predict_async(make_body(2))
                assert waited.cancelled_caught and gate.started == 2  # ...cancelled, unsent
                assert slots.value == 0 and slots.statistics().tasks_waiting == 0
                gate.open.set()
            # A call cancelled while it holds a slot (mid-request) gives it back too.
            gate.open = anyio.Event()
            with anyio.move_on_after(0.2):
                await client.predict_async(make_body(3))
            assert slots.value == 2
            gate.open.set()
            got = [await client.predict_async(make_body(i)) for i in range(4, 6)]
    assert [json.loads(g)["patch_idx"] for g in got] == [4, 5]


@pytest.mark.anyio
async def test_waiting_for_a_slot_counts_against_the_timeout():
    gate = Gate()
    gate.open = anyio.Event()
    transport = httpx.MockTransport(gate)
    async with HttpClient("http://mock", max_in_flight=1, timeout=0.3, transport=transport) as c:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(c.predict_async, make_body(0))
                while gate.started < 1:
                    await anyio.sleep(0.01)
                said = r"failed after 1 attempt: no connection or request slot free within 0\.3 s"
                with pytest.raises(InferenceError, match=said) as err:
                    await c.predict_async(make_body(1))
                assert isinstance(err.value.__cause__, httpx.PoolTimeout)
                gate.open.set()


@pytest.mark.anyio
async def test_a_retry_gives_its_slot_back_while_it_sleeps():
    """Call A gets a 503 and sleeps 0.5 s before retrying; call B, sent meanwhile through the
    only slot, is answered within that sleep."""
    answered: list[str] = []
    refused = anyio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        idx = json.loads(request.content)["patch_idx"]
        if idx == 0 and not refused.is_set():
            refused.set()
            problem = {"type": "https://histoinfer.dev/problems/overloaded", "detail": "busy"}
            headers = {"content-type": "application/problem+json", "retry-after": "5"}
            return httpx.Response(503, headers=headers, json=problem)
        answered.append(f"call {idx}")
        return httpx.Response(200, content=request.content)

    transport = httpx.MockTransport(handler)
    async with HttpClient(
        "http://mock", max_in_flight=1, max_backoff=0.5, transport=transport
    ) as client:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.predict_async, make_body(0))
                await refused.wait()
                with anyio.fail_after(0.4):  # well inside A's 0.5 s backoff
                    await client.predict_async(make_body(1))
    assert answered == ["call 1", "call 0"]


@pytest.mark.parametrize("model", ["h1/batch", "", "a/b"])
def test_a_model_name_with_a_slash_is_refused(model):
    """The server decodes %2F before routing: "h1/batch" would reach h1's batch route."""
    with pytest.raises(ValueError, match="without '/'"):
        HttpClient("http://127.0.0.1:1", model)


def test_a_batch_answer_that_is_not_a_list_of_responses_is_an_inference_error():
    """A proxy's HTML page, or a JSON object, where the batch's responses should be."""
    answers = [
        httpx.Response(200, text="<html>maintenance</html>", headers={"content-type": "text/html"}),
        httpx.Response(200, json={"output": [1.0]}),
    ]
    for answer in answers:
        transport = httpx.MockTransport(lambda r, answer=answer: answer)
        with (
            HttpClient("http://h", transport=transport, retries=0) as client,
            pytest.raises(InferenceError, match="not NDJSON or a JSON list of responses") as info,
        ):
            client.predict_batch([make_body(0)])
        assert type(info.value) is InferenceError
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json=[{"output": [1.0]}]))
    with HttpClient("http://h", transport=transport, retries=0) as client:
        assert client.predict_batch([make_body(0)]) == ['{"output":[1.0]}']


def test_a_tile_sent_as_a_body_points_to_tile_body():
    """A numpy or PIL tile where the JSON string goes: a single call is refused before
    sending, with the in-process client's words (schema.not_a_json_string); in a batch it
    travels as its type's name, for the server to refuse with the batch's other bad positions
    (test_equivalence.py, test_bad_input_in_batches)."""
    sent: list[object] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(422, json={"type": "x", "detail": "refused"})

    with HttpClient("http://h", transport=httpx.MockTransport(answer), retries=0) as client:
        for tile, kind, type_name in (
            (np.zeros((4, 4, 3), np.uint8), "ndarray", "ndarray"),
            (Image.new("L", (4, 4)), "Image", "Image"),
        ):
            with pytest.raises(
                InvalidRequestError, match=rf"got {kind}: make one with histoinfer.tile_body\("
            ):
                client.predict(tile)
            assert not sent
            with pytest.raises(InvalidRequestError):
                client.predict_batch([make_body(0), tile])
            assert sent.pop()[1] == {"$type": type_name, "kind": "image"}


def test_a_batch_answered_as_a_json_list_gives_each_response_verbatim():
    """A proxy that ignores Accept turns NDJSON into a JSON list: each response must still be
    the server's text (re-serialized, 0.0000497 would read 4.97e-05), in any spacing."""
    first = '{"output":[0.0000497,1E+2],"name":"caf\u00e9"}'
    second = '{"output": [ -0.0 ]}'
    bodies = [
        f"[{first},{second}]",
        f" [\n  {first} ,\n\t{second}\n] \n",
    ]
    for text in bodies:
        answer = httpx.Response(200, text=text, headers={"content-type": "application/json"})
        transport = httpx.MockTransport(lambda r, answer=answer: answer)
        with HttpClient("http://h", transport=transport, retries=0) as client:
            assert client.predict_batch([make_body(0), make_body(1)]) == [first, second]
    for text in ("[", "[{}", "[{},]", "[{} {}]", "[{}] x", "[,]", "{}", ""):
        answer = httpx.Response(200, text=text, headers={"content-type": "application/json"})
        transport = httpx.MockTransport(lambda r, answer=answer: answer)
        with (
            HttpClient("http://h", transport=transport, retries=0) as client,
            pytest.raises(InferenceError, match="not NDJSON or a JSON list of responses"),
        ):
            client.predict_batch([make_body(0)])


def test_stats_from_a_server_that_is_not_histoinfer_is_an_inference_error():
    for answer in (
        httpx.Response(200, text="<html>hello</html>", headers={"content-type": "text/html"}),
        httpx.Response(200, json=[1, 2]),
        httpx.Response(200, json={"predict": {"batches": 1}}),
    ):
        transport = httpx.MockTransport(lambda r, answer=answer: answer)
        with (
            HttpClient("http://h", transport=transport, retries=0) as client,
            pytest.raises(InferenceError, match="not a JSON object of statistics per mode"),
        ):
            client.stats()


def test_a_body_nested_too_deep_for_the_servers_list_goes_verbatim():
    """The server reads a JSON list one level deeper than the body alone: a body at the edge of
    its nesting limit must go verbatim, to be refused by position as in-process."""
    body = json.loads(make_body(1))
    inner: dict[str, Any] = {}
    deep = inner
    for _ in range(200):
        deep["zzz"] = {}
        deep = deep["zzz"]
    text = json.dumps({**body, "zzz": inner})
    assert http_module._json_object(make_body(1))
    assert not http_module._json_object(text)
    assert not http_module._json_object(make_body(1) + "," + make_body(2))  # two, not one


def _answering(response: httpx.Response) -> httpx.MockTransport:
    """A transport that answers every request (sync or async) with a copy of ``response``."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            response.status_code, headers=response.headers, content=response.content
        )

    return httpx.MockTransport(handler)


NOT_UTF8 = httpx.Response(
    200, headers={"content-type": "application/json"}, content=b'{"a":"\xff"}'
)


def test_a_body_that_is_not_utf8_is_an_inference_error():
    """A proxy's (or another server's) answer in Latin-1: not a bare UnicodeDecodeError."""
    ndjson = httpx.Response(
        200, headers={"content-type": http_module.NDJSON}, content=b'{"a":"\xff"}\n'
    )
    calls = [
        (NOT_UTF8, "POST http://h/api/predict/h1 ", lambda c: c.predict(make_body(0))),
        (NOT_UTF8, "POST http://h/api/embed/h1 ", lambda c: c.embed(make_body(0))),
        (NOT_UTF8, "GET http://h/api/metadata/h1 ", lambda c: c.metadata()),
        (ndjson, "POST http://h/api/predict/h1/batch ", lambda c: c.predict_batch([make_body(0)])),
    ]
    for answer, route, call in calls:
        with (
            HttpClient("http://h", transport=_answering(answer), retries=0, timeout=10) as client,
            pytest.raises(InferenceError) as info,
        ):
            call(client)
        assert type(info.value) is InferenceError
        kind = answer.headers["content-type"]
        assert str(info.value).startswith(
            f"the server answered {route}with HTTP 200 ({kind}), "
            "not a UTF-8 body (invalid start byte at offset 6): "
        )
        assert isinstance(info.value.__cause__, UnicodeDecodeError)


@pytest.mark.anyio
async def test_a_body_that_is_not_utf8_is_an_inference_error_async():
    async with HttpClient("http://h", transport=_answering(NOT_UTF8), retries=0) as client:
        with anyio.fail_after(30), pytest.raises(InferenceError) as info:
            await client.predict_async(make_body(0))
    assert type(info.value) is InferenceError
    assert str(info.value) == (
        "the server answered POST http://h/api/predict/h1 with HTTP 200 (application/json), "
        'not a UTF-8 body (invalid start byte at offset 6): {"a":"\ufffd"}'
    )


def test_json_nested_too_deep_to_parse_is_an_inference_error():
    """``json.loads`` raises RecursionError, not ValueError, on a body nested too deep."""
    deep = b"[" * 100_000 + b"]" * 100_000
    problem = httpx.Response(
        422, headers={"content-type": "application/problem+json"}, content=deep
    )
    listing = httpx.Response(200, headers={"content-type": "application/json"}, content=deep)
    calls: list[tuple[httpx.Response, type[InferenceError], str, Any]] = [
        (
            problem,
            InvalidRequestError,
            "HTTP 422 from POST http://h/api/predict/h1: [[[",
            lambda c: c.predict(make_body(0)),
        ),
        (
            listing,
            InferenceError,
            "GET http://h/api/stats/h1 with HTTP 200 (application/json), "
            "not a JSON object of statistics per mode: [[[",
            lambda c: c.stats(),
        ),
        (
            listing,
            InferenceError,
            "POST http://h/api/predict/h1/batch with HTTP 200 (application/json), "
            "not NDJSON or a JSON list of responses: [[[",
            lambda c: c.predict_batch([make_body(0)]),
        ),
    ]
    for answer, error, message, call in calls:
        with (
            HttpClient("http://h", transport=_answering(answer), retries=0, timeout=10) as client,
            pytest.raises(InferenceError, match=re.escape(message)) as info,
        ):
            call(client)
        assert type(info.value) is error


def test_a_retry_after_of_non_ascii_digits_is_ignored():
    """``"²".isdigit()`` is true but ``float("²")`` fails: such a header means no Retry-After."""
    assert http_module._retry_after("\u00b2") is None
    assert http_module._retry_after("\u0663") is None  # an Arabic-Indic 3: not RFC 9110 digits
    assert http_module._retry_after(" 3 ") == 3.0
    # On the wire, as bytes (httpx decodes the header as UTF-8): the retry backs off instead.
    answer = httpx.Response(503, headers=[(b"retry-after", b"\xc2\xb2")], content=b"busy")
    with (
        HttpClient(
            "http://h", transport=_answering(answer), retries=2, backoff=0.01, timeout=10
        ) as client,
        pytest.raises(OverloadedError, match="HTTP 503 from POST http://h/api/predict/h1: busy"),
    ):
        client.predict(make_body(0))


class Answering:
    """A MockTransport handler answering every request (sync or async) with a copy of
    ``response``; counts the requests, to show that an answer was not retried."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.n = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.n += 1
        answer = self.response
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)


LOGIN_PAGE = httpx.Response(
    200,
    headers={"content-type": "text/html; charset=utf-8"},
    content=b"\n  <!DOCTYPE html><html><body>Sign in to continue</body></html>",
)
#: 200s that are not a JSON object: a proxy's page, a captive portal's text, an empty answer,
#: a JSON list or string from another API (even labelled JSON).
NOT_AN_OBJECT = [
    LOGIN_PAGE,
    httpx.Response(200, headers={"content-type": "text/plain"}, content=b"OK"),
    httpx.Response(200, content=b""),
    httpx.Response(200, headers={"content-type": "application/json"}, content=b' ["a"]'),
    httpx.Response(200, headers={"content-type": "application/json"}, content=b'"\xff"'),
]


@pytest.mark.parametrize("answer", NOT_AN_OBJECT)
def test_a_200_that_is_not_a_json_object_is_an_inference_error(answer):
    """A proxy's login page answered 200 is not returned as the caller's response: an
    InferenceError that names the call (without the URL's credentials), sent only once."""
    kind = answer.headers.get("content-type", "no content type")
    head = answer.content[:300].decode("utf-8", "replace")
    calls = [
        ("POST http://h/api/predict/h1", lambda c: c.predict(make_body(0))),
        ("POST http://h/api/embed/h1", lambda c: c.embed(make_body(0))),
        (
            "POST http://h/api/predict_with_embedding/h1",
            lambda c: c.predict_with_embedding(make_body(0)),
        ),
        ("GET http://h/api/metadata/h1", lambda c: c.metadata()),
    ]
    for route, call in calls:
        handler = Answering(answer)
        transport = httpx.MockTransport(handler)
        with (
            HttpClient("http://user:secret@h", transport=transport, retries=3, timeout=10) as c,
            pytest.raises(InferenceError) as info,
        ):
            call(c)
        assert type(info.value) is InferenceError
        assert str(info.value) == (
            f"the server answered {route} with HTTP 200 ({kind}), not a JSON object: {head}"
        )
        assert handler.n == 1  # not retried


@pytest.mark.anyio
async def test_a_200_that_is_not_a_json_object_is_an_inference_error_async():
    handler = Answering(LOGIN_PAGE)
    transport = httpx.MockTransport(handler)
    async with (
        HttpClient("http://user:secret@h", transport=transport, retries=3) as client,
        httpx.AsyncClient(transport=transport) as session,
    ):
        with anyio.fail_after(30):
            for call in (
                client.predict_async(make_body(0)),
                client.embed_async(make_body(0)),
                client.predict_with_embedding_async(make_body(0), session=session),
            ):
                with pytest.raises(InferenceError, match="not a JSON object: \n  <!DOCTYPE") as e:
                    await call
                assert type(e.value) is InferenceError and "secret" not in str(e.value)
                assert str(e.value).startswith("the server answered POST http://h/api/")
    assert handler.n == 3  # one request per call: not retried


@pytest.mark.anyio
async def test_a_json_object_is_returned_exactly_as_the_server_wrote_it():
    """Whatever its content type (none here) and leading whitespace: the check reads the
    first byte that is not whitespace, it does not parse the body again."""
    body = b' \r\n\t{"output":[1.0],"x":0}'
    transport = httpx.MockTransport(Answering(httpx.Response(200, content=body)))
    async with HttpClient("http://h", transport=transport, retries=0) as client:
        with anyio.fail_after(30):
            assert await client.embed_async(make_body(0)) == body.decode()
        assert await anyio.to_thread.run_sync(client.metadata) == body.decode()


TOO_MANY = [
    httpx.Response(429, headers={"retry-after": "7"}, content=b"Too Many Requests"),
    httpx.Response(
        429,
        headers={"retry-after": "7", "content-type": "application/problem+json"},
        json={
            "type": "about:blank",
            "title": "Too Many Requests",
            "status": 429,
            "detail": "rate limit exceeded",
        },
    ),
]


@pytest.mark.parametrize("answer", TOO_MANY)
def test_a_429_is_an_overloaded_error_with_its_retry_after_never_retried(answer):
    """A gateway's or rate limiter's 429 is the caller's "back off" error. Like every 4xx it is
    not retried (SPEC §2.3); the wait it asks for is the error's ``retry_after``."""
    handler = Answering(answer)
    transport = httpx.MockTransport(handler)
    with (
        HttpClient("http://user:secret@h", transport=transport, retries=3, timeout=10) as client,
        pytest.raises(OverloadedError) as info,
    ):
        client.predict(make_body(0))
    assert type(info.value) is OverloadedError and info.value.retry_after == 7.0
    assert handler.n == 1
    if answer.headers.get("content-type") is None:
        assert str(info.value) == "HTTP 429 from POST http://h/api/predict/h1: Too Many Requests"
    else:
        assert str(info.value) == "rate limit exceeded"


@pytest.mark.anyio
async def test_a_429_is_an_overloaded_error_never_retried_async():
    handler = Answering(httpx.Response(429, content=b"slow down"))  # no Retry-After
    transport = httpx.MockTransport(handler)
    async with HttpClient("http://h", transport=transport, retries=3, backoff=0.01) as client:
        with (
            anyio.fail_after(30),
            pytest.raises(OverloadedError, match=r"HTTP 429 .*slow down") as e,
        ):
            await client.embed_async(make_body(0))
    assert type(e.value) is OverloadedError and e.value.retry_after is None
    assert handler.n == 1


def test_a_503_whose_retries_ran_out_keeps_its_retry_after():
    problem = {"type": "https://histoinfer.dev/problems/overloaded", "detail": "queue full"}
    answer = httpx.Response(
        503, headers={"content-type": "application/problem+json", "retry-after": "0"}, json=problem
    )
    handler = Answering(answer)
    transport = httpx.MockTransport(handler)
    with (
        HttpClient("http://h", transport=transport, retries=1, timeout=10) as client,
        pytest.raises(OverloadedError, match=r"^queue full$") as info,
    ):
        client.predict(make_body(0))
    assert info.value.retry_after == 0.0 and handler.n == 2  # retried once, then raised
    assert info.value.retryable and info.value.http_status == 503


@pytest.mark.parametrize(
    ("status", "slug", "cls", "retryable"),
    [
        (503, "closed", ClientClosedError, True),  # the server drains: not this client
        (503, "not-ready", OverloadedError, True),
        (429, None, OverloadedError, True),
        (502, None, InferenceError, True),
        (408, "request-timeout", InvalidRequestError, True),
        (413, "payload-too-large", InvalidRequestError, False),
        (500, "inference-error", InferenceError, False),
        (422, "invalid-request", InvalidRequestError, False),
    ],
)
def test_an_http_error_says_its_answers_status_and_whether_to_send_it_again(
    status: int, slug: str | None, cls: type[InferenceError], retryable: bool
) -> None:
    """What a caller decides on without reading messages (an evaluator coming from Triton: a
    draining server's ClientClosedError read like a closed client, a 404 said 422)."""
    request = httpx.Request("POST", "http://h/api/predict/h1")
    if slug is None:
        answer = httpx.Response(status, text="from a gateway", request=request)
    else:
        problem = {"type": f"https://histoinfer.dev/problems/{slug}", "detail": "said"}
        headers = {"content-type": "application/problem+json"}
        answer = httpx.Response(status, headers=headers, json=problem, request=request)
    error = http_module._error_from(answer)
    assert type(error) is cls
    assert (error.http_status, error.retryable) == (status, retryable)
    assert cls.http_status == pickle.loads(pickle.dumps(cls("x"))).http_status
    again = pickle.loads(pickle.dumps(error))  # a process pool's worker hands it back whole
    assert (again.http_status, again.retryable) == (status, retryable)


@pytest.mark.parametrize(
    ("member", "positions"),
    [([1, 3, 4], [1, 3, 4]), ("1, 3-4", None), ([1, "3"], None), ([True], None), (None, None)],
)
def test_a_refused_batchs_positions_are_read_only_when_they_are_positions(member, positions):
    """The problem's ``positions`` member becomes the error's ``positions``: a list of ints
    from histoinfer's server; anything else (another server's member of that name) is
    left out, not passed on as something a program would index with."""
    problem = {"type": InvalidRequestError.problem_type(), "title": "Invalid request"}
    problem |= {"status": 422, "detail": "2 of 5 requests are invalid (...)"}
    if member is not None:
        problem["positions"] = member
    answer = httpx.Response(422, headers={"content-type": "application/problem+json"}, json=problem)
    with (
        HttpClient("http://h", transport=_answering(answer), retries=0) as client,
        pytest.raises(InvalidRequestError, match=r"^2 of 5 requests are invalid") as info,
    ):
        client.predict_batch([make_body(0)] * 5)
    assert info.value.positions == positions


# -- *_batch calls over the server's limits: sent as several /batch requests -----------------


def _padded(i: int, pad: int, fill: str = "x") -> str:
    return json.dumps({"patch_idx": i, "pad": fill * pad})


def _echoing_batches(sent: list[tuple[int, int]]) -> httpx.MockTransport:
    """A /batch route answering each element with its ``patch_idx`` (NDJSON), keeping each
    request's number of bodies and bytes."""

    def handler(request: httpx.Request) -> httpx.Response:
        elements = json.loads(request.content)
        sent.append((len(elements), len(request.content)))
        indices = [(e if isinstance(e, dict) else json.loads(e))["patch_idx"] for e in elements]
        lines = "".join(f'{{"patch_idx":{i}}}\n' for i in indices)
        return httpx.Response(200, text=lines, headers={"content-type": http_module.NDJSON})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_large_batch_goes_as_requests_within_both_budgets_answered_in_order(as_bytes):
    """Each request within max_batch_bytes (as sent: a verbatim batch's escaped bodies too,
    here bytes bodies full of quotes) and max_batch_requests; a body over the bytes budget
    alone; the responses joined in the bodies' order."""
    pads = [100, 300, 200, 2500, 50, 50, 50, 50, 400, 400, 10]
    bodies: list[Any] = [_padded(i, pad, '"') for i, pad in enumerate(pads)]
    if as_bytes:
        bodies = [body.encode() for body in bodies]  # not str: the batch goes verbatim
    sent: list[tuple[int, int]] = []
    options = {"max_batch_bytes": 1000, "max_batch_requests": 3, "retries": 0}
    with HttpClient("http://h", transport=_echoing_batches(sent), **options) as client:
        got = client.predict_batch(bodies)
    assert [json.loads(r)["patch_idx"] for r in got] == list(range(len(bodies)))
    assert sum(count for count, _ in sent) == len(bodies)
    assert all(count <= 3 and (size <= 1000 or count == 1) for count, size in sent), sent
    if as_bytes:  # escaped once more in the verbatim batch: planned, then halved as sent
        assert len(sent) > 6
    else:  # filled greedily: each request as full as the next body allows
        assert [count for count, _ in sent] == [2, 1, 1, 3, 2, 2]
        assert [size > 1000 for _, size in sent] == [False, False, True, False, False, False]
    with HttpClient("http://h", transport=_echoing_batches(sent), retries=0) as client:
        sent.clear()
        assert len(client.embed_batch(bodies)) == len(bodies)
        assert sent == [(len(bodies), sent[0][1])]  # within the defaults: one request


@pytest.mark.parametrize(
    ("failing", "where"),
    [
        (2, "positions 8-9 of this call's 10 (the 8 before it were answered and nothing"),
        (0, "positions 0-3 of this call's 10 (nothing"),  # a review: "(none nothing is …)"
    ],
)
def test_a_split_batch_that_fails_mid_way_says_where_and_what_was_lost(failing, where) -> None:
    """Regression (a chaos trial): a server killed mid-call failed a split call with "POST
    …/batch failed after 4 attempts" alone; the 600 answers before it were dropped unsaid."""
    sent: list[tuple[int, int]] = []
    echo = _echoing_batches(sent)

    def handler(request: httpx.Request) -> httpx.Response:
        if len(sent) == failing:  # the server has gone
            raise httpx.ConnectError("Connection refused")
        return echo.handler(request)  # type: ignore[attr-defined]

    bodies = [make_body(i) for i in range(10)]
    options = {"max_batch_requests": 4, "retries": 0}
    with (
        HttpClient("http://h", transport=httpx.MockTransport(handler), **options) as client,
        pytest.raises(InferenceError) as info,
    ):
        client.predict_batch(bodies)
    assert str(info.value).startswith(
        f"in the /batch request holding {where} is returned): POST "
        "http://h/api/predict/h1/batch failed after 1 attempt: cannot reach the server"
    )
    assert info.value.positions is None and info.value.retryable


@pytest.mark.anyio
async def test_a_split_batch_answered_by_two_checkpoints_fails_rather_than_mix_them() -> None:
    """Regression (a re-trial): a server restarted on another checkpoint between a split
    call's requests returned one list mixing two models' results, warned of at most once
    per client; the call now fails, sync and async, saying where."""
    old_sha, new_sha = "a" * 64, "b" * 64
    sent: list[tuple[int, int]] = []
    echo = _echoing_batches(sent)
    restarted = [3]  # the server restarts before the request of this number

    def handler(request: httpx.Request) -> httpx.Response:
        response = echo.handler(request)  # type: ignore[attr-defined]
        sha = old_sha if len(sent) < restarted[0] else new_sha
        response.headers["histoinfer-checkpoint-sha256"] = sha
        response.headers["x-request-id"] = f"r{len(sent)}"
        return response  # type: ignore[no-any-return]

    bodies = [make_body(i) for i in range(10)]
    options = {"max_batch_requests": 4, "retries": 0, "transport": httpx.MockTransport(handler)}
    want = (
        "in the /batch request holding positions 8-9 of this call's 10 (the 8 before it were "
        f"answered and nothing is returned): model 'h1' at http://h answered from checkpoint "
        f"{new_sha[:12]}…, not checkpoint {old_sha[:12]}… as it did this call's earlier requests"
    )
    with HttpClient("http://h", **options) as client:
        with pytest.raises(InferenceError) as info:
            client.predict_batch(bodies)
        assert str(info.value).startswith(want) and info.value.request_id == "r3"
        restarted[0] = 0  # a call answered by one checkpoint throughout is not refused
        assert len(client.predict_batch(bodies)) == 10
    sent.clear()
    restarted[0] = 3
    async with HttpClient("http://h", **options) as client:
        with anyio.fail_after(30), pytest.raises(InferenceError) as info:
            await client.embed_batch_async(bodies)
    assert str(info.value).startswith(want.replace("predict", "embed"))


@pytest.mark.anyio
async def test_a_split_batch_holds_one_request_at_a_time():
    """Each /batch request (up to max_batch_bytes) is dropped before the next is built: the
    last one's response held its request, and so its body, while the next was sent (a
    review: two bodies held, ~48 MB more at the defaults), sync and async alike."""
    alive: list[int] = []
    echo = _echoing_batches([])

    def handler(request: httpx.Request) -> httpx.Response:
        alive.append(len(_httpx_requests_alive()))
        return echo.handler(request)  # type: ignore[no-any-return]

    bodies = [_padded(i, 300, "x") for i in range(9)]
    options = {"max_batch_requests": 3, "retries": 0, "transport": httpx.MockTransport(handler)}
    with no_cycle_collector():
        with HttpClient("http://h", **options) as client:
            assert len(client.predict_batch(bodies)) == 9
        async with HttpClient("http://h", **options) as client:
            with anyio.fail_after(30):
                assert len(await client.predict_batch_async(bodies)) == 9
    assert alive == [1] * 6


@pytest.mark.anyio
@pytest.mark.parametrize("as_bytes", [False, True])
async def test_an_async_batch_is_sent_as_the_sync_one_is(as_bytes):
    """``*_batch_async``: the same requests as the sync call (within both budgets, halved
    where escapes outgrew the plan), sent on the loop, the responses in the bodies' order."""
    pads = [100, 300, 200, 2500, 50, 50, 50, 50, 400, 400, 10]
    bodies: list[Any] = [_padded(i, pad, '"') for i, pad in enumerate(pads)]
    if as_bytes:
        bodies = [body.encode() for body in bodies]
    options = {"max_batch_bytes": 1000, "max_batch_requests": 3, "retries": 0}
    by_sync: list[tuple[int, int]] = []
    with HttpClient("http://h", transport=_echoing_batches(by_sync), **options) as client:
        want = client.embed_batch(bodies)
    by_async: list[tuple[int, int]] = []
    async with HttpClient("http://h", transport=_echoing_batches(by_async), **options) as client:
        with anyio.fail_after(30):
            got = await client.embed_batch_async(bodies)
    assert got == want and [json.loads(r)["patch_idx"] for r in got] == list(range(len(bodies)))
    assert by_async == by_sync and len(by_async) > 1


@pytest.mark.anyio
async def test_an_async_batch_refused_names_the_calls_positions(small_server, reference):
    """Sent as 3 requests of 3, 3 and 1 bodies: the third request's bad body is the call's
    position 6, as in the sync call; a good call answers as the in-process client does."""
    bodies = [make_body(i, size=32) for i in range(7)]
    async with HttpClient(small_server.base_url, max_batch_requests=3) as client:
        with anyio.fail_after(60):
            got = await client.predict_with_embedding_batch_async(bodies)
            expected = reference.predict_with_embedding_batch(bodies)
            assert all(outputs_close(a, b) for a, b in zip(got, expected, strict=True))
            bad = [*bodies[:6], "{not json"]
            with pytest.raises(InvalidRequestError) as info:
                await client.predict_batch_async(bad)
    assert info.value.positions == [6]
    with (
        HttpClient(small_server.base_url, max_batch_requests=3) as client,
        pytest.raises(InvalidRequestError) as sync_info,
    ):
        client.predict_batch(bad)
    assert str(info.value) == str(sync_info.value)


@pytest.fixture(scope="module")
def small_server(tiny_model: Any) -> Iterator[ThreadServer]:
    """A server whose limits are below HttpClient's defaults: 512 KiB, 3 bodies a /batch."""
    client = InProcessClient(tiny_model, max_batch_size=16, overload="reject")
    app = create_app(client, max_body_bytes=512 * 1024, max_batch_requests=3, warmup=False)
    with thread_server(app) as s:
        yield s


def test_a_batch_over_the_servers_limits_goes_as_several_requests(small_server, reference):
    """What works in-process works over HTTP: 7 tiles of 200 KB (1.4 MB: over the server's
    512 KiB) and 7 small ones (over its 3 a /batch), each within the client's budgets."""
    large = [make_body(i) for i in range(7)]
    small = [make_body(i, size=32) for i in range(7)]
    sent: list[int] = []
    hooks = {"request": [lambda request: sent.append(len(request.content))]}
    with HttpClient(
        small_server.base_url, max_batch_bytes=500_000, max_batch_requests=3, event_hooks=hooks
    ) as client:
        got = client.embed_batch(large)
        assert len(sent) == 4 and max(sent) <= 500_000  # two tiles a request, then one
        assert all(
            outputs_close(a, b) for a, b in zip(got, reference.embed_batch(large), strict=True)
        )
        sent.clear()
        got = client.predict_batch(small)
        assert len(sent) == 3  # 3, 3 and 1 bodies
        expected = reference.predict_batch(small)
        assert all(outputs_close(a, b) for a, b in zip(got, expected, strict=True))
    with (  # an empty call is still sent: the server's to refuse, as in-process
        HttpClient(small_server.base_url, "h9") as unknown,
        pytest.raises(InvalidRequestError, match="unknown model 'h9'"),
    ):
        unknown.predict_batch([])


@pytest.mark.parametrize(
    ("bodies", "limit"),
    [
        ([make_body(i) for i in range(4)], "the limit is 524288 bytes"),
        ([make_body(i, size=32) for i in range(4)], "4 requests"),
    ],
    ids=["bytes", "count"],
)
def test_a_413_for_several_bodies_says_which_option_to_lower(small_server, bodies, limit):
    """A server with lower limits than the defaults: the error names the call and the options."""
    average = sum(len(body) for body in bodies) / len(bodies)
    with (
        HttpClient(small_server.base_url) as client,
        pytest.raises(InvalidRequestError, match=limit) as info,
    ):
        client.predict_batch(bodies)
    assert str(info.value).endswith(
        f"; this call's 4 bodies (~{average:,.0f} bytes each) went as /batch requests of up to "
        "max_batch_bytes=50,331,648 bytes and max_batch_requests=4,096 bodies, more than this "
        "server takes: give HttpClient a smaller max_batch_bytes or max_batch_requests"
    )
    with HttpClient(small_server.base_url, max_batch_bytes=1000) as client:
        with pytest.raises(InvalidRequestError, match="the limit is 524288 bytes") as info:
            client.predict_batch([make_body(0, slide_name="s" * 600_000), make_body(1)])
        assert "max_batch_bytes" not in str(info.value)  # a body over the server's limit alone


def test_a_refused_request_of_a_split_call_names_the_calls_positions(small_server, reference):
    """The server's refusal of one request, as the call's: ``positions`` counted from the
    call's first body, the message saying which request it was; the requests after it are
    not sent, and the call returns nothing."""
    bodies = [make_body(i, size=32) for i in range(9)]
    bodies[4] = make_body(4, size=32, x=-1)
    bodies[7] = make_body(7, size=32, x=-1)
    with pytest.raises(InvalidRequestError) as in_process:
        reference.predict_batch(bodies)
    assert in_process.value.positions == [4, 7]  # in-process: every bad position
    sent: list[int] = []
    hooks = {"request": [lambda request: sent.append(len(request.content))]}
    with (
        HttpClient(small_server.base_url, max_batch_requests=3, event_hooks=hooks) as client,
        pytest.raises(InvalidRequestError) as info,
    ):
        client.predict_batch(bodies)
    assert info.value.positions == [4]  # those of the request refused, as the call's
    assert len(sent) == 2  # the third request (positions 6-8) never sent
    message = str(info.value)
    prefix = (
        "in the /batch request holding positions 3-5 of this call's 9 (add 3 to the positions "
        "named below; error.positions are the call's; nothing is returned): "
        "1 of 3 requests are invalid (position 1), nothing of it was computed: "
    )
    assert message.startswith(prefix), message
    # The first request refused: positions as they are.
    bodies[1] = make_body(1, size=32, x=-1)
    with (
        HttpClient(small_server.base_url, max_batch_requests=3) as client,
        pytest.raises(
            InvalidRequestError,
            match=r"^in the /batch request holding positions 0-2 of this call's 9 \(error",
        ) as info,
    ):
        client.predict_batch(bodies)
    assert info.value.positions == [1]
    # A call that is one request keeps the server's words, as in-process.
    with (
        HttpClient(small_server.base_url) as client,
        pytest.raises(
            InvalidRequestError, match=r"^1 of 3 requests are invalid \(position 1\)"
        ) as info,
    ):
        client.predict_batch(bodies[:3])
    assert info.value.positions == [1]


# -- request bodies are freed with their call, not by the cycle collector ---------------------


@contextlib.contextmanager
def no_cycle_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _httpx_requests_alive() -> list[httpx.Request]:
    # type(), not isinstance: that asks some of torch's modules for __class__, which warns.
    return [o for o in gc.get_objects() if type(o) is httpx.Request]


def test_a_batchs_request_body_is_freed_when_the_call_returns(server):
    """httpx's response and its stream refer to each other, and the response holds its
    request, whose content is the whole /batch body: unbroken, each call's body stayed until
    the cycle collector ran (a user trial: RSS 193 -> 650 MB over 8 calls with it off)."""
    bodies = [make_body(i) for i in range(8)]  # 1.6 MB a call
    with HttpClient(server.base_url) as client, no_cycle_collector():
        for _ in range(3):
            client.predict_batch(bodies)
            assert not _httpx_requests_alive()
        with pytest.raises(InvalidRequestError):  # a refusal's answer too
            client.predict_batch([*bodies, "{}"])
        assert not _httpx_requests_alive()


@pytest.mark.anyio
async def test_an_async_calls_request_body_is_freed_when_the_call_returns(server):
    async with HttpClient(server.base_url) as client:
        with anyio.fail_after(60), no_cycle_collector():
            for i in range(3):
                await client.predict_async(make_body(i))
                assert not _httpx_requests_alive()


# -- httpx_options -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "hint"),
    [
        ("timout", "; did you mean 'timeout'?"),
        ("hedaers", "; did you mean 'headers'?"),
        ("max_batch_byte", "; did you mean 'max_batch_bytes'?"),
        ("zzz", ""),
    ],
)
def test_an_option_neither_httpclient_nor_httpx_takes_is_refused_when_made(option, hint):
    """Not at the first call, with httpx's TypeError that does not name HttpClient."""
    with pytest.raises(TypeError) as info:
        HttpClient("http://127.0.0.1:1", "h1", **{option: 5.0})
    assert str(info.value) == (
        f"HttpClient got an unexpected keyword argument {option!r} (not an HttpClient option "
        f"nor an httpx.Client one){hint}"
    )


def test_options_both_httpx_clients_take_are_accepted():
    hooks: dict[str, list[Any]] = {"request": [], "response": []}
    options = {"headers": {"a": "b"}, "verify": False, "follow_redirects": True}
    with HttpClient("http://127.0.0.1:1", event_hooks=hooks, trust_env=False, **options):
        pass


@pytest.mark.parametrize("option", ["max_batch_bytes", "max_batch_requests"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, None, "8"])
def test_batch_budgets_are_counts(option, value):
    with pytest.raises(ValueError, match=f"{option} must be an int >= 1, got"):
        HttpClient("http://127.0.0.1:1", **{option: value})


@pytest.mark.anyio
async def test_a_call_cancelled_while_its_body_is_sent_leaves_nothing_to_warn_of():
    """Regression (a user trial): httpx's own request stream iterates its body with an async
    generator, left unfinished by a call cancelled while it was sent; on trio its collection
    printed a ResourceWarning for every such call. Here the server never reads, so the body
    (larger than the sockets' buffers) is still being sent when the call is cancelled."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])  # and never read from

    threading.Thread(target=accept, daemon=True).start()
    body = json.dumps({"pad": "x" * 32_000_000})
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with HttpClient(url, retries=0) as client:
                for _ in range(3):
                    with anyio.move_on_after(0.3) as scope:
                        await client.predict_async(body)
                    assert scope.cancelled_caught
            gc.collect()
            await anyio.sleep(0.1)  # a finalizer the loop runs
            gc.collect()
    finally:
        listener.close()
        for connection in held:
            connection.close()
    generators = [w for w in caught if "garbage collected" in str(w.message)]
    assert not generators, [str(w.message) for w in generators]
