"""Tiny random-init models saved as HF folders, and a live RPC world of stage processes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from lab.config import ClusterConfig, Endpoint, ModelConfig
from lab.launch import Role, free_port, services
from lab.pretrain import TinyModelSpec, build_llama
from split_engine.roles import driving
from split_inference.config import ServingSplitConfig, SplitInferenceRunConfig

NUM_LAYERS = 4


@pytest.fixture(scope="session")
def tokenizer(tiny_models: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models / "tiny_target")


@pytest.fixture(scope="session")
def llama_folder(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama with the lab tokenizer, as any HF checkpoint folder looks."""
    torch.manual_seed(0)
    spec = TinyModelSpec(num_layers=NUM_LAYERS, hidden_size=64, num_heads=4, intermediate_size=128)
    model = build_llama(spec, vocab_size=len(tokenizer), context_length=256, tokenizer=tokenizer)
    folder = tmp_path_factory.mktemp("random_llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def unsplit(llama_folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_folder).eval()


def model_config(folder: Path) -> ModelConfig:
    return ModelConfig(name="random_llama", pretrained=str(folder))


def stage_role(
    module: str,
    folder: Path,
    rank: int,
    port: int,
    run_dir: Path,
    *,
    num_stages: int,
    extra: list[str],
) -> Role:
    stage_dir = run_dir / f"stage{rank}"
    argv = [
        sys.executable,
        "-m",
        module,
        "role=stage",
        f"split.rank={rank}",
        f"split.num_stages={num_stages}",
        f"cluster.master.port={port}",
        f"model.pretrained={folder}",
        "split.rpc_timeout_s=20",
        "split.join_timeout_s=120",
        "num_threads=1",
        "tracking.wandb=false",
        f"paths.run_dir={stage_dir}",
        f"hydra.run.dir={stage_dir}",
        *extra,
    ]
    return Role(f"stage{rank}", argv, service=True)


@contextmanager
def rpc_world(
    folder: Path,
    run_dir: Path,
    *,
    num_stages: int = 2,
    module: str = "split_inference",
    stage_env: dict[str, str] | None = None,
    driver_secret: str | None = None,
    extra: tuple[str, ...] = (),
) -> Iterator[SplitInferenceRunConfig]:
    """Stage processes (`python -m <module> role=stage`) plus this process as the driver."""
    port = free_port()
    roles = [
        stage_role(module, folder, rank, port, run_dir, num_stages=num_stages, extra=list(extra))
        for rank in range(1, num_stages + 1)
    ]
    for role in roles:
        role.env.update(stage_env or {})
    settings = SplitInferenceRunConfig(
        model=model_config(folder),
        split=ServingSplitConfig(num_stages=num_stages, rpc_timeout_s=20, join_timeout_s=120),
        cluster=ClusterConfig(master=Endpoint("127.0.0.1", port), secret=driver_secret),
    )
    with (
        services(roles, out=sys.stderr) as stages,
        driving(settings, settings.split, stages=stages),
    ):
        yield settings
