"""Loading ``.pt2`` checkpoints: a ``torch.export`` program or an AOTInductor package.

Both kinds are zip archives in the PT2 archive layout; they are told apart by what the archive
holds (compiled AOTInductor artifacts under ``data/aotinductor/`` versus a serialized program
under ``models/``), never by the file name. Every failure is a :class:`CheckpointError` that names
the file, instead of a stack trace from deep inside torch.

Before anything in the archive is loaded, every member is checked against the CRC-32 its zip
entry records, in the same read of the file that computes its sha256: a damaged file (bit rot,
a bad copy) is an error naming the member, not weights that load and answer other numbers, nor
a damaged compiled library that is opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import threading
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import torch

from ..errors import InferenceError
from .device_thread import one_cpu

__all__ = [
    "CheckpointError",
    "CheckpointKind",
    "LoadedCheckpoint",
    "in_the_folder",
    "load_checkpoint",
    "quieted",
    "resolve_device",
    "sniff_kind",
]

#: One block of quieted warnings at a time in the process (:func:`quieted`).
_QUIETING = threading.RLock()


@contextlib.contextmanager
def quieted(*categories: type[Warning]) -> Iterator[None]:
    """torch's warnings about its own internals left out for the block: of ``categories``,
    or every one. One such block at a time in the process: ``warnings.catch_warnings`` swaps
    the process-wide filters, and two that interleaved (two models loading on two threads)
    left one's filter installed for good (a review: ``-W error`` stopped working)."""
    with _QUIETING, warnings.catch_warnings():
        for category in categories or (Warning,):
            warnings.simplefilter("ignore", category)
        yield


CheckpointKind = Literal["torch.export", "aoti"]
Program = Callable[[torch.Tensor], object]


class CheckpointError(InferenceError, ValueError):
    """A checkpoint or its assets could not be loaded. The message names the file."""

    problem_slug = "checkpoint"
    title = "Checkpoint error"


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    kind: CheckpointKind
    sha256: str
    program: Program
    #: The floating dtype the program takes its batch in (``input_dtype``): the dtype a
    #: ``torch.export`` program was traced with, or an AOTInductor package's recorded one;
    #: float32 when neither says (docs/checkpoints.md, "Reduced precision").
    input_dtype: torch.dtype = torch.float32
    #: ``program`` is the checkpoint's TorchScript translation, already checked against the
    #: exported program when it was made (models/scripted.py, models/script_cache.py)
    scripted: bool = False
    #: The tile size (height, width) a ``torch.export`` program was exported for, where its
    #: graph fixes it; None where it does not say (an AOTInductor package, dynamic sizes).
    input_size: tuple[int, int] | None = None


def sniff_kind(path: Path) -> CheckpointKind:
    """Which kind of ``.pt2`` this is, from its content."""
    return _sniff(path)[0]


def in_the_folder(path: Path) -> str:
    """A hint for a folder given as a checkpoint (``export --out`` makes one): its files."""
    try:
        files = sorted(p.name for p in path.glob("*.pt2") if p.is_file())
    except OSError:
        return ""
    if not files:
        return ""
    return (
        f" (a folder: give the checkpoint file in it, {' or '.join(str(path / f) for f in files)})"
    )


def _sniff(path: Path) -> tuple[CheckpointKind, list[zipfile.ZipInfo]]:
    """Which kind of ``.pt2`` this is, and the archive's members."""
    if not path.exists():
        raise CheckpointError(f"checkpoint file not found: {path}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint path is not a file: {path}{in_the_folder(path)}")
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is not a .pt2 archive (not a readable zip file: {exc})"
        ) from None
    names = [member.filename for member in members]
    if any("/data/aotinductor/" in n for n in names):
        return "aoti", members
    if any("/models/" in n and n.endswith(".json") for n in names):
        return "torch.export", members
    if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
        raise CheckpointError(  # torch.jit.save's layout: torch.save's, with code beside it
            f"checkpoint {path} is a TorchScript archive (torch.jit.save), neither a "
            "torch.export program nor an AOTInductor package: torch.export.export the model "
            "(the nn.Module, not its scripted form) and torch.export.save the program "
            "(docs/checkpoints.md, 'Exporting your own model for h1')"
        )
    if any(n.endswith("/data.pkl") for n in names):  # torch.save's layout
        raise CheckpointError(
            f"checkpoint {path} is a torch.save() file (a state_dict or a pickled module), "
            "neither a torch.export program nor an AOTInductor package: load your weights into "
            "the model, then torch.export.export it and torch.export.save the program "
            "(docs/checkpoints.md, 'Exporting your own model for h1')"
        )
    raise CheckpointError(
        f"checkpoint {path} is a zip file but neither a torch.export program nor an "
        "AOTInductor package (no models/*.json and no data/aotinductor/ entries)"
    )


