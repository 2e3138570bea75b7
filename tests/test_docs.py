"""Every Python example in README.md and docs/ runs as written.

Each example runs in a fresh interpreter, in a folder laid out as the docs say (``ckpt/`` is an
export of the tiny reference model, and ``h1-tiny/``, ``ckpt/tiny/`` the same), with what its
page gives in prose or in an earlier example run first (``before``) and a check of what it made
run after (``after``). HTTP examples are sent to a ``histoinfer serve`` on loopback in place of
the docs' ``127.0.0.1:8080``. An example with no entry in ``EXAMPLES`` fails the test, so a new
one is run from the day it is written. One that needs a package histoinfer does not depend on
(docs/wire-format.md's ``anndata``) names it in ``requires``, and is skipped, saying so, where
that package is not installed.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from histoinfer.bench.loopback import ServerProcess

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS_URL = "http://127.0.0.1:8080"

A_BODY = """
from PIL import Image
from histoinfer import tile_body
tile = Image.new("RGB", (224, 224), (214, 166, 196))
body = tile_body(tile, slide_name="S1", x=0, y=0, patch_idx=0)
bodies = [body] * 16
"""

# What docs/checkpoints.md leaves to the reader: a backbone, a head and their gene names.
YOUR_MODEL = """
import torch
torch.manual_seed(0)
my_gene_names = [f"GENE{i}" for i in range(5)]
backbone = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 16, stride=16), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
    torch.nn.Linear(8, 1024),
)
head = torch.nn.Linear(1024, len(my_gene_names))
"""

# What a user checks after following docs/checkpoints.md: the model serves its genes.
YOUR_MODEL_ANSWERS = """
import json
from histoinfer import InProcessClient
with InProcessClient.from_checkpoint("h1", out / "model.pt2") as client:
    answer = json.loads(client.predict_with_embedding(body))
    meta = json.loads(client.metadata())
assert len(answer["output"]) == 5 and len(answer["embedding"]) == 1024, answer
assert (meta["name"], meta["gene_names"]) == ("my-model", my_gene_names), meta
"""


def json_example(page: str, marker: str) -> str:
    """The text of the one JSON block of ``page`` with ``marker`` in it."""
    text = (ROOT / page).read_text(encoding="utf-8")
    [found] = [m for m in re.findall(r"^```json\n(.*?)^```", text, re.S | re.M) if marker in m]
    return found


# docs/checkpoints.md's tissue-mask model.json, over a program that answers with a 14x14 grid.
A_MASK_MODEL = (
    """
