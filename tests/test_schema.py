"""The wire format (SPEC §3): strict parsing, messages that say what and where, exact output."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import numpy as np
import pytest
from helpers import make_body, request_dict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from histoinfer import ModelMetadata, ModelRequest, ModelResponse
from histoinfer.errors import InvalidRequestError
from histoinfer.schema import (
    MAX_BULK_RNA,
    MAX_INT,
    NAMED_PROBLEMS,
    InvocationEnvelope,
    InvocationRequest,
    parse_model,
    parse_request,
)

SMALL = request_dict(3, size=16)  # a valid request with a small image: cheap to re-serialize


def body(**overrides: Any) -> str:
    return json.dumps({**SMALL, **overrides})


def without(field: str) -> str:
    return json.dumps({k: v for k, v in SMALL.items() if k != field})


def test_valid_request_keeps_every_field() -> None:
    request = parse_request(make_body(5))
    expected = request_dict(5)
    assert request.model_dump(exclude_none=True) == expected
    assert request.bulk_rna is None


def test_optional_fields_may_be_absent_or_null() -> None:
    minimal = {k: v for k, v in SMALL.items() if k not in ("tissue_ratio", "resolution")}
    request = parse_request(json.dumps(minimal))
    assert request.tissue_ratio is None and request.resolution is None
    request = parse_request(body(tissue_ratio=None, resolution=None, bulk_rna=None))
    assert request.tissue_ratio is None and request.bulk_rna is None


@pytest.mark.parametrize(
    "raw", [make_body(1).encode(), bytearray(make_body(1).encode()), "  " + make_body(1) + "\n"]
)
def test_bytes_and_surrounding_whitespace_are_accepted(raw: str | bytes) -> None:
    assert parse_request(raw).patch_idx == 1


def test_integral_json_numbers_are_accepted_for_floats() -> None:
    # JSON has one number type: 1 is a fine tissue_ratio, even under strict validation.
    assert parse_request(body(tissue_ratio=1, resolution=2)).tissue_ratio == 1.0


# (name, body, fragments the message must contain)
BAD_BODIES: list[tuple[str, Any, list[str]]] = [
    ("invalid JSON", '{"x": ', ["not valid JSON"]),
    ("trailing garbage", make_body(0) + "}", ["not valid JSON"]),
    ("JSON array", "[]", ["object"]),
    ("JSON null", "null", ["object"]),
    ("non-string body", {"x": 1}, ["JSON string", "dict", "json.dumps() it"]),
    ("numpy tile", np.zeros((4, 4, 3), np.uint8), ["JSON string", "ndarray", "tile_body("]),
    ("PIL tile", Image.new("RGB", (4, 4)), ["JSON string", "Image", "tile_body("]),
    ("None body", None, ["JSON string", "NoneType"]),
    ("unknown field", body(colour="pink"), ["unknown field 'colour'", "patch_idx=3"]),
    ("missing field", without("slide_name"), ["missing", "'slide_name'", "patch_idx=3"]),
    ("missing patch_idx", without("patch_idx"), ["missing", "'patch_idx'"]),
    ("negative x", body(x=-1), ["'x'", "-1", "patch_idx=3"]),
    ("negative y", body(y=-8), ["'y'", "-8"]),
    ("zero width", body(width=0), ["'width'"]),
    ("negative height", body(height=-5), ["'height'"]),
    ("negative patch_idx", body(patch_idx=-2), ["'patch_idx'", "-2"]),
    ("tissue_ratio above 1", body(tissue_ratio=1.5), ["'tissue_ratio'", "1.5"]),
    ("tissue_ratio below 0", body(tissue_ratio=-0.1), ["'tissue_ratio'"]),
    ("NaN tissue_ratio", body(tissue_ratio=float("nan")), ["'tissue_ratio'", "finite"]),
    ("infinite resolution", body(resolution=float("inf")), ["'resolution'", "finite"]),
    ("zero resolution", body(resolution=0), ["'resolution'"]),
    ("string for int", body(x="12"), ["'x'", "integer"]),
    ("float for int", body(y=1.5), ["'y'", "integer"]),
    # JSON's words for what the body held, not Python's ("got True", "got None").
    ("bool for int", body(width=True), ["'width'", "(got true)"]),
    ("int for string", body(slide_name=7), ["'slide_name'", "string"]),
    ("null image", body(image_data=None), ["'image_data'", "(got null)"]),
    ("NaN in bulk_rna", body(bulk_rna=[1.0, float("nan")]), ["'bulk_rna.1'"]),
    ("string in bulk_rna", body(bulk_rna=["a"]), ["'bulk_rna.0'"]),
    ("byte-order mark", "\ufeff" + make_body(0), ["not valid JSON", "byte-order mark"]),
    ("byte-order mark, bytes", b"\xef\xbb\xbf" + make_body(0).encode(), ["byte-order mark"]),
]


@pytest.mark.parametrize(("name", "raw", "fragments"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_raise_invalid_request_naming_the_problem(
    name: str, raw: Any, fragments: list[str]
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(raw)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{name}: {fragment!r} not in {message!r}"


def test_batch_position_is_named() -> None:
    with pytest.raises(InvalidRequestError, match=r"at batch position 7 \(patch_idx=3\)"):
        parse_request(body(x=-1), position=7)


@pytest.mark.parametrize("raw", [body(x=-1), "\ufeff" + body(x=-1), "\ufeff{"])
def test_a_body_is_worded_alike_as_str_and_as_bytes(raw: str) -> None:
    """In-process bodies are str, the server's are bytes: one body, one message (json.loads
    alone skips a UTF-8 BOM in bytes but not in a str)."""
    messages = []
    for sent in (raw, raw.encode()):
        with pytest.raises(InvalidRequestError) as info:
            parse_request(sent)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_an_invalid_invocation_names_its_patch_idx() -> None:
    with pytest.raises(InvalidRequestError, match=r"invalid invocation \(patch_idx=3\): .*'x'"):
        parse_model(InvocationRequest, body(x=-1, model_name="h1", mode="prediction"), "invocation")


def test_every_problem_of_a_body_is_reported() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(body(x=-1, tissue_ratio=3.0, extra=1))
    message = str(info.value)
    assert "'x'" in message and "'tissue_ratio'" in message and "'extra'" in message


def test_long_inputs_are_abbreviated_in_messages() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(body(x="9" * 10_000))
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(
    ("overrides", "count", "first"),
    [
        ({"bulk_rna": ["x"] * MAX_BULK_RNA}, MAX_BULK_RNA, "field 'bulk_rna.0': Input should be"),
        ({f"key{i}": 0 for i in range(100_000)}, 100_000, "unknown field 'key0'"),
        ({"x": -1, "bulk_rna": [1.0, "a"] * 30}, 31, "field 'x': Input should be greater"),
    ],
    ids=["bad-elements", "unknown-keys", "mixed"],
)
def test_a_body_with_many_problems_names_a_few_and_counts_the_rest(
    overrides: dict[str, Any], count: int, first: str
) -> None:
    # Regression: every problem was described, a message of tens of megabytes for a few MB of
    # body, built for seconds while a server's memory grew by gigabytes.
    with pytest.raises(InvalidRequestError) as info:
        parse_request(body(**overrides))
    message = str(info.value)
    assert message.startswith(f"invalid request (patch_idx=3): {count} problems, including: ")
    assert first in message
    assert message.count("; ") == NAMED_PROBLEMS
    assert message.endswith(f"; and {count - NAMED_PROBLEMS} more")


@pytest.mark.parametrize(("bad", "described"), [(20, True), (20_000, False)])
def test_problems_past_a_lists_first_elements_are_still_counted_right(
    bad: int, described: bool
) -> None:
    """The cut-down copy sees a list's first 1,000 elements only: problems past them are
    described from pydantic's own list while that is cheap, else counted."""
    with pytest.raises(InvalidRequestError) as info:
        parse_request(body(bulk_rna=[1.0] * 1000 + ["x"] * bad))
    message = str(info.value)
    if described:
        assert f"{bad} problems, including: field 'bulk_rna.1000'" in message
        assert message.endswith(f"; and {bad - NAMED_PROBLEMS} more")
    else:
        assert message.endswith(f": {bad} problems (too many to describe)")


