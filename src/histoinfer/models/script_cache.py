"""A CPU model's TorchScript translation, kept between processes: a load in ~0.1 s, not ~4.

Loading a ``torch.export`` checkpoint costs ~4 s of CPU on the 2-core machines here (importing
``torch._dynamo`` and deserializing the graph), in every process that loads it: a server, each
path of the bench, every server a test starts. What a CPU model then runs is the program's
TorchScript translation (models/scripted.py), kept only when it answers exactly as the exported
program does. That translation is saved here once, and a later load on a CPU reads it instead
of the ``.pt2`` (``torch.jit.load``: ~0.03 s for the tiny model).

An entry is named by the checkpoint's sha256 (computed at every load, before anything in the
file is used), by the versions of torch and histoinfer and by a hash of the code that makes
and checks a translation (models/scripted.py and this module), so a changed file, a new torch
or a changed translation never reads an old entry. Only entries the current user owns and
nobody else may write are read: an entry stands in for the weights, whose sha256 it only
names. The input dtype the exported program
declares travels inside the entry. Entries are written atomically (a temporary file, then a
rename), so processes loading the same checkpoint at once never read half a file; an entry
that cannot be read, or whose bytes fail the zip's CRCs (a flipped bit), is ignored and written
again. A written entry is read back and compared
with the module that was checked (its code and every tensor) before it is put in place. The
cache is an optimization only: any failure to read or write it is logged at DEBUG and the load
goes on the slow way.

Pruning: a load that reads an entry marks it used (its modification time). Each time an entry
is written, entries unused for :data:`UNUSED_DAYS` days are deleted (an old torch's, an old
checkpoint's: ~90 MB each for a ViT-S), and so are temporary files a killed writer left behind.
The folder may also be deleted at any time.

Where: ``$HISTOINFER_SCRIPT_CACHE`` if set (``off`` turns it off), else ``scripted/`` in the
user's cache directory (platformdirs': ``~/.cache/histoinfer`` on Linux,
``~/Library/Caches/histoinfer`` on macOS, ``%LOCALAPPDATA%\\histoinfer\\histoinfer\\Cache`` on
Windows).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import time
import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch

from .checkpoint import quieted
from .scripted import bitwise_equal

__all__ = ["CACHE_ENV", "UNUSED_DAYS", "cache_dir", "load", "save"]

log = logging.getLogger("histoinfer.models")

#: a directory for the cache, or ``off``
CACHE_ENV = "HISTOINFER_SCRIPT_CACHE"
_META = "histoinfer.json"
#: an entry no load has read for this long is deleted when another is written
UNUSED_DAYS = 30
#: a temporary file this old was left by a writer that died (a write takes seconds)
_ABANDONED_S = 3600.0
#: what an entry's and a temporary file's names look like: pruning deletes nothing else, for
#: ``$HISTOINFER_SCRIPT_CACHE`` may name a folder that holds the user's own ``.pt`` files
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}-torch.+-histoinfer.+-[0-9a-f]{12}\.pt")
_TEMPORARY_PREFIX = ".histoinfer-"
_TEMPORARY_NAME = re.compile(re.escape(_TEMPORARY_PREFIX) + r".+\.tmp")


def cache_dir() -> Path | None:
    """The cache's directory, or None when it is turned off."""
    setting = os.environ.get(CACHE_ENV, "").strip()
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting).expanduser()
    from platformdirs import user_cache_path

    return user_cache_path("histoinfer") / "scripted"


