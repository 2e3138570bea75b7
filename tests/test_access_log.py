"""``--access-log``'s lines: who, what, status, size, time and request ID, for every answer."""

from __future__ import annotations

import logging
import re
from typing import Any

import anyio
import httpx
import pytest
from helpers import make_body
from starlette.types import Receive, Scope, Send

from histoinfer import InProcessClient
from histoinfer.server import app as app_module
from histoinfer.server import create_app
from histoinfer.server.access import AccessLog

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

LINE = re.compile(
    r'^(?P<client>\S+) "(?P<method>\S+) (?P<target>\S+) HTTP/(?P<version>[\d.]+)" '
    r"(?P<status>\d{3}|-) (?P<size>[\d.]+ [KM]?B) (?P<ms>\d+\.\d) ms(?: id=(?P<id>\S+))?$"
)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    lines = [r.getMessage() for r in caplog.records if r.name == "histoinfer.access"]
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    return [m.groupdict() for m in parsed if m]


async def test_every_answer_of_the_app_is_one_line(
    tiny_model: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(InProcessClient(tiny_model, max_batch_size=8))
    transport = httpx.ASGITransport(
        app=AccessLog(app), raise_app_exceptions=False, client=("10.0.0.7", 4321)
    )
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as http,
    ):
        with anyio.fail_after(30):
            while (await http.get("/health/ready")).status_code != 200:
                await anyio.sleep(0.02)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="histoinfer.access"):
            ok = await http.post(
                "/api/predict/h1", content=make_body(0), headers={"X-Request-ID": "r-1"}
            )
            bad = await http.post("/api/predict/h1", content="{}")
            forged = await http.get("/nope%0Aforged")

            def bug(mode: str) -> None:
                raise ZeroDivisionError("a bug")

            monkeypatch.setattr(app_module, "_mode", bug)
            broken = await http.post("/api/predict/h1", content=make_body(1))
    assert [ok.status_code, bad.status_code, forged.status_code, broken.status_code] == [
        200, 422, 404, 500,
    ]  # fmt: skip
    lines = access_lines(caplog)
    assert [(line["method"], line["target"], line["status"]) for line in lines] == [
        ("POST", "/api/predict/h1", "200"),
        ("POST", "/api/predict/h1", "422"),
        ("GET", "/nope%0Aforged", "404"),  # as sent: a decoded %0A would forge a line
        ("POST", "/api/predict/h1", "500"),
    ]
    assert {line["client"] for line in lines} == {"10.0.0.7:4321"}
    assert lines[0]["id"] == "r-1" and lines[1]["id"] is None
    # An unhandled error's answer is given an ID: the same one the error's log line names.
    assert lines[3]["id"] == broken.headers["x-request-id"]
    assert lines[0]["size"] == f"{len(ok.content) / 1000:.1f} KB"
    assert lines[1]["size"] == f"{len(bad.content)} B"


async def test_a_hang_up_and_a_failure_before_any_answer_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def hung_up(scope: Scope, receive: Receive, send: Send) -> None:
        # What the app does for a client that hung up: 499, sent to nobody.
        await send({"type": "http.response.start", "status": 499, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def failing(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("before any answer")

    async def nowhere(message: Any) -> None:
        pass

    async def nothing() -> Any:
        return {"type": "http.disconnect"}

    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/api/predict/h1",
        "raw_path": b"/api/predict/h1",
        "root_path": "",
        "query_string": b"a=1",
        "http_version": "1.1",
        "headers": [],
        "client": ("::1", 5000),
    }
    with caplog.at_level(logging.INFO, logger="histoinfer.access"):
        await AccessLog(hung_up)(scope, nothing, nowhere)
        with pytest.raises(RuntimeError, match="before any answer"):
            await AccessLog(failing)(scope, nothing, nowhere)
        await AccessLog(hung_up)({"type": "lifespan"}, nothing, nowhere)  # not a request: no line
    first, second = access_lines(caplog)
    assert (first["client"], first["target"], first["status"]) == (
        "[::1]:5000",
        "/api/predict/h1?a=1",
        "499",
    )
    assert (second["status"], second["size"]) == ("-", "0 B")
