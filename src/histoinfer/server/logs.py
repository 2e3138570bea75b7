"""The server's log lines: timestamped text, or one JSON object a line (``--log-format json``).

Text for a person at a terminal; JSON for a log pipeline (Loki, Elasticsearch, CloudWatch),
which otherwise has to parse the text back. histoinfer's lines, hypercorn's (through the root
handler) and uvicorn's (through its own configuration) all get the same format.
"""

from __future__ import annotations

import copy
import json
import logging
from datetime import UTC, datetime
from typing import Any

from .problems import LogThrottle, since

__all__ = [
    "TEXT_FORMAT",
    "JsonFormatter",
    "ThrottledInvalidRequests",
    "formatter_for",
    "uvicorn_log_config",
]

#: A service's log lines say when (the CLI's other commands' need not).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What every LogRecord has: anything else on a record was given as ``extra=`` (the access
# log's fields) and goes into the JSON object as it is.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's copy of the message, with terminal colours
}


class JsonFormatter(logging.Formatter):
    """One JSON object a record: ``time`` (UTC, ISO 8601 to the millisecond), ``level``,
    ``logger``, ``message``, any ``extra=`` fields, and ``exception`` (the traceback) if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        return json.dumps(entry, default=str, ensure_ascii=False)


def formatter_for(log_format: str) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def uvicorn_log_config(log_format: str) -> dict[str, Any]:
    """uvicorn's own logging configuration, its lines in ``log_format`` like histoinfer's."""
    from uvicorn.config import LOGGING_CONFIG

    config: dict[str, Any] = copy.deepcopy(LOGGING_CONFIG)
    for name, formatter in config["formatters"].items():
        if log_format == "json":
            config["formatters"][name] = {"()": f"{__name__}.JsonFormatter"}
        else:
            formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
    return config


class ThrottledInvalidRequests(logging.Filter):
    """uvicorn's warnings for a malformed request or an upgrade it does not serve (one a
    request, which anyone can send by the thousand: a fuzzing trial filled the log) at most
    once a minute each, saying how many it left out."""

    MESSAGES = frozenset(
        {
            "Invalid HTTP request received.",
            "Unsupported upgrade request.",
            "Request head too large.",  # server/guarded_http.py's
            "Request head too slow.",
        }
    )
    #: asyncio's, as a message's first line: logged with a traceback for each connection it
    #: could not accept, up to the listen backlog (2048) a second (a security trial: 1.5
    #: million lines, 112 MB, in 20 s with the file descriptors exhausted)
    FIRST_LINES = frozenset({"socket.accept() out of system resource"})

    def __init__(self, throttle: LogThrottle | None = None) -> None:
        super().__init__()
        self._throttle = throttle if throttle is not None else LogThrottle()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg
        if not isinstance(message, str):
            return True
        key = message if message in self.MESSAGES else message.partition("\n")[0]
        if key not in self.MESSAGES and key not in self.FIRST_LINES:
            return True
        due = self._throttle.due(key)
        if due is None:
            return False
        record.msg = key + since(*due) + message[len(key) :]
        return True
