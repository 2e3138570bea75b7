"""``ServerModel``: one loaded model on one device, knowing nothing of clients or transports.

It turns a validated :class:`ModelRequest` into a ``uint8`` tile tensor (``prepare_sample``, on
the CPU, thread-safe), runs a batch of them (``forward_tiles``, or ``forward_batch`` of a stacked
one, on the device), and turns one sample's output back into a :class:`ModelResponse`
(``postprocess``).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Self

import torch

from ..errors import (
    InferenceError,
    InvalidRequestError,
    ModelExecutionError,
    UnsupportedModeError,
)
from ..schema import MODES, Mode, ModelMetadata, ModelRequest, ModelResponse
from . import script_cache
from .assets import ASSETS_FILE, ModelAssets, load_assets
from .buffers import InputBuffer
from .checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    first_line,
    load_checkpoint,
    sniff_kind,
)
from .device_thread import device_thread, one_cpu
from .imaging import decode_tile
from .scripted import bitwise_equal, interpreter_error, script_program, scripted_equal

__all__ = [
    "BatchOutput",
    "SampleOutput",
    "ServerModel",
    "hwc_view",
    "non_finite_error",
    "stack_tiles",
]

#: :attr:`ServerModel.batch_layout` where CPU batches are channels-last
CHANNELS_LAST = "channels-last"


def _apart(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """How far apart two outputs are, relative to ``a``'s largest value (or 1, if smaller): 0
    for bitwise-equal ones, infinite for ones that cannot compare or where a NaN differs (a
    NaN would be lost in a ``max`` of several)."""
    if a is None or b is None:
        return 0.0 if a is b else math.inf
    if bitwise_equal(a, b):
        return 0.0
    if a.shape != b.shape or not a.is_floating_point() or not b.is_floating_point():
        return math.inf
    a64, b64 = a.double(), b.double()
    scale = max(1.0, float(a64.abs().max())) if a64.numel() else 1.0
    apart = float((a64 - b64).abs().max()) / scale
    return apart if not math.isnan(apart) else math.inf


def hwc_view(tile: torch.Tensor) -> torch.Tensor | None:
    """A ``[3, H, W]`` tile's pixels as a contiguous ``[H, W, 3]`` view, if its memory is laid
    out so (as decoded tiles are: models/imaging.py); else None."""
    if tile.dim() != 3:
        return None
    pixels = tile.permute(1, 2, 0)
    return pixels if pixels.is_contiguous() else None


def stack_tiles(tiles: Sequence[torch.Tensor], keep_layout: bool) -> torch.Tensor:
    """``tiles`` as one ``[B, 3, H, W]`` batch. With ``keep_layout``, tiles laid out as decoded
    are stacked as they are (plain copies; the batch has channels-last strides), which saves
    an accelerator's feeding thread the transposing copy: the device makes it contiguous."""
    pixels = _pixels(tiles) if keep_layout else None
    if pixels is not None:
        return torch.stack(pixels).permute(0, 3, 1, 2)
    return torch.stack(list(tiles))


