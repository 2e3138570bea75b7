"""The model registry: a key (``"h1"``) names a :class:`ServerModel` subclass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import InvalidRequestError
from .base import ServerModel

__all__ = ["available_models", "build_server_model", "register_model"]

_REGISTRY: dict[str, type[ServerModel]] = {}
M = TypeVar("M", bound=type[ServerModel])


class UnknownModelError(InvalidRequestError, KeyError):
    """No model is registered under that key."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register_model(key: str) -> Callable[[M], M]:
    """Class decorator: make ``build_server_model(key, ...)`` build this class."""

    def decorate(cls: M) -> M:
        # The built-ins first: a user's class registered under "h1" is refused here, at its
        # decorator, not later inside every lookup (which imports them).
        _load_builtins()
        registered = _REGISTRY.get(key)
        if registered is not None and not _same_definition(registered, cls):
            raise ValueError(f"a model is already registered as {key!r}: {registered!r}")
        _REGISTRY[key] = cls
        return cls

    return decorate


def _same_definition(registered: type[ServerModel], cls: type[ServerModel]) -> bool:
    """The same class, or a class defined again where it was (a notebook cell run twice, a
    module reloaded): the new definition replaces the old one."""
    return registered is cls or (
        registered.__module__ == cls.__module__ and registered.__qualname__ == cls.__qualname__
    )


def available_models() -> list[str]:
    """The registry keys :func:`build_server_model` accepts (the built-in ``h1``, and every
    class registered with :func:`register_model`), sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def model_class(key: str) -> type[ServerModel]:
    _load_builtins()
    try:
        return _REGISTRY[key]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {key!r}; available models: {', '.join(available_models()) or 'none'}"
        ) from None


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
