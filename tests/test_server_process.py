"""``histoinfer serve`` as a process: hypercorn on trio, several models, SIGTERM drain, and
the command's errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from helpers import make_body, outputs_close, request_dict
from prometheus_client.parser import text_string_to_metric_families
from test_server_support import HERE, SRC, free_port, serve

from histoinfer import HttpClient
from histoinfer.bench.loopback import ServerProcess
from histoinfer.cli import main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def trio_server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    args = ["--server", "hypercorn", "--backend", "trio", "--max-batch-size", "8"]
    args += ["--model", "h1", "--checkpoint", str(tiny_checkpoint)]
    args += ["--model", "second=h1", "--checkpoint", str(tiny_checkpoint)]
    with serve(args) as server:
        yield server


def test_hypercorn_on_trio_serves_several_models(trio_server, reference):
    body = make_body(6)
    expected = reference.predict_with_embedding(body)
    for name in ("h1", "second"):
        with HttpClient(trio_server.base_url, name) as client:
            assert outputs_close(client.predict_with_embedding(body), expected)
            assert json.loads(client.metadata())["batching"]["max_batch_size"] == 8
    invocation = json.dumps(request_dict(6, model_name="second", mode="prediction"))
    r = httpx.post(trio_server.base_url + "/invocations", content=invocation, timeout=30)
    assert r.status_code == 200 and outputs_close(r.text, reference.predict(body))
    ready = httpx.get(trio_server.base_url + "/health/ready", timeout=10).json()
    assert ready["models"] == {"h1": "ready", "second": "ready"}


def test_hypercorn_on_trio_batches_concurrent_trio_calls(trio_server, reference):
    bodies = [make_body(i) for i in range(24)]
    expected = reference.embed_batch(bodies)
    got: dict[int, str] = {}

    async def run() -> None:
        async with HttpClient(trio_server.base_url) as client:

            async def one(i: int) -> None:
                got[i] = await client.embed_async(bodies[i])

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(len(bodies)):
                        tg.start_soon(one, i)

    anyio.run(run, backend="trio")
    assert all(outputs_close(got[i], expected[i]) for i in range(len(bodies)))
    with HttpClient(trio_server.base_url) as client:
        assert all(
            outputs_close(a, b) for a, b in zip(client.embed_batch(bodies), expected, strict=True)
        )


def in_flight(base_url: str) -> float:
    """Inference requests in flight: on every route but the scrape's, probes' and polls'."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    gauge = families["histoinfer_http_requests_in_flight"]
    inference = ("/api/{mode}/{model}", "/api/{mode}/{model}/batch", "/invocations")
    return sum(s.value for s in gauge.samples if s.labels["route"] in inference)


#: Windows cannot send these tests' SIGTERM or SIGINT: send_signal terminates the process there
#: (SIGTERM) or refuses (SIGINT), so nothing drains.
POSIX_SIGNALS = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals to the server")

SERVERS = pytest.mark.parametrize(
    "server_args",
    [
        ["--server", "uvicorn"],
        ["--server", "hypercorn"],  # asyncio: exited 1 with a CancelledError traceback
        ["--server", "hypercorn", "--backend", "trio"],
    ],
    ids=["uvicorn", "hypercorn", "hypercorn-trio"],
)


def assert_stopped_as_documented(
    server: ServerProcess, server_args: list[str], sig: int = signal.SIGTERM
) -> None:
    """docs/server.md, "Lifecycle": uvicorn re-raises the signal (SIGINT: KeyboardInterrupt, which
    the command reports as "interrupted", status 130), hypercorn exits 0."""
    code = server.proc.wait(timeout=60)
    if "uvicorn" not in server_args:
        assert code == 0, server.output()
    else:
        assert code == (-signal.SIGTERM if sig == signal.SIGTERM else 130), server.output()
    assert "Traceback" not in server.output()