def test_a_long_unknown_key_is_abbreviated() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(body(**{"k" * 100_000: 1}))
    assert "unknown field 'kkk" in str(info.value) and len(str(info.value)) < 200


@pytest.mark.parametrize("raw", ["[" * 100_000, '{"a":' * 50_000, "[" * 5_000 + "]" * 5_000])
def test_deeply_nested_json_is_an_invalid_request(raw: str) -> None:
    # Regression: the patch_idx hint re-parsed the body with json.loads and let RecursionError
    # escape, which a server would have answered with a 500.
    with pytest.raises(InvalidRequestError, match="invalid request"):
        parse_request(raw)


def test_lone_surrogate_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequestError):
        parse_request(body(slide_name="a").replace('"a"', '"\ud800"'))


def test_response_omits_embedding_unless_present() -> None:
    fields = {k: SMALL[k] for k in ("slide_name", "x", "y", "width", "height", "patch_idx")}
    plain = json.loads(ModelResponse(output=[1.0, 2.0], **fields).model_dump_json())
    assert "embedding" not in plain
    assert plain["tissue_ratio"] is None and plain["resolution"] is None
    with_emb = ModelResponse(output=[1.0], embedding=[0.5, 0.25], **fields)
    assert json.loads(with_emb.model_dump_json())["embedding"] == [0.5, 0.25]
    # What we write, we read back identically.
    assert ModelResponse.model_validate_json(with_emb.model_dump_json()) == with_emb


