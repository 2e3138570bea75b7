"""The ``Client`` protocol (SPEC §2.1): what every backend implements, in full.

Bodies and responses are JSON *strings*. The double serialization is deliberate: it is what makes
:class:`~histoinfer.InProcessClient` and :class:`~histoinfer.HttpClient` drop-in replacements for
each other, byte for byte.
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol, Self, TypeVar, runtime_checkable

__all__ = ["Client"]


@runtime_checkable
class Client(Protocol):
    """The one client API: what :class:`~histoinfer.InProcessClient` (in this process) and
    :class:`~histoinfer.HttpClient` (against ``histoinfer serve``) both implement, in full.

    Each mode (``predict``, ``embed``, ``predict_with_embedding``) comes in three forms: a sync
    call (``predict``), an async call on asyncio or trio (``predict_async``: by default,
    concurrent calls are batched together by the dynamic batcher, in this process or at the
    server), and an explicit batch (``predict_batch``: the responses in the order of the
    bodies; one invalid body fails the whole call, naming every bad position). A body is one
    tile's request and a response one tile's answer, both as JSON strings
    (docs/wire-format.md).

    Every failure raises :class:`~histoinfer.errors.InferenceError` or a subclass:
    ``InvalidRequestError`` (bad JSON, a schema violation, an undecodable image, a body that is
    not a string; its subclass ``UnsupportedModeError`` for a mode the model does not offer),
    ``ModelExecutionError`` (the forward pass failed), ``OverloadedError`` (a full queue, a
    server still loading; its subclass ``DeadlineExceededError`` for a request not run before
    its deadline) and ``ClientClosedError`` (a call after ``close()``). Both clients raise the
    same class with the same message for the same input; ``HttpClient`` raises a plain
    ``InferenceError`` when the server cannot be reached after its retries. (One exception:
    a model's own code that raises ``SystemExit`` or another ``BaseException`` on a worker
    thread fails its requests with :class:`~histoinfer.errors.ThreadAbortedError`, a
    ``RuntimeError``: not a refusal of the request.)

    Use it as a type, to accept either client. ``isinstance(obj, Client)`` checks that the
    methods exist, not their signatures.
    """

    def predict(self, body: str) -> str:
        """One tile's response JSON; its ``output`` is the model's prediction (gene values, or
        a grid such as a tissue mask's, flattened: the metadata's ``output_shape``)."""
        ...

    def embed(self, body: str) -> str:
        """One tile's response JSON; its ``output`` is the tile's embedding."""
        ...

    def predict_with_embedding(self, body: str) -> str:
        """One tile's response JSON with ``output`` (the prediction) and ``embedding``, from one
        forward pass."""
        ...

    def metadata(self) -> str:
        """The model's metadata JSON (``ModelMetadata``), with the batching settings in force."""
        ...

    async def predict_async(self, body: str, session: object | None = None) -> str:
        """As :meth:`predict`, awaited. ``session``: an ``httpx.AsyncClient`` for
        ``HttpClient`` to send through; ``InProcessClient`` accepts it and ignores it."""
        ...

    async def embed_async(self, body: str, session: object | None = None) -> str:
        """As :meth:`embed`, awaited; ``session`` as in :meth:`predict_async`."""
        ...

    async def predict_with_embedding_async(self, body: str, session: object | None = None) -> str:
        """As :meth:`predict_with_embedding`, awaited; ``session`` as in :meth:`predict_async`."""
        ...

    def predict_batch(self, bodies: list[str]) -> list[str]:
        """:meth:`predict` for each body, as one explicit batch; responses in the same order.

        All or nothing: one invalid body fails the call, naming every bad position, before
        anything is computed; so every tile is decoded, and held (~0.3 MB a 224-px tile),
        before the first pass. A whole slide goes in chunks of a few thousand bodies, or
        through :meth:`predict_async` with bounded concurrency, which holds only the tiles
        in flight."""
        ...

    def embed_batch(self, bodies: list[str]) -> list[str]:
        """:meth:`embed` for each body, as one explicit batch; responses in the same order."""
        ...

    def predict_with_embedding_batch(self, bodies: list[str]) -> list[str]:
        """:meth:`predict_with_embedding` for each body, as one explicit batch; responses in
        the same order."""
        ...

    def close(self) -> None:
        """Finish what is already queued, then release the client's threads and connections;
        later calls raise ``ClientClosedError``."""
        ...

    async def aclose(self) -> None:
        """As :meth:`close`, awaited."""
        ...

    def __enter__(self) -> Self:
        """The client itself; :meth:`close` on leaving the block."""
        ...

    # Positional-only, here and in __aexit__: a test double's own parameter names match.
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None:
        """Close the client."""
        ...

    async def __aenter__(self) -> Self:
        """The client itself; :meth:`aclose` on leaving the block."""
        ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None:
        """Close the client."""
        ...


C = TypeVar("C", bound=type)


def documented_as_client(cls: C) -> C:
    """``cls`` with the :class:`Client` protocol's docstring on each of its own protocol
    methods that has none: ``client.predict?`` in a notebook says what the call does, and
    the text lives in one place."""
    for name, spec in vars(Client).items():
        own = vars(cls).get(name)
        doc = getattr(spec, "__doc__", None)
        if callable(own) and doc and not own.__doc__:
            own.__doc__ = doc
    return cls
