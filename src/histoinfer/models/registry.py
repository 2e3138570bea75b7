"""The model registry: a key (``"h1"``) names a :class:`ServerModel` subclass.

Keys come from :func:`register_model` (the built-in ``h1``, and any class a user's module
registers once imported) and from the ``histoinfer.models`` entry points of installed packages
(``my-key = "mypkg.models:MyModel"``), each loaded only when its key is first asked for.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import InvalidRequestError
from ..schema import MODES
from .base import ServerModel

__all__ = ["ENTRY_POINT_GROUP", "available_models", "build_server_model", "register_model"]

#: The entry-point group whose entries name a model class: ``KEY = "module:Class"``.
ENTRY_POINT_GROUP = "histoinfer.models"

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type[ServerModel]] = {}
# Held while an entry point is loaded: two threads asking for one key import it once.
_ENTRY_POINT_LOCK = threading.RLock()
#: Keys whose entry points were looked at for one that is not used (``_shadowed``): once each.
_SHADOWS_CHECKED: set[str] = set()
#: Keys registered from their entry point (which is then the one in use).
_FROM_ENTRY_POINTS: set[str] = set()
M = TypeVar("M", bound=type[ServerModel])


class UnknownModelError(InvalidRequestError, KeyError):
    """No model is registered under that key."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ModelEntryPointError(UnknownModelError):
    """A ``histoinfer.models`` entry point declares the key, but its class cannot be loaded
    (its module fails to import, it names no :class:`ServerModel` subclass, ...)."""


def register_model(key: str) -> Callable[[M], M]:
    """Class decorator: make ``build_server_model(key, ...)`` build this class.

    ``key`` must be a non-empty ``str`` without ``/``, whitespace or control characters (it
    is also the model's default route name); the class must subclass :class:`ServerModel`,
    and its ``modes`` be a non-empty tuple (or list) of known modes. Anything else is refused
    here, with a ``TypeError`` or a ``ValueError``, not later at every lookup or load.
    """
    _check_key(key)

    def decorate(cls: M) -> M:
        _check_class(key, cls)
        # The built-ins first: a user's class registered under "h1" is refused here, at its
        # decorator, not later inside every lookup (which imports them).
        _load_builtins()
        registered = _REGISTRY.get(key)
        if registered is not None and not _same_definition(registered, cls):
            raise ValueError(f"a model is already registered as {key!r}: {registered!r}")
        _REGISTRY[key] = cls
        return cls

    return decorate


def _check_key(key: object) -> None:
    if not isinstance(key, str):
        raise TypeError(
            f"register_model: a model key must be a str (e.g. 'my-model'), "
            f"got {type(key).__name__} {key!r}"
        )
    if not key:
        raise ValueError("register_model: a model key must not be empty")
    bad = sorted({ch for ch in key if ch == "/" or ch.isspace() or not ch.isprintable()})
    if bad:
        raise ValueError(
            f"register_model: model key {key!r} contains {', '.join(map(repr, bad))}: a key "
            f"is a route name (/api/predict/KEY), so it must have no '/', whitespace or "
            f"control characters"
        )


def _check_class(key: str, cls: object) -> None:
    where = f"register_model({key!r})"
    if not (isinstance(cls, type) and issubclass(cls, ServerModel)):
        what = f"class {cls!r}" if isinstance(cls, type) else f"{type(cls).__name__} {cls!r}"
        raise TypeError(
            f"{where}: {what} is not a subclass of histoinfer.ServerModel; register a "
            f"ServerModel subclass (a torch module goes into its checkpoint, not here)"
        )
    modes: Any = cls.modes
    known = ", ".join(map(repr, MODES))
    if not isinstance(modes, (tuple, list)):  # a str would be taken letter by letter
        raise TypeError(
            f"{where}: {cls.__qualname__}.modes must be a tuple of modes, e.g. ('embed',), "
            f"got {type(modes).__name__} {modes!r}"
        )
    if not modes:
        raise ValueError(
            f"{where}: {cls.__qualname__}.modes is empty: the model would serve nothing; "
            f"give at least one of {known}"
        )
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise ValueError(
            f"{where}: {cls.__qualname__}.modes has unknown mode(s) "
            f"{', '.join(map(repr, unknown))}; the modes are {known}"
        )
    twice = sorted({mode for mode in modes if modes.count(mode) > 1})
    if twice:
        raise ValueError(
            f"{where}: {cls.__qualname__}.modes names {', '.join(map(repr, twice))} twice"
        )


