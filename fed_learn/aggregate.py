"""Aggregating LoRA adapter updates: pure functions over (state dict, num_examples) pairs.

No I/O here, so every rule is tested exactly. A PEFT LoRA adapter holds, per adapted module,
`...lora_A.weight` (r, in) and `...lora_B.weight` (out, r); the module's update is B @ A.

- `fedavg`: the mean of each tensor weighted by dataset size (McMahan et al. 2017). For LoRA
  this averages A and B separately, and mean(B_i) @ mean(A_i) is *not* mean(B_i @ A_i).
- `ffa_average` (FFA-LoRA, Sun et al. 2024): A is frozen at a shared initialization and only B
  trains, so mean(B_i) @ A == mean(B_i @ A): exact.
- `svd_average`: average the products B_i @ A_i and re-factorize by SVD to rank r_out; exact
  when r_out >= the sum of the clients' ranks, the best rank-r_out fit otherwise.

Each of them combines the clients' values of one tensor with a `Combine`: the weighted mean
(the default, what the names above describe), or a robust one against a misbehaving minority,
`coordinate_median` or `trimmed_mean` (Yin et al. 2018), which are unweighted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
from torch._utils import _flatten_dense_tensors

State = Mapping[str, torch.Tensor]
Update = tuple[State, int]
"""An adapter state dict and the number of examples it was trained on."""

LORA_A, LORA_B = "lora_A", "lora_B"

Combine = Callable[[Sequence[torch.Tensor], Sequence[float]], torch.Tensor]
"""How the clients' values of one tensor become one: (their tensors, their weights summing to
1) -> a float64 tensor of the same shape. Coordinate by coordinate: `fedavg` combines tensors
flattened together."""

AGGREGATORS = ("mean", "median", "trimmed_mean")


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_i w_i * t_i, accumulated in float64."""
    return sum(
        (w * t.double() for t, w in zip(tensors, weights, strict=True)),
        start=torch.zeros_like(tensors[0], dtype=torch.float64),
    )


def _sorted_stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The clients' tensors stacked and sorted coordinate by coordinate: (n, *shape), float64."""
    return torch.stack([t.double() for t in tensors]).sort(dim=0).values


def coordinate_median(
    tensors: Sequence[torch.Tensor], weights: Sequence[float] = ()
) -> torch.Tensor:
    """Coordinate-wise median, unweighted (`weights` are ignored): with an even count the mean
    of the two middle values. Any minority of clients cannot move it outside the others' range."""
    ordered = _sorted_stack(tensors)  # (n, *shape)
    n = ordered.size(0)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def trimmed_count(num_clients: int, trim_fraction: float) -> int:
    """How many values trimmed_mean drops at each end: floor(trim_fraction * num_clients)."""
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction={trim_fraction} must be in [0, 0.5)")
    return int(trim_fraction * num_clients)


def trimmed_mean(
    tensors: Sequence[torch.Tensor], weights: Sequence[float] = (), *, trim_fraction: float
) -> torch.Tensor:
    """Coordinate-wise trimmed mean, unweighted (`weights` are ignored): per coordinate, drop
    the floor(trim_fraction * n) smallest and as many largest values, average the rest. The
    kept values are added one client's row at a time, in sorted order: not `mean(dim=0)`,
    whose vectorised sum adds a coordinate's values in an order that depends on how many
    coordinates there are (1 ulp apart in float64), so a tensor alone and flattened with
    others (`fedavg`) get the same value."""
    ordered = _sorted_stack(tensors)  # (n, *shape)
    cut = trimmed_count(ordered.size(0), trim_fraction)
    kept = ordered[cut : ordered.size(0) - cut]
    total = kept[0].clone()
    for row in kept[1:]:
        total += row
    return total / kept.size(0)


def combiner(aggregator: str, *, trim_fraction: float = 0.0) -> Combine:
    """The Combine named by `fed.aggregator`."""
    if aggregator == "mean":
        return weighted_mean
    if aggregator == "median":
        return coordinate_median
    if aggregator == "trimmed_mean":
        trimmed_count(1, trim_fraction)  # validates it now, not at the first round
        return partial(trimmed_mean, trim_fraction=trim_fraction)
    raise ValueError(f"aggregator={aggregator!r}: choose one of {list(AGGREGATORS)}")


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