def test_response_json_is_deterministic() -> None:
    fields = dict(output=[0.1, -2.5], slide_name="s", x=1, y=2, width=3, height=4, patch_idx=5)
    assert ModelResponse(**fields).model_dump_json() == ModelResponse(**fields).model_dump_json()


@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize(
    "overrides",
    [{"image_data": [1] * 400_000}, {f"k{i}": 0 for i in range(150_000)}],
    ids=["a long list", "many keys"],
)
def test_a_long_body_of_more_values_than_a_request_holds_is_refused_unparsed(
    overrides: dict[str, Any], as_bytes: bool
) -> None:
    """pydantic takes ~20 times such a body's text to parse it (a 30 MB list: 650 MB), more
    again for the errors naming it: counted, not parsed."""
    text = body(**overrides)
    with pytest.raises(InvalidRequestError) as info:
        parse_request(text.encode() if as_bytes else text, 7)
    commas = text.count(",")
    assert str(info.value) == (
        f"invalid request at batch position 7: body has {commas:,} commas: a request has a few "
        f"between its fields and at most {MAX_BULK_RNA:,} in its bulk_rna (a list or an object "
        "this long is not a request, nor a slide name this long a name)"
    )


def test_json_the_parser_words_tersely_is_explained() -> None:
    """A fuzzing trial: "unexpected end of hex escape" named neither the field nor the cause."""
    cases = {
        '{"slide_name": "\\ud800"}': "escape without its pair, which is no character",
        '{"slide_name": "\\ud800\\ud800"}': "escape without its pair",
        '{"x": ' + "9" * 4301 + "}": "a number too long to read",
    }
    for text, says in cases.items():
        with pytest.raises(InvalidRequestError, match="body is not valid JSON") as info:
            parse_request(text)
        assert says in str(info.value), str(info.value)


