"""Heterogeneous clients for local runs (`fed.partition=file_type`): the stdlib test suite's
text files dealt by file type, so each client's data differs in kind, not only in amount.

The types: `.py` test modules, `.decTest` files (the decimal module's test vectors: lines of
operands and results), and every other text file (`.txt`, `.toml`, `.xml`, `.pem`, `.json`,
`.html`, `.c`, ...). Client i holds type i mod 3; clients sharing a type split its files. The
`.py` files held out for the coordinator's own evaluation stay out of every client's data.
"""

from __future__ import annotations

import random
from pathlib import Path

from lab.corpus import FINETUNE_DIR, load_finetune_corpus, stdlib_root

FILE_TYPES = ("py", "decTest", "other")
MAX_FILE_BYTES = 2 * 2**20
"""Larger files are skipped (none of the test suite's text files is near it)."""
CHARS_PER_BLOCK_TOKEN = 6
"""Characters read per token a client may use: more than any text here needs per token, so
a client's blocks are never short for want of text, without tokenizing whole megabytes."""


def file_type(path: Path) -> str:
    """Which of FILE_TYPES a file is."""
    suffix = path.suffix.removeprefix(".")
    return suffix if suffix in FILE_TYPES else "other"


def text_files(root: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """The test suite's text files by type: (relative path, text), in path order. Binary files
    (a NUL byte in their first 8 KiB, bytecode) and the coordinator's held-out files are out."""
    tests = (root or stdlib_root()) / FINETUNE_DIR
    if not tests.is_dir():
        raise FileNotFoundError(
            f"fed.partition=file_type needs the standard library's test suite ({tests}); "
            "Debian ships it as libpython3.X-testsuite"
        )
    held_out = {d.path for d in load_finetune_corpus(root=root).validation}
    by_type: dict[str, list[tuple[str, str]]] = {kind: [] for kind in FILE_TYPES}
    for path in sorted(tests.rglob("*")):
        rel = path.relative_to(tests).as_posix()
        if (
            not path.is_file()
            or path.suffix == ".pyc"
            or "__pycache__" in path.parts
            or path.stat().st_size > MAX_FILE_BYTES
            or rel in held_out
        ):
            continue
        raw = path.read_bytes()
        if b"\0" in raw[:8192] or not raw.strip():
            continue
        by_type[file_type(path)].append((rel, raw.decode(errors="replace")))
    return by_type


def file_type_shard(
    index: int, num_clients: int, *, seed: int, max_chars: int, root: Path | None = None
) -> list[str]:
    """Client `index`'s texts: its file type's files (a seeded share of them when clients
    share a type), at most about `max_chars` characters."""
    kind = FILE_TYPES[index % len(FILE_TYPES)]
    sharing = list(range(index % len(FILE_TYPES), num_clients, len(FILE_TYPES)))
    files = text_files(root)[kind]
    random.Random(f"{seed}-{kind}").shuffle(files)
    mine = files[sharing.index(index) :: len(sharing)]
    texts, total = [], 0
    for _, text in mine:
        if total >= max_chars:
            break
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
    return texts
