"""A torch.export program's graph runs in TorchScript's interpreter only where it answers exactly
as the program's own fx module does; otherwise the fx module runs, and the model says why."""

from __future__ import annotations

import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from helpers import save_program

from histoinfer.models import BatchOutput, ServerModel, base, build_server_model, shards
from histoinfer.models.device_thread import device_thread
from histoinfer.models.h1 import H1ServerModel
from histoinfer.models.script_cache import CACHE_ENV
from histoinfer.models.scripted import script_program, scripted_equal
from histoinfer.schema import Mode


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
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def off_by_a_little(program: object) -> tuple[object, str]:
        def scripted(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            predictions, embedding = program(x)  # type: ignore[operator]
            return predictions + 1e-6, embedding

        return scripted, "compiled"

    monkeypatch.setattr(base, "script_program", off_by_a_little)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # not the session's: its entry is good
    model = build_server_model("h1", tiny_checkpoint)
    assert model.runner == ("fx GraphModule (the scripted graph's outputs differ on a batch of 2)")
    assert isinstance(model.checkpoint.program, torch.fx.GraphModule)
    assert not list(tmp_path.iterdir())  # and is not kept for the next load
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


def test_scripted_equal_compares_bit_for_bit() -> None:
    """NaN answers NaN alike (torch.equal says they differ: a model answering NaN for the probe's
    random tiles ran as fx); -0.0 is not 0.0 (a response writes them differently)."""
    batches = [torch.ones(2, 3)]

    def nan(x: torch.Tensor) -> torch.Tensor:
        return x * float("nan")

    def zero(x: torch.Tensor) -> torch.Tensor:
        return x * 0.0

    def negative_zero(x: torch.Tensor) -> torch.Tensor:
        return x * -0.0

    assert scripted_equal(nan, lambda x: x * float("nan"), batches) is None
    assert scripted_equal(zero, negative_zero, batches) == (
        "the scripted graph's outputs differ on a batch of 2"
    )


# -- what a program returns -----------------------------------------------------------------


class _Backbone(torch.nn.Module):
    """An embedding-only backbone: one tensor out, [B, 96] (the tiny model's embedding size)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patches = torch.nn.Conv2d(3, 96, 16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.patches(x).mean(dim=(2, 3))


class _Embedder(ServerModel):
    modes = ("embed",)

    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> BatchOutput:
        return BatchOutput(None, self.checkpoint.program(batch.float().div(255)))


class _FxEmbedder(_Embedder):
    script_program = False


def test_a_program_returning_one_tensor_runs_scripted_and_answers_as_its_fx_module(
    copy_of_tiny: Path,
) -> None:
    # Regression: the scripted graph returned a 1-tuple where the program returns a tensor, the
    # check took that for different outputs, and every single-output program ran as fx.
    path = save_program(_Backbone().eval(), copy_of_tiny)
    model = _Embedder.from_files(path)
    assert model.runner == "TorchScript interpreter"
    assert isinstance(model.checkpoint.program, torch.jit.ScriptModule)
    fx = _FxEmbedder.from_files(path)
    assert isinstance(fx.checkpoint.program, torch.fx.GraphModule)
    for n in (1, 5):
        batch = tiles(n, seed=n)
        got, want = model.forward_batch(batch, "embed"), fx.forward_batch(batch, "embed")
        assert isinstance(got.embedding, torch.Tensor) and isinstance(want.embedding, torch.Tensor)
        assert got.embedding.shape == (n, 96)
        assert torch.equal(got.embedding, want.embedding)


Pair = namedtuple("Pair", "mean total")


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=(2, 3))


def _total(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=(2, 3))


def _peak(x: torch.Tensor) -> torch.Tensor:
    return x.amax(dim=(2, 3))


class _Returns(torch.nn.Module):
    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> object:
        a, b, c = _mean(x), _total(x), _peak(x)
        return {
            "tensor": a,
            "1-tuple": (a,),
            "pair": (a, b),
            "three": (a, b, c),
            "list": [a, b],
            "dict": {"mean": a, "total": b},
            "nested": (a, [b, c]),
            "dict of tuple": {"mean": a, "rest": (b, c)},
            "with None": (a, None),
            "named tuple": Pair(a, b),
        }[self.shape]


def _exported(shape: str) -> torch.fx.GraphModule:
    batch = torch.export.Dim("batch", min=1, max=8)
    example = (torch.zeros(2, 3, 8, 8),)
    program = torch.export.export(_Returns(shape), example, dynamic_shapes={"x": {0: batch}})
    return program.module()  # type: ignore[return-value]


@pytest.mark.parametrize(
    "shape",
    [
        "tensor",
        "1-tuple",
        "pair",
        "three",
        "list",
        "dict",
        "nested",
        "dict of tuple",
        "with None",
    ],
)
def test_the_scripted_graph_returns_what_the_program_returns(shape: str) -> None:
    program = _exported(shape)
    scripted, why = script_program(program)
    assert scripted is not None, why
    batches = [torch.randn(2, 3, 8, 8), torch.randn(1, 3, 8, 8)]
    assert scripted_equal(program, scripted, batches) is None
    got, want = scripted(batches[0]), program(batches[0])
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)


def test_what_the_scripted_graph_cannot_return_alike_keeps_the_fx_module_and_says_why() -> None:
    program = _exported("named tuple")  # rebuilt as a plain tuple, a different type
    scripted, _ = script_program(program)
    assert scripted is not None
    batches = [torch.randn(2, 3, 8, 8)]
    assert scripted_equal(program, scripted, batches) == (
        "the scripted graph returns a tuple of 2 where the program returns a Pair of 2 on a "
        "batch of 2"
    )


def test_scripted_equal_names_a_different_structure() -> None:
    def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(dim=1)

    def one(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    batches = [torch.ones(2, 3)]
    assert scripted_equal(one, lambda x: (one(x),), batches) == (
        "the scripted graph returns a tuple of 1 where the program returns a Tensor on a batch of 2"
    )
    assert scripted_equal(pair, lambda x: [*pair(x)], batches) == (
        "the scripted graph returns a list of 2 where the program returns a tuple of 2 on a "
        "batch of 2"
    )
    assert scripted_equal(
        lambda x: {"a": one(x), "b": one(x)}, lambda x: {"b": one(x), "a": one(x)}, batches
    ) == (
        "the scripted graph returns a dict ('b', 'a') where the program returns a dict "
        "('a', 'b') on a batch of 2"
    )
    # The same structure, one value off: the values differ.
    assert scripted_equal(pair, lambda x: (x * 2, x.sum(dim=1) + 1), batches) == (
        "the scripted graph's outputs differ on a batch of 2"
    )


# -- the program's own checks ----------------------------------------------------------------


class _Checks(torch.nn.Module):
    """A run-time check of the kind a model owner writes, on a value of the batch."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "assert_async":  # no message of its own: torch's
            torch._assert_async(x.amax() < 2.0)
        elif self.kind == "assert_async_msg":
            torch._assert_async(x.amax() < 2.0, "tile too bright")
        else:  # torch._check on a Python number: export's _assert_scalar
            torch._check(x.amax().item() < 2.0)
        return x.mean(dim=(2, 3)), x.amax(dim=(2, 3))


def _program(module: torch.nn.Module) -> torch.fx.GraphModule:
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(
        module, (torch.zeros(2, 3, 8, 8),), dynamic_shapes={"x": {0: batch}}
    )
    return program.module()  # type: ignore[return-value]


@pytest.mark.parametrize("kind", ["assert_async", "assert_async_msg", "check_scalar"])
def test_the_programs_own_checks_are_raised_by_the_scripted_graph(kind: str) -> None:
    """Regression: TorchScript drops an op that returns nothing as dead code, so the scripted
    graph answered what its program refuses (a user trial)."""
    from histoinfer.models.scripted import interpreter_error

    fx = _program(_Checks(kind))
    scripted, why = script_program(fx)
    assert scripted is not None, why
    fine, bright = torch.zeros(2, 3, 8, 8), torch.full((2, 3, 8, 8), 3.0)
    assert scripted_equal(fx, scripted, [fine, fine[:1]]) is None
    with pytest.raises(RuntimeError) as want:
        fx(bright)
    for _ in range(3):  # the optimized graph too (the interpreter optimizes after a call)
        with pytest.raises(Exception) as got:  # torch.jit.Error: unwrapped below
            scripted(bright)
        unwrapped = interpreter_error(got.value)
        assert (type(unwrapped), str(unwrapped)) == (RuntimeError, str(want.value))
        scripted(fine)


def test_a_graph_with_another_op_that_returns_nothing_keeps_the_fx_module() -> None:
    fx = _program(_Checks("assert_async_msg"))
    output = next(node for node in fx.graph.nodes if node.op == "output")
    with fx.graph.inserting_before(output):
        fx.graph.call_function(torch.ops.aten._print.default, ("a side effect",))
    fx.recompile()
    scripted, why = script_program(fx)
    assert scripted is None
    assert (
        why
        == "its graph calls aten._print.default, which returns nothing: TorchScript would drop it"
    )