@SERVERS
@POSIX_SIGNALS
def test_sigterm_lets_in_flight_requests_finish_and_refuses_new_ones(tiny_checkpoint, server_args):
    args = ["--model", "h1=h1-slow", "--checkpoint", str(tiny_checkpoint), *server_args]
    with serve(args, script=True) as server:
        url = server.base_url + "/api/predict/h1"
        outcome: dict[str, Any] = {}

        def slow_request() -> None:  # its tile takes 3 s to decode (SlowModel)
            try:
                outcome["response"] = httpx.post(
                    url, content=make_body(1, slide_name="slow-3"), timeout=60
                )
            except Exception as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=slow_request)
        thread.start()
        deadline = time.monotonic() + 30
        while in_flight(server.base_url) < 1:
            assert time.monotonic() < deadline, "the slow request never arrived"
            time.sleep(0.02)
        server.terminate()

        try:  # a new request: the port is closed, or the server answers 503 "closed"
            late = httpx.post(url, content=make_body(2), timeout=30)
        except httpx.TransportError:
            pass
        else:
            assert late.status_code == 503, late.text
            assert late.json()["type"].endswith("/closed")
        thread.join(60)
        assert "error" not in outcome, outcome.get("error")
        response = outcome["response"]
        assert response.status_code == 200, response.text
        assert json.loads(response.text)["slide_name"] == "slow-3"
        assert_stopped_as_documented(server, server_args)
        assert "start-up heap frozen" in server.output()  # once the models were loaded
        # The operator's record (under hypercorn there was none at all), the signal first
        # (under uvicorn the drain's line came before it: a user trial).
        said = server.output()
        signal_line = said.find("SIGTERM: draining; requests in flight have")
        drain_line = said.find("draining: new requests are refused (503 closed); 1 in flight go on")
        assert 0 <= signal_line < drain_line, said


@POSIX_SIGNALS
def test_sigint_inherited_ignored_still_ends_the_server_as_interrupted(tiny_checkpoint):
    """A background job of a script (`histoinfer serve ... &`) inherits SIGINT ignored, and
    uvicorn's re-raise of it then did nothing: `kill -INT` drained the server, which exited 0
    with no word (a user trial)."""
    ignoring = "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    ignoring += "from histoinfer.cli import main; sys.exit(main())"
    args = ["--model", "h1", "--checkpoint", str(tiny_checkpoint), "--server", "uvicorn"]
    env = {"PYTHONPATH": str(SRC)}
    with ServerProcess(args, launcher=["-c", ignoring], env=env, ready_timeout=90) as server:
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=60) == 130, server.output()
        assert "SIGINT: draining" in server.output()
        assert "histoinfer: interrupted" in server.output()