def _same_definition(registered: type[ServerModel], cls: type[ServerModel]) -> bool:
    """The same class, or a class defined again where it was (a notebook cell run twice, a
    module reloaded): the new definition replaces the old one."""
    return registered is cls or (
        registered.__module__ == cls.__module__ and registered.__qualname__ == cls.__qualname__
    )


def available_models() -> list[str]:
    """The registry keys :func:`build_server_model` accepts (the built-in ``h1``, every class
    registered with :func:`register_model`, and every key an installed package declares in
    the ``histoinfer.models`` entry-point group, not loaded until asked for), sorted."""
    _load_builtins()
    return sorted(set(_REGISTRY) | {entry.name for entry in _entry_points()})


def model_class(key: str) -> type[ServerModel]:
    """The class registered as ``key``, loading its entry point if a package declares it.

    Raises :class:`UnknownModelError` for a key nothing declares, and
    :class:`ModelEntryPointError` (a subclass) for one whose entry point fails to load.
    """
    _load_builtins()
    registered = _REGISTRY.get(key)
    if registered is not None:
        _shadowed(key, registered)
        return registered
    with _ENTRY_POINT_LOCK:
        registered = _REGISTRY.get(key)  # loaded by another thread meanwhile
        if registered is not None:
            return registered
        declared = [entry for entry in _entry_points() if entry.name == key]
        if declared:
            return _load_entry_point(key, declared)
    available = available_models()
    close = difflib.get_close_matches(key, available, n=1)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    raise UnknownModelError(
        f"unknown model {key!r}{guess}; available models: {', '.join(available) or 'none'}"
    )


def _shadowed(key: str, registered: type[ServerModel]) -> None:
    """Warn (once a key) of an installed package's entry point for ``key`` that is not used:
    the key is histoinfer's own (``h1``) or was registered in code first. It was ignored
    silently."""
    if key in _SHADOWS_CHECKED or key in _FROM_ENTRY_POINTS:
        return
    _SHADOWS_CHECKED.add(key)
    here = f"{registered.__module__}:{registered.__qualname__}"
    for entry in _entry_points():
        if entry.name != key or entry.value == here:
            continue
        log.warning(
            "model %r: the entry point %s is not used: %r is %s in this process (%s); "
            "declare the entry point under another key",
            key,
            _describe(entry),
            key,
            "histoinfer's own" if registered.__module__.startswith("histoinfer.") else "registered",
            here,
        )


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    """The installed ``histoinfer.models`` entry points (read on each call: cheap next to a
    model's load, and a package installed meanwhile is seen)."""
    try:
        return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # a distribution's broken metadata must not break the built-in keys
        log.warning("could not read the %r entry points", ENTRY_POINT_GROUP, exc_info=True)
        return []


def _load_entry_point(key: str, declared: list[importlib.metadata.EntryPoint]) -> type[ServerModel]:
    values = sorted({entry.value for entry in declared})
    if len(values) > 1:
        raise ModelEntryPointError(
            f"model {key!r} is declared by several {ENTRY_POINT_GROUP!r} entry points: "
            f"{', '.join(f'{_describe(e)}' for e in declared)}; uninstall all but one"
        )
    entry = declared[0]
    try:
        cls = entry.load()
        register_model(key)(cls)
        _FROM_ENTRY_POINTS.add(key)
    except Exception as exc:
        why = " ".join(str(exc).split())
        raise ModelEntryPointError(
            f"model {key!r}: its entry point {_describe(entry)} failed to load: "
            f"{type(exc).__name__}{': ' + why if why else ''}"
        ) from exc
    return _REGISTRY[key]


def _describe(entry: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    source = f", from {dist.name} {dist.version}" if dist is not None else ""
    return f"{entry.value!r} ({ENTRY_POINT_GROUP}{source})"


def build_server_model(
    model: str,
    checkpoint_path: str | Path,
    device: str = "cpu",
    assets_dir: str | Path | None = None,
) -> ServerModel:
    """Load ``checkpoint_path`` as the model registered under ``model``, on ``device``."""
    return model_class(model).from_files(checkpoint_path, device=device, assets_dir=assets_dir)


def _load_builtins() -> None:
    from . import h1  # noqa: F401  (registers "h1")
