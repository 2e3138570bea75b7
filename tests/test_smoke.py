import json

import anyio
import pytest
from helpers import make_body, outputs_close

from histoinfer import Client


def test_client_satisfies_protocol(client):
    assert isinstance(client, Client)


@pytest.mark.parametrize("name", ["InProcessClient", "HttpClient"])
def test_every_protocol_method_says_what_it_does(name):
    """``client.predict?`` in a notebook: each method of the protocol has a docstring."""
    import inspect

    import histoinfer

    cls = getattr(histoinfer, name)
    machinery = ("_abc", "__subclasshook__")  # typing.Protocol's own
    methods = [n for n, v in vars(Client).items() if callable(v) and not n.startswith(machinery)]
    assert "predict_batch" in methods and "__aexit__" in methods
    missing = [n for n in methods if n in vars(Client) and not inspect.getdoc(getattr(cls, n))]
    assert missing == []


@pytest.mark.anyio
async def test_async_matches_explicit_batch(client, explicit_client):
    bodies = [make_body(i) for i in range(6)]
    expected = explicit_client.predict_batch(bodies)
    got = [None] * len(bodies)

    async def one(i):
        got[i] = await client.predict_async(bodies[i])

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(len(bodies)):
                tg.start_soon(one, i)
    for a, b in zip(got, expected, strict=True):
        assert outputs_close(a, b)
    assert json.loads(got[3])["patch_idx"] == 3


def test_the_packages_listing_is_its_public_names():
    """``dir(histoinfer)`` (a notebook's completion) listed ``Any``, ``TYPE_CHECKING``,
    ``annotations`` and the lazy-import table beside the public names."""
    import histoinfer

    names = dir(histoinfer)
    assert set(histoinfer.__all__) <= set(names)
    assert not {"Any", "TYPE_CHECKING", "annotations", "_LAZY"} & set(names)
    with pytest.raises(AttributeError, match="no attribute 'InprocessClient'"):
        histoinfer.InprocessClient  # noqa: B018


def test_every_error_imports_from_the_package_too():
    """``except* InvalidRequestError`` in the README's example needs no submodule (an
    evaluator's ``histoinfer.OverloadedError`` raised AttributeError)."""
    import histoinfer
    import histoinfer.errors

    for name in histoinfer.errors.__all__:
        if name[0].isupper():
            assert getattr(histoinfer, name) is getattr(histoinfer.errors, name)
            assert name in histoinfer.__all__
