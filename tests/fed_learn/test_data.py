"""Clients' data: text the base never saw, disjoint shards, or a real client's own folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from fed_learn.lora import client_data, folder_documents, validation_blocks
from lab.config import ModelConfig
from lab.corpus import load_corpus, load_finetune_corpus
from lab.models import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_models: Path, lab_cache: Path):
    return load_tokenizer(ModelConfig(lab_preset="debug"), cache_dir=lab_cache)


def test_finetune_text_is_held_out_of_pretraining_and_of_every_client() -> None:
    finetune = load_finetune_corpus()
    pretraining = load_corpus()
    seen = {d.text for d in pretraining.train + pretraining.validation}
    assert finetune.train and finetune.validation
    assert not seen & {d.text for d in finetune.train + finetune.validation}
    assert not {d.path for d in finetune.train} & {d.path for d in finetune.validation}


def test_clients_hold_disjoint_shards_and_the_coordinator_none_of_them(tokenizer) -> None:
    shards = [
        client_data(tokenizer, index=i, num_clients=3, seed=0, block=32, max_examples=64)
        for i in range(3)
    ]
    rows = [{tuple(row.tolist()) for row in train} for train, _ in shards]
    assert all(len(r) > 10 for r in rows)
    assert not rows[0] & rows[1] and not rows[1] & rows[2] and not rows[0] & rows[2]
    held_out = {tuple(row.tolist()) for row in validation_blocks(tokenizer, block=32, count=64)}
    assert len(held_out) == 64
    assert not held_out & (rows[0] | rows[1] | rows[2])


def test_a_real_client_trains_on_its_own_folder(tokenizer, tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("my private notes\n" * 200)
    (tmp_path / "b.txt").write_text("def private():\n    return 42\n" * 200)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    assert [d.path for d in folder_documents(str(tmp_path))] == ["b.txt", "notes/a.md"]
    train, val = client_data(
        tokenizer,
        index=7,  # ignored: the folder is the data
        num_clients=1,
        seed=0,
        block=32,
        max_examples=40,
        data_dir=str(tmp_path),
    )
    assert len(train) + len(val) == 40
    text = tokenizer.decode(train[0])
    assert "private" in text


def test_a_missing_or_empty_folder_is_a_clear_error(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such folder"):
        folder_documents(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no text files"):
        folder_documents(str(tmp_path), pattern="*.py")
