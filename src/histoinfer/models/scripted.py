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
original's parameters (no second copy of the weights). The graph returns its outputs flat (a
tuple); the fx module rebuilds the structure the program returned (one tensor, a tuple, a list,
a dict) with the export's output spec, so the copy's output node returns that structure itself.

Checks. An op that returns nothing is, to TorchScript, dead code: it drops it. In an exported
graph such ops are the program's own run-time checks (``torch._assert_async(x.mean() < 2,
"...")``, ``torch._check`` on a value), which the fx module raises; a model owner's check must
not vanish in the translation (a user trial: a scripted model answered a tile its own program
refuses). So the translation raises them itself (:func:`_check_tensor`, :func:`_check_scalar`),
and a graph with any other op that returns nothing is not scripted (an in-place one too:
``_foreach_add_``'s effect was lost in a trial of it). The one dropped on purpose is
``_assert_tensor_metadata`` (the dtype and device of a tensor at a ``.to()``: the batch's
dtype and device are checked before every pass). An error raised
inside the interpreter comes out wrapped in its traceback; :func:`interpreter_error` unwraps
it, so a failing pass reads the same whichever way it ran.

Trust. It is used only if it returns exactly what the fx module returns (bit for bit) on the
model's load-time probe, after the interpreter has optimized the graph; anything else (a graph
TorchScript cannot compile, a different value, a future torch without TorchScript) keeps the fx
module, and :func:`script_program` says why.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence

import torch
from torch.utils._pytree import tree_unflatten

from .checkpoint import first_line, quieted

__all__ = ["bitwise_equal", "interpreter_error", "script_program", "scripted_equal"]

#: calls of the scripted module before its outputs are compared: TorchScript's profiling
#: executor runs the graph as written once (one profiled run, torch's default), then optimizes
#: it; the optimized graph is the one that must agree
OPTIMIZE_AFTER_CALLS = 2


def script_program(program: object) -> tuple[torch.jit.ScriptModule | None, str]:
    """``program``'s graph compiled by TorchScript, or ``None`` and the reason it was not."""
    if not isinstance(program, torch.fx.GraphModule):
        return None, f"not an fx GraphModule ({type(program).__name__})"
    # torch warns about its own internals on the copy and about the generated module's
    # annotations on every compile.
    with quieted():
        try:
            plain = _plain_graph_module(program)
        except _Unscriptable as exc:
            return None, str(exc)
        try:
            scripted = torch.jit.script(plain)
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
    for node in list(graph.nodes):
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target in _CHECKS:
                _raise_in_script(node)
                continue
            if node.target in _DROPPED:
                graph.erase_node(node)
                continue
            if not node.target._schema.returns:  # in-place ones too: TorchScript lost one
                raise _Unscriptable(
                    f"its graph calls {node.target}, which returns nothing: TorchScript would "
                    "drop it"
                )
            if node.target is torch.ops.aten.sym_size.int:
                node.target = torch.ops.aten.size.int
            node.target = node.target.overloadpacket  # TorchScript resolves the overload
    _return_as_the_program_does(program, graph)
    graph._codegen = torch.fx.graph.CodeGen()  # plain arguments, not export's pytree
    return torch.fx.GraphModule(program, graph)


class _Unscriptable(Exception):
    """Why a graph is not translated, though TorchScript might compile it."""


def _check_tensor(condition: torch.Tensor, message: str) -> None:
    if not bool(condition):
        raise RuntimeError(message)


