"""The offline corpus: the Python standard library's own source, present on every machine.

Documents are `.py` files. The train/validation split is decided per file by a hash of its path,
so it is the same on every machine with the same Python version and does not shift when a
budget trims the corpus. Pretraining reads `load_corpus`; fine-tuning reads
`load_finetune_corpus`, the stdlib's test suite, which pretraining never sees. Federated shards
group files by package (`test_email`, `test_asyncio`, ...), so clients see different kinds of
code (non-IID) in unequal amounts, like real edge devices.
"""

from __future__ import annotations

import hashlib
import random
import sys
import sysconfig
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "__pycache__",
        "idle_test",
        "lib2to3",
        "turtledemo",
    }
)
"""Tests and vendored trees: mostly boilerplate, and huge."""

MAX_FILE_BYTES = 400_000
"""Skip generated giants (unicode tables, ...) that would dominate a small corpus."""


@dataclass(frozen=True)
class Document:
    path: str
    """Path relative to the stdlib root, POSIX style."""
    package: str
    """Top-level package (`email`), or the module name for a single-file module."""
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    validation: list[Document]
    source: str
    """Where the text came from, e.g. `Python 3.11.7 stdlib at /usr/lib/python3.11`."""

    def num_chars(self, split: str = "train") -> int:
        return sum(len(doc.text) for doc in getattr(self, split))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _path_fraction(rel_path: str, salt: str) -> float:
    """A stable number in [0, 1) for a file, independent of Python's hash randomization."""
    digest = hashlib.sha256(f"{salt}:{rel_path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _package_of(rel_path: str) -> str:
    parts = rel_path.split("/")
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _read_document(root: Path, rel_path: str) -> Document:
    text = (root / rel_path).read_text(encoding="utf-8", errors="replace")
    return Document(path=rel_path, package=_package_of(rel_path), text=text)


def list_sources(root: Path | None = None) -> list[str]:
    """Relative paths of the stdlib's `.py` files used as corpus, sorted."""
    root = root or stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"standard library source not found at {root}")
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        paths.append(rel.as_posix())
    if not paths:
        raise FileNotFoundError(f"no .py files under {root}; is this the standard library?")
    return sorted(paths)


def load_corpus(
    *, val_fraction: float = 0.05, max_train_chars: int | None = None, root: Path | None = None
) -> Corpus:
    """Read the stdlib corpus and split it into train and validation documents.

    `max_train_chars` keeps a package-diverse subset: files are taken in a fixed pseudo-random
    order (by path hash) until the budget is spent; validation keeps the same fraction of it.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    root = root or stdlib_root()
    rel_paths = sorted(list_sources(root), key=lambda p: _path_fraction(p, "order"))
    train: list[Document] = []
    validation: list[Document] = []
    train_chars = 0
    val_budget = None if max_train_chars is None else max_train_chars * val_fraction
    val_chars = 0
    for rel in rel_paths:
        is_val = _path_fraction(rel, "split") < val_fraction
        if (
            max_train_chars is not None
            and train_chars >= max_train_chars
            and (val_budget is None or val_chars >= val_budget)
        ):
            break
        if is_val and val_budget is not None and val_chars >= val_budget:
            continue
        if not is_val and max_train_chars is not None and train_chars >= max_train_chars:
            continue
        doc = _read_document(root, rel)
        if is_val:
            validation.append(doc)
            val_chars += len(doc.text)
        else:
            train.append(doc)
            train_chars += len(doc.text)
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(
        train=sorted(train, key=lambda d: d.path),
        validation=sorted(validation, key=lambda d: d.path),
        source=f"Python {version} stdlib at {root}",
    )


FINETUNE_DIR = "test"
"""The stdlib's own test suite: excluded from pretraining (EXCLUDED_DIRS), so it is text the
lab's models have never seen, in a style of its own (unittest classes, assert calls)."""


