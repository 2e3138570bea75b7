"""``serve``'s options from the environment: ``HISTOINFER_MAX_QUEUE=256`` for ``--max-queue 256``.

A container is configured through its environment as often as through its command. Each
long option ``--some-option`` takes its default from ``HISTOINFER_SOME_OPTION``; the command
line still wins. A value is checked as the option's own is, and refused naming the variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PREFIX", "defaults_from_environment", "variable_for"]

PREFIX = "HISTOINFER_"

#: options that are not settings of the server (help, and the global --debug)
_SKIPPED = {"--help", "--debug"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def variable_for(option: str) -> str:
    """``--max-queue`` -> ``HISTOINFER_MAX_QUEUE``."""
    return PREFIX + option.lstrip("-").upper().replace("-", "_")


def defaults_from_environment(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """Set each long option's default from its variable, where it is set.

    A repeatable option (``--model``, ``--checkpoint``, ``--assets``, ``--import``) takes
    several values separated by commas, and given on the command line too, the command line's
    replace the variable's (they would otherwise be added to them). A flag takes 1, true, yes
    or on (and 0, false, no, off or nothing for unset).
    """
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        long = next((o for o in action.option_strings if o.startswith("--")), None)
        if long is None or long in _SKIPPED:
            continue
        name = variable_for(long)
        text = environ.get(name)
        if text is None:
            continue
        try:
            action.default = _value(action, text.strip())
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            parser.error(f"{name}={text!r}: {exc}")
        if isinstance(action, argparse._AppendAction):
            action.required = False
            action.__class__ = _AppendOverDefault


def _value(action: argparse.Action, text: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError("a flag takes 1, true, yes or on (0, false, no, off: not set)")
    if isinstance(action, argparse._AppendAction):
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            raise ValueError("an empty value in the comma-separated list")
        return [_one(action, part) for part in parts]
    return _one(action, text)


def _one(action: argparse.Action, text: str) -> Any:
    value = action.type(text) if callable(action.type) else text
    choices: Sequence[Any] | None = action.choices  # type: ignore[assignment]
    if choices is not None and value not in choices:
        raise ValueError(f"must be one of {', '.join(map(str, choices))}")
    return value


class _AppendOverDefault(argparse._AppendAction):
    """``append``, whose first value given on the command line replaces the default list
    (the environment's) instead of adding to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)
