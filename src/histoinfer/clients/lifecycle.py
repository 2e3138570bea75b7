"""The context-manager half of the ``Client`` protocol, shared by every backend.

A backend implements ``close()`` and ``aclose()``; ``with`` and ``async with`` call them.
Torch-free on purpose: ``HttpClient`` uses it too.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["ClosingContext"]


class ClosingContext:
    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