#: A zip member's local header: signature, then fixed fields up to the name's and the extra
#: field's lengths (the last two), which say where the member's data starts.
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIGNATURE = b"PK\x03\x04"


def verified_sha256(path: Path, members: list[zipfile.ZipInfo]) -> str:
    """The file's sha256, computed in the same read that checks each member's CRC-32.

    ``.pt2`` archives store their members uncompressed: each one's CRC-32 is computed over the
    bytes as they stream past for the sha256, so the check costs the CRC's arithmetic and no
    second read (~0.45 ms a MB: the small reference model's 89 MB took 0.146 s instead of
    0.106, the tiny one's 2.4 MB 5.6 ms instead of 3.7). A compressed member (no writer of
    ``.pt2`` files here makes one) is read and checked through :mod:`zipfile` instead.
    """
    try:
        with path.open("rb") as f:
            spans = _stored_spans(path, f, members)
            crcs = [0] * len(spans)
            done = 0  # spans before this one ended before the current chunk
            digest = hashlib.sha256()
            position = 0
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                end = position + len(chunk)
                view = memoryview(chunk)
                i = done
                while i < len(spans) and spans[i][0] < end:
                    start, stop, _ = spans[i]
                    if stop > position:
                        piece = view[max(start, position) - position : min(stop, end) - position]
                        crcs[i] = zlib.crc32(piece, crcs[i])
                    i += 1
                while done < len(spans) and spans[done][1] <= end:
                    done += 1
                position = end
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} could not be read: {exc}") from None
    damaged = [member for (_, _, member), crc in zip(spans, crcs, strict=True) if crc != member.CRC]
    compressed = [m for m in members if m.compress_type != zipfile.ZIP_STORED]
    if compressed and not damaged:
        damaged = _damaged_compressed(path, compressed)
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path} is damaged: its member {damaged[0].filename!r}{more} does not "
            "match the CRC-32 the archive records for it (the file changed after it was "
            "written: copy or export it again)"
        )
    return digest.hexdigest()


def _stored_spans(
    path: Path, f: BinaryIO, members: list[zipfile.ZipInfo]
) -> list[tuple[int, int, zipfile.ZipInfo]]:
    """Where each stored member's bytes lie in the file (``[start, stop)``), by start."""
    spans = []
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED:
            continue
        f.seek(member.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        fields = _LOCAL_HEADER.unpack(header) if len(header) == _LOCAL_HEADER.size else None
        if fields is None or fields[0] != _LOCAL_SIGNATURE:
            raise CheckpointError(
                f"checkpoint {path} is damaged: the zip header of its member "
                f"{member.filename!r} is not where the archive's directory says"
            )
        start = member.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        spans.append((start, start + member.compress_size, member))
    f.seek(0)
    return sorted(spans, key=lambda span: span[0])


def _damaged_compressed(path: Path, members: list[zipfile.ZipInfo]) -> list[zipfile.ZipInfo]:
    """The compressed ``members`` whose content fails its CRC-32 (or does not decompress)."""
    damaged = []
    with zipfile.ZipFile(path) as archive:
        for member in members:
            try:
                with archive.open(member) as content:  # checks the CRC-32 at the end
                    while content.read(1 << 20):
                        pass
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, OSError):
                damaged.append(member)
    return damaged


