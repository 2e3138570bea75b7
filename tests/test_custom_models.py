"""A user's ``ServerModel`` subclass (SPEC §2.4): its ``prepare_sample`` and ``postprocess`` as
SPEC writes them, and what they raise, reach every caller alike: dynamic (lone and batched),
explicit, ``*_batch`` and HTTP."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import pytest
import torch
from concurrency_helpers import all_at_once, hooked_model
from helpers import make_body, outputs_close, serving
from PIL import Image

from histoinfer import HttpClient, InProcessClient
from histoinfer.errors import InvalidRequestError, ModelExecutionError
from histoinfer.models.base import SampleOutput, ServerModel
from histoinfer.models.h1 import H1ServerModel
from histoinfer.schema import Mode, ModelRequest, ModelResponse
from histoinfer.server import create_app

pytestmark = pytest.mark.timeout(120)

BAD = 3  # the patch_idx the failing models fail on


class SpecSignature(H1ServerModel):
    """``prepare_sample(self, request)``, exactly as SPEC §2.4 writes it."""

    def prepare_sample(self, request: ModelRequest) -> torch.Tensor:  # type: ignore[override]
        return super().prepare_sample(request)


def logged(method: Any) -> Any:
    """A decorator that forgets functools.wraps: its wrapper's signature is (*args, **kwargs)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return wrapper


class DecoratedPrepare(H1ServerModel):
    @logged
    def prepare_sample(self, request: ModelRequest) -> torch.Tensor:  # type: ignore[override]
        return super().prepare_sample(request)


class FailingPrepare(H1ServerModel):
    def prepare_sample(self, request: ModelRequest) -> torch.Tensor:  # type: ignore[override]
        if request.patch_idx == BAD:
            raise ValueError("stain normalisation failed: blank tile")
        return super().prepare_sample(request)


class FailingPostprocess(H1ServerModel):
    def postprocess(self, request: ModelRequest, output: SampleOutput, mode: Mode) -> ModelResponse:
        if request.patch_idx == BAD:
            raise KeyError("gene panel mapping missing")
        return super().postprocess(request, output, mode)


class NormalizingPrepare(H1ServerModel):
    """Normalizes in ``prepare_sample``, where SPEC §5 places normalization, as a user writes it
    from ``model.json``'s mean and std."""

    def prepare_sample(self, request: ModelRequest) -> torch.Tensor:  # type: ignore[override]
        mean = torch.tensor(self.assets.mean).view(3, 1, 1)
        std = torch.tensor(self.assets.std).view(3, 1, 1)
        return (super().prepare_sample(request).float() / 255 - mean) / std


class NormalizingPrepareOwnForward(NormalizingPrepare):
    """A forward_batch of its own that hands the batch on (floats: normalized already)."""

    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> Any:
        return super().forward_batch(batch, mode)


class Int64Prepare(H1ServerModel):
    def prepare_sample(self, request: ModelRequest) -> torch.Tensor:  # type: ignore[override]
        return super().prepare_sample(request).long()


def build(cls: type[ServerModel], tiny_model: ServerModel) -> ServerModel:
    return cls(tiny_model.checkpoint, tiny_model.assets, "cpu")


@pytest.mark.parametrize("kind", [SpecSignature, DecoratedPrepare])
def test_spec_signature_serves_every_path(
    kind: type[ServerModel], tiny_model: ServerModel, reference: Any
) -> None:
    model = build(kind, tiny_model)
    bodies = [make_body(i) for i in range(4)]
    expected = [reference.predict(b) for b in bodies]
    with InProcessClient(model) as dynamic, InProcessClient(model, dynamic_batching=False) as one:
        assert [dynamic.predict(b) for b in bodies] == expected
        assert [one.predict(b) for b in bodies] == expected
        assert len(dynamic.predict_batch(bodies)) == 4


def expected_error(kind: type[ServerModel]) -> str:
    step = "prepare_sample" if kind is FailingPrepare else "postprocess"
    return rf"model 'h1': {step} failed (at batch position {BAD} )?for patch_idx={BAD} "


@pytest.mark.anyio
@pytest.mark.parametrize("kind", [FailingPrepare, FailingPostprocess])
async def test_a_subclass_failing_fails_its_own_request_alike_everywhere(
    kind: type[ServerModel], tiny_model: ServerModel
) -> None:
    model = build(kind, tiny_model)
    bodies = [make_body(i) for i in range(6)]
    message = expected_error(kind)
    with InProcessClient(model) as dynamic, InProcessClient(model, dynamic_batching=False) as one:
        for client in (dynamic, one):
            with pytest.raises(ModelExecutionError, match=message):  # alone
                await client.predict_async(bodies[BAD])
        errors = dynamic.stats()["predict"].errors
        with pytest.raises(ModelExecutionError, match=message):
            dynamic.predict_batch(bodies)
        # Counted as a single call's is: postprocess, after the pass (in a batch it was not);
        # prepare_sample, before any queue, not (a single call's is not either).
        counted = 1 if kind is FailingPostprocess else 0
        assert dynamic.stats()["predict"].errors == errors + counted

        outcomes = await all_at_once(dynamic, bodies)
        failed = outcomes.pop(BAD)
        assert isinstance(failed, ModelExecutionError), failed
        assert all(isinstance(o, str) for o in outcomes.values()), outcomes  # the others served

        # Over HTTP: the same class and message (a 500 with the detail).
        app = create_app({"h1": InProcessClient(model)}, warmup=False)
        async with serving(app):
            transport = httpx.ASGITransport(app=app)
            async with HttpClient("http://test", transport=transport, retries=0) as http:
                with pytest.raises(ModelExecutionError, match=message):
                    await http.predict_async(bodies[BAD])
                assert isinstance(await http.predict_async(bodies[0]), str)


