"""``InputBuffer``: the float batch tensor CPU forward passes reuse instead of re-allocating."""

from __future__ import annotations

import dataclasses
import threading
from functools import partial

import pytest
import torch
from concurrency_helpers import join_threads, start_threads

from histoinfer import ServerModel
from histoinfer.models.base import BatchOutput
from histoinfer.models.buffers import InputBuffer
from histoinfer.schema import Mode

CPU = torch.device("cpu")


def tiles(n: int, seed: int = 0, size: int = 8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)


def test_a_lease_is_the_batch_as_float32_and_leaves_the_batch_alone() -> None:
    buffer = InputBuffer()
    batch = tiles(3)
    before = batch.clone()
    with buffer.lease(batch, CPU) as x:
        assert x.dtype == torch.float32 and x.shape == batch.shape and x.is_contiguous()
        assert torch.equal(x, batch.float())
        x.mul_(2)  # what forward_batch does to it
    assert torch.equal(batch, before)


def test_leases_reuse_one_storage_and_grow_only_for_a_bigger_batch() -> None:
    buffer = InputBuffer()
    pointers = []
    for n, seed in [(4, 0), (4, 1), (2, 2), (4, 3), (6, 4), (5, 5)]:
        batch = tiles(n, seed)
        with buffer.lease(batch, CPU) as x:
            assert torch.equal(x, batch.float())  # a smaller batch sees none of an older one
            pointers.append(x.untyped_storage().data_ptr())
    assert len(set(pointers[:4])) == 1  # 4, 4, 2, 4 tiles: one allocation
    assert pointers[4] == pointers[5]  # grown once for 6 tiles, then reused for 5


def test_leases_at_the_same_time_get_tensors_of_their_own_which_the_pool_keeps() -> None:
    # Shards of one forward pass lease at the same time (models/shards.py).
    buffer = InputBuffer()
    first, second = tiles(2, 0), tiles(2, 1)
    with buffer.lease(first, CPU) as a, buffer.lease(second, CPU) as b:
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        assert buffer.holds(a) and buffer.holds(a[1:]) and buffer.holds(b)
        assert torch.equal(a, first.float()) and torch.equal(b, second.float())
    assert not buffer.holds(first.float())
    pointers = {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}
    for _ in range(3):  # released: both are reused, nothing new is made
        with buffer.lease(second, CPU) as c, buffer.lease(first, CPU) as d:
            assert {c.untyped_storage().data_ptr(), d.untyped_storage().data_ptr()} == pointers
            assert torch.equal(c, second.float()) and torch.equal(d, first.float())


def test_a_grown_tensor_replaces_the_smaller_one() -> None:
    buffer = InputBuffer()
    with buffer.lease(tiles(2), CPU):
        pass
    with buffer.lease(tiles(5), CPU) as big:
        assert torch.equal(big, tiles(5).float())
    assert buffer.holds(big)
    assert len(buffer._free) == 1 and len(buffer._pointers) == 1  # one tensor, not two


def test_concurrent_forward_passes_on_one_model_stay_correct(tiny_model: ServerModel) -> None:
    batches = [tiles(3, seed, size=224) for seed in range(4)]
    expected = [tiny_model.forward_batch(b, "predict").predictions for b in batches]
    got: dict[int, torch.Tensor | None] = {}
    start = threading.Barrier(4, timeout=30)

    def work(i: int) -> None:
        start.wait()
        for _ in range(3):
            got[i] = tiny_model.forward_batch(batches[i], "predict").predictions
            assert got[i] is not None and torch.equal(got[i], expected[i])

    threads, errors = start_threads([partial(work, i) for i in range(4)])
    join_threads(threads)
    assert not errors, errors
    assert len(got) == 4


