"""A torch.export program's graph runs in TorchScript's interpreter only where it answers exactly
as the program's own fx module does; otherwise the fx module runs, and the model says why."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from histoinfer.models import ServerModel, base, build_server_model, shards
from histoinfer.models.device_thread import device_thread
from histoinfer.models.h1 import H1ServerModel
from histoinfer.models.scripted import script_program, scripted_equal


class FxOnly(H1ServerModel):
    script_program = False


def tiles(n: int, seed: int = 0) -> torch.Tensor:
    seeded = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 224, 224), generator=seeded, dtype=torch.uint8)


def test_the_reference_program_runs_scripted_and_answers_exactly_as_its_fx_module(
    tiny_model: ServerModel, tiny_checkpoint: Path
) -> None:
    assert tiny_model.runner == "TorchScript interpreter"
    assert isinstance(tiny_model.checkpoint.program, torch.jit.ScriptModule)
    fx = FxOnly.from_files(tiny_checkpoint)
    assert fx.runner == "fx GraphModule (script_program is False)"
    assert isinstance(fx.checkpoint.program, torch.fx.GraphModule)
    for n in (1, 5, 23):  # sizes other than the load-time check's
        batch = tiles(n, seed=n)
        want = fx.forward_batch(batch, "predict_with_embedding")
        got = tiny_model.forward_batch(batch, "predict_with_embedding")
        assert want.predictions is not None and got.predictions is not None
        assert want.embedding is not None and got.embedding is not None
        assert torch.equal(got.predictions, want.predictions)
        assert torch.equal(got.embedding, want.embedding)


@pytest.mark.timeout(60)
def test_scripted_passes_from_several_threads_at_once_answer_as_one_pass(
    tiny_model: ServerModel,
) -> None:
    # Sharded CPU passes call the scripted module from the device's thread and its helpers.
    batch = tiles(32, seed=7)
    whole = tiny_model.forward_batch(batch, "predict")
    sharded = device_thread("cpu").call(shards.forward, tiny_model, batch, "predict", 2)
    assert whole.predictions is not None and sharded.predictions is not None
    torch.testing.assert_close(sharded.predictions, whole.predictions)
    results: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        out = tiny_model.forward_batch(batch[i * 8 : (i + 1) * 8], "predict")
        assert out.predictions is not None
        results[i] = out.predictions

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    together = torch.cat([results[i] for i in range(4)])
    torch.testing.assert_close(together, whole.predictions)


def test_a_scripted_graph_that_answers_differently_is_not_used(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def off_by_a_little(program: object) -> tuple[object, str]:
        def scripted(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            predictions, embedding = program(x)  # type: ignore[operator]
            return predictions + 1e-6, embedding

        return scripted, "compiled"

    monkeypatch.setattr(base, "script_program", off_by_a_little)
    model = build_server_model("h1", tiny_checkpoint)
    assert model.runner == ("fx GraphModule (the scripted graph's outputs differ on a batch of 2)")
    assert isinstance(model.checkpoint.program, torch.fx.GraphModule)
    out = model.forward_batch(tiles(3), "predict")  # and it serves, with the fx module
    assert out.predictions is not None and out.predictions.shape == (3, 307)


def unscriptable(x: torch.Tensor) -> torch.Tensor:
    return x * sum(v for v in (1, 2))  # TorchScript has no generator expressions


torch.fx.wrap("unscriptable")  # a leaf of the traced graph, as a custom Python op would be


class Odd(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return unscriptable(x) + 1


def test_what_torchscript_cannot_compile_keeps_the_fx_module() -> None:
    scripted, why = script_program(torch.fx.symbolic_trace(Odd()))
    assert scripted is None
    assert why.startswith("TorchScript could not compile its graph: ")
    assert " at `" in why  # the generated line TorchScript points at, not only its first line
    scripted, why = script_program(Odd())
    assert scripted is None and why == "not an fx GraphModule (Odd)"


def test_scripted_equal_names_what_differed() -> None:
    def program(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(dim=1)

    def wrong_dtype(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * 2).double(), x.sum(dim=1)

    def fails_on_one(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(x) == 1:
            raise RuntimeError("size 1\nmore")
        return program(x)

    batches = [torch.ones(2, 3), torch.ones(1, 3)]
    assert scripted_equal(program, program, batches) is None
    assert scripted_equal(program, wrong_dtype, batches) == (
        "the scripted graph's outputs differ on a batch of 2"
    )
    assert scripted_equal(program, fails_on_one, batches) == (
        "the scripted graph failed on a batch of 1: size 1"
    )
    assert scripted_equal(program, lambda x: program(x)[0], batches) is not None
    # What the program itself refuses (a batch dimension exported static) cannot be compared.
    assert scripted_equal(fails_on_one, program, batches) == (
        "the program itself fails on a batch of 1: size 1"
    )
