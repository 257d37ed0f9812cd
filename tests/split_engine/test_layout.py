"""Where a model is cut and what one stage holds: no RPC, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from split_engine.config import SplitConfig
from split_engine.generation import positions_from_mask
from split_engine.layout import (
    StageCosts,
    balance_boundaries,
    build_stage_model,
    stage_costs,
    stage_ranges,
)
from split_training.config import SplitTrainConfig

from .conftest import NUM_LAYERS


def run_in_process(stages, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Chain stage models by hand, as the RPC stages do (first: ids; others: hidden states)."""
    positions = positions_from_mask(mask)
    x = input_ids
    for index, (model, layout, _) in enumerate(stages):
        decoder = getattr(model, layout.decoder)
        key = "input_ids" if index == 0 else "inputs_embeds"
        hidden = decoder(**{key: x}, attention_mask=mask, position_ids=positions).last_hidden_state
        x = hidden
    return getattr(model, layout.head)(x)


def test_equal_capacities_balance_parameter_counts() -> None:
    costs = StageCosts(embeddings=100, per_layer=10, head=100, num_layers=12)
    boundaries = balance_boundaries(costs, capacities=[1.0, 1.0])
    assert boundaries == [6]  # embeddings and head weigh the same: the middle
    heavy_head = StageCosts(embeddings=0, per_layer=10, head=40, num_layers=12)
    assert balance_boundaries(heavy_head, capacities=[1.0, 1.0]) == [8]


def test_memory_balance_gives_the_bigger_host_more_layers() -> None:
    costs = StageCosts(embeddings=0, per_layer=10, head=0, num_layers=12)
    assert balance_boundaries(costs, capacities=[3.0, 1.0]) == [9]
    three = balance_boundaries(costs, capacities=[1.0, 1.0, 1.0])
    assert three == [4, 8]


def test_every_stage_gets_a_layer_and_impossible_cuts_are_refused() -> None:
    costs = StageCosts(embeddings=1000, per_layer=1, head=0, num_layers=3)
    assert balance_boundaries(costs, capacities=[1.0, 1.0, 1.0]) == [1, 2]
    with pytest.raises(ValueError, match="at least as many layers"):
        balance_boundaries(costs, capacities=[1.0] * 4)
    with pytest.raises(ValueError, match="non-empty stages"):
        stage_ranges([0], 4)
    with pytest.raises(ValueError, match="non-empty stages"):
        stage_ranges([4], 4)
    assert stage_ranges([1, 3], 4) == [(0, 1), (1, 3), (3, 4)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"boundaries": [1, 2]}, "num_stages-1"),
        ({"num_stages": 3, "boundaries": [2, 2]}, "increase strictly"),
        ({"wire_dtype": "int8"}, "split.wire_dtype"),
        ({"balance": "speed"}, "split.balance"),
        ({"rank": 5}, "split.rank"),
        ({"rpc_threads": 1}, "split.rpc_threads=1: at least 4"),
    ],
)
def test_bad_split_settings_name_the_key(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SplitConfig(**fields)


def test_batch_must_divide_into_microbatches() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        SplitTrainConfig(batch_size=6, microbatches=4)


def test_stage_costs_add_up_to_the_model(llama_folder: Path, unsplit) -> None:
    costs = stage_costs(unsplit.config)
    total = sum(p.numel() for p in unsplit.parameters())
    assert costs.stage(0, NUM_LAYERS) == total


@pytest.mark.parametrize("boundaries", [[2], [1], [1, 3]])
def test_chained_stages_reproduce_the_unsplit_logits(
    llama_folder: Path, unsplit, boundaries
) -> None:
    ranges = stage_ranges(boundaries, NUM_LAYERS)
    stages = [
        build_stage_model(
            str(llama_folder), start=a, end=b, dtype=torch.float32, device=torch.device("cpu")
        )
        for a, b in ranges
    ]
    ids = torch.randint(3, unsplit.config.vocab_size, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in row 1
    with torch.no_grad():
        expected = unsplit(
            input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)
        ).logits
        got = run_in_process(stages, ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_stage_holds_only_its_own_weights(llama_folder: Path) -> None:
    first, layout, _ = build_stage_model(
        str(llama_folder), start=0, end=1, dtype=torch.float32, device=torch.device("cpu")
    )
    last, _, _ = build_stage_model(
        str(llama_folder), start=1, end=NUM_LAYERS, dtype=torch.float32, device=torch.device("cpu")
    )
    first_names = set(first.state_dict())
    last_names = set(last.state_dict())
    assert any("embed_tokens" in n for n in first_names)
    assert not any("lm_head" in n or n.startswith("model.norm") for n in first_names)
    assert not any("embed_tokens" in n for n in last_names)
    assert "lm_head.weight" in last_names
    assert len(getattr(first.model, layout.layers)) == 1
    assert len(getattr(last.model, layout.layers)) == NUM_LAYERS - 1
    assert all(p.device.type != "meta" for p in [*first.parameters(), *last.parameters()])


def test_gpt2_family_is_cut_too(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=200, n_positions=64, n_embd=32, n_layer=3, n_head=2)
    model = GPT2LMHeadModel(config).eval()  # tied embeddings: the last stage's head copies wte
    model.save_pretrained(tmp_path)
    stages = [
        build_stage_model(
            str(tmp_path), start=a, end=b, dtype=torch.float32, device=torch.device("cpu")
        )
        for a, b in stage_ranges([1], 3)
    ]
    ids = torch.randint(0, 200, (1, 10))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model(
            input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)
        ).logits
        got = run_in_process(stages, ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_unsupported_families_are_refused_by_name(tmp_path: Path) -> None:
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    GemmaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gemma'"):
        build_stage_model(
            str(tmp_path), start=0, end=1, dtype=torch.float32, device=torch.device("cpu")
        )
