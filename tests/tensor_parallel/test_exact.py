"""Tensor-parallel generation against the unsplit model: float64 greedy identical, float32 logits
within 1e-4, sampled tokens the same on every rank, for 2 and 3 ranks and both engines.

Random-init shapes whose heads, KV heads and MLP width divide by 2 and 3: a Llama with grouped-
query attention and a Qwen2 with tied embeddings and q/k/v biases (the lab's tiny models are
neither). Each rank is its own process, meeting through tensor_parallel.group on loopback.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from lab.config import ClusterConfig, Endpoint
from lab.launch import free_port
from tensor_parallel.decode import generate, left_padded, same_on_every_rank
from tensor_parallel.group import tp_group
from tensor_parallel.shard import ENGINES, load_sharded

PROMPTS = [[5, 17, 3, 44, 9, 12], [7, 7, 81], [60, 2, 33, 19], [90]]
"""The set every case generates from (random-init models: token ids, not text)."""
NEW_TOKENS = 8
SEED = 1234


def shapes() -> dict[str, object]:
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=6,
        head_dim=8,
        max_position_embeddings=64,
    )
    return {
        "llama_gqa": LlamaConfig(**common, tie_word_embeddings=False),  # type: ignore[arg-type]
        "qwen2_tied_bias": Qwen2Config(**common, tie_word_embeddings=True),  # type: ignore[arg-type]
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each shape saved once (safetensors), the folder every rank loads its shards from."""
    from transformers import AutoModelForCausalLM

    folders = {}
    for name, config in shapes().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
        with torch.no_grad():  # larger weights than the init's 0.02: logits far from ties
            for p in model.parameters():
                p.mul_(8.0) if p.dim() > 1 else None
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        folders[name] = folder
    return folders


def run(model, dtype: torch.dtype, *, temperature: float = 0.0):
    ids, mask = left_padded(PROMPTS, 0)
    return generate(
        model.to(dtype),
        ids,
        mask,
        max_new_tokens=NEW_TOKENS,
        temperature=temperature,
        seed=SEED,
        keep_logits=True,
    )


def rank_main(rank: int, ranks: int, port: int, folders: dict[str, Path], out: Path) -> None:
    torch.set_num_threads(1)
    cluster = ClusterConfig(master=Endpoint("127.0.0.1", port), secret="test-secret")
    results = {}
    with tp_group(cluster, rank=rank, ranks=ranks, timeout_s=60) as group:
        for name, folder in folders.items():
            for engine in ENGINES:
                for dtype, temperature in (
                    (torch.float64, 0.0),
                    (torch.float32, 0.0),
                    (torch.float64, 0.8),
                ):
                    sharded = load_sharded(
                        folder,
                        rank=rank,
                        ranks=ranks,
                        engine=engine,
                        dtype=dtype,
                        device=group.device,
                        mesh=group.mesh,
                    )
                    got = run(sharded.model, dtype, temperature=temperature)
                    agreed = same_on_every_rank(got.tokens)
                    key = (name, engine, str(dtype), temperature)
                    results[key] = (
                        got.tokens,
                        torch.stack(got.step_logits),
                        agreed,
                        sharded.collectives.count,
                    )
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("ranks", [2, 3])
def test_split_generation_matches_the_unsplit_model(
    saved: dict[str, Path], ranks: int, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    context = mp.get_context("spawn")
    out = tmp_path / "results.pt"
    port = free_port("127.0.0.1")
    procs = [
        context.Process(target=rank_main, args=(r, ranks, port, saved, out)) for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=240)
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * ranks
    results = torch.load(out, weights_only=True)
    for name, folder in saved.items():
        unsplit = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        layers = unsplit.config.num_hidden_layers
        want = {
            (str(d), t): run(unsplit, d, temperature=t)
            for d, t in ((torch.float64, 0.0), (torch.float32, 0.0), (torch.float64, 0.8))
        }
        for engine in ENGINES:

            def got(dtype: torch.dtype, t: float, engine: str = engine, name: str = name):
                return results[(name, engine, str(dtype), t)]

            tokens, _, agreed, count = got(torch.float64, 0.0)
            assert agreed, f"{name} {engine}: ranks generated different tokens"
            assert torch.equal(tokens, want[(str(torch.float64), 0.0)].tokens), (name, engine)
            if engine == "local":  # two all-reduces a layer, every step
                assert count == 2 * layers * NEW_TOKENS
            tokens32, logits32, agreed32, _ = got(torch.float32, 0.0)
            ref32 = want[(str(torch.float32), 0.0)]
            assert agreed32
            diverged = (tokens32 != ref32.tokens).any(dim=0).nonzero()
            upto = int(diverged[0]) + 1 if len(diverged) else NEW_TOKENS
            worst = (logits32[:upto] - torch.stack(ref32.step_logits)[:upto]).abs().max()
            assert worst < 1e-4, f"{name} {engine}: float32 logits {worst:.2e} apart"
            if len(diverged):  # only at a near tie of the unsplit model
                step = int(diverged[0])
                row = int((tokens32[:, step] != ref32.tokens[:, step]).nonzero()[0])
                top = ref32.step_logits[step][row].topk(2).values
                assert float(top[0] - top[1]) < 1e-4
            sampled, _, agreed_s, _ = got(torch.float64, 0.8)
            assert agreed_s, f"{name} {engine}: ranks sampled different tokens"
            assert torch.equal(sampled, want[(str(torch.float64), 0.8)].tokens)
            assert not torch.equal(sampled, tokens)  # sampling did sample
