"""``--log-format json``: one JSON object a record, extra fields and tracebacks included."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from histoinfer.server.logs import (
    JsonFormatter,
    ThrottledInvalidRequests,
    formatter_for,
    uvicorn_log_config,
)
from histoinfer.server.problems import LogThrottle


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("histoinfer.test", logging.WARNING, __file__, 1, message, args, None)
    for key, value in extra.items():
        setattr(made, key, value)
    return made


def test_a_record_is_one_json_object_with_its_extra_fields() -> None:
    line = JsonFormatter().format(record("%d tiles\nfrom %s", 3, "S1", status=200, path="/a"))
    assert "\n" not in line  # the message's newline escaped: one record, one line
    entry = json.loads(line)
    assert entry["message"] == "3 tiles\nfrom S1" and entry["level"] == "WARNING"
    assert entry["logger"] == "histoinfer.test" and entry["time"].endswith("+00:00")
    assert (entry["status"], entry["path"]) == (200, "/a")
    assert "args" not in entry and "msg" not in entry  # the record's own fields stay out


def test_a_traceback_goes_in_the_object() -> None:
    try:
        raise ZeroDivisionError("a bug")
    except ZeroDivisionError:
        failed = record("failed")
        failed.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(failed))
    assert "ZeroDivisionError: a bug" in entry["exception"] and "Traceback" in entry["exception"]


def test_text_stays_timestamped_and_uvicorn_follows_the_format() -> None:
    assert formatter_for("text").format(record("hello")).endswith(" WARNING histoinfer.test: hello")
    assert isinstance(formatter_for("json"), JsonFormatter)
    for formatter in uvicorn_log_config("json")["formatters"].values():
        assert formatter == {"()": "histoinfer.server.logs.JsonFormatter"}
    for formatter in uvicorn_log_config("text")["formatters"].values():
        assert formatter["fmt"].startswith("%(asctime)s ")


def test_uvicorn_s_invalid_request_warning_is_throttled_saying_what_it_left_out() -> None:
    now = [0.0]
    keep = ThrottledInvalidRequests(LogThrottle(every=60.0, clock=lambda: now[0])).filter

    def invalid() -> logging.LogRecord:
        return record("Invalid HTTP request received.")

    assert keep(invalid()) and not keep(invalid()) and not keep(invalid())
    assert keep(record("another warning"))  # other lines pass untouched
    upgrade = record("Unsupported upgrade request.")  # throttled on its own
    assert keep(upgrade) and upgrade.getMessage() == "Unsupported upgrade request."
    assert not keep(record("Unsupported upgrade request."))
    now[0] = 61.0
    third = invalid()
    assert keep(third)
    assert third.getMessage() == (
        "Invalid HTTP request received. (2 more like it since the last such line, 61 s ago)"
    )


def test_asyncio_s_accept_errors_are_throttled_too() -> None:
    """Regression (a security trial): with the file descriptors exhausted, asyncio logged a
    traceback for each connection it could not accept: 1.5 million lines in 20 s."""
    now = [0.0]
    keep = ThrottledInvalidRequests(LogThrottle(every=60.0, clock=lambda: now[0])).filter

    def refused(fd: int) -> logging.LogRecord:
        return record(f"socket.accept() out of system resource\nsocket: <socket fd={fd}>")

    assert keep(refused(5)) and not keep(refused(6)) and not keep(refused(7))
    now[0] = 61.0
    later = refused(8)
    assert keep(later) and later.getMessage() == (
        "socket.accept() out of system resource (2 more like it since the last such line, "
        "61 s ago)\nsocket: <socket fd=8>"
    )


def test_serve_installs_the_throttle_once(tiny_checkpoint: Path, monkeypatch: Any) -> None:
    import uvicorn

    from histoinfer.cli import main

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *_: None)
    args = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint), "--port", "0"]
    assert main(args) == 0 and main(args) == 0
    for logger in ("uvicorn.error", "asyncio"):
        installed = logging.getLogger(logger).filters
        assert sum(isinstance(f, ThrottledInvalidRequests) for f in installed) == 1
