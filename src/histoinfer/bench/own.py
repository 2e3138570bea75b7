"""``histoinfer bench --checkpoint PATH``: the sweep on a model of the user's own.

The reference sizes (``--models``) are checkpoints the bench exports itself; an own checkpoint
is taken as ``histoinfer serve --checkpoint`` takes it: a ``.pt2`` with its ``model.json``
beside it, loaded by the class registered under ``--model-key`` (``h1`` by default), which a
module of the user's may register (``--import``, in this process and in every bench child).

This module names what a run needs (:class:`OwnModel`) without importing torch;
:func:`resolve_own` loads the model once, here, before any child process starts: a missing
file, a module that fails to import, an unknown key or a checkpoint that does not load is
refused at once, and its metadata gives the tiles' size and the modes to sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..schema import Mode

if TYPE_CHECKING:
    from .runner import BenchConfig

__all__ = [
    "NOT_EVALUATED",
    "REFERENCE_BUILD",
    "ModelBuild",
    "OwnModel",
    "describe",
    "import_user_modules",
    "modes_to_sweep",
    "own_label",
    "resolve_own",
]

#: why an own checkpoint's targets are not evaluated: they are set for the reference models
NOT_EVALUATED = "own checkpoint"

#: what the report quotes of the model's metadata
_METADATA_KEYS = ("name", "version", "task", "tile_size", "modes", "trained", "checkpoint_kind")


@dataclass(frozen=True)
class ModelBuild:
    """How a bench process builds its model and its request bodies (sent to every child):
    the registry key, the modules that register it (``--import``), its model.json's folder
    (``--assets``) and the tiles' side in pixels. By default, the reference ``h1``'s."""

    key: str = "h1"
    imports: tuple[str, ...] = ()
    assets: str | None = None
    tile_size: int = 224


#: the reference ``h1``'s build (``--models tiny,small``)
REFERENCE_BUILD = ModelBuild()


def own_label(model_key: str, name: str | None) -> str:
    """The name an own checkpoint's rows carry: its ``--model-key``, or with the default key
    its model.json's name (three checkpoints of one's own all read ``own:h1``: a user trial)."""
    return f"own:{model_key if model_key != 'h1' else name or model_key}"


@dataclass(frozen=True)
class OwnModel:
    """A checkpoint of the user's own, measured instead of the reference sizes."""

    checkpoint: str
    model_key: str = "h1"
    #: ``--import`` modules, imported before the model is built (here and in every child)
    imports: tuple[str, ...] = ()
    #: the folder of its model.json, where not beside the checkpoint (``--assets``)
    assets: str | None = None
    #: what its metadata says (``resolve_own``): name, version, tile size, modes, trained...
    metadata: dict[str, Any] = field(default_factory=dict)
    #: the program's precision (``float32``, ``bfloat16``...), as loaded
    dtype: str = "float32"
    #: whether each response can be checked against its tile run alone: a float32 program
    #: whose answers do not vary by design (``ServerModel.repeatable_outputs``)
    checked: bool = True

    @property
    def label(self) -> str:
        """The name its rows carry (``model``): never a reference size's (:func:`own_label`;
        its name once its metadata is read)."""
        return own_label(self.model_key, self.metadata.get("name"))

    @property
    def build(self) -> ModelBuild:
        tile_size = int(self.metadata.get("tile_size", 224))
        return ModelBuild(self.model_key, self.imports, self.assets, tile_size)


def import_user_modules(imports: Sequence[str]) -> None:
    """``--import``'s modules, as ``histoinfer serve`` imports them (in a bench child too)."""
    from ..cli import import_modules

    import_modules(imports)


def modes_to_sweep(
    asked: Sequence[Mode], served: Sequence[Mode], explicit: bool
) -> tuple[Mode, ...]:
    """The modes to sweep on a model that serves ``served``: those of ``asked`` it serves.

    ``explicit``: ``asked`` is the user's ``--modes``, and a mode it does not serve is refused
    (ValueError); otherwise (the defaults, ``--quick``'s ``predict``) it is left out, and where
    none is left the model's first mode is swept (an embedding model under ``--quick``).
    """
    unserved = [mode for mode in asked if mode not in served]
    if explicit and unserved:
        raise ValueError(
            f"--modes {','.join(asked)}: the model serves {', '.join(served)} only "
            f"(not {', '.join(unserved)})"
        )
    kept = tuple(mode for mode in asked if mode in served)
    return kept or tuple(served[:1])


