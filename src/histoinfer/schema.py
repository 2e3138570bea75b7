"""The wire format (SPEC §3): pydantic v2 models, parsed strictly with pydantic's JSON parser.

Requests are parsed with ``model_validate_json`` (never ``json.loads`` + dict): it is faster and
its errors carry exact field locations, which :func:`parse_request` turns into messages that
name the field, the batch position and the ``patch_idx``. This module imports nothing else of
ours except the errors: it is part of the contract.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
)
from pydantic_core import from_json

from .errors import InvalidRequestError

__all__ = [
    "FOREIGN_KEY",
    "MAX_BULK_RNA",
    "MAX_INT",
    "MODES",
    "BatchingSettings",
    "ForeignBody",
    "InvocationEnvelope",
    "InvocationMetadataOfRequest",
    "InvocationMetadataRequest",
    "InvocationMode",
    "InvocationRequest",
    "Mode",
    "ModelMetadata",
    "ModelRequest",
    "ModelResponse",
    "json_hint",
    "parse_request",
    "utf8_size",
]

Mode = Literal["predict", "embed", "predict_with_embedding"]
MODES: tuple[Mode, ...] = ("predict", "embed", "predict_with_embedding")

InvocationMode = Literal["prediction", "embedding", "metadata", "prediction_with_embedding"]
INVOCATION_MODES: dict[str, Mode] = {
    "prediction": "predict",
    "embedding": "embed",
    "prediction_with_embedding": "predict_with_embedding",
}


def _from_numpy(value: object) -> object:
    """A numpy scalar as the Python number it holds, for a request built in Python: tile
    coordinates usually come out of numpy arrays (``tile_body`` takes them too). Nothing else
    is loosened: JSON holds no numpy scalars, and a ``numpy.bool_`` is still no integer, nor
    ``3.0`` an ``x``."""
    if _numpy_number(value):
        return value.item()  # type: ignore[attr-defined]
    return value


def _numpy_number(value: object) -> bool:
    """A numpy integer or float: not a bool, nor a duration (numpy counts it an integer)."""
    return isinstance(value, (np.integer, np.floating)) and not isinstance(value, np.timedelta64)


def _list_from_numpy(value: object, info: ValidationInfo) -> object:
    """``bulk_rna`` built in Python from numpy (an expression matrix's row, or its values): a
    1-D array, or a list of numpy scalars, as a list of Python numbers. Parsed JSON is passed
    as it is, with no look at each of its values."""
    if info.mode == "json":
        return value
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return value.tolist()
    if isinstance(value, list):  # a numpy.bool_ too, which a float would otherwise take
        return [
            item.item() if _numpy_number(item) or isinstance(item, np.bool_) else item
            for item in value
        ]
    return value


_NUMPY_SCALAR = BeforeValidator(_from_numpy)

#: the largest integer field: JSON's exact integers (a JavaScript client's, a float64 column),
#: and within int64, as coordinates and indices end up in numpy and AnnData
MAX_INT = 2**53 - 1
# The numpy step last: placed before Field, it would leave the bounds outside the int schema
# (checked after it, in other words: a NaN ratio was "not >= 0", not "not finite").
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_INT), _NUMPY_SCALAR]
PositiveInt = Annotated[int, Field(gt=0, le=MAX_INT), _NUMPY_SCALAR]

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)

#: the most ``bulk_rna`` values a request may hold: a whole transcriptome is ~60,000 genes
MAX_BULK_RNA = 100_000


class _Elided:
    """A long field as its repr shows it: a notebook displaying a request or response should
    not print ~100 KB of base64 or 307 floats (the values stay whole on the object)."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return self._text


def _elided_floats(values: list[float]) -> object:
    if len(values) <= 6:
        return values
    head = ", ".join(repr(value) for value in values[:3])
    return _Elided(f"[{head}, ... {len(values)} floats]")


def _elided_text(text: str) -> object:
    if len(text) <= 40:
        return text
    return _Elided(f"{text[:24]!r}... ({len(text):,} chars)")


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
    tissue_ratio: (
        Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False), _NUMPY_SCALAR] | None
    ) = None
    resolution: Annotated[float, Field(gt=0.0, allow_inf_nan=False), _NUMPY_SCALAR] | None = Field(
        default=None, description="µm/px of the tile"
    )
    bulk_rna: Annotated[
        list[Annotated[float, Field(allow_inf_nan=False)]] | None,
        BeforeValidator(_list_from_numpy),
    ] = Field(
        default=None,
        max_length=MAX_BULK_RNA,
        description="only for models that take it; otherwise rejected",
    )

    def where(self) -> str:
        """A short locator for error messages."""
        return f"patch_idx={self.patch_idx} (slide {self.slide_name!r}, x={self.x}, y={self.y})"

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            if name == "image_data":
                value = _elided_text(value)
            elif name == "bulk_rna" and value is not None:
                value = _elided_floats(value)
            yield name, value


