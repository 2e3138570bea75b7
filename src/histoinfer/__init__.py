"""histoinfer: computational-pathology tile models behind one client API.

The contract (schema, errors, the ``Client`` protocol) imports eagerly (~0.4 s, mostly numpy
and pydantic, which the schema needs); the errors import from here as from
``histoinfer.errors``. Everything heavier is imported on first use, so ``from
histoinfer import HttpClient`` never imports torch and ``from histoinfer import
InProcessClient`` never imports a web framework.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from .errors import (
    ClientClosedError,
    DeadlineExceededError,
    InferenceError,
    InvalidRequestError,
    ModelExecutionError,
    OverloadedError,
    ThreadAbortedError,
    UnsupportedModeError,
)
from .protocol import Client
from .schema import ModelMetadata, ModelRequest, ModelResponse

if TYPE_CHECKING:
    from .batching import BatchScheduler
    from .bodies import tile_body
    from .clients.http import HttpClient
    from .clients.inprocess import InProcessClient
    from .models import ServerModel, available_models, build_server_model, register_model

__version__ = "0.1.0"

__all__ = [
    "BatchScheduler",
    "Client",
    "ClientClosedError",
    "DeadlineExceededError",
    "HttpClient",
    "InProcessClient",
    "InferenceError",
    "InvalidRequestError",
    "ModelExecutionError",
    "ModelMetadata",
    "ModelRequest",
    "ModelResponse",
    "OverloadedError",
    "ServerModel",
    "ThreadAbortedError",
    "UnsupportedModeError",
    "__version__",
    "available_models",
    "build_server_model",
    "register_model",
    "tile_body",
]

_LAZY = {
    "BatchScheduler": "histoinfer.batching",
    "HttpClient": "histoinfer.clients.http",
    "InProcessClient": "histoinfer.clients.inprocess",
    "ServerModel": "histoinfer.models",
    "available_models": "histoinfer.models",
    "build_server_model": "histoinfer.models",
    "register_model": "histoinfer.models",
    "tile_body": "histoinfer.bodies",
}


if not TYPE_CHECKING:  # seen by a type checker, it typed every misspelt name as Any

    def __getattr__(name: str) -> Any:
        module_name = _LAZY.get(name)
        if module_name is None:
            raise AttributeError(f"module 'histoinfer' has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module_name), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """The public names (and the submodules imported so far), not this module's helpers."""
    modules = {name for name, value in globals().items() if isinstance(value, ModuleType)}
    return sorted(set(__all__) | modules)
