"""Aggregation strategies, registered by name (`fed.strategy=...`).

A strategy says what clients must do in a round (`client_options`), what a client's adapter
must respect to be admitted (`check_update`) and how the admitted ones become the next global
adapter (`aggregate`, each tensor combined by `combine`: the weighted mean, or a robust
coordinate-wise one, see `fed.aggregator`); the coordinator owns the round loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from fed_learn.aggregate import (
    Combine,
    Update,
    fedavg,
    ffa_average,
    lora_modules,
    svd_average,
    weighted_mean,
)


class Strategy(ABC):
    name: ClassVar[str]
    registry: ClassVar[dict[str, type[Strategy]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a wrapper (privacy.DPMean) is no `fed.strategy` choice
            Strategy.registry[cls.name] = cls

    def __init__(
        self, *, prox_mu: float = 0.0, rank: int = 8, combine: Combine = weighted_mean
    ) -> None:
        self.prox_mu = prox_mu
        self.rank = rank
        self.combine = combine

    def client_options(self) -> dict[str, Any]:
        return {"prox_mu": 0.0, "freeze_a": False}

    def configure_round(
        self, global_state: Mapping[str, torch.Tensor], sampled_weights: Sequence[int]
    ) -> None:
        """A round starts from `global_state` with clients declaring `sampled_weights`
        examples (the pair of `aggregate`, as Flower's configure_fit is of aggregate_fit)."""
        return None

    def check_update(
        self, update: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor]
    ) -> None:
        """ValueError if a client's adapter, trained from `global_state`, breaks the strategy."""
        return None  # the default: no rule beyond the coordinator's own checks

    def trained(self, global_state: Mapping[str, torch.Tensor]) -> list[str]:
        """The adapter tensors clients change: the only ones that need to cross the network
        once a client holds the others (the default: all of them)."""
        return list(global_state)

    @abstractmethod
    def aggregate(self, updates: Sequence[Update]) -> dict[str, torch.Tensor]:
        """The next global adapter from (client adapter, num_examples) pairs."""

    @classmethod
    def create(cls, name: str, **kwargs: Any) -> Strategy:
        if name not in cls.registry:
            raise ValueError(f"fed.strategy={name!r}: choose one of {sorted(cls.registry)}")
        return cls.registry[name](**kwargs)


class FedAvg(Strategy):
    """Dataset-size-weighted mean of A and B separately (McMahan et al. 2017)."""

    name = "fedavg"

    def aggregate(self, updates: Sequence[Update]) -> dict[str, torch.Tensor]:
        return fedavg(updates, combine=self.combine)


class FedProx(FedAvg):
    """FedAvg, with a proximal term in each client's loss (Li et al. 2020)."""

    name = "fedprox"

    def client_options(self) -> dict[str, Any]:
        return {"prox_mu": self.prox_mu, "freeze_a": False}


class FFALoRA(Strategy):
    """A frozen at the shared initialization, B averaged: exactly the mean of the B @ A."""

    name = "ffa"

    def client_options(self) -> dict[str, Any]:
        return {"prox_mu": 0.0, "freeze_a": True}

    def check_update(
        self, update: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor]
    ) -> None:
        for a_key, _b in lora_modules(global_state).values():
            if not torch.equal(update[a_key], global_state[a_key]):
                raise ValueError(f"{a_key} moved: FFA-LoRA clients keep A frozen")

    def trained(self, global_state: Mapping[str, torch.Tensor]) -> list[str]:
        frozen = {a_key for a_key, _ in lora_modules(global_state).values()}
        return [name for name in global_state if name not in frozen]

    def aggregate(self, updates: Sequence[Update]) -> dict[str, torch.Tensor]:
        return ffa_average(updates, combine=self.combine)


class SVDLoRA(Strategy):
    """The mean of the products B_i @ A_i, re-factorized by SVD to the adapter's rank."""

    name = "svd"

    def aggregate(self, updates: Sequence[Update]) -> dict[str, torch.Tensor]:
        return svd_average(updates, rank=self.rank, combine=self.combine)
