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
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import pytest
from helpers import make_body

from histoinfer import HttpClient, InProcessClient, ServerModel
from histoinfer.errors import ClientClosedError

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform"),
]


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
    """Answers every GET with the client's port: which connection the request came on."""

    protocol_version = "HTTP/1.1"  # keep-alive

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
        assert said.startswith(f"{type(client).__name__} cannot be pickled: it holds {holds}")
        assert "in its initializer" in said
    http.close()
