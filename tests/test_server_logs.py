"""``--log-format json``: one JSON object a record, extra fields and tracebacks included."""

from __future__ import annotations

import json
import logging
import sys

from histoinfer.server.logs import JsonFormatter, formatter_for, uvicorn_log_config


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
