"""The histoinfer microservice: FastAPI over the in-process client (``pip install
'histoinfer[server]'``). Run it with ``histoinfer serve``, or embed :func:`create_app`."""

from .app import ServerState, create_app

__all__ = ["ServerState", "create_app"]
