"""Server models: the ``ServerModel`` base, the registry, ``.pt2`` loading and ``h1``.

``Mode`` (the type of a method's ``mode``) is re-exported for subclasses' signatures."""

from ..schema import Mode
from .base import BatchOutput, SampleOutput, ServerModel
from .checkpoint import CheckpointError, load_checkpoint
from .registry import (
    ModelEntryPointError,
    UnknownModelError,
    available_models,
    build_server_model,
    register_model,
)

__all__ = [
    "BatchOutput",
    "CheckpointError",
    "Mode",
    "ModelEntryPointError",
    "SampleOutput",
    "ServerModel",
    "UnknownModelError",
    "available_models",
    "build_server_model",
    "load_checkpoint",
    "register_model",
]
