"""The stdlib corpus: deterministic split, disjoint non-IID shards of unequal size."""

from __future__ import annotations

import pytest

from lab.corpus import client_shards, load_corpus, token_blocks

BUDGET = 400_000


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(val_fraction=0.1, max_train_chars=BUDGET)


def test_split_is_deterministic_and_disjoint(corpus) -> None:
    again = load_corpus(val_fraction=0.1, max_train_chars=BUDGET)
    assert [d.path for d in again.train] == [d.path for d in corpus.train]
    assert [d.path for d in again.validation] == [d.path for d in corpus.validation]
    assert not {d.path for d in corpus.train} & {d.path for d in corpus.validation}
    assert corpus.validation, "validation must not be empty"
    assert BUDGET <= corpus.num_chars("train") < BUDGET + 400_000  # budget met, one file over


def test_a_file_stays_on_its_side_of_the_split_whatever_the_budget(corpus) -> None:
    bigger = load_corpus(val_fraction=0.1, max_train_chars=4 * BUDGET)
    assert {d.path for d in corpus.train} <= {d.path for d in bigger.train}
    assert {d.path for d in corpus.validation} <= {d.path for d in bigger.validation}


def test_corpus_is_stdlib_source_without_tests(corpus) -> None:
    assert corpus.source.startswith("Python 3.")
    assert all(d.path.endswith(".py") for d in corpus.train)
    assert not any("/test/" in f"/{d.path}" or "/tests/" in f"/{d.path}" for d in corpus.train)
    assert len({d.package for d in corpus.train}) > 10


def test_client_shards_are_disjoint_whole_packages_unequal_and_deterministic(corpus) -> None:
    shards = client_shards(corpus.train, 3, seed=0)
    paths = [{d.path for d in shard} for shard in shards]
    assert all(paths) and sum(map(len, paths)) == len(corpus.train)
    assert not (paths[0] & paths[1] or paths[0] & paths[2] or paths[1] & paths[2])
    packages = [{d.package for d in shard} for shard in shards]
    assert not (packages[0] & packages[1] or packages[0] & packages[2] or packages[1] & packages[2])
    sizes = [sum(len(d.text) for d in shard) for shard in shards]
    assert sizes[0] < sizes[1] < sizes[2]
    assert [[d.path for d in s] for s in client_shards(corpus.train, 3, seed=0)] == [
        [d.path for d in s] for s in shards
    ]
    assert [[d.path for d in s] for s in client_shards(corpus.train, 3, seed=1)] != [
        [d.path for d in s] for s in shards
    ]


def test_more_clients_than_packages_is_refused(corpus) -> None:
    with pytest.raises(ValueError, match="packages cannot fill"):
        client_shards(corpus.train[:1], 2)


def test_token_blocks_cut_joined_documents_into_equal_blocks(tiny_models) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "tiny_target")
    blocks = token_blocks(["x = 1\n" * 50, "def f():\n    pass\n" * 30], tokenizer, block_size=16)
    assert blocks.dim() == 2 and blocks.size(1) == 16 and blocks.size(0) >= 4
    assert (blocks == tokenizer.eos_token_id).any()  # documents are separated by EOS
    with pytest.raises(ValueError, match="fewer than one block"):
        token_blocks(["x"], tokenizer, block_size=64)