def test_a_body_is_screened_by_its_utf8_length_whatever_its_type() -> None:
    """A str in-process and its bytes over HTTP: a name of 350,000 "é," was parsed as a str
    (901,389 characters) and refused as bytes (1,251,389): a fuzzing trial."""
    text = json.dumps({**SMALL, "slide_name": "é," * 350_000}, ensure_ascii=False)
    assert len(text) < 2**20 <= len(text.encode())
    for sent in (text, text.encode()):
        with pytest.raises(InvalidRequestError, match="body has 350,0"):
            parse_request(sent)
    short = json.dumps({**SMALL, "slide_name": "é," * 1000}, ensure_ascii=False)  # parsed
    assert parse_request(short).slide_name == "é," * 1000


@pytest.mark.parametrize("field", ["x", "y", "patch_idx", "width"])
def test_integers_past_json_exact_range_are_refused(field: str) -> None:
    """10**30 was accepted and echoed: past int64 for numpy and AnnData, and not an exact
    number for a JavaScript client or a float64 column."""
    assert getattr(parse_request(body(**{field: MAX_INT})), field) == MAX_INT
    with pytest.raises(InvalidRequestError, match=f"field '{field}': Input should be less than"):
        parse_request(body(**{field: MAX_INT + 1}))


def test_an_invocation_envelope_is_screened_too() -> None:
    """Its extra fields are ignored, but pydantic parses them all the same."""
    text = json.dumps({"model_name": "h1", "mode": "prediction", "junk": [0] * 400_000})
    with pytest.raises(InvalidRequestError, match=r"^invalid invocation: body has 400,001 commas"):
        parse_model(InvocationEnvelope, text.encode(), "invocation")


def test_long_valid_bodies_pass_the_screen() -> None:
    long_image = "A" * (2 << 20)  # a large image's base64: no commas
    assert parse_request(body(image_data=long_image)).image_data == long_image
    bulk = [0.123456789012] * MAX_BULK_RNA  # the most a request holds: 1.6 MB of them
    text = body(bulk_rna=bulk, slide_name="a," * 30)  # and commas in its name
    assert len(text) > (1 << 20)
    assert parse_request(text.encode()).bulk_rna == bulk


def test_bulk_rna_longer_than_a_transcriptome_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError, match="field 'bulk_rna': List should have at most"):
        parse_request(body(bulk_rna=[0.5] * (MAX_BULK_RNA + 1)))


def test_a_request_built_in_python_takes_numpy_numbers() -> None:
    """Tile coordinates come out of numpy arrays: ``ModelRequest(x=np.int64(3), ...)`` is the
    request with ``x=3`` (it was refused: strict mode took only Python ints), while what strict
    parsing refuses stays refused: a bool, a float where an int goes, a value out of range."""
    fields = {k: v for k, v in SMALL.items() if k not in ("x", "y", "patch_idx", "tissue_ratio")}
    plain = ModelRequest(**fields, x=3, y=4, patch_idx=5, tissue_ratio=0.5, bulk_rna=[1.5, 2.0])
    from_numpy = ModelRequest(
        **fields,
        x=np.int64(3),
        y=np.uint16(4),
        patch_idx=np.int32(5),
        tissue_ratio=np.float32(0.5),
        bulk_rna=np.array([1.5, 2.0], np.float32),
    )
    assert from_numpy == plain
    assert type(from_numpy.x) is int and type(from_numpy.tissue_ratio) is float
    assert from_numpy.model_dump_json() == plain.model_dump_json()
    listed = ModelRequest(**fields, x=3, y=4, patch_idx=5, bulk_rna=[np.float64(1.5), 2.0])
    assert listed.bulk_rna == [1.5, 2.0]
    refused: list[dict[str, Any]] = [
        {"x": np.bool_(True)},
        {"x": np.timedelta64(3, "ns")},
        {"x": np.float64(3.0)},
        {"x": np.int64(-1)},
        {"tissue_ratio": np.float32(1.5)},
        {"bulk_rna": np.zeros((2, 2))},
        {"bulk_rna": [np.bool_(True)]},
    ]
    for bad in refused:
        with pytest.raises(ValueError, match=next(iter(bad))):
            ModelRequest(**{**fields, "x": 3, "y": 4, "patch_idx": 5, **bad})


