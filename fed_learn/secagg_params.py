"""What every party of one secure round agrees on (fed_learn.secagg): its parameters, which the
coordinator sends with the task, and the neighbourhood graph SecAgg+ derives from them."""

from __future__ import annotations

import base64
import binascii
import math
import random
from dataclasses import dataclass
from typing import Any

from fed_learn.fixed_point import FRAC_BITS_MAX
from fed_learn.privacy import noise_std

MAX_CLIENTS = 65_535
"""Client ids and share indices travel as 16-bit numbers."""


@dataclass(frozen=True)
class Params:
    """What every party of one round agrees on (the coordinator sends it with the task)."""

    round: int
    clients: tuple[int, ...]
    """The round's clients (ids), sorted."""
    threshold: int
    """Shares needed to rebuild a secret: at least this many neighbours of every client
    must answer each step. More than half a neighbourhood keeps a coordinator that claims a
    client dropped from also learning its self-mask (Bonawitz et al. 2017, section 4)."""
    neighbors: int
    """Neighbours per client (SecAgg+'s degree k); >= len(clients) - 1: everyone."""
    frac_bits: int
    """Fixed point: a value x travels as round(x * 2^frac_bits) modulo 2^64."""
    length: int
    """Entries of a masked input: the update's entries and its weight."""
    graph_seed: bytes = b""
    """Seeds the neighbourhood graph's shuffle (the coordinator draws it per round)."""

    def __post_init__(self) -> None:
        ids = self.clients
        if not ids or list(ids) != sorted(set(ids)) or not all(0 <= i <= MAX_CLIENTS for i in ids):
            raise ValueError(f"clients must be distinct sorted ids in 0..{MAX_CLIENTS}")
        if self.neighbors < 1:
            raise ValueError(f"neighbors={self.neighbors} must be >= 1")
        degree = min(self.neighbors, len(ids) - 1)
        if not 1 <= self.threshold <= degree + 1:
            raise ValueError(
                f"threshold={self.threshold} must be in 1..{degree + 1} (a client and its "
                f"{degree} neighbours hold its shares)"
            )
        if not 0 <= self.round < 2**32:
            raise ValueError(f"round={self.round} must be in 0..2^32-1 (it travels as 32 bits)")
        if not 0 <= self.frac_bits <= FRAC_BITS_MAX:
            raise ValueError(f"frac_bits={self.frac_bits} must be in 0..{FRAC_BITS_MAX}")
        if not 1 <= self.length <= 2**31:
            raise ValueError(f"length={self.length} out of range")

    def neighbours(self, client: int) -> tuple[int, ...]:
        """`client`'s neighbours: a ring over the clients in a shuffled order, each joined to
        the `neighbors` nearest around it (a Harary graph, as SecAgg+ builds). Worked out for
        `client` alone from the shuffled ring (cached): a client never holds the whole graph,
        whose entries grow as clients x degree."""
        ring, at = self._ring()
        n = len(ring)
        if self.neighbors >= n - 1:
            return tuple(c for c in ring if c != client)  # `ring` is the sorted ids here
        position = at[client]
        half, odd = divmod(self.neighbors, 2)
        steps = [*range(1, half + 1), *range(-half, 0)]
        if odd:  # an odd degree: joined to the one opposite it, and to the one it is opposite
            steps += [n // 2, -(n // 2)]
        return tuple(sorted({ring[(position + step) % n] for step in steps} - {client}))

    def graph(self) -> dict[int, tuple[int, ...]]:
        """Every client's neighbours (the coordinator's view: it relays between all of them)."""
        return {c: self.neighbours(c) for c in self.clients}

    def _ring(self) -> tuple[list[int], dict[int, int]]:
        """The clients in the graph's shuffled order, and each one's place in it (built once
        per Params: O(clients) memory)."""
        cached = self.__dict__.get("_ring_cache")
        if cached is None:
            ring = list(self.clients)
            if self.neighbors < len(ring) - 1:
                random.Random(self.graph_seed or bytes(8)).shuffle(ring)
            cached = (ring, {c: i for i, c in enumerate(ring)})
            object.__setattr__(self, "_ring_cache", cached)  # frozen: a cache, not a field
        return cached


def shares_needed(fraction: float, degree: int) -> int:
    """The threshold for fed.secagg.threshold=`fraction` when each client has `degree`
    neighbours: that fraction of a client and its neighbours, rounded up, at least 2 (at most
    all of them). The coordinator picks it so; a client refuses a round asking fewer."""
    return min(degree + 1, max(2, math.ceil(fraction * (degree + 1))))


@dataclass(frozen=True)
class RoundFloor:
    """The weakest secure round a client takes part in, from its own config (`client.
    round_floor`): a coordinator that announces less (a lying one, one configured weaker, or a
    stranger holding the federation's secret) costs itself this client's round, in one line
    naming the key. The defaults are the least any config allows."""

    secure: bool = False
    """fed.secure_aggregation: a plain round (its update sent in clear) is refused."""
    threshold: float = 0.0
    """fed.secagg.threshold: the fewest shares that rebuild this client's secrets, as a
    fraction of it and its neighbours (`shares_needed`: at least 2)."""
    neighbors: int = 1
    """fed.secagg.neighbors: the fewest neighbours (0: every client of the round)."""
    min_clients: int = 2
    """fed.min_fit_clients (at least 2): the fewest clients a round may list (the sum hides an
    update only among others; without identities a coordinator can still invent them)."""
    noise_multiplier: float = 0.0
    """DP (fed.dp.enabled): the run's noise multiplier (`privacy.run_noise_multiplier`); 0: off."""
    clip_norm: float = math.inf
    """DP: fed.dp.clip_norm, the most the round may clip this client's update to."""
    weight_cap: int = 2**31 - 1
    """DP: fed.dp.weight_cap, the most weight the round may let this client use."""

    def check(self, params: Params, *, weight_cap: int, bound: float, share_std: float) -> None:
        """ValueError, in one line naming the config key, if the round's parameters are weaker
        than this floor: fewer neighbours or a lower threshold, or under DP a wider clip, a
        higher weight cap or a noise share smaller than this client's settings give (the
        noise of any `threshold` shares must add up to noise_multiplier x clip_norm x
        weight_cap)."""
        if len(params.clients) < self.min_clients:
            raise ValueError(
                f"the round lists {len(params.clients)} clients; this client's "
                f"fed.min_fit_clients asks for at least {self.min_clients}"
            )
        others = len(params.clients) - 1
        degree = min(params.neighbors, others)
        wanted = min(self.neighbors or others, others)
        if degree < wanted:
            raise ValueError(
                f"the round gives each client {degree} neighbours; this client's "
                f"fed.secagg.neighbors={self.neighbors} asks for {wanted}"
            )
        need = shares_needed(self.threshold, degree)
        if params.threshold < need:
            raise ValueError(
                f"the round's threshold is {params.threshold} shares of {degree + 1}; this "
                f"client's fed.secagg.threshold={self.threshold:g} needs at least {need}"
            )
        if self.noise_multiplier <= 0:
            return
        if not bound <= self.clip_norm or weight_cap > self.weight_cap:
            raise ValueError(
                f"the round clips to {bound:g} with a weight cap of {weight_cap}; this client's "
                f"fed.dp.clip_norm={self.clip_norm:g} and fed.dp.weight_cap={self.weight_cap} "
                "are the most its noise covers"
            )
        floor = noise_std(
            self.noise_multiplier, self.clip_norm * self.weight_cap, shares=params.threshold
        )
        if not share_std >= floor * (1 - 1e-9):  # float rounding room only
            raise ValueError(
                f"the round's DP noise share has std {share_std:.4g}; this client's fed.dp "
                f"settings need at least {floor:.4g} (noise multiplier "
                f"{self.noise_multiplier:.4g} x clip_norm x weight_cap / sqrt(threshold "
                f"{params.threshold}))"
            )


def params_message(
    params: Params, *, weight_cap: int, bound: float, share_std: float = 0.0
) -> dict[str, Any]:
    return {
        "noise_std": share_std,
        "round": params.round,
        "clients": list(params.clients),
        "threshold": params.threshold,
        "neighbors": params.neighbors,
        "frac_bits": params.frac_bits,
        "length": params.length,
        "graph_seed": base64.b64encode(params.graph_seed).decode("ascii"),
        "weight_cap": weight_cap,
        "bound": bound,
    }


def parse_params(payload: Any, *, max_clients: int) -> tuple[Params, int, float, float]:
    """The round's parameters as a client reads them from its TASK: (params, its weight cap,
    the norm it clips to, the std of its share of DP noise); ValueError if absurd, or if the
    round lists more than `max_clients` (fed.secagg.max_clients), before anything is built."""
    if not isinstance(payload, dict):
        raise ValueError("the task's secure parameters must be a JSON object")
    listed = payload.get("clients")
    if not isinstance(listed, list):
        raise ValueError("the task's secure parameters list no clients")
    if len(listed) > max_clients:
        raise ValueError(
            f"the round lists {len(listed)} clients; this client takes part in secure rounds "
            f"of at most {max_clients} (fed.secagg.max_clients)"
        )
    try:
        params = Params(
            round=int(payload["round"]),
            clients=tuple(int(c) for c in payload["clients"]),
            threshold=int(payload["threshold"]),
            neighbors=int(payload["neighbors"]),
            frac_bits=int(payload["frac_bits"]),
            length=int(payload["length"]),
            graph_seed=base64.b64decode(str(payload["graph_seed"]), validate=True),
        )
        weight_cap, bound = int(payload["weight_cap"]), float(payload["bound"])
        share_std = float(payload.get("noise_std", 0.0))
    except (KeyError, TypeError, OverflowError, binascii.Error) as exc:  # float(10**400)
        raise ValueError(f"the task's secure parameters are malformed ({exc})") from None
    if not 1 <= weight_cap < 2**31 or not 0 < bound < float("inf"):
        raise ValueError("the task's secure weight cap or bound is out of range")
    if not 0 <= share_std < float("inf"):
        raise ValueError("the task's noise_std is out of range")
    return params, weight_cap, bound, share_std
