"""Clients in a forked child (a ProcessPoolExecutor's workers on Linux, with a module-level
client): an InProcessClient refuses every call saying why, where it hung for ever waiting for
threads the fork left behind; an HttpClient opens connections of its own, where it sent on the
parent's (and could read the answer to the parent's request)."""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import pytest
from helpers import make_body

from histoinfer import HttpClient, InProcessClient, ServerModel
from histoinfer.errors import ClientClosedError

pytestmark = pytest.mark.timeout(180)
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")


def in_forked_child(work: Callable[[], object], limit_s: float = 20.0) -> str:
    """``repr`` of what ``work()`` returns or raises in a forked child; the child is killed,
    and the test fails, if it takes longer than ``limit_s``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            try:
                said = repr(work())
            except BaseException as exc:
                said = repr(exc)
            os.write(write, said.encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], limit_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the forked child did not answer within {limit_s} s (hung)")
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)


@pytest.fixture
def used_client(tiny_model: ServerModel) -> Iterator[InProcessClient]:
    client = InProcessClient(tiny_model, max_batch_size=8)
    client.predict(make_body(0))  # its portal and the device's thread are running
    client.predict_batch([make_body(1)])
    yield client
    client.close()


@needs_fork
@pytest.mark.parametrize("call", ["predict", "predict_batch", "metadata", "asyncio", "trio"])
def test_an_inprocess_client_refuses_every_call_in_a_forked_child(
    used_client: InProcessClient, call: str
) -> None:
    def work() -> object:
        if call == "predict_batch":
            return used_client.predict_batch([make_body(2)])
        if call == "metadata":
            return used_client.metadata()
        if call in ("asyncio", "trio"):
            return anyio.run(used_client.predict_async, make_body(2), backend=call)
        return used_client.predict(make_body(2))

    said = in_forked_child(work)
    assert said.startswith("ClientClosedError("), said
    assert f"made in process {os.getpid()}" in said and "is a fork of it" in said
    assert "in its initializer" in said
    # The parent's client is untouched.
    assert json.loads(used_client.predict(make_body(3)))["patch_idx"] == 3


@needs_fork
def test_a_forked_child_closes_the_inherited_client_and_runs_one_of_its_own(
    used_client: InProcessClient, tiny_model: ServerModel
) -> None:
    want = used_client.predict(make_body(4))

    def work() -> object:
        started = time.perf_counter()
        used_client.close()  # nothing of the parent's to wait for, nor to stop
        closing_s = time.perf_counter() - started
        with pytest.raises(ClientClosedError, match="is a fork of it"):
            used_client.predict(make_body(4))
        with InProcessClient(tiny_model) as own:
            return (closing_s < 1.0, own.predict(make_body(4)) == want)

    assert in_forked_child(work) == "(True, True)"


class _PeerPort(BaseHTTPRequestHandler):
    """Answers every GET with the client's port: which connection the request came on; a POST
    likewise, after a second."""

    protocol_version = "HTTP/1.1"  # keep-alive

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(1.0)
        self.do_GET()

    def do_GET(self) -> None:
        body = json.dumps({"port": self.client_address[1]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def peer_port_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PeerPort)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@needs_fork
def test_an_http_client_in_a_forked_child_sends_on_connections_of_its_own(
    peer_port_server: str,
) -> None:
    client = HttpClient(peer_port_server, model="m", max_connections=1)
    try:
        first = json.loads(client.metadata())["port"]
        assert json.loads(client.metadata())["port"] == first  # a kept-alive connection

        def work() -> object:
            return json.loads(client.metadata())["port"]

        in_child = int(in_forked_child(work))
        assert in_child != first  # it sent on the parent's connection before
        assert json.loads(client.metadata())["port"] == first  # the parent's is still there
    finally:
        client.close()


def test_neither_client_pickles_and_the_error_says_what_to_do(
    used_client: InProcessClient,
) -> None:
    """Pickle's own errors named internals ("GraphModule which does not have a __getstate__",
    "cannot pickle '_thread.lock' object"), also when a client is passed to a process pool."""
    http = HttpClient("http://127.0.0.1:9", model="h1")
    for client, holds in [(used_client, "a loaded model"), (http, "open connections")]:
        with pytest.raises(TypeError) as refused:
            pickle.dumps(client)
        said = str(refused.value)
        assert said.startswith(
            f"{type(client).__name__} cannot be pickled or copied: it holds {holds}"
        )
        assert "in its initializer" in said
    http.close()


@needs_fork
def test_an_http_client_in_a_forked_child_has_its_own_in_flight_slots(
    peer_port_server: str,
) -> None:
    """A parent's call in flight at the fork held a slot that no thread of the child would
    ever give back: with max_in_flight=1, the child's first call waited for ever."""
    client = HttpClient(peer_port_server, model="m", max_in_flight=1, timeout=30)
    try:
        in_flight = threading.Thread(target=client.predict, args=("{}",))
        in_flight.start()
        time.sleep(0.3)  # its POST holds the one slot for a second
        said = in_forked_child(lambda: json.loads(client.metadata())["port"], limit_s=10)
        assert said.isdigit(), said
        in_flight.join(10)
    finally:
        client.close()


_POOL_SCRIPT = """
import os, sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from histoinfer import InProcessClient
from histoinfer.bench.bodies import make_bodies
from histoinfer.errors import ClientClosedError

CHECKPOINT = sys.argv[1]
client = InProcessClient.from_checkpoint("h1", CHECKPOINT)  # module-level, used before forks
own = None


def start_worker():
    global own
    own = InProcessClient.from_checkpoint("h1", CHECKPOINT)


def inherited(body):
    try:
        client.predict(body)
    except ClientClosedError as exc:
        return "refused" if "is a fork of it" in str(exc) else repr(exc)
    return "answered"


def work(body):
    return inherited(body), own.predict(body)


if __name__ == "__main__":
    bodies = make_bodies(4)
    want = [client.predict(body) for body in bodies]
    with ProcessPoolExecutor(2, mp_context=get_context("fork"), initializer=start_worker) as pool:
        results = list(pool.map(work, bodies))
    assert [r[0] for r in results] == ["refused"] * 4, results
    assert [r[1] for r in results] == want  # one tile a pass, as here: the same bytes
    pid = os.fork()
    if pid == 0:  # a plain fork that exits as a script does: atexit handlers and finalizers run
        assert inherited(bodies[0]) == "refused"
        client.close()
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    client.close()
    print("ok")
"""


@needs_fork
def test_a_fork_pool_with_a_module_level_client_and_worker_clients_runs_and_exits(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """The scenario of a user trial, in a process of its own: a module-level client used
    before the fork, a fork ProcessPoolExecutor whose initializer makes each worker's client,
    and a forked child that exits normally (its atexit handlers run: they must not wait on the
    parent's threads)."""
    script = tmp_path / "pool.py"
    script.write_text(_POOL_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_checkpoint)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert "Task was destroyed" not in done.stderr, done.stderr[-3000:]
