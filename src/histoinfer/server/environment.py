"""``serve``'s options from the environment: ``HISTOINFER_MAX_QUEUE=256`` for ``--max-queue 256``.

A container is configured through its environment as often as through its command. Each
long option ``--some-option`` takes its default from ``HISTOINFER_SOME_OPTION``; the command
line still wins. A value is checked as the option's own is, and refused naming the variable,
but only where it is used: an option given on the command line leaves its variable unread.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["PREFIX", "defaults_from_environment", "variable_for"]

log = logging.getLogger("histoinfer.server")

PREFIX = "HISTOINFER_"

#: options that are not settings of the server (help, and the global --debug)
_SKIPPED = {"--help", "--debug"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

#: what Kubernetes writes into ``<SERVICE>_PORT`` for every Service in the namespace (a
#: Service named ``histoinfer`` sets ``HISTOINFER_PORT=tcp://10.96.0.12:8080`` in every pod)
_SERVICE_LINKS = ("tcp://", "udp://", "sctp://")
#: the variables Kubernetes sets for a Service named ``histoinfer`` (``HISTOINFER_SERVICE_HOST``,
#: ``HISTOINFER_SERVICE_PORT_HTTP``, ``HISTOINFER_PORT_8080_TCP_ADDR``...) or ``histoinfer-x``
#: (``HISTOINFER_X_SERVICE_HOST``, ``HISTOINFER_X_PORT``...), in every pod of its namespace
_SERVICE_VARIABLE = re.compile(
    PREFIX + r"(?:\w+_)?(?:SERVICE_HOST|SERVICE_PORT(?:_\w+)?|PORT(?:_\d+_(?:TCP|UDP|SCTP)\w*)?)"
)


def variable_for(option: str) -> str:
    """``--max-queue`` -> ``HISTOINFER_MAX_QUEUE``."""
    return PREFIX + option.lstrip("-").upper().replace("-", "_")


def defaults_from_environment(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Set each long option's default from its variable, where it is set and not empty.

    A value is kept as text and converted by argparse only if the option is not given on the
    command line (a bad one then refused naming its variable). A repeatable option
    (``--model``, ``--checkpoint``, ``--assets``, ``--import``) takes several values separated
    by commas, and given on the command line, its values replace the variable's (they would
    otherwise be added to them). A flag takes 1, true, yes or on (0, false, no or off: unset).

    Returns what to warn of: each ``HISTOINFER_`` variable that sets nothing, said by the
    command once its log is set up (here, before it, a line would miss ``--log-format json``).
    """
    environ = os.environ if environ is None else environ
    known = set(_OTHERS)
    for action in parser._actions:
        long = next((o for o in action.option_strings if o.startswith("--")), None)
        if long is None or long in _SKIPPED:
            continue
        name = variable_for(long)
        known.add(name)
        text = environ.get(name, "").strip()
        if not text:  # unset, or set empty (a compose file's way of leaving it out)
            continue
        if long == "--port" and text.startswith(_SERVICE_LINKS):
            log.debug("%s=%r is a Kubernetes service link, not a port: ignored", name, text)
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = _flag(parser, name, text)
        elif isinstance(action, argparse._AppendAction):
            action.default = _listed(parser, name, text, action)
            action.required = False
            action.__class__ = _AppendOverDefault
        else:
            # argparse converts a str default with the option's type only when the option is
            # not given: the wrapper names the variable in the refusal.
            action.type = _from_variable(name, text, action.type, action.choices)
            action.default = text
    return _unknown(environ, known)


#: variables of histoinfer's that are not serve's options
_OTHERS = ("HISTOINFER_SCRIPT_CACHE",)


def _unknown(environ: Mapping[str, str], known: set[str]) -> list[str]:
    """Which ``HISTOINFER_*`` variables set nothing, each said as a warning: a misspelt one
    (``HISTOINFER_MAX_QEUE``) was ignored unsaid, and ``HISTOINFER_DEBUG`` looks like
    ``--debug``'s but is not read. Kubernetes' service variables are left alone."""
    said = []
    for name in sorted(environ):
        if not name.startswith(PREFIX) or name in known or _SERVICE_VARIABLE.fullmatch(name):
            continue
        if name == variable_for("--debug"):
            why = "--debug has no variable: give it on the command line"
        else:
            # Compared without the prefix they all share, which made any name look close.
            suffixes = sorted(known_name.removeprefix(PREFIX) for known_name in known)
            close = difflib.get_close_matches(name.removeprefix(PREFIX), suffixes, n=1)
            why = f"did you mean {PREFIX}{close[0]}?" if close else "no option of serve's reads it"
        said.append(f"{name} is not a setting of histoinfer serve ({why}): ignored")
    return said


def _flag(parser: argparse.ArgumentParser, name: str, text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    parser.error(f"{name}={text!r}: a flag takes 1, true, yes or on (0, false, no, off: unset)")


def _listed(
    parser: argparse.ArgumentParser, name: str, text: str, action: argparse.Action
) -> list[Any]:
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        parser.error(f"{name}={text!r}: an empty value in the comma-separated list")
    convert = action.type if callable(action.type) else str
    return [convert(part) for part in parts]


def _from_variable(name: str, text: str, convert: Any, choices: Any) -> Callable[[str], Any]:
    """``convert``, refusing the variable's own value (``text``) by the variable's name, and
    by ``choices``, which argparse checks only for values given on the command line."""
    convert = convert if callable(convert) else str

    def typed(value: str) -> Any:
        if value is not text:  # from the command line: as the option always did
            return convert(value)
        try:
            converted = convert(value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"{name}={value!r}: {exc}") from None
        allowed: Sequence[Any] | None = choices
        if allowed is not None and converted not in allowed:
            raise argparse.ArgumentTypeError(
                f"{name}={value!r}: must be one of {', '.join(map(str, allowed))}"
            )
        return converted

    return typed


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
