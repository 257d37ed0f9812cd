"""The CUDA paths, end to end (marker `cuda`: `make gpu-check` runs them where a GPU is; every
other machine skips them, saying why).

Each module runs as a user runs it, its device detected, on models small enough for seconds:
the device and dtype a process picks, tensors crossing netproto from the GPU, speculative
decoding's greedy output, a split model whose stages compute on the GPU while activations cross
on the CPU, split training under bf16 autocast,
federated QLoRA with bitsandbytes' NF4 layers on the GPU, and tensor parallelism on NCCL.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lab.device import default_dtype, detect_device, supports_bf16
from lab.pretrain import TinyModelSpec, build_llama

pytestmark = pytest.mark.cuda


def test_a_process_picks_the_gpu_and_a_half_precision_dtype() -> None:
    device = detect_device()
    assert device.type == "cuda"
    expected = torch.bfloat16 if supports_bf16(device) else torch.float16
    assert default_dtype(device) == expected
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # lab.device.skip_cudnn_attention


def test_a_gpu_tensor_crosses_netproto_and_arrives_equal() -> None:
    from netproto import Connection, MsgType, Server

    def echo(conn: Connection) -> None:
        while True:
            message = conn.recv()
            conn.send(message.type, message.payload, request_id=message.request_id)

    sent = torch.randn(1024, 64, device="cuda", dtype=torch.bfloat16)
    with Server(echo).start() as server, Connection.connect(*server.address) as conn:
        conn.send_tensors(MsgType.DATA_TENSORS, {"x": sent})
        received = conn.recv_tensors(MsgType.DATA_TENSORS)["x"]
    assert received.device.type == "cpu"  # frames carry host bytes; the receiver places them
    assert torch.equal(received.to("cuda"), sent)


def test_speculative_decoding_on_the_gpu_keeps_the_targets_greedy_output(
    compose_config, tiny_models: Path
) -> None:
    from spec_decoding.run import run

    for pipeline in ("true", "false"):
        cfg = compose_config(
            "spec_decoding",
            [
                f"spec.pipeline={pipeline}",
                "tracking.wandb=false",
                "spec.num_prompts=2",
                "spec.max_new_tokens=12",
                "spec.prompt_tokens=16",
            ],
        )
        metrics = run(cfg)
        assert metrics["greedy_match"] == 1.0
        assert metrics["new_tokens"] == 24


@pytest.mark.parametrize("draft_top_k", [0, 8])
def test_sampled_speculative_decoding_runs_on_the_gpu(
    compose_config, tiny_models: Path, draft_top_k: int
) -> None:
    """Sampling: both sides' models on the GPU, q and the rule's draws on the CPU (the first
    GPU run failed here: the drafter's q and the verifier's p were on the GPU beside a CPU
    generator and a CPU q)."""
    from spec_decoding.run import run

    for pipeline in ("true", "false"):
        cfg = compose_config(
            "spec_decoding",
            [
                f"spec.pipeline={pipeline}",
                "tracking.wandb=false",
                "spec.temperature=0.8",
                "spec.top_p=0.95",
                f"spec.draft_top_k={draft_top_k}",
                "spec.num_prompts=2",
                "spec.max_new_tokens=12",
                "spec.prompt_tokens=16",
            ],
        )
        metrics = run(cfg)
        assert metrics["new_tokens"] > 0
        assert 0.0 < metrics["acceptance_rate"] <= 1.0
        if pipeline == "true":  # coupled by position: no q travels (spec_decoding.sampling)
            assert "q_bytes_per_drafted" not in metrics
        else:  # rounds keep the rule of Leviathan et al.: q crosses with each draft
            assert metrics["q_bytes_per_drafted"] > 0


@pytest.fixture(scope="module")
def llama_folder(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "tiny_target")
    torch.manual_seed(0)
    spec = TinyModelSpec(num_layers=4, hidden_size=64, num_heads=4, intermediate_size=128)
    model = build_llama(spec, vocab_size=len(tokenizer), context_length=256, tokenizer=tokenizer)
    folder = tmp_path_factory.mktemp("cuda_llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_split_model_on_the_gpu_generates_what_the_unsplit_one_does(
    compose_config, llama_folder: Path
) -> None:
    """float32 on both sides, so greedy tokens must match exactly."""
    from split_inference.run import run

    cfg = compose_config(
        "split_inference",
        [
            f"model.pretrained={llama_folder}",
            "model.dtype=float32",
            "tracking.wandb=false",
            "generate.num_prompts=2",
            "generate.max_new_tokens=8",
            "generate.prompt_tokens=16",
        ],
    )
    metrics = run(cfg)
    assert metrics["greedy_match"] == 1.0
    assert metrics.get("stage1_cuda_max_allocated_mib", 0) > 0
    assert metrics.get("stage2_cuda_max_allocated_mib", 0) > 0


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_tensor_parallel_on_the_gpu_runs_nccl(
    compose_config, tiny_models: Path, dtype: str
) -> None:
    """Ranks on NCCL, one GPU each (2 where there are 2, else a world of 1: NCCL runs no two
    ranks on one device): float32 keeps the unsplit model's greedy output (or differs only at a
    near tie); bf16 (auto) runs, every rank generating the same tokens."""
    import json

    from tensor_parallel.run import run

    ranks = 2 if torch.cuda.device_count() >= 2 else 1
    cfg = compose_config("tensor_parallel", [f"tp.ranks={ranks}", f"model.dtype={dtype}",
                                             "tp.max_new_tokens=6", "tp.repeats=1",
                                             "tracking.wandb=false"])  # fmt: skip
    metrics = run(cfg)
    layers = json.loads((tiny_models / "tiny_target" / "config.json").read_text())
    assert metrics["allreduces_per_token"] == 2 * layers["num_hidden_layers"]
    assert metrics["same_tokens_on_every_rank"] == 1.0
    assert metrics["cuda_max_allocated_mib"] > 0
    if dtype == "float32":
        assert metrics["same_greedy_tokens"] == 1.0 or metrics["unsplit_top2_margin"] < 1e-4


def test_split_training_on_the_gpu_under_bf16_autocast_lowers_the_loss(
    compose_config, llama_folder: Path
) -> None:
    from split_training.run import run

    cfg = compose_config(
        "split_training",
        [
            f"model.pretrained={llama_folder}",
            "tracking.wandb=false",
            "split.batch_size=4",
            "split.block_size=32",
            "split.steps=12",
            "split.lr=0.003",
            "split.checkpoint_every=0",
            "split.max_train_blocks=64",
            "split.mixed_precision=bf16",
        ],
    )
    metrics = run(cfg)
    assert math.isfinite(metrics["final_loss"])
    assert metrics["final_loss"] < metrics["first_loss"]


def test_federated_qlora_runs_its_base_layers_in_4bit_on_the_gpu(
    compose_config, tiny_models: Path
) -> None:
    from fed_learn.run import run

    metrics = run(
        compose_config(
            "fed_learn",
            [
                "model.quantization=4bit",
                "tracking.wandb=false",
                "fed.num_clients=2",
                "fed.rounds=2",
                "fed.local_steps=20",
                "fed.max_examples_per_client=256",
                "fed.eval_blocks=16",
            ],
        )
    )
    assert metrics["base_4bit_layers"] > 0
    assert math.isfinite(metrics["final_val_loss"])