def resolve_device(device: str | torch.device | int, path: Path) -> torch.device:
    """``device`` as a ``torch.device`` this process can use, or an error naming the file."""
    # torch's own words for None stop at "expected one of:"; an int is torch's CUDA index
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise CheckpointError(
            f"cannot load checkpoint {path}: device must be a string such as 'cpu' or 'cuda:0', "
            f"a torch.device or a CUDA index; got {type(device).__name__}"
        )
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"cannot load checkpoint {path}: {device!r} is not a torch device ({first_line(exc)})"
        ) from None
    if resolved.type == "cpu":
        if resolved.index:
            # torch takes it, and runs on the one CPU device; here it would have been a device
            # of its own, with a forward thread of its own beside cpu's (two passes at once).
            raise CheckpointError(
                f"cannot load checkpoint {path} on {device!r}: the CPU is one device, with no "
                "index; use device='cpu' (its passes use every core)"
            )
        return one_cpu(resolved)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(
                f"cannot load checkpoint {path} on {device!r}: CUDA is not available here "
                f"(torch {torch.__version__}); use device='cpu' (--device cpu on the command line)"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise CheckpointError(
                f"cannot load checkpoint {path} on {device!r}: only "
                f"{torch.cuda.device_count()} CUDA device(s) here"
            )
    elif resolved.type != "cpu":  # mps, xpu...: torch.<type>.is_available(), where it says
        backend = getattr(torch, resolved.type, None)
        available = getattr(backend, "is_available", None)
        if callable(available) and not available():
            raise CheckpointError(
                f"cannot load checkpoint {path} on {device!r}: {resolved.type} is not available "
                f"here (torch {torch.__version__}); use device='cpu' (--device cpu on the "
                f"command line)"
            )
    return resolved


def _load_program(path: Path, kind: CheckpointKind, device: torch.device) -> Program:
    with quieted(FutureWarning):  # torch's own pytree deprecations, on every load
        if kind == "aoti":
            import torch._inductor as inductor

            index = device.index if device.type == "cuda" and device.index is not None else -1
            package = inductor.aoti_load_package(str(path), device_index=index)
            # A package is compiled for one device type and cannot be moved to another.
            compiled_for = package.get_metadata().get("AOTI_DEVICE_KEY", device.type)
            if compiled_for != device.type:
                raise ValueError(
                    f"the AOTInductor package was compiled for {compiled_for!r}; "
                    f"compile one for {device.type!r} (or load it with device={compiled_for!r})"
                )
            return package  # type: ignore[no-any-return]
        program = torch.export.load(str(path)).module()
        program.to(device)
        return program  # type: ignore[no-any-return]


#: The metadata key an AOTInductor package records its input dtype under (docs/checkpoints.md):
#: ``aoti_compile_and_package(..., inductor_configs={"aot_inductor.metadata": {...}})``.
AOTI_INPUT_DTYPE_KEY = "input_dtype"


def input_dtype(program: object) -> torch.dtype:
    """The floating dtype the program's input is in: float32 unless the program says otherwise.

    A ``torch.export`` program says so in its graph, where the input carries the example it was
    traced with. An AOTInductor package cannot be asked; it says so only if its metadata records
    it (``AOTI_INPUT_DTYPE_KEY``), and is taken to want float32 otherwise, as the contract says.
    """
    get_metadata = getattr(program, "get_metadata", None)
    if get_metadata is not None:  # an AOTInductor package
        name = get_metadata().get(AOTI_INPUT_DTYPE_KEY, "float32")
        # 'torch.bfloat16' is what str(torch.bfloat16) gives: accepted as 'bfloat16'.
        dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"its metadata says {AOTI_INPUT_DTYPE_KEY}={name!r}, which is not the name of a "
                "torch floating dtype (e.g. 'bfloat16')"
            )
        return dtype
    graph = getattr(program, "graph", None)
    for node in getattr(graph, "nodes", ()):
        if node.op == "placeholder":
            example = node.meta.get("val")
            dtype = getattr(example, "dtype", None)
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                return dtype
            break
    return torch.float32


def input_size(program: object) -> tuple[int, int] | None:
    """The (height, width) of the tiles a ``torch.export`` program takes, where its graph fixes
    them (the example it was traced with, sizes not made dynamic); None where it does not say."""
    graph = getattr(program, "graph", None)
    nodes = getattr(graph, "nodes", ())
    for node in nodes if isinstance(nodes, Iterable) else ():  # a TorchScript graph's is a method
        if node.op == "placeholder":
            shape = getattr(node.meta.get("val"), "shape", None)
            if shape is not None and len(shape) == 4:
                height, width = shape[2], shape[3]
                if type(height) is int and type(width) is int:  # a SymInt is dynamic
                    return height, width
            break
    return None


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (torch's run to pages), or its type."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", *, script_cache: bool = False
) -> LoadedCheckpoint:
    """Load a ``.pt2`` file of either kind onto ``device``. With ``script_cache`` (for a
    model class that scripts its program: ``ServerModel.script_program``), a ``torch.export``
    program bound for a CPU is read from its saved TorchScript translation when there is one
    (models/script_cache.py: ~0.1 s instead of ~4); ``program`` is then a ScriptModule from
    the start, not the fx module a first load scripts."""
    path = Path(path).expanduser()
    kind, members = _sniff(path)
    resolved = resolve_device(device, path)
    sha256 = verified_sha256(path, members)  # before anything in it is loaded
    if script_cache and kind == "torch.export" and resolved.type == "cpu":
        from . import script_cache as cache

        cached = cache.load(sha256)
        if cached is not None:
            module, dtype, size = cached
            return LoadedCheckpoint(
                path, kind, sha256, module, input_dtype=dtype, scripted=True, input_size=size
            )
    try:
        program = _load_program(path, kind, resolved)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} ({kind}) could not be loaded on device {str(resolved)!r}: "
            f"{first_line(exc)}"
        ) from exc
    try:
        dtype = input_dtype(program)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path} ({kind}): {exc}") from None
    return LoadedCheckpoint(
        path=path,
        kind=kind,
        sha256=sha256,
        program=program,
        input_dtype=dtype,
        input_size=input_size(program),
    )
