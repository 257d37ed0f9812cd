"""Aggregation strategies, registered by name (`fed.strategy=...`).

A strategy says what clients must do in a round (`client_options`) and how their updates
become the next global adapter (`aggregate`); the coordinator owns the round loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from fed_learn.aggregate import Update, fedavg, ffa_average, svd_average


class Strategy(ABC):
    name: ClassVar[str]
    registry: ClassVar[dict[str, type[Strategy]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Strategy.registry[cls.name] = cls

    def __init__(self, *, prox_mu: float = 0.0, rank: int = 8) -> None:
        self.prox_mu = prox_mu
        self.rank = rank

    def client_options(self) -> dict[str, Any]:
        return {"prox_mu": 0.0, "freeze_a": False}

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
        return fedavg(updates)


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

    def aggregate(self, updates: Sequence[Update]) -> dict[str, torch.Tensor]:
        return ffa_average(updates)


class SVDLoRA(Strategy):
    """The mean of the products B_i @ A_i, re-factorized by SVD to the adapter's rank."""

    name = "svd"

    def aggregate(self, updates: Sequence[Update]) -> dict[str, torch.Tensor]:
        return svd_average(updates, rank=self.rank)
