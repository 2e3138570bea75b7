"""A ``torch.export`` program's graph run by TorchScript's interpreter: the same ATen ops, in C++.

Why. ``torch.export.load(...).module()`` is an fx ``GraphModule``: generated Python that calls
one ATen op after another. Each op releases the GIL while it computes and must take it back
before the next one starts, so beside a thread that runs Python (an event loop waking callers,
a decoder parsing JSON) every op boundary can wait up to the interpreter's switch interval
(5 ms) for it. Measured on the tiny reference model, one thread, a pass of 16 tiles: 1.45-1.54
ms a tile alone, **12.4-13.0 ms a tile beside a pure-Python thread**; the same graph scripted:
1.45-1.53 alone, 2.2 beside it (docs/benchmarks-history.md, "Session 10"). TorchScript's
interpreter runs the whole graph in C++ with the GIL released.

How. The graph is copied; the export's input-guard call (a Python submodule: our own checks run
before any pass) is dropped; each ATen overload becomes its packet (TorchScript resolves the
overload from the arguments); ``torch.jit.script`` compiles it. The scripted module shares the
original's parameters (no second copy of the weights).

Trust. It is used only if it returns exactly what the fx module returns (``torch.equal``) on the
model's load-time probe, after the interpreter has optimized the graph; anything else (a graph
TorchScript cannot compile, a different value, a future torch without TorchScript) keeps the fx
module, and :func:`script_program` says why.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence

import torch

from .checkpoint import first_line

__all__ = ["script_program", "scripted_equal"]

#: calls of the scripted module before its outputs are compared: TorchScript's profiling
#: executor runs the graph as written once (one profiled run, torch's default), then optimizes
#: it; the optimized graph is the one that must agree
OPTIMIZE_AFTER_CALLS = 2


def script_program(program: object) -> tuple[torch.jit.ScriptModule | None, str]:
    """``program``'s graph compiled by TorchScript, or ``None`` and the reason it was not."""
    if not isinstance(program, torch.fx.GraphModule):
        return None, f"not an fx GraphModule ({type(program).__name__})"
    with warnings.catch_warnings():
        # torch warns about its own internals on the copy and about the generated module's
        # annotations on every compile.
        warnings.simplefilter("ignore")
        try:
            scripted = torch.jit.script(_plain_graph_module(program))
        except Exception as exc:
            return None, f"TorchScript could not compile its graph: {_compile_error(exc)}"
    return scripted, "compiled"


def _plain_graph_module(program: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``program`` that TorchScript can compile, sharing its parameters."""
    graph = copy.deepcopy(program.graph)
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            # export's Python checks of the input's shape; ServerModel checks it before a pass
            graph.erase_node(node)
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target is torch.ops.aten.sym_size.int:
                node.target = torch.ops.aten.size.int
            node.target = node.target.overloadpacket  # TorchScript resolves the overload
    graph._codegen = torch.fx.graph.CodeGen()  # plain arguments, not export's pytree
    return torch.fx.GraphModule(program, graph)


def _compile_error(exc: BaseException) -> str:
    """TorchScript's first line, and the generated line it points at (the first line alone is
    often just "attribute lookup is not defined on builtin:")."""
    lines = str(exc).splitlines()
    for i, line in enumerate(lines):
        if "<--- HERE" in line and i > 0:
            return f"{first_line(exc)} at `{lines[i - 1].strip()[:120]}`"
    return first_line(exc)


def scripted_equal(
    original: Callable[[torch.Tensor], object],
    scripted: Callable[[torch.Tensor], object],
    batches: Sequence[torch.Tensor],
) -> str | None:
    """``None`` if ``scripted`` returns exactly what ``original`` does on every batch (after
    the interpreter's optimization); otherwise what differed, or what failed."""
    for batch in batches:
        try:
            want = original(batch)
        except Exception as exc:
            # export's own guards refuse it (a batch dimension exported static, say): what the
            # program does not take cannot be compared, and its fx module keeps refusing it
            return f"the program itself fails on a batch of {len(batch)}: {first_line(exc)}"
        try:
            for _ in range(OPTIMIZE_AFTER_CALLS):
                got = scripted(batch)
        except Exception as exc:
            return f"the scripted graph failed on a batch of {len(batch)}: {first_line(exc)}"
        if not _same(want, got):
            return f"the scripted graph's outputs differ on a batch of {len(batch)}"
    return None


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Sequence) and isinstance(b, Sequence) and not isinstance(a, str):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return False
