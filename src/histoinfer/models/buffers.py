"""``InputBuffer``: float batch tensors reused across CPU forward passes.

Why: a float32 batch of 64 tiles of 224 px is 38.5 MB. glibc serves an allocation that large
with a fresh ``mmap`` (above its 32 MB ceiling for the heap), and hands it back with ``munmap``
when freed, so every batch page-faulted all 9,400 of its pages in again: converting and
normalizing a batch of 64 took ~12.8 ms on one core instead of ~4.7 ms into a reused tensor
(docs/benchmarks-history.md). CUDA's caching allocator already reuses device memory, so only CPU
batches lease the buffer.

A CPU forward pass may run as shards on several threads at once (models/shards.py), so the
buffer is a small pool: as many tensors as parts have ever run at the same time, each grown to
the largest batch it has held.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["InputBuffer"]


class InputBuffer:
    """Float32 tensors leased to one forward pass each; a lease takes a free one or makes one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        #: data pointers of every tensor of the pool, leased or free
        self._pointers: set[int] = set()

    @contextmanager
    def lease(self, batch: torch.Tensor, device: torch.device) -> Iterator[torch.Tensor]:
        """``batch`` converted to float32 on ``device``, in a tensor of the pool on a CPU."""
        if device.type != "cpu" or batch.device.type != "cpu":
            # Contiguous on the device, whatever the layout it came in (a channels-last stack
            # of decoded tiles: ServerModel.forward_tiles). Asynchronous only to CUDA, whose
            # stream orders the copy before the pass: on MPS such a copy can hold garbage
            # (pytorch/pytorch#139550), and one to the CPU must be whole before it is read.
            x = batch.to(device, non_blocking=device.type == "cuda")
            yield x.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
            return
        with self.take(tuple(batch.shape)) as x:
            yield x.copy_(batch)

    @contextmanager
    def take(self, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
        """An uninitialized float32 CPU tensor of ``shape``, from the pool, for the lease."""
        numel = math.prod(shape)
        storage = self._take(numel)
        try:
            yield storage[:numel].view(shape)
        finally:
            with self._lock:
                self._free.append(storage)

    def _take(self, numel: int) -> torch.Tensor:
        with self._lock:
            if self._free:
                # The largest free one: it most likely fits, and the pool stays small.
                largest = max(range(len(self._free)), key=lambda i: self._free[i].numel())
                storage = self._free.pop(largest)
                if storage.numel() >= numel:
                    return storage
                self._pointers.discard(storage.data_ptr())
                del storage  # freed before the bigger one is made
        storage = torch.empty(numel, dtype=torch.float32)
        with self._lock:
            self._pointers.add(storage.data_ptr())
        return storage

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares memory with a tensor of the pool."""
        if tensor.device.type != "cpu":
            return False
        with self._lock:
            return tensor.untyped_storage().data_ptr() in self._pointers
