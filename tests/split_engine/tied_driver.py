"""Driver for one tied-embedding training run in a process of its own (the tests' subprocess).

torch.distributed.rpc cannot be joined again in one process with a different world size, so the
tests run a stage count other than their own world's from a fresh driver process: `python -m
tests.split_engine.tied_driver FOLDER NUM_STAGES STEPS OUT.json EXPORT_DIR`. It trains STEPS batches
(micro-batches 2, clipping on) and records, after every step, the loss, the global gradient
norm and whether the first stage's embedding and the last stage's head copy are bitwise equal;
then it exports the whole model to EXPORT_DIR and records the split model's logits on fixed ids
(`record_training`, which the tests also call in their own world of two stages).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch


def record_training(folder: Path, num_stages: int, steps: int, export_dir: Path) -> dict:
    """In a live world of `num_stages` stages (this process its driver): the record above."""
    from split_engine.sharded import ShardedModel
    from split_training.config import SplitTrainConfig
    from split_training.trainer import DistributedTrainer
    from tests.split_engine.conftest import model_config
    from tests.split_engine.test_tied import SPLIT_SETTINGS, probe_ids, training_batches

    split = SplitTrainConfig(num_stages=num_stages, **SPLIT_SETTINGS)
    trainer = DistributedTrainer(
        ShardedModel.build(model_config(folder), split, training=True), split
    )
    last = len(trainer.sharded.stages) - 1
    vocab = int(trainer.sharded.call(0, "tied_weight").shape[0])
    record: dict[str, list] = {"loss": [], "grad_norm": [], "copies_equal": []}
    for batch in training_batches(vocab, steps=steps):
        result = trainer.train_step([batch])
        first, copy = (
            trainer.sharded.call(0, "tied_weight"),
            trainer.sharded.call(last, "tied_weight"),
        )
        record["loss"].append(result.loss)
        record["grad_norm"].append(result.grad_norm)
        record["copies_equal"].append(bool(torch.equal(first, copy)))
    trainer.export(export_dir)
    record["logits"] = trainer.sharded.forward(probe_ids(vocab)).tolist()
    record["embedding"] = trainer.sharded.call(0, "tied_weight").tolist()
    return record


def main(folder: Path, num_stages: int, steps: int, out: Path, export_dir: Path) -> None:
    from tests.split_engine.conftest import rpc_world

    with (
        tempfile.TemporaryDirectory() as run_dir,
        # with a secret: every call of the run, stage-to-stage ones included, is signed
        rpc_world(
            folder,
            Path(run_dir),
            num_stages=num_stages,
            module="split_training",
            stage_env={"LAB_SECRET": "tied"},
            driver_secret="tied",
        ),
    ):
        record = record_training(folder, num_stages, steps, export_dir)
    out.write_text(json.dumps(record))


if __name__ == "__main__":
    main(
        Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5])
    )
