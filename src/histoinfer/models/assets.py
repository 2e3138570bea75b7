"""The assets a checkpoint does not hold: ``model.json`` (name, tile size, normalization, genes)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .checkpoint import CheckpointError

__all__ = ["ASSETS_FILE", "Interpolation", "ModelAssets", "load_assets"]

ASSETS_FILE = "model.json"
Interpolation = Literal["nearest", "bilinear", "bicubic", "lanczos", "box", "hamming"]


class ModelAssets(BaseModel):
    """Everything about a model that lives beside its ``.pt2``, in ``model.json``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str
    version: str
    task: str = "gene-expression"
    tile_size: int = Field(gt=0)
    resolution: float = Field(gt=0, description="µm/px the model expects")
    mean: list[float] = Field(min_length=3, max_length=3)
    std: list[float] = Field(min_length=3, max_length=3)
    interpolation: Interpolation = "bilinear"
    gene_names: list[str]
    embedding_size: int = Field(gt=0)
    accepts_bulk_rna: bool = False
    #: False for seeded, untrained weights (the reference checkpoints write it); a user's own
    #: model.json may leave it out (SPEC lists the fields without it)
    trained: bool = True
    description: str = ""
    architecture: dict[str, int | float | str] = Field(default_factory=dict)

    @field_validator("std")
    @classmethod
    def _std_positive(cls, std: list[float]) -> list[float]:
        # Normalization divides by std: a zero would turn every tile into inf/NaN.
        if any(not 0.0 < s < float("inf") for s in std):
            raise ValueError(f"every std must be a positive finite number, got {std}")
        return std

    @field_validator("gene_names")
    @classmethod
    def _genes_named_once(cls, names: list[str]) -> list[str]:
        # Outputs are looked up by gene name: a blank or repeated name makes that ambiguous.
        if not names:
            raise ValueError("at least one gene name is needed")
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
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"model assets {path} could not be read: {exc.strerror}") from None
    try:
        return ModelAssets.model_validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in exc.errors()
        )
        raise CheckpointError(f"model assets {path} are invalid: {problems}") from None