@pytest.mark.parametrize("server_args", [["--server", "uvicorn"], ["--server", "hypercorn"]])
def test_json_logs_are_one_object_a_line_access_lines_with_their_fields(
    tiny_checkpoint, server_args
):
    args = ["--model", "h1", "--checkpoint", str(tiny_checkpoint), *server_args]
    with serve([*args, "--log-format", "json", "--access-log"]) as server:
        answer = httpx.post(
            server.base_url + "/api/predict/h1",
            content=make_body(0),
            headers={"X-Request-ID": "json-1"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        server.terminate()
        server.proc.wait(timeout=60)
        entries = [json.loads(line) for line in server.output().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= set(entry) for entry in entries)
    loggers = {entry["logger"] for entry in entries}
    assert {"histoinfer.server", "histoinfer.untrained", "histoinfer.access"} <= loggers
    assert any(entry["message"].startswith("serving h1 on http://") for entry in entries)
    [access] = [e for e in entries if e["logger"] == "histoinfer.access" and e["method"] == "POST"]
    assert (access["path"], access["status"], access["request_id"]) == (
        "/api/predict/h1",
        200,
        "json-1",
    )
    assert access["bytes"] == len(answer.content) and access["duration_ms"] > 0


def post_in_thread(url: str, body: str) -> tuple[threading.Thread, dict[str, Any]]:
    """POST ``body`` from a thread; its response (or error) lands in the dict."""
    outcome: dict[str, Any] = {}

    def post() -> None:
        try:
            outcome["response"] = httpx.post(url, content=body, timeout=60)
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=post)
    thread.start()
    return thread, outcome


def wait_in_flight(server: ServerProcess, n: int) -> None:
    deadline = time.monotonic() + 30
    while in_flight(server.base_url) < n:
        assert time.monotonic() < deadline, "the requests never arrived"
        time.sleep(0.02)


@SERVERS
@POSIX_SIGNALS
def test_requests_outlasting_the_graceful_timeout_are_answered_503_closed(
    tiny_checkpoint, server_args
):
    """Regression: the server cancelled their handlers itself (uvicorn: 500 text/plain, hypercorn:
    a bare 500 or a dropped connection), and HttpClient does not retry a 500."""
    args = ["--model", "h1=h1-slow", "--checkpoint", str(tiny_checkpoint), *server_args]
    with serve([*args, "--graceful-timeout", "1"], script=True) as server:
        url = server.base_url + "/api/predict/h1"
        thread, outcome = post_in_thread(url, make_body(1, slide_name="slow-8"))
        wait_in_flight(server, 1)
        server.terminate()
        thread.join(60)
        assert "error" not in outcome, outcome.get("error")
        response = outcome["response"]
        assert response.status_code == 503, response.text
        assert response.json()["type"].endswith("/closed")
        assert "graceful timeout ran out" in response.json()["detail"]
        assert response.headers["retry-after"] == "1"
        assert_stopped_as_documented(server, server_args)
        assert "1 request(s) still in flight are answered 503 closed" in server.output()


@SERVERS
@POSIX_SIGNALS
def test_during_the_drain_delay_readiness_fails_and_requests_are_served(
    tiny_checkpoint, server_args
):
    """--drain-delay: load balancers see readiness fail (and stop sending) while what they
    already sent is served; before it, the listening socket closed within ~50 ms of SIGTERM,
    so a balancer never saw the 503 and met refused connections instead."""
    args = ["--model", "h1", "--checkpoint", str(tiny_checkpoint), *server_args]
    with serve([*args, "--drain-delay", "3"], script=True) as server:
        server.terminate()
        time.sleep(0.3)
        ready = httpx.get(server.base_url + "/health/ready", timeout=10)  # a new connection
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        r = httpx.post(server.base_url + "/api/predict/h1", content=make_body(1), timeout=30)
        assert r.status_code == 200, r.text
        assert_stopped_as_documented(server, server_args)
        assert "SIGTERM: readiness fails now; new requests are refused after 3 s" in (
            server.output()
        )


@SERVERS
@POSIX_SIGNALS
def test_a_second_signal_lets_in_flight_requests_finish(tiny_checkpoint, server_args):
    """Regression: under uvicorn a second SIGINT was its force quit, and the request in flight
    got a bare 500 (and the log four tracebacks); under hypercorn it was always let finish."""
    args = ["--model", "h1=h1-slow", "--checkpoint", str(tiny_checkpoint), *server_args]
    with serve(args, script=True) as server:
        url = server.base_url + "/api/predict/h1"
        thread, outcome = post_in_thread(url, make_body(1, slide_name="slow-3"))
        wait_in_flight(server, 1)
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # draining
        server.proc.send_signal(signal.SIGINT)
        thread.join(60)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["response"].status_code == 200, outcome["response"].text
        assert_stopped_as_documented(server, server_args, signal.SIGINT)
        assert "SIGINT again: already draining; nothing more to do" in server.output()


def test_cli_argument_errors(tiny_checkpoint, capsys):
    one = ["--model", "h1", "--checkpoint", str(tiny_checkpoint)]
    cases = {
        "is not a file": ["--model", "h1", "--checkpoint", f"{tiny_checkpoint}.missing"],
        "give one --checkpoint": [*one, "--model", "b=h1"],
        "given twice": [*one, *one],
        "uvicorn runs on asyncio only": [*one, "--backend", "trio"],
    }
    for message, args in cases.items():
        assert main(["serve", *args]) == 1
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_checkpoint_that_fails_to_load_stops_the_server(tmp_path, tiny_dir, log_format):
    bad = tmp_path / "model.pt2"
    bad.write_bytes(b"this is not a checkpoint")
    shutil.copy(tiny_dir / "model.json", tmp_path)  # without it, refused before binding
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    command = [sys.executable, "-m", "histoinfer", "serve", "--model", "h1"]
    command += ["--checkpoint", str(bad), "--port", str(free_port()), "--log-format", log_format]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=90, env=env, cwd=HERE.parent
    )
    assert done.returncode == 1, done.stderr
    assert "failed to load" in done.stderr and str(bad) in done.stderr
    if log_format == "text":
        assert "histoinfer: error: model 'h1' failed to load: " in done.stderr
    else:  # every line an object, the last word too
        entries = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
        assert entries[-1]["level"] == "ERROR"
        assert entries[-1]["message"].startswith("model 'h1' failed to load: ")


def test_a_server_that_does_not_start_is_reported_with_its_output() -> None:
    """Regression (a review): the error said "its output:" and nothing more, the log
    already removed when it was read."""
    failing = "import sys; print('no checkpoint here, said the server'); sys.exit(3)"
    with pytest.raises(RuntimeError, match="did not start") as info:
        ServerProcess([], launcher=["-c", failing], ready_timeout=30)
    assert "no checkpoint here, said the server" in str(info.value)
