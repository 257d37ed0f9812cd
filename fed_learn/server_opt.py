"""Server-side optimizers (FedOpt, Reddi et al. 2021), registered by name (`fed.server_optimizer`).

A round's aggregate (the strategy's weighted mean, a robust aggregator's value, DP's noised
mean or secure aggregation's unmasked sum over the weights) minus the global adapter it was
trained from is the round's pseudo-gradient, delta (its sign as in Flower's FedOpt: the
direction to move in). The optimizer turns it into the move the global adapter makes:

    none     x + delta                                      (plain averaging: FedAvg)
    avgm     m = beta1 * m + delta;  x + lr * m             (FedAvgM, Hsu et al. 2019)
    adam     m = beta1 * m + (1 - beta1) * delta
             v = beta2 * v + (1 - beta2) * delta^2
             x + lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + tau)
    yogi     v = v - (1 - beta2) * delta^2 * sign(v - delta^2),  then as adam (no bias correction)
    adagrad  v = v + delta^2,  then as adam (no bias correction)

Pure functions of tensors: no I/O. The state (m, v and the step count) goes into every
checkpoint and comes back on resume, so a resumed run moves exactly as an uninterrupted one.
A step is proposed and then committed: a round whose result is refused leaves the state as it
was. Everything is computed in float64 and cast back to the adapter's dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

State = Mapping[str, torch.Tensor]
SLOTS = ("m", "v")
Slots = dict[str, dict[str, torch.Tensor]]
"""The per-tensor state an optimizer may keep, saved as `<slot>/<tensor name>`."""


@dataclass
class Step:
    """A proposed step: the new global adapter, and the optimizer state that produced it."""

    weights: dict[str, torch.Tensor]
    slots: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    count: int = 0


class ServerOptimizer(ABC):
    """Turns a round's aggregate into the next global adapter (see the module)."""

    name: ClassVar[str]
    default_lr: ClassVar[float] = 1.0
    registry: ClassVar[dict[str, type[ServerOptimizer]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a shared base (Adaptive) registers nothing
            ServerOptimizer.registry[cls.name] = cls

    def __init__(
        self, *, lr: float = 0.0, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ) -> None:
        self.lr = lr or self.default_lr
        self.beta1 = beta1
        self.beta2 = beta2
        self.tau = tau
        self.slots: dict[str, dict[str, torch.Tensor]] = {}
        self.count = 0
        """Steps taken (t in the formulas)."""

    @classmethod
    def create(cls, name: str, **kwargs: Any) -> ServerOptimizer:
        if name not in cls.registry:
            raise ValueError(f"fed.server_optimizer={name!r}: choose one of {sorted(cls.registry)}")
        return cls.registry[name](**kwargs)

    def propose(self, current: State, aggregate: State) -> Step:
        """The step from `current` (the global adapter the round trained from) given the
        round's `aggregate` of the same tensors (any of `current`'s missing from it stay)."""
        delta = {n: aggregate[n].double() - current[n].double() for n in aggregate}
        slots = {s: dict(self.slots.get(s, {})) for s in SLOTS}
        for slot in slots.values():
            for name, tensor in delta.items():
                slot.setdefault(name, torch.zeros_like(tensor))
        moves = self._moves(delta, slots, self.count + 1)
        weights = {
            n: (current[n].double() + moves[n]).to(current[n].dtype) if n in moves else t
            for n, t in {**current, **aggregate}.items()
        }
        kept = {s: slots[s] for s in self.uses}
        return Step(weights=weights, slots=kept, count=self.count + 1)

    def commit(self, step: Step) -> None:
        """The proposed step was applied: its state is the optimizer's from now on."""
        self.slots, self.count = step.slots, step.count

    uses: ClassVar[tuple[str, ...]] = ()
    """The slots this optimizer keeps."""

    @abstractmethod
    def _moves(
        self, delta: dict[str, torch.Tensor], slots: dict[str, dict[str, torch.Tensor]], t: int
    ) -> dict[str, torch.Tensor]:
        """Each tensor's move (float64) from its pseudo-gradient; updates `slots` in place
        (they are the proposal's copies)."""

    # ---------------------------------------------------------------- checkpoints

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state as flat tensors for a safetensors file: `<slot>/<tensor name>`."""
        return {
            f"{s}/{n}": t.contiguous() for s, slot in self.slots.items() for n, t in slot.items()
        }

    def describe(self) -> dict[str, Any]:
        """What fed_state.json records beside the tensors."""
        return {"name": self.name, "step": self.count, "lr": self.lr, "beta1": self.beta1,
                "beta2": self.beta2, "tau": self.tau}  # fmt: skip

    def restore(self, described: Mapping[str, Any], tensors: State) -> None:
        """Load a checkpoint's state (`describe()` and `state_tensors()` as saved)."""
        if described.get("name") != self.name:
            raise ValueError(
                f"the checkpoint's server optimizer is {described.get('name')!r}, this run's "
                f"fed.server_optimizer={self.name}: resume with the same one"
            )
        slots: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            slot, _, name = key.partition("/")
            if slot not in self.uses or not name:
                raise ValueError(f"server optimizer state: unexpected tensor {key!r}")
            slots.setdefault(slot, {})[name] = tensor.double()
        self.slots, self.count = slots, int(described.get("step", 0))


class Plain(ServerOptimizer):
    """No server optimizer: the aggregate is the next global adapter (FedAvg)."""

    name = "none"

    def _moves(
        self, delta: dict[str, torch.Tensor], slots: Slots, t: int
    ) -> dict[str, torch.Tensor]:
        return delta


class AvgM(ServerOptimizer):
    """FedAvgM: server momentum beta1 on the pseudo-gradient (Flower's `server_momentum`)."""

    name = "avgm"
    uses = ("m",)

    def _moves(
        self, delta: dict[str, torch.Tensor], slots: Slots, t: int
    ) -> dict[str, torch.Tensor]:
        m = slots["m"]
        for n, d in delta.items():
            m[n] = self.beta1 * m[n] + d
        return {n: self.lr * m[n] for n in delta}


class Adaptive(ServerOptimizer):
    """What FedAdam, FedYogi and FedAdagrad share: a first moment, a second moment each
    updates its own way, and lr * m / (sqrt(v) + tau)."""

    default_lr = 0.1  # Flower's eta for all three
    uses = ("m", "v")
    bias_correction: ClassVar[bool] = False

    @abstractmethod
    def _second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        """The new v from the old one and delta^2."""

    def _moves(
        self, delta: dict[str, torch.Tensor], slots: Slots, t: int
    ) -> dict[str, torch.Tensor]:
        m, v = slots["m"], slots["v"]
        lr = self.lr
        if self.bias_correction:
            lr *= (1 - self.beta2**t) ** 0.5 / (1 - self.beta1**t)
        moves = {}
        for n, d in delta.items():
            m[n] = self.beta1 * m[n] + (1 - self.beta1) * d
            v[n] = self._second_moment(v[n], d * d)
            moves[n] = lr * m[n] / (v[n].sqrt() + self.tau)
        return moves


class Adam(Adaptive):
    name = "adam"
    bias_correction = True

    def _second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return self.beta2 * v + (1 - self.beta2) * d2


class Yogi(Adaptive):
    name = "yogi"

    def _second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.beta2) * d2 * torch.sign(v - d2)


class Adagrad(Adaptive):
    name = "adagrad"

    def _second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return v + d2


SERVER_OPTIMIZERS = tuple(ServerOptimizer.registry)