def fedavg(
    updates: Sequence[Update], *, combine: Combine = weighted_mean
) -> dict[str, torch.Tensor]:
    """Every tensor combined across clients (by default: its mean weighted by num_examples),
    computed in float64 and cast back to the first update's dtype. A group of tensors at a
    time, flattened together (a few ops a client, not a few a tensor: the weighted mean of 100
    clients' debug adapters, 28 tensors each, ~7 ms, not ~16), each group at most
    GROUP_ELEMENTS entries over all the clients' copies; the same values as tensor by tensor,
    since every Combine is coordinate-wise (tested)."""
    weights = _check(updates)
    first = updates[0][0]
    combined: dict[str, torch.Tensor] = {}
    for names in in_groups(list(first), first, limit=max(1, GROUP_ELEMENTS // len(updates))):
        flat = combine([flatten([state[n] for n in names]) for state, _ in updates], weights)
        for name, piece in zip(names, flat.split([first[n].numel() for n in names]), strict=True):
            combined[name] = piece.view(first[name].shape).to(first[name].dtype, copy=True)
    return combined


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


def average_products(
    updates: Sequence[Update], *, combine: Combine = weighted_mean
) -> dict[str, torch.Tensor]:
    """The exact target of any LoRA aggregation: the weighted mean of B_i @ A_i per module
    (or the products combined by `combine`)."""
    weights = _check(updates)
    products = [lora_products(state) for state, _ in updates]
    return {prefix: combine([p[prefix] for p in products], weights) for prefix in products[0]}


def ffa_average(
    updates: Sequence[Update], *, atol: float = 0.0, combine: Combine = weighted_mean
) -> dict[str, torch.Tensor]:
    """FFA-LoRA: every client kept the same frozen A; B is averaged (or combined by `combine`:
    B alone, A is the shared one). Exact for the products."""
    weights = _check(updates)
    first = updates[0][0]
    a_keys = {a_key for a_key, _b in lora_modules(first).values()}
    for state, _ in updates[1:]:
        for a_key in a_keys:
            if not torch.allclose(state[a_key], first[a_key], rtol=0, atol=atol):
                raise ValueError(
                    f"{a_key} differs between clients: FFA-LoRA needs A frozen "
                    f"at one shared initialization"
                )
    return {
        key: (
            first[key].clone()
            if key in a_keys
            else combine([state[key] for state, _ in updates], weights).to(first[key].dtype)
        )
        for key in first
    }


def svd_average(
    updates: Sequence[Update], *, rank: int, combine: Combine = weighted_mean
) -> dict[str, torch.Tensor]:
    """Average the products (or combine them by `combine`) and re-factorize each to rank
    `rank` (B = U S^1/2, A = S^1/2 V^T). Non-LoRA tensors (if any) are combined as in fedavg.
    """
    if rank < 1:
        raise ValueError(f"rank={rank} must be >= 1")
    averaged = fedavg(updates, combine=combine)
    template = updates[0][0]
    for prefix, product in average_products(updates, combine=combine).items():
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


GROUP_ELEMENTS = 1 << 20
"""Entries flattened together at most (`in_groups`): a few ops a group, not a few a tensor,
with memory bounded whatever the adapter's size (float64 copies of a 1M-entry group: 8 MiB)."""


def in_groups(names: list[str], state: State, limit: int | None = None) -> list[list[str]]:
    """`names` in order, cut into runs of at most `limit` (GROUP_ELEMENTS) entries of `state`
    (a bigger tensor alone)."""
    limit = GROUP_ELEMENTS if limit is None else limit
    groups: list[list[str]] = []
    size = 0
    for name in names:
        if not groups or size + state[name].numel() > limit:  # a zero-size first one too
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += state[name].numel()
    return groups


def update_norm(state: State, reference: State) -> float:
    """L2 norm of state - reference over every tensor together, in float64 (no overflow for
    any finite float32 entry); inf or nan when an entry is not finite. The tensors flattened
    together by groups (`in_groups`): a few ops a group, not five a tensor (a coordinator
    checks every update)."""
    total = 0.0
    for names in in_groups(list(state), state):
        ours = flatten([state[name] for name in names]).double()
        theirs = flatten([reference[name] for name in names]).double()
        total += float((ours - theirs).square().sum())
    return total**0.5


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`tensors` flattened into one 1-D tensor, in order: torch's own (DDP's buckets), one
    call, not a reshape a tensor (about 13 against 32 us for the debug adapter's 28)."""
    return _flatten_dense_tensors(list(tensors))


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
