"""Aggregation maths, exactly: FedAvg weights, and LoRA products that stay exact."""

from __future__ import annotations

import pytest
import torch

from fed_learn.aggregate import (
    average_products,
    fedavg,
    ffa_average,
    lora_products,
    product_error,
    svd_average,
)


def test_fedavg_weights_by_dataset_size_exactly() -> None:
    updates = [
        ({"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}, 1),
        ({"w": torch.tensor([4.0, 8.0]), "b": torch.tensor([3.0])}, 3),
    ]
    result = fedavg(updates)
    assert torch.equal(result["w"], torch.tensor([3.25, 6.5]))  # (1*1 + 3*4)/4, (2 + 24)/4
    assert torch.equal(result["b"], torch.tensor([2.25]))
    assert result["w"].dtype == torch.float32


def test_fedavg_keeps_bf16_and_refuses_mismatched_updates() -> None:
    bf = [
        ({"w": torch.ones(3, dtype=torch.bfloat16)}, 2),
        ({"w": torch.zeros(3, dtype=torch.bfloat16)}, 2),
    ]
    assert fedavg(bf)["w"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="disagree on tensor names"):
        fedavg([({"w": torch.ones(1)}, 1), ({"v": torch.ones(1)}, 1)])
    with pytest.raises(ValueError, match="shape"):
        fedavg([({"w": torch.ones(1)}, 1), ({"w": torch.ones(2)}, 1)])
    with pytest.raises(ValueError, match="num_examples=0"):
        fedavg([({"w": torch.ones(1)}, 0)])
    with pytest.raises(ValueError, match="no client updates"):
        fedavg([])


def lora_state(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    prefix = "base_model.model.layers.0.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}


def random_clients(*, shared_a: bool, seed: int = 0) -> list[tuple[dict, int]]:
    torch.manual_seed(seed)
    a0 = torch.randn(2, 6)
    return [
        (lora_state(a0.clone() if shared_a else torch.randn(2, 6), torch.randn(5, 2)), n)
        for n in (10, 30, 60)
    ]


def test_naive_fedavg_of_lora_is_not_the_average_of_products() -> None:
    clients = random_clients(shared_a=False)
    assert product_error(fedavg(clients), clients) > 0.1


def test_ffa_lora_equals_the_average_of_products() -> None:
    clients = random_clients(shared_a=True)
    merged = ffa_average(clients)
    [(prefix, expected)] = average_products(clients).items()
    torch.testing.assert_close(lora_products(merged)[prefix], expected, rtol=1e-6, atol=1e-6)
    assert product_error(merged, clients) < 1e-6


def test_ffa_refuses_clients_whose_a_moved() -> None:
    with pytest.raises(ValueError, match="FFA-LoRA needs A frozen"):
        ffa_average(random_clients(shared_a=False))


def test_svd_at_the_summed_rank_equals_the_average_of_products() -> None:
    clients = random_clients(shared_a=False)
    merged = svd_average(clients, rank=6)  # 3 clients x rank 2
    assert product_error(merged, clients) < 1e-6
    truncated = svd_average(clients, rank=2)
    assert 0 < product_error(truncated, clients) < product_error(fedavg(clients), clients)


def test_staleness_weight_discounts_older_updates() -> None:
    from fed_learn.aggregate import staleness_weight

    fresh = staleness_weight(0, mixing=0.5, exponent=0.5)
    assert fresh == 0.5
    assert staleness_weight(3, mixing=0.5, exponent=0.5) == pytest.approx(0.5 / 2.0)
    assert staleness_weight(3, mixing=0.5, exponent=0.0) == fresh  # exponent 0: no discount
    with pytest.raises(ValueError, match="staleness"):
        staleness_weight(-1, mixing=0.5, exponent=0.5)


def test_mix_moves_the_global_adapter_towards_the_update_by_the_weight() -> None:
    from fed_learn.aggregate import mix

    global_state = {"a": torch.zeros(2, 2), "b": torch.ones(3)}
    update = {"a": torch.full((2, 2), 4.0), "b": torch.full((3,), 3.0)}
    mixed = mix(global_state, update, weight=0.25)
    assert torch.equal(mixed["a"], torch.full((2, 2), 1.0))
    assert torch.equal(mixed["b"], torch.full((3,), 1.5))
    with pytest.raises(ValueError, match="different tensors"):
        mix(global_state, {"a": update["a"]}, weight=0.5)


def test_round_averages_weigh_the_coordinator_share_by_round_length() -> None:
    from fed_learn.coordinator import round_averages

    history = [
        {"clients": 3.0, "bytes_up": 900.0, "round_s": 9.0, "coordinator_share": 0.1},
        {"clients": 1.0, "bytes_up": 100.0, "round_s": 1.0, "coordinator_share": 0.5},
    ]
    averages = round_averages(history)
    assert averages["coordinator_share"] == pytest.approx((0.9 + 0.5) / 10)  # not 0.3
    assert averages["bytes_up_per_client_round"] == 250.0
    assert averages["mean_clients_per_round"] == 2.0
    assert round_averages([])["coordinator_share"] == 0.0
