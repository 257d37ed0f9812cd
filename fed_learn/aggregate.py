"""Aggregating LoRA adapter updates: pure functions over (state dict, num_examples) pairs.

No I/O here, so every rule is tested exactly. A PEFT LoRA adapter holds, per adapted module,
`...lora_A.weight` (r, in) and `...lora_B.weight` (out, r); the module's update is B @ A.

- `fedavg`: the mean of each tensor weighted by dataset size (McMahan et al. 2017). For LoRA
  this averages A and B separately, and mean(B_i) @ mean(A_i) is *not* mean(B_i @ A_i).
- `ffa_average` (FFA-LoRA, Sun et al. 2024): A is frozen at a shared initialization and only B
  trains, so mean(B_i) @ A == mean(B_i @ A): exact.
- `svd_average`: average the products B_i @ A_i and re-factorize by SVD to rank r_out; exact
  when r_out >= the sum of the clients' ranks, the best rank-r_out fit otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

State = Mapping[str, torch.Tensor]
Update = tuple[State, int]
"""An adapter state dict and the number of examples it was trained on."""

LORA_A, LORA_B = "lora_A", "lora_B"


def _check(updates: Sequence[Update]) -> list[float]:
    """Validate updates and return their weights (summing to 1)."""
    if not updates:
        raise ValueError("nothing to aggregate: no client updates")
    keys = set(updates[0][0])
    for state, num_examples in updates:
        if num_examples <= 0:
            raise ValueError(f"num_examples={num_examples} must be > 0")
        if set(state) != keys:
            raise ValueError(f"updates disagree on tensor names: {sorted(set(state) ^ keys)[:4]}")
        for key in keys:
            if state[key].shape != updates[0][0][key].shape:
                raise ValueError(
                    f"{key}: shape {tuple(state[key].shape)} vs {tuple(updates[0][0][key].shape)}"
                )
    total = sum(n for _, n in updates)
    return [n / total for _, n in updates]


def fedavg(updates: Sequence[Update]) -> dict[str, torch.Tensor]:
    """Every tensor's mean weighted by num_examples (accumulated in float64, cast back)."""
    weights = _check(updates)
    first = updates[0][0]
    return {
        key: sum(
            (w * state[key].double() for (state, _), w in zip(updates, weights, strict=True)),
            start=torch.zeros_like(first[key], dtype=torch.float64),
        ).to(first[key].dtype)
        for key in first
    }


def lora_modules(state: State) -> dict[str, tuple[str, str]]:
    """Adapted module prefix -> (its lora_A key, its lora_B key)."""
    pairs: dict[str, tuple[str, str]] = {}
    for key in state:
        if f".{LORA_A}." in key:
            prefix = key.split(f".{LORA_A}.")[0]
            b_key = key.replace(f".{LORA_A}.", f".{LORA_B}.")
            if b_key not in state:
                raise ValueError(f"{key} has no matching {b_key}")
            pairs[prefix] = (key, b_key)
    return pairs


def lora_products(state: State) -> dict[str, torch.Tensor]:
    """Each adapted module's update B @ A, (out, in), in float64."""
    return {
        prefix: state[b].double() @ state[a].double()
        for prefix, (a, b) in lora_modules(state).items()
    }


def average_products(updates: Sequence[Update]) -> dict[str, torch.Tensor]:
    """The exact target of any LoRA aggregation: the weighted mean of B_i @ A_i per module."""
    weights = _check(updates)
    products = [lora_products(state) for state, _ in updates]
    return {
        prefix: sum(
            (w * p[prefix] for p, w in zip(products, weights, strict=True)),
            start=torch.zeros_like(products[0][prefix]),
        )
        for prefix in products[0]
    }


def ffa_average(updates: Sequence[Update], *, atol: float = 0.0) -> dict[str, torch.Tensor]:
    """FFA-LoRA: every client kept the same frozen A; B is averaged. Exact for the products."""
    for state, _ in updates[1:]:
        for a_key, _b in lora_modules(state).values():
            if not torch.allclose(state[a_key], updates[0][0][a_key], rtol=0, atol=atol):
                raise ValueError(
                    f"{a_key} differs between clients: FFA-LoRA needs A frozen "
                    f"at one shared initialization"
                )
    return fedavg(updates)


def svd_average(updates: Sequence[Update], *, rank: int) -> dict[str, torch.Tensor]:
    """Average the products and re-factorize each to rank `rank` (B = U S^1/2, A = S^1/2 V^T).

    Non-LoRA tensors (if any) are averaged as in fedavg.
    """
    if rank < 1:
        raise ValueError(f"rank={rank} must be >= 1")
    averaged = fedavg(updates)
    template = updates[0][0]
    for prefix, product in average_products(updates).items():
        a_key, b_key = lora_modules(template)[prefix]
        u, s, vh = torch.linalg.svd(product, full_matrices=False)
        r = min(rank, s.numel())
        root = s[:r].sqrt()
        b = torch.zeros(product.size(0), rank, dtype=torch.float64)
        a = torch.zeros(rank, product.size(1), dtype=torch.float64)
        b[:, :r] = u[:, :r] * root  # (out, r)
        a[:r] = root[:, None] * vh[:r]  # (r, in)
        averaged[a_key] = a.to(template[a_key].dtype)
        averaged[b_key] = b.to(template[b_key].dtype)
    return averaged


def product_error(state: State, updates: Sequence[Update]) -> float:
    """Relative Frobenius distance between `state`'s products and the true average of products."""
    target = average_products(updates)
    got = lora_products(state)
    num = sum(float((got[p] - target[p]).pow(2).sum()) for p in target)
    den = sum(float(target[p].pow(2).sum()) for p in target)
    return (num / den) ** 0.5 if den else 0.0


def staleness_weight(staleness: int, *, mixing: float, exponent: float) -> float:
    """Weight of an update `staleness` global versions old (FedAsync: mixing * (1+s)^-a)."""
    if staleness < 0:
        raise ValueError(f"staleness={staleness} must be >= 0")
    return mixing * (1.0 + staleness) ** -exponent


def mix(
    global_state: dict[str, torch.Tensor], update: dict[str, torch.Tensor], *, weight: float
) -> dict[str, torch.Tensor]:
    """(1 - weight) * global + weight * update, tensor by tensor, in the global's dtype."""
    if update.keys() != global_state.keys():
        raise ValueError("update and global adapter name different tensors")
    return {
        name: ((1.0 - weight) * g.float() + weight * update[name].float()).to(g.dtype)
        for name, g in global_state.items()
    }
