"""Writes a crash never leaves half done: write beside the target, flush to disk, rename.

Checkpoints, manifests and built models are read back after a crash (`fed.resume`, a split
run's resume, the model cache), so each is written under a temporary name in the same folder,
fsynced, and renamed over the old one: a reader sees the old version or the new one, never a
torn file. (Replacing a whole folder removes the old one first: between the two a crash leaves
no folder, never a partial one.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:  # some platforms cannot open a folder: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_file(path: Path, write: Callable[[Path], object]) -> Path:
    """Write `path` through `write(temporary_path)`, then fsync and rename it into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: Path, text: str) -> Path:
    """`path.write_text(text)`, atomically."""
    return replace_file(path, lambda tmp: tmp.write_text(text))


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """A fresh folder beside `final` for the block to fill; renamed to `final` (replacing it)
    when the block ends normally, removed when it raises."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield staging
        for file in staging.rglob("*"):
            if file.is_file():
                _fsync(file)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync(final.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
