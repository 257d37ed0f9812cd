"""Aggregation maths, exactly: FedAvg weights, and LoRA products that stay exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fed_learn.aggregate import (
    average_products,
    combiner,
    coordinate_median,
    fedavg,
    ffa_average,
    in_groups,
    lora_products,
    product_error,
    svd_average,
    trimmed_mean,
    update_norm,
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
    from fed_learn.rounds import round_averages

    history = [
        {"clients": 3.0, "bytes_up": 900.0, "round_s": 9.0, "coordinator_share": 0.1},
        {"clients": 1.0, "bytes_up": 100.0, "round_s": 1.0, "coordinator_share": 0.5},
    ]
    averages = round_averages(history)
    assert averages["coordinator_share"] == pytest.approx((0.9 + 0.5) / 10)  # not 0.3
    assert averages["bytes_up_per_client_round"] == 250.0
    assert averages["mean_clients_per_round"] == 2.0
    assert round_averages([])["coordinator_share"] == 0.0


# ---------------------------------------------------------------- robust aggregation


def five_clients(*, honest: list[float], attackers: list[float]) -> list[tuple[dict, int]]:
    """Clients whose every entry is one value; the attackers claim most of the examples."""
    return [({"w": torch.full((2, 3), v)}, 10) for v in honest] + [
        ({"w": torch.full((2, 3), v)}, 1000) for v in attackers
    ]


def test_coordinate_median_ignores_two_attackers_of_five_and_their_weights() -> None:
    clients = five_clients(honest=[0.1, 0.2, 0.3], attackers=[1e6, 1e6])
    assert torch.equal(fedavg(clients, combine=coordinate_median)["w"], torch.full((2, 3), 0.3))
    assert fedavg(clients)["w"][0, 0] > 1e5  # the weighted mean is theirs


def test_coordinate_median_per_coordinate_and_even_counts_average_the_middle_pair() -> None:
    tensors = [torch.tensor([1.0, -5.0]), torch.tensor([2.0, 7.0]), torch.tensor([9.0, 0.0])]
    assert torch.equal(coordinate_median(tensors), torch.tensor([2.0, 0.0], dtype=torch.float64))
    assert coordinate_median([torch.tensor([1.0]), torch.tensor([4.0])]).item() == 2.5


def test_trimmed_mean_drops_the_extremes_at_each_end_unweighted() -> None:
    clients = five_clients(honest=[1.0, 2.0, 3.0, 4.0], attackers=[-1e9])
    merged = fedavg(clients, combine=combiner("trimmed_mean", trim_fraction=0.2))
    assert torch.equal(merged["w"], torch.full((2, 3), 2.0))  # -1e9 and 4 cut: mean of 1, 2, 3
    two = five_clients(honest=[1.0, 2.0, 3.0], attackers=[1e9, 1e9])
    merged = fedavg(two, combine=combiner("trimmed_mean", trim_fraction=0.4))
    assert torch.equal(merged["w"], torch.full((2, 3), 3.0))  # 2 cut each side: the median
    assert trimmed_mean([torch.tensor([1.0]), torch.tensor([3.0])], trim_fraction=0.0) == 2.0


def test_combiner_refuses_unknown_names_and_trim_fractions_of_half_or_more() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        combiner("mode")
    with pytest.raises(ValueError, match=r"trim_fraction=0\.5"):
        combiner("trimmed_mean", trim_fraction=0.5)


def test_robust_ffa_combines_b_alone_and_keeps_the_shared_a() -> None:
    torch.manual_seed(0)
    a = torch.randn(2, 6)
    bs = [torch.randn(5, 2) for _ in range(3)] + [torch.full((5, 2), 1e6)] * 2
    clients = [(lora_state(a.clone(), b), 10) for b in bs]
    merged = ffa_average(clients, combine=coordinate_median)
    (a_key, b_key) = sorted(merged)
    assert torch.equal(merged[a_key], a)
    expected = torch.stack(bs).median(dim=0).values  # odd count: the middle value
    assert torch.equal(merged[b_key], expected)
    assert merged[b_key].abs().max() < 1e3


def test_robust_svd_takes_the_median_of_the_products_not_of_a_and_b() -> None:
    torch.manual_seed(0)
    honest = [lora_state(torch.randn(2, 6), torch.randn(5, 2)) for _ in range(3)]
    attackers = [lora_state(torch.full((2, 6), 30.0), torch.full((5, 2), 30.0))] * 2
    clients = [(state, 10) for state in honest + attackers]
    merged = svd_average(clients, rank=5, combine=coordinate_median)  # rank 5: exact here
    [(_prefix, product)] = lora_products(merged).items()
    products = torch.stack([next(iter(lora_products(s).values())) for s, _ in clients])
    torch.testing.assert_close(product, products.median(dim=0).values, rtol=1e-6, atol=1e-6)
    assert product.abs().max() <= products[:3].abs().max()  # within the honest clients' range


def test_update_norm_is_the_distance_over_every_tensor_in_float64() -> None:
    reference = {"a": torch.zeros(2), "b": torch.ones(1)}
    assert update_norm({"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([5.0])}, reference) == 5.0
    huge = update_norm({"a": torch.tensor([3e38, 3e38]), "b": torch.ones(1)}, reference)
    assert huge == pytest.approx(3e38 * 2**0.5)  # finite: float32 squares would overflow
    nan = {"a": torch.tensor([float("nan"), 0.0]), "b": torch.ones(1)}
    assert update_norm(nan, reference) != update_norm(nan, reference)  # nan
    mixed = {"a": torch.tensor([3.0, 0.0], dtype=torch.float16), "b": torch.tensor([5.0])}
    assert update_norm(mixed, reference) == 5.0  # tensors of several dtypes, flattened together


def test_tensors_are_flattened_together_in_bounded_groups() -> None:
    state = {"a": torch.zeros(3), "b": torch.zeros(2), "c": torch.zeros(9), "d": torch.zeros(1)}
    assert in_groups(list(state), state, limit=5) == [["a", "b"], ["c"], ["d"]]
    assert in_groups(list(state), state, limit=100) == [["a", "b", "c", "d"]]
    assert in_groups([], state) == []
    empty = {"e": torch.zeros(0), "a": torch.zeros(3)}  # a zero-size one first (an attack
    assert in_groups(["e", "a"], empty, limit=5) == [["e", "a"]]  # review: IndexError)
    assert in_groups(["e"], empty, limit=5) == [["e"]]


@pytest.mark.parametrize("aggregator", ["mean", "median", "trimmed_mean"])
@pytest.mark.parametrize("limit", [1 << 20, 40])
@pytest.mark.parametrize("clients", [5, 20])
def test_fedavg_in_flattened_groups_equals_combining_tensor_by_tensor(
    aggregator: str, limit: int, clients: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fedavg combines a group of tensors flattened together: bit for bit what combining each
    tensor alone gives, for every aggregator, whole or in groups of a few entries (40 over 5
    clients: 8 each, so groups of one tensor and of several), mixed dtypes and shapes. 20
    clients keep 16 rows in a trimmed mean: enough for a vectorised sum's order to depend on
    the number of coordinates (an attack review found 1 ulp in float64 there)."""
    import fed_learn.aggregate

    monkeypatch.setattr(fed_learn.aggregate, "GROUP_ELEMENTS", limit)
    combine = combiner(aggregator, trim_fraction=0.1)
    g = torch.Generator().manual_seed(0)
    shapes = {"e": (0, 2), "a": (2, 3), "b": (3,), "c": (4, 4), "d": (1,), "f": (20, 10)}
    shapes |= {"g": (5,), "h": (3, 3), "k": (7,), "m": (2,)}  # odd widths after a wide one
    dtypes = {"c": torch.bfloat16, "b": torch.float32}  # the rest float64: no rounding hides
    updates = [
        (
            {
                n: (torch.randn(shape, generator=g, dtype=torch.float64) * 10 ** (i % 5 - 2)).to(
                    dtypes.get(n, torch.float64)
                )
                for n, shape in shapes.items()
            },
            i + 1,
        )
        for i in range(clients)
    ]
    weights = [n / sum(range(1, clients + 1)) for _, n in updates]
    got = fedavg(updates, combine=combine)
    assert list(got) == list(shapes)
    for name, tensor in got.items():
        alone = combine([state[name] for state, _ in updates], weights)
        assert tensor.dtype == updates[0][0][name].dtype and tensor.shape == alone.shape
        assert torch.equal(tensor, alone.to(tensor.dtype)), name
    held = [t.untyped_storage().data_ptr() for t in got.values() if t.numel()]
    assert len(set(held)) == len(held)  # each its own storage (safetensors refuses shared)