def resolve_own(cfg: BenchConfig, explicit_modes: bool, log: Callable[[str], None]) -> BenchConfig:
    """``cfg`` with its own checkpoint loaded once, here: its metadata, and the modes to sweep.

    Refused, each in one line (``CommandError``, a ``CheckpointError``, a ``ValueError``),
    before any child process starts: a checkpoint that is not a file, an ``--import`` that
    fails, a key nothing registers, a checkpoint that does not load, ``--modes`` it does not
    serve."""
    from ..cli import CommandError, unknown_model

    own = cfg.own
    if own is None:
        return cfg
    path = Path(own.checkpoint)
    if not path.is_file():
        from ..models.checkpoint import in_the_folder

        what = "no such file" if not path.exists() else "not a file"
        raise CommandError(f"--checkpoint {path}: {what}{in_the_folder(path)}")
    import_user_modules(own.imports)  # before the key is looked up: they may register it
    from ..models.registry import UnknownModelError, model_class

    try:
        cls = model_class(own.model_key)
    except UnknownModelError as exc:
        raise unknown_model(f"--model-key {own.model_key}", exc) from exc
    log(f"loading {path} as {own.model_key!r} to read its metadata ...")
    # The report says whether it is trained: a warning here would say it again.
    untrained = logging.getLogger("histoinfer.untrained")
    was_disabled, untrained.disabled = untrained.disabled, True
    try:
        model = cls.from_files(path, device="cpu", assets_dir=own.assets)
    finally:
        untrained.disabled = was_disabled
    metadata = model.metadata().model_dump(mode="json")
    dtype = str(model.checkpoint.input_dtype).removeprefix("torch.")
    checked = dtype == "float32" and bool(cls.repeatable_outputs)
    del model  # the children load their own
    resolved = replace(
        own,
        checkpoint=str(path.resolve()),  # the report names it wherever it is read
        assets=None if own.assets is None else str(Path(own.assets).resolve()),
        metadata={key: metadata[key] for key in _METADATA_KEYS if key in metadata},
        dtype=dtype,
        checked=checked,
    )
    modes = modes_to_sweep(cfg.modes, metadata["modes"], explicit_modes)
    return replace(cfg, own=resolved, modes=modes, models=(resolved.label,))


def describe(own: dict[str, Any]) -> str:
    """The own checkpoint, in a line of the report (``own`` as ``report.json`` holds it)."""
    meta = own.get("metadata", {})
    facts = [f"model key `{own['model_key']}`"]
    facts += [f"{key} {meta[key]}" for key in ("name", "version") if key in meta]
    if "tile_size" in meta:
        facts.append(f"tile size {meta['tile_size']} px")
    if "modes" in meta:
        facts.append(f"modes {', '.join(meta['modes'])}")
    if "trained" in meta:
        facts.append(f"trained: {str(meta['trained']).lower()}")
    facts.append(f"precision {own.get('dtype', 'float32')}")
    imports = own.get("imports") or []
    if imports:
        facts.append(f"imported: {', '.join(imports)}")
    if own.get("assets"):
        facts.append(f"model.json from `{own['assets']}`")
    checked = (
        "each response is checked against its own tile run alone"
        if own.get("checked", True)
        else "responses are checked to answer their own request only (not float32, or outputs "
        "that vary by design: a tile run alone is no reference)"
    )
    return (
        f"Own checkpoint `{own['checkpoint']}` ({'; '.join(facts)}), measured as "
        f"`{own_label(own['model_key'], meta.get('name'))}` on bodies of its own tile size; "
        f"{checked}. Its targets are "
        "not evaluated: they are set for the reference tiny and small models (the ratios are "
        "reported)."
    )
