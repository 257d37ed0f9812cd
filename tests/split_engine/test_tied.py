"""Tied input embedding and LM head, trained across stages as the one matrix it is.

The first stage holds the embedding, the last a copy as its head: every step both copies get
the sum of their gradients (what the shared matrix gets in one process), the global norm
counts the matrix once, and both take the same update, so they stay bitwise equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from split_engine.sharded import ShardedModel
from split_training.config import SplitTrainConfig
from split_training.trainer import DistributedTrainer
from tests.clocks import HANG_GUARD_S

from .conftest import model_config, rpc_world
from .test_rpc import reference_training, training_batches
from .tied_driver import record_training

STEPS = 4
SPLIT_SETTINGS: dict[str, Any] = {
    "microbatches": 2,
    "batch_size": 4,
    "lr": 3e-3,
    "weight_decay": 0.1,
    "grad_clip": 0.5,
    "rpc_timeout_s": 20,
}
"""Micro-batches 2, clipping on: what the tied runs below all use."""

__all__ = ["SPLIT_SETTINGS", "probe_ids", "training_batches"]


def probe_ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def _save_tied_llama(folder: Path, tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _save_tied_gpt2(folder: Path, tokenizer, dropout: float = 0.0) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=64,
        n_layer=4,
        n_head=4,
        n_positions=256,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    assert config.tie_word_embeddings
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tied_folders(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tied")
    return {
        "llama": _save_tied_llama(root / "llama", tokenizer),
        "gpt2": _save_tied_gpt2(root / "gpt2", tokenizer),
        "gpt2_dropout": _save_tied_gpt2(root / "gpt2_dropout", tokenizer, dropout=0.3),
    }


@pytest.fixture(scope="module")
def world(tied_folders, tmp_path_factory: pytest.TempPathFactory):
    """Two stage processes, as every in-process world of this suite has."""
    with rpc_world(
        tied_folders["llama"], tmp_path_factory.mktemp("tied_world"), module="split_training"
    ) as settings:
        yield settings


def _trainer(folder: Path, num_stages: int = 2, **kwargs) -> DistributedTrainer:
    split = SplitTrainConfig(num_stages=num_stages, **{**SPLIT_SETTINGS, **kwargs})
    sharded = ShardedModel.build(model_config(folder), split, training=True)
    return DistributedTrainer(sharded, split)


def _copies(trainer: DistributedTrainer) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        trainer.sharded.call(0, "tied_weight"),
        trainer.sharded.call(len(trainer.sharded.stages) - 1, "tied_weight"),
    )


def _run_in_own_process(folder: Path, num_stages: int, tmp_path: Path) -> dict:
    """`tied_driver` in a fresh process: RPC cannot be joined again here with another size."""
    out = tmp_path / f"{num_stages}.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.split_engine.tied_driver",
            str(folder),
            str(num_stages),
            str(STEPS),
            str(out),
            str(tmp_path / "exported"),
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tied_model_trains_as_one_matrix_across_stages_and_exports_tied(
    world, tied_folders, tmp_path: Path, family: str, num_stages: int
) -> None:
    """Losses equal single-process training (micro-batches 2, clipping on) for 4 steps; the
    two copies bitwise equal after every step; the exported folder loads tied and predicts as
    the split model does. Two stages: in this module's world; three: a world of its own, with
    a secret (every call signed, the tie's sync between the stages included)."""
    from transformers import AutoModelForCausalLM

    folder = tied_folders[family]
    if num_stages == world.split.num_stages:
        record = record_training(folder, num_stages, STEPS, tmp_path / "exported")
    else:
        record = _run_in_own_process(folder, num_stages, tmp_path)
    assert record["copies_equal"] == [True] * STEPS
    split = SplitTrainConfig(num_stages=num_stages, **SPLIT_SETTINGS)
    assert all(norm > split.grad_clip for norm in record["grad_norm"])  # clipping bit
    vocab = len(record["embedding"])
    expected, norms = reference_training(folder, training_batches(vocab, steps=STEPS), split)
    assert record["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    # the global norm counts the shared matrix once, as clip_grad_norm_ does in one process
    # (losses alone barely move with the clip factor: AdamW is nearly scale-invariant)
    assert record["grad_norm"] == pytest.approx(norms, rel=1e-4)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() == embedding.data_ptr()  # loads tied: one matrix
    torch.testing.assert_close(embedding.detach(), torch.tensor(record["embedding"]))
    with torch.no_grad():
        logits = model(input_ids=probe_ids(vocab)).logits
    torch.testing.assert_close(logits, torch.tensor(record["logits"]), rtol=1e-4, atol=1e-4)


def test_without_the_sync_the_copies_drift_and_the_losses_differ(world, tied_folders) -> None:
    """What the sync prevents (and what this suite would miss if it stopped running)."""
    folder = tied_folders["llama"]
    split = SplitTrainConfig(num_stages=2, **SPLIT_SETTINGS)
    sharded = ShardedModel.build(model_config(folder), split, training=True)
    trainer = DistributedTrainer(sharded, split, sync_tied=False)
    vocab = int(trainer.sharded.call(0, "tied_weight").shape[0])
    data = training_batches(vocab, steps=STEPS)
    got = [trainer.train_step([batch]).loss for batch in data]
    embedding, head = _copies(trainer)
    assert not torch.equal(embedding, head)
    expected, _ = reference_training(folder, data, trainer.settings)
    assert got[0] == pytest.approx(expected[0], rel=1e-4, abs=1e-4)  # the same start
    assert got != pytest.approx(expected, rel=1e-4, abs=1e-4), (got, expected)


def test_checkpoint_stores_the_tied_matrix_once_and_resumes_tied(
    world, tied_folders, tmp_path: Path
) -> None:
    from safetensors import safe_open

    folder = tied_folders["llama"]
    trainer = _trainer(folder, 2)
    vocab = int(trainer.sharded.call(0, "tied_weight").shape[0])
    data = training_batches(vocab, steps=4)
    for batch in data[:2]:
        trainer.train_step([batch])
    trainer.save(tmp_path)
    uninterrupted = [trainer.train_step([batch]).loss for batch in data[2:]]

    step = tmp_path / "step-000002"
    with safe_open(str(step / "stage2.safetensors"), framework="pt") as f:
        assert not any(name.startswith("lm_head") for name in f.keys())  # noqa: SIM118
    with safe_open(str(step / "stage1.safetensors"), framework="pt") as f:
        assert "model.embed_tokens.weight" in f.keys()  # noqa: SIM118

    resumed = _trainer(folder, 2)
    resumed.load(tmp_path)
    embedding, head = _copies(resumed)
    assert torch.equal(embedding, head)
    again = [resumed.train_step([batch]).loss for batch in data[2:]]
    assert again == pytest.approx(uninterrupted, rel=1e-6)


def test_lora_on_a_tied_matrix_is_refused_by_name(world, tied_folders) -> None:
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]}
    split = SplitTrainConfig(num_stages=2, microbatches=2, batch_size=4, rpc_timeout_s=20)
    with pytest.raises(Exception, match=r"lora.target_modules=\['lm_head'\] adapts a tied"):
        ShardedModel.build(model_config(tied_folders["llama"]), split, training=True, lora=lora)