import json
from pathlib import Path
import torch
from histoinfer import InProcessClient
class Mask(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(torch.sigmoid(-x.mean(dim=1)), 14)
batch = torch.export.Dim("batch", min=1, max=64)
program = torch.export.export(Mask(), (torch.zeros(2, 3, 224, 224),),
                              dynamic_shapes={"x": {0: batch}})
out = Path("tissue"); out.mkdir()
torch.export.save(program, out / "model.pt2")
(out / "model.json").write_text("""
    + repr(json_example("docs/checkpoints.md", '"tissue-mask"'))
    + """)
client = InProcessClient.from_checkpoint("h1", out / "model.pt2")
"""
)


def slide_answers(run: str) -> str:
    """What README.md's whole-slide recipe promises: the answers in the order of the bodies,
    and (``run`` sending them again with 4 workers) no more bodies held than that."""
    return f"""
import json
assert [json.loads(r)["patch_idx"] for r in results] == list(range(200))
assert [(json.loads(r)["x"], json.loads(r)["y"]) for r in results] == coords
from histoinfer import InProcessClient
answered, held = 0, []
def counted(bodies):
    for n, body in enumerate(bodies):
        held.append(n - answered)  # bodies taken before this one and not answered yet
        yield body
real_predict_async = InProcessClient.predict_async
async def predict_async(self, body, session=None):
    global answered
    try:
        return await real_predict_async(self, body, session)
    finally:
        answered += 1
InProcessClient.predict_async = predict_async
assert len({run}) == 200
assert max(held) < 4, max(held)
"""


@dataclass(frozen=True)
class Example:
    page: str  # relative to the repository
    line: int
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Context:
    before: str = ""
    after: str = ""
    # Top-level ``await`` (docs/server.md's test recipe): run inside ``anyio.run``.
    awaits: bool = False
    # Also run with ``anyio.run(main, backend="trio")``, as the example's comment offers.
    on_trio: bool = False
    # Packages it imports that are not histoinfer's dependencies: skipped where one is missing.
    requires: tuple[str, ...] = ()


def example_code(page: str, marker: str) -> str:
    """The code of the one example of ``page`` with ``marker`` in it."""
    [code] = [e.code for e in python_examples() if e.page == page and marker in e.code]
    return code


def python_examples() -> Iterator[Example]:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text.count("\n", 0, match.start()) + 2
            yield Example(str(page.relative_to(ROOT)), line, match.group(1))


# Keyed by the page and a line found in one example of it.
EXAMPLES: dict[tuple[str, str], Context] = {
    ("README.md", "response = client.predict(body)"): Context(
        after="""
import json
assert len(json.loads(response)["output"]) == 307
assert len(json.loads(both)["embedding"]) > 0 and len(many) == 100
""",
    ),
    ("README.md", "results = asyncio.run(main(slide_bodies(coords)))"): Context(
        after=slide_answers("asyncio.run(main(counted(slide_bodies(coords)), 4))"),
    ),
    ("README.md", "trio.run(main, slide_bodies(coords))"): Context(
        # It reuses the asyncio example's ``slide_bodies`` and ``coords``.
        before=example_code("README.md", "results = asyncio.run(main(slide_bodies(coords)))"),
        after=slide_answers("trio.run(main, counted(slide_bodies(coords)), 4)"),
    ),
    ("README.md", "HttpClient("): Context(
        before=A_BODY,
        after="""
import json
assert len(json.loads(client.predict(body))["output"]) == 307
client.close()
""",
    ),
    ("docs/batching.md", "BatchScheduler(double"): Context(on_trio=True),
    ("docs/batching.md", "ProcessPoolExecutor(2, initializer"): Context(
        before=A_BODY + "from histoinfer import InProcessClient\n",
        after="""
import json
assert [json.loads(r)["output"] for r in results] == [json.loads(results[0])["output"]] * 16
""",
    ),
    ("docs/benchmarks.md", "torch.profiler.profile()"): Context(),
    ("docs/wire-format.md", "keep(i, await client.predict_with_embedding_async(body))"): Context(
        # Its bodies are README.md's ``slide_bodies(coords)``.
        before=example_code("README.md", "results = asyncio.run(main(slide_bodies(coords)))"),
        after="""
import json
assert X.shape == (200, 307) and X.dtype == np.float32 and embedding.shape == (200, 96)
assert spatial.tolist() == [list(c) for c in coords] and patch_idx.tolist() == list(range(200))
assert list(slide_name) == ["S1"] * 200 and obs_names[:2] == ["S1_0", "S1_1"]
assert list(obs["x"]) == [x for x, _ in coords] and list(obs["y"]) == [y for _, y in coords]
assert uns["trained"] is False and len(uns["checkpoint_sha256"]) == 64, uns
with InProcessClient.from_checkpoint("h1", "ckpt/model.pt2") as other:
    one = json.loads(other.predict_with_embedding(next(slide_bodies(coords))))
# What the page says of the floats: float32 holds each exactly.
assert np.float32(one["output"]).astype(np.float64).tolist() == one["output"]
assert np.float32(one["embedding"]).astype(np.float64).tolist() == one["embedding"]
# Every tile is the same pixels: the same answer, up to the batch's composition.
assert np.allclose(X, one["output"], atol=1e-4)
assert np.allclose(embedding, one["embedding"], atol=1e-4)
""",
    ),
    ("docs/wire-format.md", "anndata.AnnData("): Context(
        requires=("anndata",),
        before=example_code("README.md", "results = asyncio.run(main(slide_bodies(coords)))")
        + example_code("docs/wire-format.md", "predict_with_embedding_async(body)"),
        after="""
back = anndata.read_h5ad("slide.h5ad")
assert back.shape == (200, 307) and list(back.var_names) == meta.gene_names
assert list(back.obs_names[:2]) == ["S1_0", "S1_1"] and list(back.obs["x"]) == list(obs["x"])
assert (back.X == X).all() and (back.obsm["embedding"] == embedding).all()
assert (back.obsm["spatial"] == spatial).all() and not back.uns["model"]["trained"]
""",
    ),
    ("docs/checkpoints.md", "dtype=torch.bfloat16)"): Context(
        # It is the example below it with the dtype added: that one runs first. Compiling
        # ahead of time takes minutes, so that call is bound to its signature, not run.
        before=A_BODY
        + YOUR_MODEL
        + example_code("docs/checkpoints.md", "class MyTileModel")
        + """
import inspect
def aoti_compile_and_package(*args, **kwargs):
    global aoti_call
    aoti_call = signature.bind(*args, **kwargs)
signature = inspect.signature(torch._inductor.aoti_compile_and_package)
torch._inductor.aoti_compile_and_package = aoti_compile_and_package
""",
        after="""
assert aoti_call.arguments["package_path"].endswith("model-aoti.pt2")
assert next(iter(program.state_dict.values())).dtype == torch.bfloat16
"""
        + YOUR_MODEL_ANSWERS,
    ),
    ("docs/checkpoints.md", "reshape(shape)"): Context(
        before=A_BODY + A_MASK_MODEL,
        after="""
assert mask.shape == (14, 14) and 0 < mask.min() <= mask.max() < 1, mask
assert json.loads(client.metadata())["embedding_size"] == 0
client.close()
""",
    ),
    ("docs/checkpoints.md", "channels_last_tolerance = 1e-5"): Context(
        after="""
from histoinfer.models.registry import model_class
assert model_class("my-cnn") is MyCnn and MyCnn.channels_last_tolerance == 1e-5
""",
    ),
    ("docs/checkpoints.md", "class MyTileModel"): Context(
        before=A_BODY + YOUR_MODEL, after=YOUR_MODEL_ANSWERS
    ),
    ("docs/server.md", '"h1": partial(InProcessClient.from_checkpoint'): Context(
        after="assert app.title\n"
    ),
    ("docs/server.md", "httpx.ASGITransport(app=app)"): Context(
        # The app of the example above it, which this one tests.
        before=A_BODY
        + """
from functools import partial
from histoinfer import InProcessClient
from histoinfer.server import create_app
app = create_app({"h1": partial(InProcessClient.from_checkpoint, "h1", "h1-tiny/model.pt2")})
""",
        awaits=True,
        after="""
import json
assert response.status_code == 200, response.text
assert len(json.loads(response.text)["output"]) == 307
""",
    ),
    ("docs/server.md", "responses = client.embed_batch([body1, body2])"): Context(
        on_trio=True,
        after="""
import json
assert len(json.loads(response_json)["output"]) == 307
assert len(responses) == 2 and json.loads(meta)["name"] == "h1"
""",
    ),
}


def context_of(example: Example) -> Context:
    found = [
        context
        for (page, marker), context in EXAMPLES.items()
        if page == example.page and marker in example.code
    ]
    if len(found) != 1:
        pytest.fail(
            f"{example} is matched by {len(found)} entries of EXAMPLES in tests/test_docs.py: "
            "give it one, saying what it needs from its page and what to check"
        )
    return found[0]


def script(example: Example, context: Context, backend: str, base_url: str) -> str:
    code = example.code.replace(DOCS_URL, base_url)
    if backend == "trio":
        assert "anyio.run(main)" in code, f"{example} offers no trio run"
        code = code.replace("anyio.run(main)", 'anyio.run(main, backend="trio")')
    if context.awaits:
        # ``after`` runs in the same function, where the example's names are.
        body = textwrap.indent(code + context.after, "    ")
        return f"{context.before}\nimport anyio\nasync def example():\n{body}\nanyio.run(example)\n"
    return "\n".join([context.before, code, context.after])


@pytest.fixture(scope="module")
def docs_folder(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the examples name: ``ckpt/model.pt2``, ``ckpt/tiny/model.pt2``,
    ``h1-tiny/model.pt2``, each with its assets, all the tiny reference export."""
    folder = tmp_path_factory.mktemp("docs")
    (folder / "ckpt").mkdir()
    for item in tiny_dir.iterdir():
        (folder / "ckpt" / item.name).symlink_to(item)
    (folder / "ckpt" / "tiny").symlink_to(tiny_dir)
    (folder / "h1-tiny").symlink_to(tiny_dir)
    return folder


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    with ServerProcess.for_checkpoint(tiny_checkpoint, max_batch_size=16, max_wait_ms=5) as s:
        yield s


def runs() -> Iterator[object]:
    for example in python_examples():
        backends = ["asyncio", "trio"] if _offers_trio(example) else ["asyncio"]
        for backend in backends:
            yield pytest.param(example, backend, id=f"{example}-{backend}")


def _offers_trio(example: Example) -> bool:
    return any(
        context.on_trio
        for (page, marker), context in EXAMPLES.items()
        if page == example.page and marker in example.code
    )


def test_the_docs_have_python_examples() -> None:
    found = {str(e) for e in python_examples()}
    assert len(found) >= len(EXAMPLES), found
    for page, marker in EXAMPLES:
        assert any(e.page == page and marker in e.code for e in python_examples()), (
            f"no example in {page} has {marker!r}: EXAMPLES names one the docs no longer have"
        )


@pytest.mark.skipif(sys.platform == "win32", reason="symlinks need a privilege on Windows")
@pytest.mark.parametrize(("example", "backend"), list(runs()))
def test_example_runs_as_written(
    example: Example,
    backend: str,
    docs_folder: Path,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    context = context_of(example)
    for package in context.requires:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{example} needs {package}, which histoinfer does not depend on")
    needs_server = DOCS_URL in example.code
    base_url = request.getfixturevalue("server").base_url if needs_server else DOCS_URL
    work = tmp_path / "work"
    work.mkdir()
    for item in docs_folder.iterdir():
        (work / item.name).symlink_to(item)
    path = work / "example.py"
    path.write_text(script(example, context, backend, base_url), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(path)], cwd=work, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, (
        f"{example} ({backend}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
