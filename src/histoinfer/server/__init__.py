"""The histoinfer microservice: FastAPI over the in-process client (the ``server`` extra).
Run it with ``histoinfer serve``, or embed :func:`create_app`."""

from ..extras import install_hint

try:
    import fastapi  # noqa: F401 - only to say which extra is missing
except ModuleNotFoundError as exc:  # a plain install: say what to install, not "no fastapi"
    raise ModuleNotFoundError(
        f"histoinfer.server needs the 'server' extra: {install_hint('server')} ({exc})",
        name=exc.name,
    ) from exc

from .app import ServerState, create_app

__all__ = ["ServerState", "create_app"]