def test_a_tie_the_stages_did_not_load_equal_is_refused(world, tied_folders) -> None:
    trainer = _trainer(tied_folders["llama"], 2)
    embedding, _ = _copies(trainer)
    trainer.sharded.call(1, "set_tied_weight", embedding + 1)
    with pytest.raises(ValueError, match="cannot keep the tie; refusing to train an untied"):
        trainer._check_tie()


def test_export_of_a_lora_run_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"split\.export=true writes the whole model"):
        SplitTrainConfig(lora=True, export=True)


def test_accumulated_and_pipelined_gradients_of_the_tied_matrix_are_the_plain_ones(
    world, tied_folders
) -> None:
    trainer = _trainer(tied_folders["llama"])
    vocab = int(trainer.sharded.call(0, "tied_weight").shape[0])
    (batch,) = training_batches(vocab, steps=1)
    plain = trainer.gradients([batch], microbatches=1)
    for grads in (
        plain,
        trainer.gradients([batch], microbatches=2),
        trainer.gradients([batch[:2], batch[2:]], microbatches=2),
    ):
        embedding, head = grads["stage1.model.embed_tokens.weight"], grads["stage2.lm_head.weight"]
        assert torch.equal(embedding, head)  # both ends got the summed gradient
        torch.testing.assert_close(embedding, plain["stage1.model.embed_tokens.weight"])


def test_evaluation_of_a_training_run_has_no_dropout(world, tied_folders) -> None:
    """A model with dropout: the stages train with it, and evaluate without it (the loss is
    the eval-mode model's, and the same every time), then go on training with it."""
    from transformers import AutoModelForCausalLM

    folder = tied_folders["gpt2_dropout"]
    trainer = _trainer(folder, 2)
    vocab = int(trainer.sharded.call(0, "tied_weight").shape[0])
    blocks = torch.cat(training_batches(vocab, steps=2))  # (8, T)
    first = trainer.evaluate(blocks, batch_size=4)
    assert trainer.evaluate(blocks, batch_size=4) == first
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = model(input_ids=blocks, labels=blocks).loss.item()
    assert first == pytest.approx(expected, rel=1e-5)
    (batch,) = training_batches(vocab, steps=1)
    norms = {
        trainer.gradients([batch], microbatches=1)["stage2.lm_head.weight"].norm().item()
        for _ in range(2)
    }
    assert len(norms) == 2  # training still draws dropout masks