@cache
def _code_hash() -> str:
    """What made and checked an entry: this module and models/scripted.py."""
    digest = hashlib.sha256()
    for name in ("scripted.py", "script_cache.py"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()[:12]


def _entry(sha256: str) -> Path | None:
    from .. import __version__

    folder = cache_dir()
    if folder is None:
        return None
    return folder / (f"{sha256}-torch{torch.__version__}-histoinfer{__version__}-{_code_hash()}.pt")


def _trusted(path: Path) -> bool:
    """Ours alone: owned by this user, writable by nobody else (where the OS says so)."""
    info = path.stat()
    if os.name == "nt":
        # Windows says nothing here: access is by ACL, st_uid is 0 and st_mode 0o666 for every
        # writable file, so the checks below refused every entry. The default folder is in
        # the user's own profile (%LOCALAPPDATA%), which other users cannot write.
        return True
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return False
    return not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


@contextlib.contextmanager
def _torch_jit() -> Iterator[None]:
    """torch's DeprecationWarning for ``torch.jit.load``/``save`` left out: it is about this
    module's own use, printed at every load under ``python -X dev``, and under ``-W error`` (a
    strict test run) it was raised, so that no entry was ever read or written (a user trial)."""
    with quieted(DeprecationWarning):
        yield


def load(
    sha256: str,
) -> tuple[torch.jit.ScriptModule, torch.dtype, tuple[int, int] | None] | None:
    """The translation saved for the checkpoint of ``sha256``, its input dtype and the tile
    size its program was exported for (None: not fixed); or None."""
    path = _entry(sha256)
    if path is None or not path.is_file():
        return None
    try:
        if not _trusted(path):
            raise PermissionError("another user owns it, or others may write it")
        _check_crcs(path)
        extra = {_META: ""}
        with _torch_jit():
            module = torch.jit.load(  # type: ignore[no-untyped-call]
                str(path), map_location="cpu", _extra_files=extra
            )
        meta = json.loads(extra[_META])
        dtype = getattr(torch, meta["input_dtype"])
        if meta["sha256"] != sha256 or not isinstance(dtype, torch.dtype):
            raise ValueError("its record names another checkpoint or no dtype")
        size = meta["input_size"]
        if size is not None:
            height, width = size
            size = (int(height), int(width))
    except Exception as exc:  # any damage: the slow way, and the entry is written again
        log.debug("TorchScript cache entry %s not used: %r", path, exc)
        return None
    module.eval()
    with contextlib.suppress(OSError):
        os.utime(path)  # used: kept by the pruning in save()
    return module, dtype, size


def save(
    sha256: str,
    module: torch.jit.ScriptModule,
    input_dtype: torch.dtype,
    input_size: tuple[int, int] | None = None,
) -> None:
    """Keep ``module`` for the next load of the checkpoint of ``sha256`` (best effort)."""
    path = _entry(sha256)
    if path is None:
        return
    meta = {
        "sha256": sha256,
        "input_dtype": str(input_dtype).removeprefix("torch."),
        "input_size": input_size,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=_TEMPORARY_PREFIX, suffix=".tmp"
        )
        os.close(handle)
        try:
            with _torch_jit():
                torch.jit.save(module, temporary, _extra_files={_META: json.dumps(meta)})
                written = torch.jit.load(temporary, map_location="cpu")  # type: ignore[no-untyped-call]
            if not _same(module, written):
                raise ValueError("the file read back differs from the module checked")
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except Exception as exc:  # a read-only home, a full disk: loads stay slow, nothing fails
        log.debug("TorchScript cache entry %s not written: %r", path, exc)
        return
    _prune(path.parent, keep=path)


def _check_crcs(path: Path) -> None:
    """Every member of the entry (a zip) matches the CRC written with it. ``torch.jit.load``
    checks none: a flipped bit in a weight loaded, and answered wrongly, every time (a trial).
    ~30 ms for a ViT-S's 87 MB, read again from the page cache."""
    with zipfile.ZipFile(path) as archive:
        bad = archive.testzip()
    if bad is not None:
        raise ValueError(f"its member {bad} fails its CRC check")


def _same(a: torch.jit.ScriptModule, b: torch.jit.ScriptModule) -> bool:
    """The same program: the code of every submodule, and every tensor, bit for bit."""
    modules_a, modules_b = dict(a.named_modules()), dict(b.named_modules())
    if modules_a.keys() != modules_b.keys():
        return False
    if any(_code(m) != _code(modules_b[name]) for name, m in modules_a.items()):
        return False
    tensors_a, tensors_b = a.state_dict(), b.state_dict()
    return tensors_a.keys() == tensors_b.keys() and all(
        bitwise_equal(t, tensors_b[k]) for k, t in tensors_a.items()
    )


def _code(module: torch.nn.Module) -> str | None:
    """A scripted module's ``forward`` as TorchScript prints it; None if it has none."""
    try:
        return str(module.code)
    except Exception:  # no forward of its own
        return None


def _prune(folder: Path, keep: Path) -> None:
    """Delete entries unused for :data:`UNUSED_DAYS` days and abandoned temporary files: only
    files named as this module names them."""
    now = time.time()
    for path in folder.glob("*.pt"):
        if _ENTRY_NAME.fullmatch(path.name):
            _delete_if_older(path, now - UNUSED_DAYS * 86400.0, keep)
    for path in folder.glob(f"{_TEMPORARY_PREFIX}*.tmp"):
        if _TEMPORARY_NAME.fullmatch(path.name):
            _delete_if_older(path, now - _ABANDONED_S, keep)


def _delete_if_older(path: Path, before: float, keep: Path) -> None:
    try:
        if path != keep and _trusted(path) and path.stat().st_mtime < before:
            path.unlink()
            log.debug("TorchScript cache: deleted %s (unused)", path)
    except OSError as exc:  # another process pruning too, or not ours to delete
        log.debug("TorchScript cache: %s not pruned: %r", path, exc)
