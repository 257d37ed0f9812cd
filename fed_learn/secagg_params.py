"""What every party of one secure round agrees on (fed_learn.secagg): its parameters, which the
coordinator sends with the task, and the neighbourhood graph SecAgg+ derives from them."""

from __future__ import annotations

import random
from dataclasses import dataclass

from fed_learn.fixed_point import FRAC_BITS_MAX

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
        if not 0 <= self.frac_bits <= FRAC_BITS_MAX:
            raise ValueError(f"frac_bits={self.frac_bits} must be in 0..{FRAC_BITS_MAX}")
        if not 1 <= self.length <= 2**31:
            raise ValueError(f"length={self.length} out of range")

    def neighbours(self, client: int) -> tuple[int, ...]:
        """`client`'s neighbours: a ring over the clients in a shuffled order, each joined to
        the `neighbors` nearest around it (a Harary graph, as SecAgg+ builds)."""
        return self.graph()[client]

    def graph(self) -> dict[int, tuple[int, ...]]:
        ids = list(self.clients)
        n = len(ids)
        if self.neighbors >= n - 1:
            return {c: tuple(i for i in ids if i != c) for c in ids}
        order = ids[:]
        random.Random(self.graph_seed or bytes(8)).shuffle(order)
        half, odd = divmod(self.neighbors, 2)
        links: dict[int, set[int]] = {c: set() for c in ids}
        for at, c in enumerate(order):
            for step in range(1, half + 1):
                other = order[(at + step) % n]
                links[c].add(other)
                links[other].add(c)
            if odd:  # an odd degree: each is also joined to the one opposite it
                other = order[(at + n // 2) % n]
                links[c].add(other)
                links[other].add(c)
        return {c: tuple(sorted(links[c] - {c})) for c in ids}