def load_finetune_corpus(*, val_fraction: float = 0.1, root: Path | None = None) -> Corpus:
    """Fine-tuning text the lab's pretrained models never saw: the stdlib's test suite.

    Files are split by a hash of their path into train (dealt to clients by `client_shards`,
    one test package per client at a time: non-IID) and validation (held out from every client:
    the coordinator's evaluation text). Documents' `package` is the test package
    (`test_asyncio`) or module (`test_os`). Where the test suite is not installed (Debian ships
    it separately, as libpython3.X-testsuite) the pretraining corpus stands in, with a warning:
    fine-tuning on text the base was trained on has little to gain.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    tests = (root or stdlib_root()) / FINETUNE_DIR
    if not tests.is_dir():
        warnings.warn(
            f"the standard library's test suite is not installed ({tests}): fine-tuning on the "
            "pretraining corpus instead, which the lab's models have already seen",
            stacklevel=2,
        )
        return load_corpus(val_fraction=val_fraction, root=root)
    train: list[Document] = []
    validation: list[Document] = []
    for rel in list_sources(tests):
        doc = _read_document(tests, rel)
        if not doc.text.strip():  # empty __init__.py files: nothing to learn
            continue
        is_val = _path_fraction(rel, "finetune") < val_fraction
        (validation if is_val else train).append(doc)
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(train=train, validation=validation, source=f"Python {version} tests at {tests}")


def shuffled(docs: Sequence[Document], *, seed: int) -> list[Document]:
    """Documents in a seeded order, so that a budget of blocks samples many files, not the
    first few in path order."""
    order = list(docs)
    random.Random(seed).shuffle(order)
    return order


def client_shards(
    docs: Sequence[Document], num_clients: int, *, seed: int = 0, skew: float = 1.0
) -> list[list[Document]]:
    """Split documents into `num_clients` disjoint shards, whole packages at a time.

    Client i aims at a share proportional to (i + 1) ** skew, so shard sizes differ
    (skew=0 asks for equal shares). Packages are dealt in a seeded random order, each to the
    client furthest below its target: which client gets which kind of code depends on the
    seed, and is deterministic for it.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients={num_clients} must be >= 1")
    by_package: dict[str, list[Document]] = defaultdict(list)
    for doc in docs:
        by_package[doc.package].append(doc)
    if len(by_package) < num_clients:
        raise ValueError(f"{len(by_package)} packages cannot fill {num_clients} client shards")
    packages = sorted(by_package)
    random.Random(seed).shuffle(packages)
    size = {p: sum(len(d.text) for d in by_package[p]) for p in packages}

    weights = [(i + 1) ** skew for i in range(num_clients)]
    total = sum(size.values())
    targets = [total * w / sum(weights) for w in weights]
    filled = [0] * num_clients
    shards: list[list[Document]] = [[] for _ in range(num_clients)]
    for index, package in enumerate(packages):
        remaining = len(packages) - index
        empty = [c for c in range(num_clients) if not shards[c]]
        # Keep enough packages back that every client gets at least one.
        candidates = empty if len(empty) >= remaining else range(num_clients)
        client = max(candidates, key=lambda c: (targets[c] - filled[c]) / targets[c])
        shards[client].extend(by_package[package])
        filled[client] += size[package]
    return [sorted(shard, key=lambda d: d.path) for shard in shards]


def token_blocks(
    texts: Sequence[str], tokenizer, *, block_size: int, max_blocks: int | None = None
) -> torch.Tensor:
    """Tokenize documents, join them with EOS and cut into (num_blocks, block_size) ids."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size} must be >= 2")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    limit = None if max_blocks is None else max_blocks * block_size
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
        if limit is not None and len(ids) >= limit:
            break
    num_blocks = len(ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    if num_blocks == 0:
        raise ValueError(f"{len(ids)} tokens are fewer than one block of {block_size}")
    return torch.tensor(ids[: num_blocks * block_size], dtype=torch.long).view(
        num_blocks, block_size
    )  # (num_blocks, block_size)


def train_and_validation_blocks(
    tokenizer: Any, *, block_size: int, max_train_blocks: int, eval_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_train_blocks, block_size) token ids from the stdlib corpus' training split and
    (eval_blocks, block_size) from its validation split (at most: fewer if the text runs out):
    what the lab's training experiments train and validate on."""
    corpus = load_corpus(val_fraction=0.05)
    train = token_blocks(
        [doc.text for doc in corpus.train],
        tokenizer,
        block_size=block_size,
        max_blocks=max_train_blocks,
    )
    validation = token_blocks(
        [doc.text for doc in corpus.validation],
        tokenizer,
        block_size=block_size,
        max_blocks=eval_blocks,
    )
    return train, validation


def held_out_prompts(tokenizer: Any, *, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` tokens from the held-out stdlib files: code the models never
    saw (the generation experiments' prompts). First the start of each file; when more prompts
    are asked than files have that many tokens, the next `tokens` of each file, and so on."""
    corpus = load_corpus(val_fraction=0.05)
    encoded = [
        tokenizer(doc.text, add_special_tokens=False)["input_ids"] for doc in corpus.validation
    ]
    prompts: list[list[int]] = []
    for window in range(max((len(ids) for ids in encoded), default=0) // tokens):
        for ids in encoded:
            piece = ids[window * tokens : (window + 1) * tokens]
            if len(piece) == tokens:
                prompts.append(piece)
            if len(prompts) == count:
                return prompts
    raise ValueError(
        f"the held-out corpus holds fewer than {count} prompts of {tokens} tokens "
        f"({len(prompts)}): ask for fewer or shorter prompts"
    )