@pytest.mark.parametrize("limit", [1 << 20, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_update_is_checked_finite_as_a_whole_and_the_bad_tensor_named(
    bad: float, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole, or in groups of two entries (a big adapter's): the same norm, the same tensor
    named."""
    import fed_learn.aggregate

    monkeypatch.setattr(fed_learn.aggregate, "GROUP_ELEMENTS", limit)
    from fed_learn.admission import Reply, Task
    from fed_learn.config import FedConfig
    from fed_learn.strategy import Strategy
    from fed_learn.updates import check_answer

    base = {"a": torch.zeros(2), "b": torch.zeros(3, dtype=torch.float16)}
    strategy = Strategy.create("fedavg", prox_mu=0.0, rank=1, combine=fedavg)
    task = Task(number=1, round=0)
    result: Any = object()  # not read by the check
    good = {"a": torch.tensor([0.5, 0.5]), "b": torch.ones(3, dtype=torch.float16)}
    _, _, norm = check_answer(Reply(task, result, good), base, strategy=strategy, fed=FedConfig())
    assert norm == pytest.approx(3.5**0.5)
    bad_b = {**good, "b": torch.tensor([1.0, bad, 1.0], dtype=torch.float16)}
    with pytest.raises(ValueError, match="update tensor 'b' is not finite"):
        check_answer(Reply(task, result, bad_b), base, strategy=strategy, fed=FedConfig())


@pytest.mark.parametrize("limit", [1 << 20, 2])
def test_an_update_led_by_a_zero_size_tensor_is_refused_not_a_crash(
    limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attack review: a client that sends a zero-size tensor first made the grouping raise
    IndexError, which no refusal catches (the coordinator's round would die). Now it is
    grouped like any other and the update refused for its layout, as one client's failure."""
    import fed_learn.aggregate

    monkeypatch.setattr(fed_learn.aggregate, "GROUP_ELEMENTS", limit)
    from fed_learn.admission import Reply, Task
    from fed_learn.config import FedConfig
    from fed_learn.strategy import Strategy
    from fed_learn.updates import ANSWER_ERRORS, check_answer

    base = {"m.lora_A.weight": torch.zeros(2, 4), "m.lora_B.weight": torch.zeros(4, 2)}
    strategy = Strategy.create("fedavg", prox_mu=0.0, rank=2, combine=fedavg)
    evil = {"a": torch.empty(0), **{k: torch.zeros_like(v) for k, v in base.items()}}
    reply = Reply(Task(number=1, round=0), object(), evil)  # type: ignore[arg-type]
    with pytest.raises(ANSWER_ERRORS, match="layout"):
        check_answer(reply, base, strategy=strategy, fed=FedConfig())


def test_a_resumed_run_logs_only_the_checkpointed_rounds_its_metrics_file_lacks(
    tmp_path: Path,
) -> None:
    """A coordinator killed between round 3's checkpoint and its log line: the checkpoint's
    history has rounds 1-3, the file 0-2 and a line the kill cut short. Only round 3 is logged
    on resume, at step 3, with the checkpoint's figures."""
    from fed_learn.rounds import logged_steps, unlogged_rounds

    metrics_file = tmp_path / "metrics.jsonl"
    rows = [{"kind": "metrics", "step": s, "val_loss": 5.0 - s} for s in range(3)]
    lines = [json.dumps(r) for r in rows] + [json.dumps({"kind": "summary"}), '{"kind": "metr']
    metrics_file.write_text("\n".join(lines))
    assert logged_steps(metrics_file) == {0, 1, 2}
    assert logged_steps(tmp_path / "none.jsonl") == set()
    history = [{"val_loss": 4.0}, {"val_loss": 3.0}, {"val_loss": 2.5}]
    assert unlogged_rounds(history, 3, logged_steps(metrics_file)) == [(3, {"val_loss": 2.5})]
    assert unlogged_rounds(history, 3, {0, 1, 2, 3}) == []  # nothing logged twice
    # a resume into a fresh folder gets the whole checkpointed run, each at its own step
    assert [s for s, _ in unlogged_rounds(history, 3, set())] == [1, 2, 3]