class ModelResponse(BaseModel):
    """One tile's result: the output, the echoed tile fields, and the embedding when asked for."""

    model_config = ConfigDict(extra="forbid")

    output: list[float] = Field(
        description="the model's output for the tile: one value a gene, in the metadata's "
        "gene_names order (a shaped output, e.g. a tissue mask, flattened row-major); for the "
        "embed mode, the embedding"
    )
    slide_name: str = Field(description="echoed from the request")
    x: int = Field(description="echoed from the request: level-0 pixels, the tile's left edge")
    y: int = Field(description="echoed from the request: level-0 pixels, the tile's top edge")
    width: int = Field(description="echoed from the request")
    height: int = Field(description="echoed from the request")
    tissue_ratio: float | None = Field(default=None, description="echoed from the request")
    patch_idx: int = Field(description="echoed from the request")
    resolution: float | None = Field(default=None, description="echoed from the request (µm/px)")
    # SPEC §3.2: absent (not null) unless the mode is predict_with_embedding. A field-level
    # rule, not a model serializer: a wrapping serializer makes pydantic build each response as
    # a Python dict first, which doubled the cost of writing one (~38 µs against ~18, on the
    # event loop, for every request).
    embedding: list[float] | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="the tile's embedding: present only in predict_with_embedding answers",
    )

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            if name in ("output", "embedding") and value is not None:
                value = _elided_floats(value)
            yield name, value


class BatchingSettings(BaseModel):
    """The batching settings in force for a client or server."""

    dynamic_batching: bool
    max_batch_size: int
    max_wait_ms: float
    max_queue: int | None = None
    #: seconds a request may wait for its pass (``--request-timeout``); None: no bound
    request_timeout: float | None = None


class ModelMetadata(BaseModel):
    """What a loaded model is (SPEC §3.3)."""

    model_config = ConfigDict(protected_namespaces=())

    name: str = Field(description="the model's name (its model.json's, not the route's)")
    version: str = Field(description="the model's version, as its model.json gives it")
    task: str = Field(description="what it computes, e.g. gene-expression")
    tile_size: int = Field(description="pixels a side the model takes; other tiles are resized")
    resolution: float = Field(description="µm/px the model expects")
    mean: list[float] = Field(description="per-channel mean the pixels are normalized with")
    std: list[float] = Field(description="per-channel standard deviation, likewise")
    interpolation: str = Field(description="how a tile of another size is resized")
    modes: list[Mode] = Field(description="the modes it serves (predict, embed, ...)")
    gene_names: list[str] = Field(description="names of the predict output, in order")
    output_size: int = Field(description="how many values a predict output holds")
    output_shape: list[int] | None = Field(
        default=None,
        description="the shape of one tile's predict output when it is not a vector (a tissue "
        "mask's [14, 14]): `output` holds it flattened, row-major; null for a vector",
    )
    embedding_size: int = Field(description="the embedding's width; 0 if it serves none")
    accepts_bulk_rna: bool = Field(default=False, description="whether requests may send bulk_rna")
    trained: bool = Field(description="False for the seeded, untrained reference checkpoints")
    description: str = Field(default="", description="free text from its model.json")
    checkpoint_sha256: str = Field(
        description="the sha256 of the .pt2 it runs: every inference answer's "
        "histoinfer-checkpoint-sha256 header names it too"
    )
    checkpoint_kind: str = Field(description="'torch.export' or 'aoti'")
    device: str = Field(description="where its passes run: cpu, cuda:0, ...")
    batching: BatchingSettings | None = Field(
        default=None, description="the batching settings in force, where a client serves it"
    )