def _pixels(tiles: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Every tile's :func:`hwc_view`, or None if one is laid out otherwise."""
    views = []
    for tile in tiles:
        view = hwc_view(tile)
        if view is None:
            return None
        views.append(view)
    return views


log = logging.getLogger(__name__)

# Why a program that took the probe's 2 tiles fails on 1: usually exported for a fixed batch.
_DYNAMIC_BATCH = (
    "export the program with a dynamic batch dimension from 1 (dynamic_shapes={'x': {0: "
    "torch.export.Dim('batch', min=1, max=4096)}}, docs/checkpoints.md) and keep that "
    "dimension in its outputs"
)
_LONE_PROBE_HINT = (
    "; a lone request, and each part of a sharded pass, is one tile: " + _DYNAMIC_BATCH
)
#: a program that takes one tile and fails on two: exported from an example batch of 1,
#: which torch.export specializes to 1 (docs/checkpoints.md)
_BATCH_OF_ONE_HINT = "; it takes a batch of one tile only (exported from one?): " + _DYNAMIC_BATCH
#: a program that fails on two tiles with a guard on its batch's size: exported for another
#: fixed batch (torch.export's guard reads "x.size()[0] == 4")
_FIXED_BATCH_HINT = "; it takes one batch size only (exported without dynamic_shapes?): " + (
    _DYNAMIC_BATCH
)
#: Where loading an untrained checkpoint is announced, once a process for each (its own name:
#: a harness that reports it already can silence it alone).
untrained_log = logging.getLogger("histoinfer.untrained")
_announced: set[str] = set()


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One sample's share of a batch output, as plain floats (ready to serialize)."""

    predictions: list[float] | None
    embedding: list[float] | None
    #: False when the model gave NaN or infinity for this sample (JSON cannot carry them).
    finite: bool = True


@dataclass(frozen=True, slots=True)
class BatchOutput:
    """A forward pass's result for a batch: ``[B, G]`` predictions and/or ``[B, D]`` embedding."""

    predictions: torch.Tensor | None
    embedding: torch.Tensor | None

    def __len__(self) -> int:
        tensor = self.predictions if self.predictions is not None else self.embedding
        return 0 if tensor is None else int(tensor.shape[0])

    @classmethod
    def concat(cls, parts: Sequence[BatchOutput]) -> BatchOutput:
        """The outputs of consecutive parts of one batch, as the batch's output."""

        def cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
            present = [t for t in tensors if t is not None]
            return torch.cat(present) if len(present) == len(tensors) else None

        return cls(
            predictions=cat([p.predictions for p in parts]),
            embedding=cat([p.embedding for p in parts]),
        )

    def split(self) -> list[SampleOutput]:
        # One .tolist() per tensor for the whole batch: far cheaper than one per sample. Shaped
        # predictions (a mask's [B, H, W]) are each tile's values row-major.
        preds = self.predictions.flatten(1).tolist() if self.predictions is not None else None
        embs = self.embedding.tolist() if self.embedding is not None else None
        finite: list[bool] = self._finite_rows().tolist()
        return [
            SampleOutput(
                predictions=preds[i] if preds is not None else None,
                embedding=embs[i] if embs is not None else None,
                finite=finite[i],
            )
            for i in range(len(self))
        ]

    def _finite_rows(self) -> torch.Tensor:
        mask = torch.ones(len(self), dtype=torch.bool)
        for tensor in (self.predictions, self.embedding):
            if tensor is not None:
                mask &= torch.isfinite(tensor).flatten(1).all(dim=1).cpu()
        return mask


#: how far two answers to the same tile may differ, relative to the largest value in them
_REPEAT_TOLERANCE = 0.05


def _gap(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The largest difference between ``a`` and ``b`` if it is over the tolerance, else None."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if a.numel() == 0:
        return None
    gap = float((a - b).abs().max())
    if math.isnan(gap):  # a pass answered NaN (or infinity) where the other did not
        return float("inf")
    scale = max(float(a.abs().max()), float(b.abs().max()))
    return gap if gap > _REPEAT_TOLERANCE * scale + 1e-6 else None


def non_finite_error(model: str, where: str, step: str = "") -> ModelExecutionError:
    """The error of outputs with NaN or infinity (``where``: "for" one tile, or several, or
    "at" a batch position), blaming ``step`` if one is named (else the model's pass). JSON has
    no NaN: serialized, it would become null and break the response schema."""
    blame = f"model {model!r}: {step} returned" if step else f"model {model!r} produced"
    return ModelExecutionError(f"{blame} non-finite values (NaN or infinity) {where}")


def assets_folder(checkpoint_path: str | Path, assets_dir: str | Path | None = None) -> Path:
    """Where :meth:`ServerModel.from_files` looks for ``model.json``: ``assets_dir``, else the
    checkpoint's own folder."""
    return Path(assets_dir if assets_dir is not None else Path(checkpoint_path).parent).expanduser()


class ServerModel:
    """A tile model whose program maps a normalized float batch to ``(predictions, embedding)``.

    Subclass it (and :func:`~histoinfer.register_model` the subclass) to serve another model;
    override ``forward_batch`` if your program's outputs differ.
    """

    #: Modes this model class serves; others raise :class:`UnsupportedModeError`. A
    #: checkpoint's ``model.json`` may narrow them (its ``modes``): an instance's are its own.
    modes: tuple[Mode, ...] = MODES
    #: Whether a CPU batch of 2+ tiles may run as parts on several threads at once (models/
    #: shards.py);
    #: ``forward_batch`` must then be safe to call from several threads at once, as the
    #: built-in one is. Set it to False in a subclass whose ``forward_batch`` is not.
    shard_cpu_passes: ClassVar[bool] = True
    #: Whether a ``torch.export`` program's graph may run in TorchScript's interpreter (models/
    #: scripted.py: no GIL between ops), which it does only if it returns exactly what the
    #: program returns on the load-time probe. Set it to False to always run the fx module.
    script_program: ClassVar[bool] = True
    #: Whether a CPU batch of decoded tiles may be laid out channels-last (``[B, 3, T, T]``
    #: with NHWC strides: each tile's pixels as they were decoded, no transposing copy), which
    #: it is only if the program returns exactly what it returns on a contiguous batch on the
    #: load-time probe. Set it to False to always pass contiguous batches.
    channels_last_batches: ClassVar[bool] = True
    #: How far a channels-last batch's outputs may be from a contiguous batch's, relative to
    #: each output's largest value (or 1, if smaller), for that layout to be used; 0: exactly
    #: equal. A convolutional network's CPU kernels sum in another order on channels-last
    #: batches (~1e-8 apart), which keeps it on contiguous ones; set e.g. 1e-5 to accept that
    #: for the layout's speed (a user's CNN ran 1.5-1.7x as fast: docs/checkpoints.md).
    channels_last_tolerance: ClassVar[float] = 0.0
    #: Whether a tile's answer is the same each time, and whatever tiles share its batch: the
    #: load-time probe checks it, refusing a module exported in training mode (dropout on,
    #: batch statistics). Set it to False in a subclass whose answers are random by design
    #: (Monte Carlo dropout) or depend on the batch by design: the check is then skipped.
    repeatable_outputs: ClassVar[bool] = True
    #: Limits on one tile's encoded size and decoded pixel count.
    max_image_bytes: ClassVar[int] = 32 * 1024 * 1024
    max_image_pixels: ClassVar[int] = 4096 * 4096

    def __init__(self, checkpoint: LoadedCheckpoint, assets: ModelAssets, device: str = "cpu"):
        self.checkpoint = checkpoint
        self.assets = assets
        named = assets.directory / ASSETS_FILE if assets.directory else ASSETS_FILE
        if assets.modes is not None:
            unserved = [mode for mode in assets.modes if mode not in self.modes]
            if unserved:
                raise CheckpointError(
                    f"model assets {named} are invalid for {type(self).__name__}: modes "
                    f"{', '.join(unserved)} not among the modes it serves "
                    f"({', '.join(self.modes)})"
                )
            self.modes = tuple(mode for mode in self.modes if mode in assets.modes)
        #: the one output a program may return alone, for a model that serves one of these
        self._alone: Mode | None = (
            self.modes[0] if tuple(self.modes) in (("embed",), ("predict",)) else None
        )
        predicting = [m for m in self.modes if m != "embed"]
        if predicting and not assets.output_size:
            raise CheckpointError(
                f"model assets {named} are invalid for {type(self).__name__}: gene_names is "
                f"empty, but it serves {', '.join(predicting)}: name the genes (a list, or a "
                f"gene list file in the assets directory), give the output's output_shape (a "
                f'tissue mask\'s [14, 14]), or serve embed alone ("modes": ["embed"] in '
                f"model.json)"
            )
        embedding = [m for m in self.modes if m != "predict"]
        if embedding and assets.embedding_size is None:
            raise CheckpointError(
                f"model assets {named} are invalid for {type(self).__name__}: embedding_size "
                f"is missing, but it serves {', '.join(embedding)}: give the embedding's "
                f'width, or serve predict alone ("modes": ["predict"] in model.json)'
            )
        self.device = one_cpu(torch.device(device))
        mean = torch.tensor(assets.mean, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(assets.std, dtype=torch.float32).view(1, 3, 1, 1)
        # (x / 255 - mean) / std  ==  x * scale + shift: one fused pass over the batch.
        self._scale = (1.0 / (255.0 * std)).to(self.device)
        self._shift = (-mean / std).to(self.device)
        # The same along a row of a channels-last batch, [T, 3T] (_run_channels_last).
        self._row_scale = self._scale.reshape(3).repeat(assets.tile_size)
        self._row_shift = self._shift.reshape(3).repeat(assets.tile_size)
        self._input_buffer = InputBuffer()
        self._metadata = self._build_metadata()
        if not assets.trained and checkpoint.sha256 not in _announced:
            _announced.add(checkpoint.sha256)
            untrained_log.warning(
                "%s (model %r, version %s) has UNTRAINED weights (its model.json says "
                '"trained": false, as histoinfer\'s seeded reference checkpoints do): the real '
                "architecture and costs, but not a trained model's outputs",
                checkpoint.path,
                assets.name,
                assets.version,
            )
        # SPEC's signature is prepare_sample(request); the built-in one also takes where the
        # request sits in its batch, for its error messages (prepared_tile).
        prepare = type(self).prepare_sample
        self._own_prepare = prepare is ServerModel.prepare_sample
        self._own_postprocess = type(self).postprocess is ServerModel.postprocess
        # A parameter named so, not a bare **kwargs: a decorator's (*args, **kwargs) wrapper
        # would take it, and the function inside it would not.
        parameters = inspect.signature(self.prepare_sample).parameters
        where = parameters.get("where")
        self._prepare_takes_where = where is not None and where.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        # On the device's thread, where the clients run every forward pass: run here, the probe
        # would leave this thread an OpenMP team for good (models/device_thread.py).
        device_thread(self.device).call(self._check_outputs)
        #: how the program runs: "TorchScript interpreter", "fx GraphModule (why not scripted)"
        #: or "AOTInductor" (the bench reports it: it changes every figure)
        self.runner: str = device_thread(self.device).call(self._script)
        #: how CPU batches of decoded tiles are laid out: "channels-last" or "contiguous (why)"
        self.batch_layout: str = device_thread(self.device).call(self._choose_layout)

    @classmethod
    def from_files(
        cls,
        checkpoint_path: str | Path,
        device: str = "cpu",
        assets_dir: str | Path | None = None,
    ) -> Self:
        """Load a ``.pt2`` and its ``model.json`` (by default from the checkpoint's folder)."""
        checkpoint_path = Path(checkpoint_path).expanduser()
        # The checkpoint first: a mistyped path must be reported as a missing checkpoint, not
        # as a missing model.json beside it. Its kind is sniffed before the slow assets check.
        sniff_kind(checkpoint_path)
        assets = load_assets(assets_folder(checkpoint_path, assets_dir))
        checkpoint = load_checkpoint(checkpoint_path, device, script_cache=cls.script_program)
        return cls(checkpoint, assets, device)

    @property
    def shardable(self) -> bool:
        """Whether CPU batches of this model may be sharded (models/shards.py). Never for
        an AOTInductor package: its runner takes one call at a time, so parts would wait for
        each other on one thread each (measured: 1.4x slower than one pass on every thread)."""
        return self.shard_cpu_passes and self.checkpoint.kind == "torch.export"

    # -- the four steps -------------------------------------------------------------------

    def metadata(self) -> ModelMetadata:
        """What this model is (SPEC §3.3), built once from its checkpoint and ``model.json``;
        a client adds the batching settings it serves it with."""
        return self._metadata

    def check_mode(self, mode: Mode) -> None:
        """Raise ``UnsupportedModeError`` for a mode this model does not serve (its
        ``model.json``'s ``modes``). Override to refuse more; called before any decoding."""
        if mode not in self.modes:
            raise UnsupportedModeError(
                f"model {self.assets.name!r} does not support mode {mode!r} "
                f"(supported: {', '.join(self.modes)})"
            )

    def check_request(self, request: ModelRequest, mode: Mode, where: str) -> None:
        """Reject what this model cannot serve, before any decoding."""
        self.check_mode(mode)
        if request.bulk_rna is not None and not self.assets.accepts_bulk_rna:
            raise UnsupportedModeError(
                f"invalid request {where}: field 'bulk_rna': model {self.assets.name!r} "
                "does not take bulk RNA input; omit the field"
            )

    def prepare_sample(self, request: ModelRequest, where: str | None = None) -> torch.Tensor:
        """Decode one tile to a ``uint8`` tensor ``[3, T, T]`` on the CPU. Thread-safe."""
        return decode_tile(
            request.image_data,
            width=request.width,
            height=request.height,
            tile_size=self.assets.tile_size,
            interpolation=self.assets.interpolation,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            where=where if where is not None else f"for {request.where()}",
        )

    def prepared_tile(self, request: ModelRequest, where: str) -> torch.Tensor:
        """``prepare_sample`` as the clients call it, ``where`` naming the request in errors.

        A subclass's ``prepare_sample`` gets ``where`` only if it takes it. What it raises other
        than an :class:`InferenceError`, or a tile that is not ``uint8 [3, T, T]`` on the CPU
        (normalization belongs to the batch: :meth:`forward_tiles`), fails its own request
        with a :class:`ModelExecutionError`, the same on every path (a ``*_batch`` call, all or
        nothing, as a whole)."""
        if self._own_prepare:
            return self.prepare_sample(request, where)
        name = self.assets.name
        try:
            if self._prepare_takes_where:
                tile = self.prepare_sample(request, where=where)
            else:
                tile = self.prepare_sample(request)
        except InferenceError:
            raise
        except Exception as exc:
            raise ModelExecutionError(
                f"model {name!r}: prepare_sample failed {where}: {exc!r}"
            ) from exc
        size = self.assets.tile_size
        if not (
            isinstance(tile, torch.Tensor)
            and (tile.dtype == torch.uint8 or tile.is_floating_point())
            and tuple(tile.shape) == (3, size, size)
            and tile.device.type == "cpu"
        ):
            got = (
                f"{str(tile.dtype).removeprefix('torch.')} {list(tile.shape)} on {tile.device}"
                if isinstance(tile, torch.Tensor)
                else type(tile).__name__
            )
            raise ModelExecutionError(
                f"model {name!r}: prepare_sample must return a tensor [3, {size}, {size}] on the "
                f"CPU, of uint8 pixels (the batch is normalized on the device) or of floats "
                f"(normalized already), got {got} {where}"
            )
        return tile

    def response_json(
        self, request: ModelRequest, output: SampleOutput, mode: Mode, where: str | None = None
    ) -> str:
        """``postprocess`` as the response's JSON, as the clients call it, ``where`` naming the
        request in errors (as ``prepared_tile``'s). What it raises other than an
        :class:`InferenceError` fails its own request with a :class:`ModelExecutionError`,
        the same on every path."""
        try:
            response = self.postprocess(request, output, mode)
            if not self._own_postprocess:
                self._check_response(response, output, request, where)
            return response.model_dump_json()
        except InferenceError:
            raise
        except Exception as exc:
            where = where or f"for {request.where()}"  # made only when needed: per response
            raise ModelExecutionError(
                f"model {self.assets.name!r}: postprocess failed {where}: {exc!r}"
            ) from exc

    def _check_response(
        self, response: object, output: SampleOutput, request: ModelRequest, where: str | None
    ) -> None:
        """What a subclass's ``postprocess`` returned: a ``ModelResponse`` whose values JSON can
        carry (a NaN it computed would be written as null, breaking the response schema)."""
        if not isinstance(response, ModelResponse):
            raise TypeError(
                f"postprocess must return a ModelResponse, got {type(response).__name__}"
            )
        values = [response.output, response.embedding or ()]
        if not all(math.isfinite(v) for vector in values for v in vector):
            # The pass's own NaN (a postprocess that does not check, as the built-in one
            # does), or one the postprocess made from finite outputs: blame the step.
            step = "" if not output.finite else "postprocess"
            raise non_finite_error(self.assets.name, where or f"for {request.where()}", step)

    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> BatchOutput:
        """Run a stacked batch ``[B, 3, T, T]`` through the model on its device: ``uint8``
        pixels, normalized here with ``model.json``'s mean and std, or floats, taken as
        normalized already (what a ``prepare_sample`` that normalizes gives: SPEC §5)."""
        # inference_mode is thread-local, and forward passes run on reused worker threads.
        with torch.inference_mode():
            if batch.is_floating_point():
                return self._run(batch.to(self.device, torch.float32), mode)
            with self._input_buffer.lease(batch, self.device) as x:
                # Normalized into a fresh or leased float tensor, never in the caller's batch.
                return self._run(x.mul_(self._scale).add_(self._shift), mode)

    def forward_tiles(self, tiles: Sequence[torch.Tensor], mode: Mode) -> BatchOutput:
        """Run ``uint8`` tiles ``[3, T, T]`` as one batch: ``forward_batch`` of their stack.

        What the clients call. On a CPU each tile is converted and normalized straight into
        its row of the (leased) float batch while that row is in the cache: no stacked copy,
        and one pass over memory instead of three (~30% less time than stacking, for a part
        of 16 tiles or a lone tile; the values are bit-identical). Tiles laid out as decoded
        (:func:`hwc_view`) fill a channels-last batch where :attr:`batch_layout` allows:
        their decoding skipped a transposing copy, and the program's first convolution
        takes that layout without reordering it (see :meth:`_choose_layout`). A subclass or
        instance that overrides ``forward_batch`` gets it called with the stacked batch, as
        before (contiguous).
        """
        if any(tile.dtype != torch.uint8 for tile in tiles):
            return self.forward_batch(self._normalized_stack(tiles), mode)
        overridden = self._forward_batch_overridden()
        if self.device.type != "cpu" or overridden or not tiles:
            # The built-in forward_batch on an accelerator makes the batch contiguous there.
            keep = self.device.type != "cpu" and not overridden
            return self.forward_batch(stack_tiles(tiles, keep_layout=keep), mode)
        shape = (len(tiles), *tiles[0].shape)
        with torch.inference_mode():
            size = self.assets.tile_size
            takes = self.batch_layout == CHANNELS_LAST and shape[1:] == (3, size, size)
            pixels = _pixels(tiles) if takes else None
            if pixels is not None:
                return self._run_channels_last(shape, pixels, mode)
            with self._input_buffer.take(shape) as x:
                scale, shift = self._scale[0], self._shift[0]
                for row, tile in zip(x, tiles, strict=True):
                    if tile.shape != row.shape:
                        raise ValueError(f"tiles of shapes {shape[1:]} and {tuple(tile.shape)}")
                    row.copy_(tile).mul_(scale).add_(shift)
                return self._run(x, mode)

    def _run_channels_last(
        self, shape: tuple[int, ...], pixels: list[torch.Tensor], mode: Mode
    ) -> BatchOutput:
        """:meth:`forward_tiles` of tiles given as their ``[T, T, 3]`` pixels: each row is
        filled as ``[T, 3T]`` (rows of interleaved channels), so that the per-channel scale
        and shift broadcast along a long contiguous row (as ``[T, T, 3]`` with a channel
        dimension of 3 innermost, torch's loop ran ~3.5x slower)."""
        n, c, h, w = shape
        with self._input_buffer.take((n, h, w * c)) as rows:
            for row, tile in zip(rows, pixels, strict=True):
                if tile.shape != (h, w, c):
                    got = tuple(tile.permute(2, 0, 1).shape)
                    raise ValueError(f"tiles of shapes {shape[1:]} and {got}")
                row.copy_(tile.view(h, w * c)).mul_(self._row_scale).add_(self._row_shift)
            return self._run(rows.view(n, h, w, c).permute(0, 3, 1, 2), mode)

    def _normalized_stack(self, tiles: Sequence[torch.Tensor]) -> torch.Tensor:
        """The float batch of tiles that a subclass's ``prepare_sample`` normalized itself
        (floats, as SPEC §5 places normalization) and any pixel tiles beside them, normalized
        here on the CPU: ``forward_batch`` takes it as normalized, so nothing is normalized
        twice. Correct, not fast: the ``uint8`` path normalizes on the device."""
        with torch.inference_mode():
            scale, shift = self._scale[0].cpu(), self._shift[0].cpu()
            rows = [
                tile.float().mul_(scale).add_(shift) if tile.dtype == torch.uint8 else tile
                for tile in tiles
            ]
            return torch.stack(rows).float()

    def _forward_batch_overridden(self) -> bool:
        return "forward_batch" in vars(self) or type(self).forward_batch is not (
            ServerModel.forward_batch
        )

    def _run(self, x: torch.Tensor, mode: Mode) -> BatchOutput:
        predictions, embedding = self._run_program(x)
        return BatchOutput(
            predictions=(
                self._own(predictions.float().cpu())
                if mode != "embed" and predictions is not None
                else None
            ),
            embedding=(
                self._own(embedding.float().cpu())
                if mode != "predict" and embedding is not None
                else None
            ),
        )

    def postprocess(self, request: ModelRequest, output: SampleOutput, mode: Mode) -> ModelResponse:
        """One tile's response from its pass's output: the predictions (or, for ``embed``, the
        embedding) as ``output``, the request's tile fields echoed, and the embedding beside
        them for ``predict_with_embedding``. Refuses a NaN or infinite output
        (``ModelExecutionError``). Override to reshape or rename what a model gives; an
        ``InferenceError`` raised here fails this tile's request alone (in a ``*_batch``
        call, the whole call)."""
        if not output.finite:
            raise non_finite_error(self.assets.name, f"for {request.where()}")
        values = output.embedding if mode == "embed" else output.predictions
        if values is None:
            raise InvalidRequestError(
                f"model {self.assets.name!r} gave no output for mode {mode!r}"
            )
        # model_construct: the values come from our own tensors, validating them again is waste.
        return ModelResponse.model_construct(
            output=values,
            slide_name=request.slide_name,
            x=request.x,
            y=request.y,
            width=request.width,
            height=request.height,
            tissue_ratio=request.tissue_ratio,
            patch_idx=request.patch_idx,
            resolution=request.resolution,
            embedding=output.embedding if mode == "predict_with_embedding" else None,
        )

    # -- helpers --------------------------------------------------------------------------

    def _own(self, output: torch.Tensor) -> torch.Tensor:
        """``output``, copied if it lives in the leased input buffer (a program that returns
        its input, or a view of it): the next batch overwrites that buffer."""
        return output.clone() if self._input_buffer.holds(output) else output

    def _run_program(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        size = self.assets.tile_size
        if x.dim() != 4 or tuple(x.shape[1:]) != (3, size, size):
            # The program's own input guards do not run when it is scripted (models/scripted.py).
            raise ValueError(
                f"model {self.assets.name!r} takes batches of shape [B, 3, {size}, {size}], "
                f"got {list(x.shape)}"
            )
        if x.dtype != self.checkpoint.input_dtype:
            # A reduced-precision program: normalized in float32, then cast, once per batch.
            x = x.to(self.checkpoint.input_dtype)
        try:
            result = self.checkpoint.program(x)
        except Exception as exc:
            unwrapped = interpreter_error(exc) if self.checkpoint.scripted else exc
            if unwrapped is exc:
                raise
            raise unwrapped from exc  # as the fx module says it, not in TorchScript's traceback
        alone = self._alone
        if alone and isinstance(result, Sequence) and len(result) == 1:
            result = result[0]  # a tuple of one: the one output
        if alone and isinstance(result, torch.Tensor):
            # a model serving one mode's output: its embedding, or its predictions
            return (None, result) if alone == "embed" else (result, None)
        if not isinstance(result, Sequence) or len(result) != 2:
            got = type(result).__name__
            if isinstance(result, Sequence):
                got += f" of {len(result)}"
            one = (
                "; a program returning one tensor serves a model that serves embed or predict "
                'alone ("modes" in model.json, docs/checkpoints.md)'
                if isinstance(result, torch.Tensor) or got.endswith(" of 1")
                else ""
            )
            wanted = "its output (a tensor) or " if alone else ""
            raise CheckpointError(
                f"checkpoint {self.checkpoint.path} must return {wanted}a tuple (predictions, "
                f"embedding), got {got}{one}"
            )
        return result[0], result[1]

    def _script(self) -> str:
        """Run the program's graph in TorchScript's interpreter if it answers exactly alike;
        kept for the next load (models/script_cache.py)."""
        if self.checkpoint.kind != "torch.export":
            return "AOTInductor"
        if not self.script_program:
            if self.checkpoint.scripted:
                raise CheckpointError(
                    f"{type(self).__name__} has script_program = False, but its checkpoint "
                    f"{self.checkpoint.path} was loaded as TorchScript: load it with "
                    "script_cache=False"
                )
            return "fx GraphModule (script_program is False)"
        if self.checkpoint.scripted:  # read from the cache: checked when it was made
            return "TorchScript interpreter"
        if self.device.type != "cpu":
            # On a GPU TorchScript's fuser compiles kernels for shapes this check never sees,
            # and no GPU has measured it yet: the fx module runs there.
            return "fx GraphModule (scripted on CPUs only)"
        scripted, why = script_program(self.checkpoint.program)
        if scripted is not None:
            size, dtype = self.assets.tile_size, self.checkpoint.input_dtype
            seeded = torch.Generator().manual_seed(1)
            batches = [
                torch.randn((n, 3, size, size), generator=seeded).to(self.device, dtype)
                for n in (2, 1)  # the probe's size, and a lone tile's
            ]
            with torch.inference_mode():
                difference = scripted_equal(self.checkpoint.program, scripted, batches)
            if difference is None:
                checkpoint = self.checkpoint
                script_cache.save(
                    checkpoint.sha256, scripted, checkpoint.input_dtype, checkpoint.input_size
                )
                self.checkpoint = replace(self.checkpoint, program=scripted, scripted=True)
                return "TorchScript interpreter"
            why = difference
        log.info("%s runs as an fx GraphModule: %s", self.checkpoint.path, why)
        return f"fx GraphModule ({why})"

    def _choose_layout(self) -> str:
        """Channels-last CPU batches, if the program answers them exactly as it answers a
        contiguous batch (the probe's size and a lone tile's); else why not.

        Tiles decode as ``[T, T, 3]`` pixels. A contiguous ``[B, 3, T, T]`` batch costs each
        tile a transposing copy (~0.1 ms of a decode thread's CPU for 224 px), and the
        reference models' patch-embedding convolution then reorders the batch to NHWC again
        inside the pass; fed channels-last, the tiny model's pass on one thread took 0.84-0.94x
        its time for parts of 16-32 tiles (docs/benchmarks.md, "What made it fast"). A program
        whose ops need a contiguous input (a ``view`` of it) fails on it, or answers
        differently: it keeps contiguous batches.
        """
        if not self.channels_last_batches:
            return "contiguous (channels_last_batches is False)"
        if self.device.type != "cpu":
            return "contiguous (channels-last on CPUs only)"
        if self._forward_batch_overridden():
            return "contiguous (forward_batch is overridden: it gets stacked batches)"
        size, dtype = self.assets.tile_size, self.checkpoint.input_dtype
        seeded = torch.Generator().manual_seed(2)
        compared = 0
        for n in (2, 1):  # the probe's size (the program takes it: _check_outputs), a lone tile's
            batch = torch.randn((n, 3, size, size), generator=seeded).to(dtype)
            with torch.inference_mode():
                try:
                    want = self._run_program(batch)
                except Exception:
                    continue  # a program exported for a static batch: nothing to compare
                try:
                    got = self._run_program(batch.contiguous(memory_format=torch.channels_last))
                except Exception as exc:
                    why = f"fails on a channels-last batch of {n}: {first_line(exc)}"
                    return f"contiguous (the program {why})"
            apart = max(_apart(a, b) for a, b in zip(want, got, strict=True))
            if apart > self.channels_last_tolerance:
                return (
                    f"contiguous (the program's outputs differ on a channels-last batch of {n}, "
                    f"by {apart:.2g} of their scale; channels_last_tolerance allows "
                    f"{self.channels_last_tolerance:g})"
                )
            compared += 1
        return CHANNELS_LAST if compared else "contiguous (the program took no probe batch)"

    def _check_outputs(self) -> None:
        """Forward passes at load time, of 2 tiles and of 1: a mismatched checkpoint fails now,
        naming the file. A lone request, and each part of a sharded pass, is one tile: a program
        exported for a fixed batch, or one that squeezes its batch dimension, would otherwise
        load and then fail (or answer wrongly) only at low load."""
        size = self.assets.tile_size
        exported = self.checkpoint.input_size
        if exported is not None and exported != (size, size):
            # Else the probe failed with torch's guard alone ("x.size()[2] == 224"), or from
            # the TorchScript cache with no word of sizes (a user trial).
            raise CheckpointError(
                f"checkpoint {self.checkpoint.path} was exported for tiles of "
                f"{exported[0]}x{exported[1]} px, but its assets (model.json) say tile_size "
                f"{size}: make them agree"
            )
        # Seeded noise, not zeros: a program fed the wrong dtype (an AOTInductor package compiled
        # for bfloat16 reads a float32 batch's bytes as bfloat16) answers garbage, not an error.
        seeded = torch.Generator().manual_seed(0)
        # The modes served, and only they: one pass when predict_with_embedding is (it returns
        # both outputs). A model serving embed alone need not return predictions at all.
        both: Mode = "predict_with_embedding"
        modes = [both] if both in self.modes else list(self.modes)
        pair = torch.randint(0, 256, (2, 3, size, size), generator=seeded, dtype=torch.uint8)
        # Unlike tiles, as a slide's are: beside a tile of like statistics (two of noise) a
        # BatchNorm left in training mode changed the first tile's answer by 5%, beside a
        # darker one by 86%.
        pair[1] //= 4
        answers: list[BatchOutput] = []  # the first mode's: to the pair, to its first tile
        for n in (2, 1):
            probe = pair[:n]
            for mode in modes:
                try:
                    out = self.forward_batch(probe, mode)
                except CheckpointError:
                    raise
                except Exception as exc:
                    if n == 1:
                        hint = _LONE_PROBE_HINT
                    elif self._takes_one_tile(mode):
                        hint = _BATCH_OF_ONE_HINT
                    else:
                        hint = _FIXED_BATCH_HINT if "size()[0]" in str(exc) else ""
                    raise CheckpointError(
                        f"checkpoint {self.checkpoint.path} failed on a [{n}, 3, {size}, {size}] "
                        f"probe batch ({mode}): {first_line(exc)}{hint}"
                    ) from exc
                if not isinstance(out, BatchOutput):
                    raise CheckpointError(
                        f"checkpoint {self.checkpoint.path}: forward_batch must return a "
                        f"BatchOutput (histoinfer.models), got {type(out).__name__}"
                    )
                if mode != "embed":
                    shape = self.assets.output_shape
                    self._check_output(
                        "predictions",
                        out.predictions,
                        (n, self.assets.output_size),
                        None if shape is None else (n, *shape),
                    )
                if mode != "predict":
                    width = self.assets.embedding_size or 0  # set: checked at __init__
                    self._check_output("embedding", out.embedding, (n, width))
                if mode == modes[0]:
                    answers.append(out)
        if self.repeatable_outputs:
            self._check_repeatable(pair, modes[0], *answers)

    def _check_repeatable(
        self, pair: torch.Tensor, mode: Mode, first: BatchOutput, alone: BatchOutput
    ) -> None:
        """The same tiles get the same answers, whether run again or beside other tiles: a
        module exported in training mode loaded and served answers that changed with each pass
        (dropout) or with a tile's neighbours in its dynamic batch (a BatchNorm's batch
        statistics), silently (a user trial). Within a tolerance: kernels for other batch
        sizes, and reduced precision, round differently."""
        again = self.forward_batch(pair, mode)
        cause = ""
        for name in ("predictions", "embedding"):
            a, b, c = (getattr(out, name) for out in (first, again, alone))
            if a is None or b is None or c is None:
                continue
            if (gap := _gap(a, b)) is not None:
                cause = (
                    f"answers the same tiles differently each time ({name} differ by up to "
                    f"{gap:.3g} between two passes of one batch): a random op left on, such as "
                    "dropout"
                )
            elif (gap := _gap(a[:1], c)) is not None:
                cause = (
                    f"answers a tile differently beside another tile ({name} differ by up to "
                    f"{gap:.3g} between a tile alone and in a batch of 2): batch statistics, "
                    "such as a BatchNorm's in training mode"
                )
            if cause:
                culprit = (
                    f"; is {type(self).__name__}.forward_batch random, or was the program "
                    "exported in training mode?"
                    if self._forward_batch_overridden()
                    else "; was it exported in training mode?"
                )
                raise CheckpointError(
                    f"checkpoint {self.checkpoint.path} {cause}{culprit} Export it after "
                    "model.eval(). (A model random or batch-dependent by design, such as Monte "
                    "Carlo dropout, is served by a ServerModel subclass with "
                    "repeatable_outputs = False; docs/checkpoints.md)"
                )

    def _takes_one_tile(self, mode: Mode) -> bool:
        """Whether a pass of one tile works (asked once a probe of two has failed)."""
        size = self.assets.tile_size
        try:
            self.forward_batch(torch.zeros((1, 3, size, size), dtype=torch.uint8), mode)
        except Exception:
            return False
        return True

    def _check_output(
        self,
        name: str,
        tensor: object,
        shape: tuple[int, int],
        shaped: tuple[int, ...] | None = None,
    ) -> None:
        """One output of the load-time probe: a tensor of the shape model.json describes (for
        the probe's batch: flat, or ``shaped`` by its output_shape), and finite."""
        wanted = {shape} if shaped is None else {shape, shaped}
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) not in wanted:
            actual: object = tensor  # None
            if isinstance(tensor, torch.Tensor):
                actual = tuple(tensor.shape)
            elif tensor is not None:
                actual = f"{type(tensor).__name__} (not a tensor)"
            described = f"{shaped} or {shape}" if shaped not in (None, shape) else f"{shape}"
            raise CheckpointError(
                f"checkpoint {self.checkpoint.path} returns {name} of shape {actual} for a "
                f"probe batch of {shape[0]}, but its assets (model.json) describe {described}"
            )
        if not bool(torch.isfinite(tensor).all()):
            dtype = str(self.checkpoint.input_dtype).removeprefix("torch.")
            hint = (
                ", or a package compiled for another input dtype that does not record it "
                "(docs/checkpoints.md, 'Reduced precision')"
                if self.checkpoint.kind == "aoti"
                else ""
            )
            raise CheckpointError(
                f"checkpoint {self.checkpoint.path} returns non-finite {name} (NaN or "
                f"infinity) for a probe batch of random tiles fed as {dtype}: a broken "
                f"program{hint}"
            )

    def _build_metadata(self) -> ModelMetadata:
        a = self.assets
        predicting = any(mode != "embed" for mode in self.modes)
        return ModelMetadata(
            name=a.name,
            version=a.version,
            task=a.task,
            tile_size=a.tile_size,
            resolution=a.resolution,
            mean=a.mean,
            std=a.std,
            interpolation=a.interpolation,
            modes=list(self.modes),
            gene_names=a.gene_names,
            # A model serving embed alone predicts nothing, whatever its model.json describes.
            output_size=a.output_size if predicting else 0,
            output_shape=a.output_shape if predicting else None,
            embedding_size=a.embedding_size or 0,  # left out: a model serving predict alone
            accepts_bulk_rna=a.accepts_bulk_rna,
            trained=a.trained,
            description=a.description,
            checkpoint_sha256=self.checkpoint.sha256,
            checkpoint_kind=self.checkpoint.kind,
            device=str(self.device),
        )
