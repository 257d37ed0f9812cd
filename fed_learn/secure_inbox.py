"""What a secure round's coordinator keeps between its clients' sessions and its round thread:
the inbox each session hands a secure step's message to (once per client and step, only for
the round's own tasks), and the run's digests of the masked inputs taken (a replay is refused
by name). `fed_learn.secure` runs the round over them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fed_learn import secagg
from fed_learn.rounds import REPORT_EVERY_S, REPORT_FIRST_S, WAKE_S

log = logging.getLogger(__name__)

GONE = -1
"""An inbox entry: the client's session ended."""
MAX_DIGESTS = 1 << 20
"""Masked-input digests kept against replay (the oldest go first): a run of 10,000 rounds
of 100 clients."""


@dataclass(frozen=True)
class Skipped:
    """In place of a masked input: the client's SKIP (its training came out non-finite)."""

    reason: str


DIGESTED_BYTES = 4096
"""A masked input's leading bytes its digest covers. Each entry of an honest input is uniform
(its self-mask is fresh ChaCha20 keystream every round), so two honest inputs share these
4,096 bytes with probability 2^-32768: an input whose first bytes came in an earlier round is
a replay, whole or spliced. Hashing only these refuses every replay the whole input's digest
did for ~0.1 ms a round, not ~7 (100 inputs of 131 KB). Within a round a shared head is not
enough: a client that reads another's frame in flight could send its head first, ahead of the
whole, and get the honest one refused; there only a whole copy is a replay."""


class InputDigests:
    """SHA-256 digests of the masked inputs taken, over the run (of their first
    `DIGESTED_BYTES`): a masked input is fresh noise every round (fresh keys and seeds), so
    one seen in an earlier round is a replay, and one equal to another of its round."""

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        """digest -> (round, client) it first came from, oldest first."""
        self._round: dict[bytes, list[tuple[int, np.ndarray]]] = {}
        """This round's inputs by digest: (client, input), to tell a whole copy."""
        self._round_index: int | None = None

    def admit(self, client: int, round_index: int, masked: np.ndarray) -> None:
        """Record `client`'s masked input of `round_index` (one the round takes: checked
        first); Refused if one came before with its head in an earlier round, or whole in
        this one."""
        if round_index != self._round_index:
            self._round, self._round_index = {}, round_index
        # its first bytes in C order, as tobytes() gives them, hashed where they lie (no copy)
        data = np.ascontiguousarray(masked).data.cast("B")[:DIGESTED_BYTES]
        digest = hashlib.sha256(data).digest()
        first = self._seen.get(digest)
        if first is not None and first[0] != round_index:
            raise secagg.Refused(
                client,
                f"replays the masked input client {first[1]} sent in round {first[0] + 1} "
                f"(its first {len(data):,} bytes)",
            )
        for other, taken in self._round.get(digest, ()):
            if np.array_equal(taken, masked):
                raise secagg.Refused(
                    client,
                    f"replays the masked input client {other} sent in round {round_index + 1}",
                )
        self._round.setdefault(digest, []).append((client, masked))
        self._seen.setdefault(digest, (round_index, client))
        while len(self._seen) > MAX_DIGESTS:
            self._seen.popitem(last=False)


@dataclass
class SecureInbox:
    """What clients' sessions read for the round in progress, handed to its thread: one
    message per client and step, and only for the round's own tasks."""

    tasks: dict[int, int] = field(default_factory=dict)
    """client id -> the task number of the secure round it takes part in."""
    seen: set[tuple[int, int]] = field(default_factory=set)
    messages: deque[tuple[int, int, Any]] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gone: set[int] = field(default_factory=set)
    clock: Callable[[], float] = time.monotonic
    """What `gather`'s deadlines are read on (tests inject one)."""
    awaited: tuple[int, set[int]] | None = None
    """While `gather` sleeps: the step's kind and the clients whose message (or leaving) it
    still waits for. The last of them wakes it: one wake-up a step, not one a message."""

    def __post_init__(self) -> None:
        self.complete = threading.Condition(self.lock)

    def open(self, tasks: Mapping[int, int]) -> None:
        with self.lock:
            self.tasks = dict(tasks)
            self.seen.clear()
            self.gone = set()
            self.messages = deque()
            self.awaited = None

    def close(self) -> None:
        with self.lock:
            self.tasks = {}

    def offer(self, client: int, kind: int, payload: Any, *, task: Any) -> bool:
        """A session thread's message; whether the round took it (else it is dropped)."""
        with self.lock:
            if self.tasks.get(client) != task or (client, kind) in self.seen:
                return False
            self.seen.add((client, kind))
            self._arrived(client, kind, payload)
            return True

    def leave(self, client: int) -> None:
        """`client`'s session ended: the round stops waiting for it."""
        with self.lock:
            if client in self.tasks:
                self.gone.add(client)
                self._arrived(client, GONE, None)

    def _arrived(self, client: int, kind: int, payload: Any) -> None:
        """Under the lock: queue it, and wake `gather` if it was the last one awaited."""
        self.messages.append((client, kind, payload))
        awaited = self.awaited
        if awaited is not None and kind in (awaited[0], GONE) and client in awaited[1]:
            awaited[1].discard(client)
            if not awaited[1]:
                self.complete.notify()

    def gather(
        self, kind: int, clients: Iterable[int], deadline: float, *, what: str
    ) -> dict[int, Any]:
        """`kind` messages from `clients` until all came (or left) or `deadline` (on `clock`)
        passed. Says whom it still waits for after 5 s, then every 30 s (`what`: for what,
        under which config key), as `rounds.gather` does."""
        wanted = set(clients)
        with self.lock:
            wanted -= self.gone
        got: dict[int, Any] = {}
        postponed: list[tuple[int, int, Any]] = []
        next_report = self.clock() + REPORT_FIRST_S
        while wanted - set(got):
            now = self.clock()
            if now >= deadline:
                break
            if now >= next_report:
                missing = sorted(wanted - set(got))
                log.info(
                    "waiting for %d clients' %s (ids %s), %.0fs left",
                    len(missing),
                    what,
                    missing[:16],
                    deadline - now,
                )
                next_report += REPORT_EVERY_S
            with self.lock:  # woken by the last one awaited; at the latest to report or time out
                if not self.messages:
                    self.awaited = (kind, wanted - set(got))
                    wait = max(0.0, min(deadline, next_report) - now)
                    self.complete.wait(min(wait, WAKE_S))
                    self.awaited = None
                arrived = list(self.messages)
                self.messages.clear()
            for client, k, payload in arrived:
                if k == GONE:
                    wanted.discard(client)
                elif k == kind and client in wanted:
                    got[client] = payload
                else:
                    postponed.append((client, k, payload))  # a fast client's next step
        with self.lock:
            self.messages.extend(postponed)
        return got