def test_a_batch_with_invalid_bodies_names_them_though_the_model_failed_on_another(
    tiny_model: ServerModel,
) -> None:
    """SPEC §2.2: any invalid body makes the ``*_batch`` call an ``InvalidRequestError``
    naming every bad position; a valid body the model could not prepare is said too, not put
    in front of them as a 500."""
    model = build(FailingPrepare, tiny_model)
    bodies = [make_body(i) for i in range(6)]  # bodies[BAD] fails in prepare_sample
    bodies[1] = "{not json"
    bodies[4] = make_body(4, x=-5)
    with InProcessClient(model, dynamic_batching=False) as client:
        with pytest.raises(InvalidRequestError) as info:
            client.predict_batch(bodies)
        # Alone, the model's failure is still the call's error.
        with pytest.raises(ModelExecutionError, match=expected_error(FailingPrepare)):
            client.predict_batch([make_body(i) for i in range(BAD + 1)])
    message = str(info.value)
    assert message.startswith("2 of 6 requests are invalid (positions 1, 4)"), message
    assert f"the model failed to prepare position {BAD}: " in message, message
    assert "stain normalisation failed" in message, message
    assert info.value.positions == sorted([1, 4, BAD])


class _Blank(BaseException):
    """What a user's model might raise that is not an Exception (SystemExit alike)."""


def _solid_body(i: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (224, 224), (0, 0, 0)).save(buf, format="PNG")
    return make_body(i, image_data=base64.b64encode(buf.getvalue()).decode())


@pytest.mark.anyio
async def test_a_pass_raising_a_base_exception_fails_only_its_own_request(
    tiny_model: ServerModel,
) -> None:
    """A model's BaseException (not an Exception) on the device's thread used to be taken for
    the loop's cancellation: every caller of the batch failed as "closed", and the sync
    client's portal died for good. Now it is that request's ModelExecutionError, everywhere."""

    def refuse_blank(batch: torch.Tensor) -> None:
        flat = batch.float().flatten(1)
        if ((flat.max(1).values - flat.min(1).values) == 0).any():
            raise _Blank("blank tile")

    model, _ = hooked_model(tiny_model, refuse_blank)
    bodies = [_solid_body(i) if i == BAD else make_body(i) for i in range(6)]
    message = rf"^model 'h1': forward pass failed for patch_idx={BAD} .*ThreadAbortedError.*_Blank"
    with InProcessClient(model, max_wait_ms=50) as dynamic:
        outcomes = await all_at_once(dynamic, bodies)
        with anyio.fail_after(60):
            with pytest.raises(ModelExecutionError, match=message):  # alone
                await dynamic.predict_async(bodies[BAD])
            assert isinstance(await dynamic.predict_async(bodies[0]), str)  # serving on
        failed = outcomes.pop(BAD)
        assert isinstance(failed, ModelExecutionError), failed
        assert all(isinstance(o, str) for o in outcomes.values()), outcomes
    # Sync calls from a plain thread (through the client's portal): the portal survives it.
    with InProcessClient(model) as dynamic, ThreadPoolExecutor(1) as pool:
        with pytest.raises(ModelExecutionError, match=message):
            pool.submit(dynamic.predict, bodies[BAD]).result(timeout=60)
        assert isinstance(pool.submit(dynamic.predict, bodies[1]).result(timeout=60), str)
    with InProcessClient(model, dynamic_batching=False) as explicit:
        with pytest.raises(ModelExecutionError, match=f"batch position {BAD} .*_Blank"):
            explicit.predict_batch(bodies)
        assert len(explicit.predict_batch(bodies[:BAD])) == BAD


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["NormalizingPrepare", "NormalizingPrepareOwnForward"])
async def test_a_tile_normalized_by_prepare_sample_is_served_on_every_path(
    tiny_model: ServerModel, reference: Any, kind: str
) -> None:
    """Regression: a float tile was refused (normalization had moved into the batch), so a
    subclass written as SPEC §5 has it failed every request; then it was refused beside a
    forward_batch of its own (SPEC §2.4), which now gets the float batch, and the built-in
    forward_batch takes a float batch as normalized."""
    model = build(globals()[kind], tiny_model)
    bodies = [make_body(i) for i in range(6)]
    expected = [reference.predict(b) for b in bodies]
    with InProcessClient(model) as dynamic, InProcessClient(model, dynamic_batching=False) as one:
        got = [dynamic.predict(bodies[0]), one.predict(bodies[1])]  # lone tiles
        got += dynamic.predict_batch(bodies[2:4])
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:  # dynamic batches of several

                async def call(i: int) -> None:
                    got.append(await dynamic.predict_async(bodies[i]))

                for i in (4, 5):
                    tg.start_soon(call, i)
        got[4:] = sorted(got[4:], key=lambda r: json.loads(r)["patch_idx"])
        for answer, want in zip(got, expected, strict=True):
            assert outputs_close(answer, want)  # normalized alike, once


@pytest.mark.parametrize(
    ("kind", "message"),
    [(Int64Prepare, r"must return a tensor \[3, 224, 224\] on the CPU, of uint8.*got int64")],
    ids=["int64"],
)
def test_a_tile_the_pipeline_cannot_take_is_refused_naming_the_contract(
    tiny_model: ServerModel, kind: type[ServerModel], message: str
) -> None:
    model = build(kind, tiny_model)
    with InProcessClient(model) as dynamic, InProcessClient(model, dynamic_batching=False) as one:
        for client in (dynamic, one):
            with pytest.raises(ModelExecutionError, match=message):
                client.predict(make_body(1))
        with pytest.raises(ModelExecutionError, match=message):
            dynamic.predict_batch([make_body(0), make_body(1)])