def test_reprs_elide_long_fields_but_keep_the_values() -> None:
    output = [i / 8 for i in range(307)]
    response = ModelResponse(
        output=output,
        embedding=[0.5] * 192,
        slide_name="S1",
        **{k: 1 for k in ("x", "y", "width", "height", "patch_idx")},
    )
    shown = repr(response)
    assert "[0.0, 0.125, 0.25, ... 307 floats]" in shown
    assert "[0.5, 0.5, 0.5, ... 192 floats]" in shown
    assert len(shown) < 400 and "slide_name='S1'" in shown
    assert response.output == output and str(response).startswith("output=[0.0, 0.125")
    short = response.model_copy(update={"output": [1.0, 2.0], "embedding": None})
    assert "output=[1.0, 2.0]" in repr(short) and "embedding=None" in repr(short)

    request = ModelRequest.model_validate_json(make_body(7))
    shown = repr(request)
    assert f"({len(request.image_data):,} chars)" in shown
    assert repr(request.image_data[:24]) in shown and len(shown) < 400
    assert "patch_idx=7" in shown


def test_metadata_round_trips(tiny_model: Any) -> None:
    metadata = tiny_model.metadata()
    assert isinstance(metadata, ModelMetadata)
    assert ModelMetadata.model_validate_json(metadata.model_dump_json()) == metadata


def test_invocation_request_carries_a_model_request() -> None:
    raw = body(model_name="h1", mode="prediction")
    invocation = InvocationRequest.model_validate_json(raw)
    assert invocation.to_model_request() == parse_request(json.dumps(SMALL))
    assert isinstance(invocation.to_model_request(), ModelRequest)


def test_invocation_envelope_takes_any_mode_string_and_nothing_else() -> None:
    """An unknown mode string is the route's to refuse, as a 400 unsupported mode (SPEC 3.4:
    test_server_app); a mode that is not a string is a schema error here."""
    envelope = parse_model(InvocationEnvelope, body(model_name="h1", mode="metadata"), "envelope")
    assert envelope.mode == "metadata"
    unknown = json.dumps({"model_name": "h1", "mode": "x"})
    assert parse_model(InvocationEnvelope, unknown, "invocation").mode == "x"
    with pytest.raises(InvalidRequestError, match=r"invalid invocation.*'mode'"):
        parse_model(InvocationEnvelope, json.dumps({"model_name": "h1", "mode": 3}), "invocation")


# -- fuzzing: whatever arrives, the parser answers with a request or an InvalidRequestError ----

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
field_names = st.sampled_from([*SMALL, "bulk_rna", "extra"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(field_names, json_values, max_size=6), st.booleans())
def test_fuzzed_requests_parse_or_raise_invalid_request(
    overrides: dict[str, Any], start_valid: bool
) -> None:
    data = {**SMALL, **overrides} if start_valid else overrides
    raw = json.dumps(data)
    try:
        request = parse_request(raw)
    except InvalidRequestError as exc:
        assert str(exc).startswith("invalid request")
        return
    # Whatever got through obeys the contract.
    assert request.x >= 0 and request.y >= 0 and request.patch_idx >= 0
    assert request.width > 0 and request.height > 0
    assert request.tissue_ratio is None or 0.0 <= request.tissue_ratio <= 1.0


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40) | st.binary(max_size=40))
def test_fuzzed_text_parses_or_raises_invalid_request(raw: str | bytes) -> None:
    with contextlib.suppress(InvalidRequestError):  # anything else fails the test
        parse_request(raw)
