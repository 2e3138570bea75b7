"""The wire format (SPEC §3): pydantic v2 models, parsed strictly with pydantic's JSON parser.

Requests are parsed with ``model_validate_json`` (never ``json.loads`` + dict): it is faster and
its errors carry exact field locations, which :func:`parse_request` turns into messages that
name the field, the batch position and the ``patch_idx``. This module imports nothing else of
ours except the errors: it is part of the contract.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
)

from .errors import InvalidRequestError

__all__ = [
    "MODES",
    "BatchingSettings",
    "InvocationEnvelope",
    "InvocationMode",
    "InvocationRequest",
    "Mode",
    "ModelMetadata",
    "ModelRequest",
    "ModelResponse",
    "parse_request",
]

Mode = Literal["predict", "embed", "predict_with_embedding"]
MODES: tuple[Mode, ...] = ("predict", "embed", "predict_with_embedding")

InvocationMode = Literal["prediction", "embedding", "metadata", "prediction_with_embedding"]
INVOCATION_MODES: dict[str, Mode] = {
    "prediction": "predict",
    "embedding": "embed",
    "prediction_with_embedding": "predict_with_embedding",
}

NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(gt=0)]

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelRequest(BaseModel):
    """One tile to run through a model."""

    model_config = _STRICT

    image_data: str = Field(description="base64 PNG (JPEG and TIFF accepted) of an RGB tile")
    slide_name: str = Field(description="stem of the source slide file name")
    x: NonNegativeInt = Field(description="level-0 x of the tile's top-left corner")
    y: NonNegativeInt = Field(description="level-0 y of the tile's top-left corner")
    width: PositiveInt = Field(description="must equal the decoded image's width")
    height: PositiveInt = Field(description="must equal the decoded image's height")
    patch_idx: NonNegativeInt = Field(description="index of the tile in the extraction plan")
    tissue_ratio: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    resolution: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = Field(
        default=None, description="µm/px of the tile"
    )
    bulk_rna: list[Annotated[float, Field(allow_inf_nan=False)]] | None = Field(
        default=None, description="only for models that take it; otherwise rejected"
    )

    def where(self) -> str:
        """A short locator for error messages."""
        return f"patch_idx={self.patch_idx} (slide {self.slide_name!r}, x={self.x}, y={self.y})"


class ModelResponse(BaseModel):
    """One tile's result: the output, the echoed tile fields, and the embedding when asked for."""

    model_config = ConfigDict(extra="forbid")

    output: list[float]
    slide_name: str
    x: int
    y: int
    width: int
    height: int
    tissue_ratio: float | None = None
    patch_idx: int
    resolution: float | None = None
    # SPEC §3.2: absent (not null) unless the mode is predict_with_embedding. A field-level
    # rule, not a model serializer: a wrapping serializer makes pydantic build each response as
    # a Python dict first, which doubled the cost of writing one (~38 µs against ~18, on the
    # event loop, for every request).
    embedding: list[float] | None = Field(default=None, exclude_if=lambda value: value is None)


class BatchingSettings(BaseModel):
    """The batching settings in force for a client or server."""

    dynamic_batching: bool
    max_batch_size: int
    max_wait_ms: float
    max_queue: int | None = None


class ModelMetadata(BaseModel):
    """What a loaded model is (SPEC §3.3)."""

    model_config = ConfigDict(protected_namespaces=())

    name: str
    version: str
    task: str
    tile_size: int
    resolution: float = Field(description="µm/px the model expects")
    mean: list[float]
    std: list[float]
    interpolation: str
    modes: list[Mode]
    gene_names: list[str] = Field(description="names of the predict output, in order")
    output_size: int
    embedding_size: int
    accepts_bulk_rna: bool = False
    trained: bool = Field(description="False for the seeded, untrained reference checkpoints")
    description: str = ""
    checkpoint_sha256: str
    checkpoint_kind: str = Field(description="'torch.export' or 'aoti'")
    device: str
    batching: BatchingSettings | None = None


class InvocationEnvelope(BaseModel):
    """The SageMaker-style dispatch fields of ``POST /invocations``; the rest is ignored here."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model_name: str
    #: any string here: an unknown mode is a 400 (unsupported mode, SPEC §3.4), not a 422
    mode: str


class InvocationRequest(ModelRequest):
    """``POST /invocations`` body for the inference modes: a ``ModelRequest`` plus dispatch."""

    model_name: str
    mode: InvocationMode

    def to_model_request(self) -> ModelRequest:
        fields = self.model_dump(exclude={"model_name", "mode"})
        return ModelRequest.model_construct(**fields)


def _describe_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        kind = err["type"]
        if kind == "json_invalid":
            parts.append(f"body is not valid JSON ({err['msg']})")
        elif kind == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        elif kind == "missing":
            parts.append(f"missing required field {loc!r}")
        else:
            got = err.get("input")
            shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
            if len(shown) > 60:
                shown = shown[:57] + "..."
            parts.append(f"field {loc!r}: {err['msg']} (got {shown})")
    return "; ".join(parts)


def _patch_idx_hint(body: str | bytes) -> str:
    """Best-effort patch_idx of an invalid body, for the error message only."""
    if isinstance(body, (bytes, bytearray)):
        # As the body's parser reads bytes: json.loads would skip a UTF-8 BOM in bytes (not in
        # a str), and the same body would be worded differently over HTTP and in-process.
        body = bytes(body).decode("utf-8", "replace")
    try:
        raw = json.loads(body)
    except (ValueError, TypeError, RecursionError):  # RecursionError: deeply nested JSON
        return ""
    if isinstance(raw, dict) and type(raw.get("patch_idx")) is int:  # not a bool
        return f" (patch_idx={raw['patch_idx']})"
    return ""


def locate(position: int | None) -> str:
    return "" if position is None else f" at batch position {position}"


def parse_request(body: str | bytes, position: int | None = None) -> ModelRequest:
    """Parse one request body, raising :class:`InvalidRequestError` that names what was wrong."""
    if not isinstance(body, (str, bytes, bytearray)):
        raise InvalidRequestError(
            f"invalid request{locate(position)}: body must be a JSON string, "
            f"got {type(body).__name__}"
        )
    try:
        return ModelRequest.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidRequestError(
            f"invalid request{locate(position)}{_patch_idx_hint(body)}: {_describe_errors(exc)}"
        ) from None


def parse_model(model: type[BaseModel], body: str | bytes, what: str) -> Any:
    """Parse ``body`` as ``model``, raising :class:`InvalidRequestError` naming ``what``."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidRequestError(
            f"invalid {what}{_patch_idx_hint(body)}: {_describe_errors(exc)}"
        ) from None
