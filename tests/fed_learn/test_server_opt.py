"""Server optimizers (FedOpt): each one's step against the paper's formulas written out here
on plain floats, their state through a checkpoint file, and the config's refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fed_learn.config import FedConfig
from fed_learn.server_opt import SERVER_OPTIMIZERS, ServerOptimizer

B1, B2, TAU, LR = 0.9, 0.99, 1e-3, 0.05


def reference(name: str, deltas: list[float]) -> float:
    """One coordinate's total move after a step per pseudo-gradient in `deltas` (Reddi et al.
    2021, Algorithm 2; Adam with its bias correction, as Flower's FedAdam has it)."""
    m = v = 0.0
    moved = 0.0
    for t, d in enumerate(deltas, start=1):
        if name == "none":
            moved += d
            continue
        if name == "avgm":
            m = B1 * m + d
            moved += LR * m
            continue
        m = B1 * m + (1 - B1) * d
        if name == "adam":
            v = B2 * v + (1 - B2) * d * d
            lr = LR * math.sqrt(1 - B2**t) / (1 - B1**t)
        elif name == "yogi":
            v = v - (1 - B2) * d * d * math.copysign(1.0, v - d * d) if v != d * d else v
            lr = LR
        else:  # adagrad
            v = v + d * d
            lr = LR
        moved += lr * m / (math.sqrt(v) + TAU)
    return moved


def optimizer(name: str) -> ServerOptimizer:
    return ServerOptimizer.create(name, lr=LR, beta1=B1, beta2=B2, tau=TAU)


DELTAS = [0.02, -0.01, 0.03, 0.005]


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS)
def test_each_optimizer_moves_the_global_adapter_as_its_formula_says(name: str) -> None:
    opt = optimizer(name)
    x = {"w": torch.zeros(3), "frozen": torch.ones(2)}
    for d in DELTAS:
        aggregate = {"w": x["w"] + torch.tensor([d, 2 * d, -d])}
        step = opt.propose(x, aggregate)
        opt.commit(step)
        x = step.weights
    assert torch.equal(x["frozen"], torch.ones(2))  # not in the aggregate: kept
    expected = [reference(name, [k * d for d in DELTAS]) for k in (1, 2, -1)]
    torch.testing.assert_close(x["w"], torch.tensor(expected), rtol=1e-5, atol=1e-7)
    assert opt.count == len(DELTAS)


def test_none_takes_the_aggregate_as_it_is() -> None:
    current = {"w": torch.randn(4, 4)}
    aggregate = {"w": torch.randn(4, 4)}
    assert torch.equal(optimizer("none").propose(current, aggregate).weights["w"], aggregate["w"])


def test_adam_first_step_moves_each_coordinate_by_about_server_lr() -> None:
    """What makes FedAdam differ from FedAvg: the step's size per coordinate is server_lr,
    whatever the pseudo-gradient's size (for |delta| >> tau)."""
    opt = ServerOptimizer.create("adam", lr=0.01, tau=1e-9)
    step = opt.propose({"w": torch.zeros(3)}, {"w": torch.tensor([1e-4, -0.5, 3.0])})
    torch.testing.assert_close(step.weights["w"], torch.tensor([0.01, -0.01, 0.01]))


def test_a_step_not_committed_leaves_the_state_as_it_was() -> None:
    """A round whose aggregate is refused must not move the moments."""
    opt = optimizer("adam")
    opt.commit(opt.propose({"w": torch.zeros(2)}, {"w": torch.ones(2)}))
    before = {k: v.clone() for k, v in opt.state_tensors().items()}
    opt.propose({"w": torch.zeros(2)}, {"w": torch.full((2,), 5.0)})
    assert opt.count == 1
    assert all(torch.equal(before[k], v) for k, v in opt.state_tensors().items())


@pytest.mark.parametrize("name", ["avgm", "adam", "yogi", "adagrad"])
def test_state_through_a_checkpoint_file_repeats_an_uninterrupted_run(
    name: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    aggregates = [{"w": torch.randn(5, 3) * 0.1} for _ in range(4)]

    def run(opt: ServerOptimizer, x: dict[str, torch.Tensor], rounds: list) -> dict:
        for aggregate in rounds:
            target = {"w": x["w"] + aggregate["w"]}
            step = opt.propose(x, target)
            opt.commit(step)
            x = step.weights
        return x

    straight = run(optimizer(name), {"w": torch.zeros(5, 3)}, aggregates)
    first = optimizer(name)
    half = run(first, {"w": torch.zeros(5, 3)}, aggregates[:2])
    save_file(first.state_tensors(), str(tmp_path / "opt.safetensors"))
    resumed = optimizer(name)
    resumed.restore(first.describe(), load_file(str(tmp_path / "opt.safetensors")))
    assert torch.equal(run(resumed, half, aggregates[2:])["w"], straight["w"])
    fresh = run(optimizer(name), half, aggregates[2:])  # control: the state is what matters
    assert not torch.equal(fresh["w"], straight["w"])


def test_restoring_another_optimizers_state_is_refused() -> None:
    adam = optimizer("adam")
    with pytest.raises(ValueError, match="resume with the same one"):
        optimizer("yogi").restore(adam.describe(), adam.state_tensors())


REFUSED = {
    "svd": ({"server_optimizer": "adam", "strategy": "svd"}, "fed.strategy=svd"),
    "async": ({"server_optimizer": "yogi", "mode": "async"}, "fed.mode=async"),
    "lr_without_optimizer": ({"server_lr": 0.1}, "fed.server_lr=0.1"),
    "unknown": ({"server_optimizer": "sgd"}, "fed.server_optimizer"),
    "beta": ({"server_optimizer": "adam", "server_beta2": 1.0}, "fed.server_beta2"),
    "tau": ({"server_optimizer": "adam", "server_tau": 0.0}, "fed.server_tau"),
    "evaluate_async": ({"evaluate_on_clients": True, "mode": "async"}, "fed.mode=async"),
    "fraction_evaluate": ({"fraction_evaluate": 0.0}, "fed.fraction_evaluate"),
    "eval_every": ({"eval_every": 0}, "eval_every"),
    "partition": ({"partition": "by_size"}, "fed.partition"),
}


@pytest.mark.parametrize("fields,key", REFUSED.values(), ids=REFUSED.keys())
def test_config_refuses_by_key(fields: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        FedConfig(**fields)


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "ffa"])
@pytest.mark.parametrize("name", SERVER_OPTIMIZERS)
def test_every_mean_strategy_takes_every_optimizer(strategy: str, name: str) -> None:
    FedConfig(strategy=strategy, server_optimizer=name, secure_aggregation=strategy != "fedprox")
