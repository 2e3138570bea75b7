"""Server models: the ``ServerModel`` base, the registry, ``.pt2`` loading and ``h1``."""

from .base import BatchOutput, SampleOutput, ServerModel
from .checkpoint import CheckpointError, load_checkpoint
from .registry import available_models, build_server_model, register_model

__all__ = [
    "BatchOutput",
    "CheckpointError",
    "SampleOutput",
    "ServerModel",
    "available_models",
    "build_server_model",
    "load_checkpoint",
    "register_model",
]