class InvocationEnvelope(BaseModel):
    """The SageMaker-style dispatch fields of ``POST /invocations``; the rest is ignored here."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model_name: str
    #: any string here: an unknown mode is a 400 (unsupported mode, SPEC §3.4), not a 422
    mode: str


class InvocationMetadataRequest(BaseModel):
    """``POST /invocations`` body for ``mode: "metadata"``: the dispatch fields alone (or a
    whole request beside them: :class:`InvocationMetadataOfRequest`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_name: str
    mode: Literal["metadata"]


class InvocationMetadataOfRequest(ModelRequest):
    """``POST /invocations`` body for ``mode: "metadata"`` written as SPEC §4 writes every
    invocation body, a ``ModelRequest`` beside the dispatch fields (a SageMaker caller sends
    one envelope for every mode): the request is validated as any, and not computed."""

    model_name: str
    mode: Literal["metadata"]


class InvocationRequest(ModelRequest):
    """``POST /invocations`` body for the inference modes: a ``ModelRequest`` plus dispatch."""

    model_name: str
    mode: InvocationMode

    def to_model_request(self) -> ModelRequest:
        fields = self.model_dump(exclude={"model_name", "mode"})
        return ModelRequest.model_construct(**fields)


#: The problems an invalid body's error names one by one; the rest are counted. A body of a
#: million unknown keys or bad ``bulk_rna`` elements is a million problems: described in full
#: (pydantic's ``errors()`` alone took 3.4 s for them) it answered with tens of megabytes and
#: held a server's memory and CPU for minutes while other callers waited.
NAMED_PROBLEMS = 10

#: a list's elements validated again to find its first problems: enough for bad elements that
#: are not all at the front, few enough that describing them all costs nothing (~3 µs each)
_LIST_PREFIX = 1_000

#: at most this many problems are described from pydantic's own list (~3 µs each)
_DESCRIBED_IN_FULL = 10_000

#: the longest a field's value or an unknown key's name is quoted in a message
_QUOTED = 60


def _describe_errors(model: type[BaseModel], exc: ValidationError, raw: object) -> str:
    """What is wrong with a body, naming at most :data:`NAMED_PROBLEMS` problems. ``raw`` is
    the body as parsed JSON (None if it is not JSON)."""
    count = exc.error_count()
    errors = _first_errors(model, raw) if count > NAMED_PROBLEMS else None
    if not errors and count <= _DESCRIBED_IN_FULL:
        # few problems, or the cut-down copy missed them (a list's bad elements all past its
        # first _LIST_PREFIX): describing them all is still cheap
        errors = exc.errors(include_url=False)
    parts = [_describe(err) for err in (errors or [])[:NAMED_PROBLEMS]]
    if count <= NAMED_PROBLEMS:
        return "; ".join(parts)
    if not parts:
        return f"{count} problems (too many to describe)"
    return f"{count} problems, including: " + "; ".join(parts) + f"; and {count - len(parts)} more"


def _first_errors(model: type[BaseModel], raw: object) -> list[Any] | None:
    """Some of the problems of a body with many, found by validating a cut-down copy: its
    known fields, its first unknown keys and its lists' first elements (the only ways one body
    has more than a few problems). ``exc.errors()`` would build every one of them."""
    if not isinstance(raw, dict):
        return None
    known = {name for name in model.model_fields} | {
        field.alias for field in model.model_fields.values() if field.alias
    }
    cut: dict[str, Any] = {}
    unknown = 0
    for key, value in raw.items():
        if key not in known:
            unknown += 1
            if unknown > NAMED_PROBLEMS:
                continue
        cut[key] = value[:_LIST_PREFIX] if isinstance(value, list) else value
    try:
        model.model_validate_json(json.dumps(cut))
    except ValidationError as exc:
        return exc.errors(include_url=False)[:NAMED_PROBLEMS]
    return None


def _describe(err: Any) -> str:
    loc = _quoted(".".join(str(p) for p in err["loc"]) or "body")
    kind = err["type"]
    if kind == "json_invalid":
        return f"body is not valid JSON ({err['msg']}){json_hint(err['msg'])}"
    if kind == "extra_forbidden":
        return f"unknown field {loc}"
    if kind == "missing":
        return f"missing required field {loc}"
    got = err.get("input")
    if got is None or isinstance(got, bool):  # as the JSON said it: true, not Python's True
        shown = json.dumps(got)
    else:
        shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if len(shown) > _QUOTED:
        shown = shown[: _QUOTED - 3] + "..."
    return f"field {loc}: {err['msg']} (got {shown})"


def json_hint(message: str) -> str:
    """What a JSON parser's terse message means, where it says too little (a fuzzing trial)."""
    if "hex escape" in message:  # "unexpected end of", "lone leading surrogate in"
        return (
            ": a \\uD800-\\uDFFF escape without its pair, which is no character (Python's "
            "json.dumps writes one for a str holding half a surrogate pair)"
        )
    if "number out of range" in message:
        return ": a number too long to read (an integer field takes at most 2**53 - 1)"
    return ""


def _quoted(name: str) -> str:
    shown = repr(name)
    return shown if len(shown) <= _QUOTED else shown[: _QUOTED - 4] + "...'"


def _parsed(body: str | bytes) -> object:
    """``body`` as JSON, or None; on an invalid body's path only."""
    if isinstance(body, (bytes, bytearray)):
        # As the body's parser reads bytes: a UTF-8 BOM in bytes would be skipped where it is
        # refused in a str, and the same body would be worded differently over HTTP and
        # in-process.
        body = bytes(body).decode("utf-8", "replace")
    try:
        return from_json(body)
    except (ValueError, TypeError):  # not JSON, nested past the depth limit, lone surrogates
        return None


def _patch_idx_hint(raw: object) -> str:
    """Best-effort patch_idx of an invalid body, for the error message only."""
    if isinstance(raw, dict) and type(raw.get("patch_idx")) is int:  # not a bool
        return f" (patch_idx={raw['patch_idx']})"
    return ""


def _invalid(model: type[BaseModel], body: str | bytes, exc: ValidationError, what: str) -> str:
    if body.startswith("\ufeff" if isinstance(body, str) else codecs.BOM_UTF8):  # type: ignore[arg-type]
        # Windows editors and .NET's UTF-8 encoder write one; pydantic says only "expected
        # value at line 1 column 1".
        return f"{what}: body is not valid JSON (it starts with a byte-order mark: send it without)"
    raw = _parsed(body)
    return f"{what}{_patch_idx_hint(raw)}: {_describe_errors(model, exc, raw)}"


def locate(position: int | None) -> str:
    return "" if position is None else f" at batch position {position}"


#: A ``/batch`` element ``{FOREIGN_KEY: type name, "kind": ...}`` stands for what a caller
#: passed where a body goes that JSON cannot carry (a numpy tile, a tuple): ``HttpClient``
#: sends it so that the server refuses it with the other bad positions, in the in-process words.
FOREIGN_KEY = "$type"
_HOW = {
    "dict": ": json.dumps() it",
    "image": ": make one with histoinfer.tile_body(tile, slide_name=, x=, y=, patch_idx=)",
    "": "",
}


def _dimensions(body: object) -> int:
    dimensions = getattr(body, "ndim", 0)
    return dimensions if isinstance(dimensions, int) else 0


class ForeignBody:
    """What a body that was not a str or bytes was, where the caller passed it: its type's
    name and which hint suits it (``dict``, ``image`` or none)."""

    __slots__ = ("kind", "type_name")

    def __init__(self, type_name: str, kind: str) -> None:
        self.type_name = type_name
        self.kind = kind if kind in _HOW else ""

    @classmethod
    def of(cls, body: object) -> ForeignBody:
        if isinstance(body, dict):
            kind = "dict"
        elif _dimensions(body) >= 2 or hasattr(body, "getpixel"):  # a numpy tile, PIL
            kind = "image"
        else:
            kind = ""
        return cls(type(body).__name__, kind)

    def to_json(self) -> dict[str, str]:
        return {FOREIGN_KEY: self.type_name, "kind": self.kind}

    @classmethod
    def from_json(cls, item: dict[str, object]) -> ForeignBody | None:
        """The element as a ``ForeignBody``, or None if it is any other object."""
        name, kind = item.get(FOREIGN_KEY), item.get("kind")
        if len(item) != 2 or not isinstance(name, str) or not isinstance(kind, str):
            return None
        if not name.isidentifier() or len(name) > 100 or kind not in _HOW:
            return None
        return cls(name, kind)


def not_a_json_string(body: object, position: int | None = None) -> InvalidRequestError:
    """The error for a body that is not a JSON string, with the way to make one from what
    was sent (the same words from every client)."""
    foreign = body if isinstance(body, ForeignBody) else ForeignBody.of(body)
    return InvalidRequestError(
        f"invalid request{locate(position)}: body must be a JSON string, "
        f"got {foreign.type_name}{_HOW[foreign.kind]}"
    )


#: bodies this long or longer are screened by :func:`_screen` before parsing
SCREENED_FROM = 1 << 20

#: commas a request may hold beside its ``bulk_rna`` values: its other fields' separators,
#: with room for a few in its slide name
_OTHER_COMMAS = 64


def byte_count(body: bytes, *chars: str) -> int:
    """How many bytes of ``body`` are any of the ASCII ``chars``: ~0.1 ms a MB each, with the
    GIL released (numpy), where parsing a long body would hold it."""
    text = np.frombuffer(body, np.uint8)
    return sum(int(np.count_nonzero(text == ord(char))) for char in chars)


def _screen(body: str | bytes, what: str = "request", position: int | None = None) -> None:
    """A long body with more commas than a request's values, refused before pydantic parses
    it: a JSON value takes ~20 times its text there (a 30 MB list of numbers, 650 MB), more
    again as the errors that name it, on every thread that decodes. A request's only list is
    ``bulk_rna``, so a valid one has no more than its length and a few more; base64 has none.
    Counted at ~0.1 ms a MB of bytes (~0.5 of str): a long body is a large image, whose
    decoding costs far more."""
    if not _screened(body):
        return
    commas = body.count(",") if isinstance(body, str) else byte_count(body, ",")
    if commas > MAX_BULK_RNA + _OTHER_COMMAS:
        raise InvalidRequestError(
            f"invalid {what}{locate(position)}: body has {commas:,} commas: a request has a few "
            f"between its fields and at most {MAX_BULK_RNA:,} in its bulk_rna (a list or an "
            "object this long is not a request, nor a slide name this long a name)"
        )


def _screened(body: str | bytes) -> bool:
    """Whether ``body`` is long enough to screen: :data:`SCREENED_FROM` bytes of its UTF-8, so
    that a ``str`` in-process and its bytes over HTTP are screened alike (a name of 350,000
    "é," was 901,389 characters, not screened, and 1,251,389 bytes, refused: a trial)."""
    if len(body) >= SCREENED_FROM:
        return True
    return (
        isinstance(body, str)
        and len(body) * 4 >= SCREENED_FROM
        and utf8_size(body) >= SCREENED_FROM
    )


def utf8_size(text: str) -> int:
    """``text``'s bytes as it is sent (UTF-8, a lone surrogate kept): its length where it is
    ASCII, which Python knows without a scan."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def parse_request(body: str | bytes, position: int | None = None) -> ModelRequest:
    """Parse one request body, raising :class:`InvalidRequestError` that names what was wrong."""
    if not isinstance(body, (str, bytes, bytearray)):
        raise not_a_json_string(body, position)
    _screen(body, position=position)
    try:
        return ModelRequest.model_validate_json(body)
    except ValidationError as exc:
        what = f"invalid request{locate(position)}"
        raise InvalidRequestError(_invalid(ModelRequest, body, exc, what)) from None


def parse_model(model: type[BaseModel], body: str | bytes, what: str) -> Any:
    """Parse ``body`` as ``model``, raising :class:`InvalidRequestError` naming ``what``."""
    _screen(body, what)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidRequestError(_invalid(model, body, exc, f"invalid {what}")) from None
