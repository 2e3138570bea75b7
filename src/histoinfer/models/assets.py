"""The assets a checkpoint does not hold: ``model.json`` (name, tile size, normalization, genes)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
    trained: bool
    description: str = ""
    architecture: dict[str, int | float | str] = Field(default_factory=dict)


def load_assets(assets_dir: str | Path) -> ModelAssets:
    path = Path(assets_dir).expanduser() / ASSETS_FILE
    if not path.is_file():
        raise CheckpointError(f"model assets not found: {path} (pass assets_dir=...)")
    try:
        return ModelAssets.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in exc.errors()
        )
        raise CheckpointError(f"model assets {path} are invalid: {problems}") from None
