"""The histoinfer microservice: FastAPI over the in-process client (the ``server`` extra:
``pip install -e '.[server]'`` in a clone). Run it with ``histoinfer serve``, or embed
:func:`create_app`."""

from .app import ServerState, create_app

__all__ = ["ServerState", "create_app"]
