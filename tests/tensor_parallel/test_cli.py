"""`python -m tensor_parallel` as a user runs it: the offline default end to end (2 ranks on
loopback), and the refusals, each one line before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import DictConfig

from lab.cli import ConfigError
from lab.records import METRICS_FILE, read_records
from tensor_parallel.run import run
from tests.clocks import HANG_GUARD_S

QUICK = ["tp.max_new_tokens=6", "tp.repeats=1"]


def test_two_ranks_generate_what_the_unsplit_model_does(
    tmp_path: Path, lab_cache: Path, tiny_models: Path
) -> None:
    command = [sys.executable, "-m", "tensor_parallel", f"hydra.run.dir={tmp_path}",
               f"paths.cache_dir={lab_cache}", "model.lab_preset=debug", *QUICK]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = [r for r in read_records(tmp_path / METRICS_FILE) if r.get("kind") == "summary"][-1]
    layers = json.loads(next(lab_cache.glob("tiny_models/debug-*/tiny_target/config.json"))
                        .read_text())["num_hidden_layers"]  # fmt: skip
    assert summary["same_greedy_tokens"] == 1 and summary["same_tokens_on_every_rank"] == 1
    assert summary["allreduces_per_token"] == 2 * layers
    assert summary["weights_mib_per_rank"] < summary["unsplit_weights_mib"]
    # a step in its parts: in the all-reduces and the compute between them, as the share says
    comm, compute = summary["collective_ms_per_token"], summary["compute_ms_per_token"]
    assert comm > 0 and compute > 0
    assert comm / (comm + compute) == pytest.approx(summary["collective_share"])
    assert summary["compute_cpu_ms_per_token"] > 0
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("what 1 more machine(s) bought here: ")
    assert "ms a token" in lines[-2]


def gpt2_folder(tmp_path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=32,
        bos_token_id=1,
        eos_token_id=2,
    )
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


def test_a_model_without_a_tp_plan_is_refused_in_one_line(tmp_path: Path, lab_cache: Path) -> None:
    folder = gpt2_folder(tmp_path)
    command = [sys.executable, "-m", "tensor_parallel", f"hydra.run.dir={tmp_path / 'run'}",
               f"model.pretrained={folder}"]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: model type 'gpt2' has no base_model_tp_plan in its transformers config: "
        "tensor_parallel shards models that declare one (Llama, Qwen2, Mistral, ...)"
    ]
    assert not (tmp_path / "run" / "rank0").exists()  # refused before any rank started


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["tp.ranks=3"], "tp.ranks=3 does not divide num_attention_heads=2, num_key_value_heads"),
        (["tp.cpus=0"], "tp.cpus is for role=rank"),
        (["role=rank", "cluster.master.host=192.0.2.7", "cluster.master.port=29500"],
         "a tensor_parallel run listens only on loopback or inside an authenticated overlay"),
    ],
)  # fmt: skip
def test_refusals_name_the_setting(
    compose_config: Callable[..., DictConfig], overrides: list[str], says: str
) -> None:
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        run(compose_config("tensor_parallel", overrides))
