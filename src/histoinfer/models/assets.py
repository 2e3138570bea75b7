"""The assets a checkpoint does not hold: ``model.json`` (name, tile size, normalization, genes)."""

from __future__ import annotations

import codecs
import difflib
import math
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails

from ..schema import Mode
from .checkpoint import CheckpointError

__all__ = ["ASSETS_FILE", "Interpolation", "ModelAssets", "load_assets"]

ASSETS_FILE = "model.json"
_HINT_255 = ": in 0-255 units? divide them by 255"
Interpolation = Literal["nearest", "bilinear", "bicubic", "lanczos", "box", "hamming"]


class ModelAssets(BaseModel):
    """Everything about a model that lives beside its ``.pt2``, in ``model.json``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str
    version: str
    task: str = "gene-expression"
    #: at most 4096: a tile of 4096² pixels is as many as a request's image may hold by default
    #: (``ServerModel.max_image_pixels``); a mistyped 100000 made the load-time probe ask
    #: torch for 60 GB
    tile_size: int = Field(gt=0, le=4096)
    resolution: float = Field(gt=0, description="µm/px the model expects")
    mean: list[float] = Field(min_length=3, max_length=3)
    std: list[float] = Field(min_length=3, max_length=3)
    interpolation: Interpolation = "bilinear"
    #: the predicted genes, in output order; or, in model.json, the name of a file in the
    #: assets directory with one gene name a line. Empty for a model that predicts nothing
    #: (it serves ``embed`` alone).
    gene_names: list[str] = Field(default_factory=list)
    #: the shape of one tile's predictions, when they are not a vector of genes: a tissue
    #: mask's ``[14, 14]`` (a program may return ``[B, 14, 14]`` or ``[B, 196]``); the
    #: response's ``output`` holds them flattened, row-major. Then ``gene_names`` may be left
    #: out (or names each value).
    output_shape: list[int] | None = Field(default=None, min_length=1, max_length=4)
    #: the embedding's width; needed only by a model that serves an embedding
    embedding_size: int | None = Field(default=None, gt=0)
    #: the modes this checkpoint serves, among its model class's (default: all of those): a
    #: program that returns one output (an embedding model's, a prediction model's) serves
    #: ``["embed"]`` or ``["predict"]`` under ``h1`` with no subclass of its own
    modes: list[Mode] | None = Field(default=None, min_length=1)
    accepts_bulk_rna: bool = False
    #: False for seeded, untrained weights (the reference checkpoints write it); a user's own
    #: model.json may leave it out (SPEC lists the fields without it)
    trained: bool = True
    description: str = ""
    architecture: dict[str, int | float | str] = Field(default_factory=dict)

    _directory: Path | None = PrivateAttr(default=None)

    @property
    def directory(self) -> Path | None:
        """The assets directory this was loaded from (for a subclass's own files), if any."""
        return self._directory

    @field_validator("mean")
    @classmethod
    def _mean_of_unit_pixels(cls, mean: list[float]) -> list[float]:
        # Pixels are scaled to [0, 1] before normalization: a mean in 0-255 units (mmcv's
        # [123.675, ...]) would make every tile nearly the same constant, silently.
        if any(not 0.0 <= m <= 1.0 for m in mean):
            raise ValueError(
                f"every mean must be in [0, 1] (pixels are scaled to [0, 1] before "
                f"normalization), got {mean}{_HINT_255 if max(mean) > 1 else ''}"
            )
        return mean

    @field_validator("std")
    @classmethod
    def _std_positive(cls, std: list[float]) -> list[float]:
        # Normalization divides by std: a zero would turn every tile into inf/NaN.
        if any(not 0.0 < s < float("inf") for s in std):
            raise ValueError(f"every std must be a positive finite number, got {std}")
        if any(s > 1.0 for s in std):  # as the mean: a std in 0-255 units
            raise ValueError(
                f"every std must be at most 1 (pixels are scaled to [0, 1] before "
                f"normalization), got {std}{_HINT_255}"
            )
        return std

    @field_validator("modes")
    @classmethod
    def _modes_named_once(cls, modes: list[Mode] | None) -> list[Mode] | None:
        twice = sorted({mode for mode in modes if modes.count(mode) > 1}) if modes else []
        if twice:
            raise ValueError(f"modes named more than once: {', '.join(twice)}")
        return modes

    @field_validator("output_shape")
    @classmethod
    def _shape_fits(cls, shape: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if shape is None:
            return shape
        if any(n <= 0 for n in shape):
            raise ValueError(f"every dimension must be > 0, got {shape}")
        names = info.data.get("gene_names")  # absent if they failed their own checks
        if names and len(names) != math.prod(shape):
            raise ValueError(
                f"gene_names has {len(names)} names, but output_shape {shape} holds "
                f"{math.prod(shape)} values: name each value, or leave gene_names out"
            )
        return shape

    @property
    def output_size(self) -> int:
        """How many values one tile's predictions hold."""
        if self.output_shape is not None:
            return math.prod(self.output_shape)
        return len(self.gene_names)

    @field_validator("gene_names", mode="before")
    @classmethod
    def _genes_from_file(cls, names: object, info: ValidationInfo) -> object:
        """A string names a gene list in the assets directory: one gene a line."""
        if not isinstance(names, str):
            return names
        directory = (info.context or {}).get("directory")
        if directory is None:
            raise ValueError(f"gene list {names!r}: a file name needs an assets directory")
        path = Path(directory) / names
        try:
            # utf-8-sig: a file saved by Excel or Notepad starts with a byte-order mark, which
            # would otherwise become part of the first gene's name, silently.
            text = path.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"gene list {str(path)!r} could not be read: {exc}") from None
        return [line.strip() for line in text.splitlines() if line.strip()]

    @field_validator("gene_names")
    @classmethod
    def _genes_named_once(cls, names: list[str]) -> list[str]:
        # Outputs are looked up by gene name: a blank or repeated name makes that ambiguous.
        if any(not n.strip() for n in names):
            raise ValueError("gene names must not be blank")
        repeated = sorted(name for name, count in Counter(names).items() if count > 1)
        if repeated:
            raise ValueError(f"gene names appear more than once: {', '.join(repeated)}")
        return names


def load_assets(assets_dir: str | Path) -> ModelAssets:
    path = Path(assets_dir).expanduser() / ASSETS_FILE
    if not path.is_file():
        raise CheckpointError(
            f"model assets not found: {path} (pass assets_dir=..., or --assets DIR on the "
            "command line)"
        )
    try:
        # A byte-order mark (Windows editors write one) is not JSON, but says nothing wrong.
        data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    except OSError as exc:
        raise CheckpointError(f"model assets {path} could not be read: {exc.strerror}") from None
    try:
        # Strict, as requests are: "tile_size": "224" or "trained": "no" is a typo to name,
        # not a value to guess at.
        assets = ModelAssets.model_validate_json(
            data, strict=True, context={"directory": path.parent}
        )
    except ValidationError as exc:
        problems = "; ".join(map(_problem, exc.errors()))
        raise CheckpointError(f"model assets {path} are invalid: {problems}") from None
    assets._directory = path.parent
    return assets


def _problem(error: ErrorDetails) -> str:
    """One validation error, a misspelt key with the key it is closest to."""
    where = ".".join(map(str, error["loc"])) or "file"
    hint = ""
    if error["type"] == "extra_forbidden" and len(error["loc"]) == 1:
        close = difflib.get_close_matches(str(error["loc"][0]), ModelAssets.model_fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    # A validator's own words, without pydantic's "Value error, " before them.
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}{hint}"