def _check_scalar(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_tensor_token(condition: torch.Tensor, message: str, token: torch.Tensor) -> torch.Tensor:
    _check_tensor(condition, message)
    return token


def _check_scalar_token(condition: bool, message: str, token: torch.Tensor) -> torch.Tensor:
    _check_scalar(condition, message)
    return token


_aten = torch.ops.aten
#: the program's own checks, raised as the fx module raises them
_CHECKS: dict[object, Callable[..., object]] = {
    _aten._assert_async.default: _check_tensor,
    _aten._assert_async.msg: _check_tensor,
    _aten._assert_scalar.default: _check_scalar,
    _aten._functional_assert_async.msg: _check_tensor_token,
    _aten._functional_assert_scalar.default: _check_scalar_token,
}
#: the message of ``torch._assert_async(t)`` with none given, as torch words it
_ASSERT_ASYNC_MESSAGE = "Expected Tensor with single nonzero value, but got zero"
_DROPPED = {_aten._assert_tensor_metadata.default}


def _raise_in_script(node: torch.fx.Node) -> None:
    """Make a check node call its TorchScript-compilable twin (which the interpreter keeps)."""
    target = node.target
    if target is _aten._assert_async.default:
        node.args = (node.args[0], _ASSERT_ASYNC_MESSAGE)
    node.target = _CHECKS[target]


#: the last line of an error raised in TorchScript's interpreter: the original error's type
_ORIGINAL = re.compile(r"(?:builtins\.)?([A-Za-z_]\w*(?:Error|Exception)): ?(.*)")
_REBUILT: tuple[type[Exception], ...] = (
    RuntimeError,
    ValueError,
    TypeError,
    IndexError,
    AssertionError,
    NotImplementedError,
)


def interpreter_error(exc: BaseException) -> BaseException:
    """An error raised in TorchScript's interpreter as the fx module would raise it: its type
    and message without the interpreter's traceback ("The following operation failed in the
    TorchScript interpreter. ..."); any other error as it is."""
    text = str(exc)
    if "TorchScript interpreter" not in text.partition("\n")[0]:
        return exc
    lines = text.rstrip("\n").splitlines()
    for i in range(len(lines) - 1, 0, -1):
        found = _ORIGINAL.fullmatch(lines[i])
        if found is not None:
            name = found.group(1)
            rebuilt = next((kind for kind in _REBUILT if kind.__name__ == name), RuntimeError)
            return rebuilt("\n".join([found.group(2), *lines[i + 1 :]]))
    return exc


def _return_as_the_program_does(program: torch.fx.GraphModule, graph: torch.fx.Graph) -> None:
    """Make ``graph`` (a copy of ``program``'s) return what ``program`` returns, not its flat
    outputs.

    An exported graph returns its outputs as one flat tuple, and export's code generator rebuilds
    the program's structure from its output spec: a single tensor, a tuple, a list, a dict. The
    plain code generator TorchScript compiles would return the flat tuple (a 1-tuple for a
    program returning one tensor), which is not what the program returns. Rebuilt here in the
    graph itself, the structure costs nothing per call: ``(a, b)`` stays ``(a, b)``. Another
    structure (a named tuple, a dataclass) is left flat, and the comparison says so.
    """
    out_spec = getattr(getattr(program.graph._codegen, "pytree_info", None), "out_spec", None)
    output = next((node for node in graph.nodes if node.op == "output"), None)
    if out_spec is None or output is None or not isinstance(output.args[0], (tuple, list)):
        return
    try:
        structured = tree_unflatten(list(output.args[0]), out_spec)
    except Exception:  # a spec this torch's pytree cannot rebuild: the flat outputs stay
        return
    if _plain_containers(structured):
        output.args = (structured,)


def _plain_containers(value: object) -> bool:
    """Whether ``value`` is nodes (or constants) in tuples, lists and dicts only: what generated
    code can spell and TorchScript can return."""
    if isinstance(value, (tuple, list, dict)):
        items = value.values() if isinstance(value, dict) else value
        return type(value) in (tuple, list, dict) and all(_plain_containers(v) for v in items)
    return isinstance(value, (torch.fx.Node, int, float, bool, str)) or value is None


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
        shape = _other_structure(want, got)
        if shape is not None:
            return f"the scripted graph returns {shape} on a batch of {len(batch)}"
        if not _same(want, got):
            return f"the scripted graph's outputs differ on a batch of {len(batch)}"
    return None


def _structure(value: object) -> str:
    """``value``'s structure in words: "a Tensor", "a tuple of 2", "a dict ('a', 'b')"."""
    if isinstance(value, torch.Tensor):
        return "a Tensor"
    if isinstance(value, dict):
        return f"a {type(value).__name__} {tuple(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _other_structure(want: object, got: object) -> str | None:
    """How ``got``'s structure differs from ``want``'s, in words, or ``None`` if it does not
    (the containers' types, lengths and keys; values are :func:`_same`'s)."""
    mismatch = f"{_structure(got)} where the program returns {_structure(want)}"
    if type(want) is not type(got) and not (
        isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)
    ):
        return mismatch
    if isinstance(want, dict) and isinstance(got, dict):
        if list(want) != list(got):
            return mismatch
        return next((d for k in want if (d := _other_structure(want[k], got[k])) is not None), None)
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)):
        if len(want) != len(got):
            return mismatch
        return next(
            (
                d
                for w, g in zip(want, got, strict=True)
                if (d := _other_structure(w, g)) is not None
            ),
            None,
        )
    return None


def _same(a: object, b: object) -> bool:
    """Equal values, in containers of the same structure (:func:`_other_structure`)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bitwise_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, Sequence) and isinstance(b, Sequence) and not isinstance(a, str):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b if type(a) is type(b) and isinstance(a, (int, float, bool, str)) else a is b


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: ``torch.equal`` alone is false for NaN against NaN (a
    model with one NaN weight was never scripted nor cached) and true for 0.0 against -0.0
    (which a JSON response writes differently)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