def test_outputs_that_are_views_of_the_input_survive_the_next_batch(
    tiny_model: ServerModel,
) -> None:
    # A program may return its (normalized) input or a view of it; the buffer is overwritten
    # by the next batch, so such outputs must be copied out of it.
    genes, dim = len(tiny_model.assets.gene_names), tiny_model.assets.embedding_size

    def echo(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.flatten(1)
        return flat[:, :genes], flat[:, :dim]

    model = ServerModel(dataclasses.replace(tiny_model.checkpoint, program=echo), tiny_model.assets)
    first = model.forward_batch(tiles(2, 0, size=224), "predict_with_embedding")
    assert first.predictions is not None and first.embedding is not None
    kept = first.predictions.clone(), first.embedding.clone()
    model.forward_batch(tiles(2, 1, size=224), "predict_with_embedding")
    assert torch.equal(first.predictions, kept[0]) and torch.equal(first.embedding, kept[1])
    assert not model._input_buffer.holds(first.predictions)


# -- ServerModel.forward_tiles: tiles normalized straight into the leased batch ----------------


@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("mode", ["predict", "embed", "predict_with_embedding"])
def test_forward_tiles_equals_forward_batch_of_the_stack_bit_for_bit(
    tiny_model: ServerModel, n: int, mode: Mode
) -> None:
    batch = tiles(n, seed=n, size=224)
    rows = list(batch.unbind(0))
    expected = tiny_model.forward_batch(batch, mode)
    got = tiny_model.forward_tiles(rows, mode)
    for ours, theirs in [
        (got.predictions, expected.predictions),
        (got.embedding, expected.embedding),
    ]:
        assert (ours is None) == (theirs is None)
        assert ours is None or torch.equal(ours, theirs)
    assert not tiny_model._input_buffer.holds(got.predictions if mode != "embed" else got.embedding)
    assert torch.equal(torch.stack(rows), batch)  # the tiles are left alone


def test_forward_tiles_leases_the_pool_and_sees_nothing_of_an_older_batch(
    tiny_model: ServerModel,
) -> None:
    model = ServerModel(tiny_model.checkpoint, tiny_model.assets)
    big, small = tiles(4, 0, size=224), tiles(2, 1, size=224)
    model.forward_tiles(list(big), "predict")
    pointers = set(model._input_buffer._pointers)
    out = model.forward_tiles(list(small), "predict").predictions
    assert set(model._input_buffer._pointers) == pointers  # reused, not re-allocated
    assert out is not None and torch.equal(out, model.forward_batch(small, "predict").predictions)


def test_forward_tiles_calls_an_overridden_forward_batch_with_the_stack(
    tiny_model: ServerModel,
) -> None:
    seen: list[torch.Tensor] = []

    class Subclass(ServerModel):
        def forward_batch(self, batch: torch.Tensor, mode: Mode) -> BatchOutput:
            seen.append(batch)
            return super().forward_batch(batch, mode)

    batch = tiles(3, 2, size=224)
    expected = tiny_model.forward_batch(batch, "predict").predictions
    subclass = Subclass(tiny_model.checkpoint, tiny_model.assets)
    seen.clear()  # the load-time probe
    out = subclass.forward_tiles(list(batch), "predict")
    assert len(seen) == 1 and torch.equal(seen[0], batch)
    assert out.predictions is not None and torch.equal(out.predictions, expected)
    # An instance-level wrapper (the GPU check's autocast does this) is honoured too.
    model = ServerModel(tiny_model.checkpoint, tiny_model.assets)
    wrapped = model.forward_batch
    model.forward_batch = lambda b, m: seen.append(b) or wrapped(b, m)  # type: ignore[method-assign]
    model.forward_tiles(list(batch), "predict")
    assert len(seen) == 2 and torch.equal(seen[1], batch)


def test_forward_tiles_of_different_sizes_is_a_clear_error(tiny_model: ServerModel) -> None:
    mixed = [tiles(1, 0, size=224)[0], tiles(1, 1, size=112)[0]]
    with pytest.raises(ValueError, match=r"\(3, 224, 224\) and \(3, 112, 112\)"):
        tiny_model.forward_tiles(mixed, "predict")
    out = tiny_model.forward_tiles([mixed[0]], "predict")  # the model still works
    assert out.predictions is not None and out.predictions.shape[0] == 1
