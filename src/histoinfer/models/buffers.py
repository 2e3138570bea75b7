"""``InputBuffer``: one float batch tensor reused across forward passes on the CPU.

Why: a float32 batch of 64 tiles of 224 px is 38.5 MB. glibc serves an allocation that large
with a fresh ``mmap`` (above its 32 MB ceiling for the heap), and hands it back with ``munmap``
when freed, so every batch page-faulted all 9,400 of its pages in again: converting and
normalizing a batch of 64 took ~12.8 ms on one core instead of ~4.7 ms into a reused tensor
(docs/benchmarks.md). CUDA's caching allocator already reuses device memory, so only CPU batches
lease the buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["InputBuffer"]


class InputBuffer:
    """A float32 tensor leased to one forward pass at a time; it grows to the largest batch.

    A second forward pass running meanwhile (the clients serialize them per device, direct
    callers of ``forward_batch`` may not) gets a fresh tensor instead of waiting.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storage: torch.Tensor | None = None

    @contextmanager
    def lease(self, batch: torch.Tensor, device: torch.device) -> Iterator[torch.Tensor]:
        """``batch`` converted to float32 on ``device``, in the buffer when it is free."""
        if device.type != "cpu" or batch.device.type != "cpu" or not self._lock.acquire(False):
            yield batch.to(device, non_blocking=True).to(torch.float32, copy=True)
            return
        try:
            numel = batch.numel()
            if self._storage is None or self._storage.numel() < numel:
                self._storage = None  # the old one is freed before the bigger one is made
                self._storage = torch.empty(numel, dtype=torch.float32)
            x = self._storage[:numel].view(batch.shape)
            yield x.copy_(batch)
        finally:
            self._lock.release()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares memory with the buffer."""
        storage = self._storage
        return (
            storage is not None
            and tensor.device.type == "cpu"
            and tensor.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
        )
