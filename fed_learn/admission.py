"""Admission: who may join the federation and how often, and the table of clients admitted.

A client's session opens with a JOIN. Each address may JOIN only so often
(`fed.join_rate_per_address`, a token bucket per address, `JoinLimiter`); a refused JOIN costs
one ERROR frame, as does a malformed one. A JOIN refused for the rate is told when to come
back (`retry_after_s`: a later token, promised to it alone), so refused clients return one per
token instead of retrying blind, each refusal a session's set-up and teardown here. An
admitted client gets an id never given before and a place in the client table, with what it
declared at JOIN capped by `fed.max_examples_per_client`.

A JOIN is charged to its address range (IPv4 /24, IPv6 /64, all of 127/8 as one:
`address_range`) and to the client index it claims (one shared charge for no claim or one past
fed.num_clients), and the charge is given back when the session hands in its first update: past
`fed.idle_join_budget` charges either one's JOINs are refused until a round counts
(`JoinBudget`). Any secret holder can claim
any index, so it can spend another client's index budget: that costs the other's reconnection,
not a round in progress (a round closes on updates, never on sessions that left).

Nor does a client's coming and going cost more than its stay: a client that leaves is dropped
from the table with its connection and buffers (its id is never given again), and what it
counted for (bytes, dropped RESULTs) stays in the totals. Every reader of the table holds the
lock its writers hold; the coordinator's rounds take the same lock (`Admission.lock`).
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fed_learn.config import FedConfig
from fed_learn.protocol import ClientResult, Evaluation, FedMsg, parse_join
from lab.cli import UserError
from lab.waiting import Wait
from netproto import Connection
from netproto.server import address_key

log = logging.getLogger(__name__)

JOINED = -1
"""On `Admission.news`: a client joined (the other entries are client ids, see there)."""
REPLY_SLOTS = 2
"""A client's queue: the answer to its one outstanding task, and the 'gone' marker."""
MAX_PROMISED_REFILLS = 10
"""The furthest ahead a refused JOIN is told to come back, in refills of the JOIN rate: a
burst of refused JOINs from an address (a stranger sharing its range, a local process on
127/8) cannot tell the next honest client to stay away longer than this."""
MAX_TRACKED_ADDRESSES = 4096
"""JOIN buckets kept (the least recently used goes first): memory stays bounded whatever the
number of addresses; a forgotten one starts again with a full bucket."""


class NotEnoughClientsError(UserError, RuntimeError):
    """Fewer than `fed.min_fit_clients` clients connected within `fed.wait_clients_s`."""


def address_range(host: str) -> str:
    """The range a host's update-less JOINs are charged to: its IPv4 /24 (all of 127/8 as one:
    any local process can bind any of it), its IPv6 /64."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    if address.is_loopback:
        return "127.0.0.0/8"
    return str(ipaddress.IPv4Network((address, 24), strict=False))


class JoinBudget:
    """Charges for JOINs whose session has handed in no update (yet), per address range and
    per claimed index; a JOIN is refused while either is spent. Cleared when a round counts.
    Not thread-safe: the caller holds a lock."""

    def __init__(self, *, budget: int, num_clients: int) -> None:
        self.budget = budget
        self.num_clients = num_clients
        self._charges: dict[str, int] = {}

    def keys(self, host: str, index: int | None) -> tuple[str, str]:
        listed = index is not None and 0 <= index < self.num_clients
        return address_range(host), f"index {index}" if listed else "index unlisted"

    def spent(self, host: str, index: int | None) -> str | None:
        """Which of `host`'s range and `index` has no budget left, or None."""
        for key in self.keys(host, index):
            if self._charges.get(key, 0) >= self.budget:
                return key
        return None

    def charge(self, host: str, index: int | None) -> None:
        for key in self.keys(host, index):
            self._charges[key] = self._charges.get(key, 0) + 1

    def refund(self, host: str, index: int | None) -> None:
        for key in self.keys(host, index):
            if self._charges.get(key, 0) > 0:
                self._charges[key] -= 1

    def refill(self) -> None:
        self._charges.clear()


class JoinLimiter:
    """A token bucket per address: `burst` JOINs at once, then `rate` a second. A refused
    JOIN is promised a later token (`retry_after`): the refused come back one per token, not
    all at once, and none retries blind. The promise is advice, not a reservation: a JOIN from
    the same address that comes first still takes the token (as a blind retry's would), so a
    flooder sharing the address can outrun it, never one from another range. Not thread-safe:
    the caller holds a lock."""

    def __init__(
        self, *, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float, float]] = OrderedDict()
        """address -> (tokens, when counted, when the next unpromised token comes), least
        recently used first."""

    def allow(self, address: str, *, now: float | None = None) -> bool:
        """Take a token from `address`'s bucket; whether there was one."""
        now = self.clock() if now is None else now
        tokens, then, free_at = self._buckets.pop(address, (float(self.burst), now, now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[address] = (tokens - allowed, now, free_at)
        while len(self._buckets) > MAX_TRACKED_ADDRESSES:
            self._buckets.popitem(last=False)
        return allowed

    def retry_after(self, address: str, *, now: float | None = None) -> float:
        """Seconds until a token a JOIN refused just now may come back for: the first not
        promised to one refused before it (a token a second apart, in their order)."""
        now = self.clock() if now is None else now
        tokens, then, free_at = self._buckets.pop(address, (float(self.burst), now, now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        due = max(now + max(0.0, 1.0 - tokens) / self.rate, free_at)
        due = min(due, now + MAX_PROMISED_REFILLS / self.rate)  # a flood parks nobody long
        self._buckets[address] = (tokens, now, due + 1.0 / self.rate)
        return due - now


@dataclass(frozen=True, eq=False)
class Task:
    """Work sent to one client: train from the global adapter of `round` (async: version)."""

    number: int
    """Drawn at random; the RESULT that answers this task echoes it."""
    round: int
    evaluate: bool = False
    """An EVALUATE (answered by an EVAL_RESULT), not training (a RESULT)."""


@dataclass(frozen=True)
class Reply:
    """A client's answer to `task`: a checked result and its update, or why it is refused."""

    task: Task
    result: ClientResult | None
    update: dict[str, torch.Tensor]
    error: str = ""
    evaluation: Evaluation | None = None
    """The answer to an EVALUATE task, checked (`result` is then None)."""


@dataclass
class ClientHandle:
    """An admitted client: what it declared at JOIN, its connection, and the one task it has
    outstanding (its answers come through `results`)."""

    client_id: int
    name: str
    num_examples: int
    """As declared at JOIN, capped by fed.max_examples_per_client: the most weight it gets."""
    conn: Connection
    joined_round: int
    index: int | None = None
    """The client index its JOIN claimed (anyone's to claim: it only picks a budget)."""
    eval_tokens: int = 0
    """Its held-out shard's size in tokens, as declared at JOIN: the most an EVAL_RESULT may
    count (0: it is never asked to evaluate)."""
    alive: bool = True
    task: Task | None = None
    """The one task it has outstanding (no RESULT is taken from it otherwise)."""
    holds_frozen: bool = False
    """It was sent the whole adapter once on this connection: from then on it gets only the
    tensors the strategy trains (FFA-LoRA: B; its A never changes)."""
    updates: int = 0
    """Answers (updates, masked inputs) a round took from this session."""
    dropped: int = 0
    """RESULTs that answered no outstanding task (unsolicited, duplicate, late): dropped."""
    results: queue.Queue[Reply | None] = field(
        default_factory=lambda: queue.Queue(maxsize=REPLY_SLOTS)
    )


class Admission:
    """Who may join and how often, and the clients connected now."""

    def __init__(self, fed: FedConfig) -> None:
        self.fed = fed
        self.clients: dict[int, ClientHandle] = {}
        """The clients connected now (a client that leaves is dropped): read it under lock."""
        self.lock = threading.Lock()
        self._joined = threading.Condition(self.lock)
        self.news: queue.SimpleQueue[int] = queue.SimpleQueue()
        """A client's id each time its queue gets something (an answer, or it left), JOINED
        when a client joins: what a round waits on, looking only at the queues it names
        (`rounds.gather`), never polling every client's."""
        self._client_ids = itertools.count()  # never reused: a departed client's id stays its
        self._joins = JoinLimiter(
            rate=fed.join_rate_per_address,
            burst=max(fed.join_burst_per_address, fed.num_clients),
        )
        self.joins_refused = 0
        self.budget = JoinBudget(
            budget=max(fed.idle_join_budget, fed.num_clients), num_clients=fed.num_clients
        )
        """Update-less sessions per address range and claimed index (see the module)."""
        self.budget_refused = 0
        self._departed_traffic = (0, 0)  # bytes (sent, received) of the clients that left
        self._departed_dropped = 0  # RESULTs dropped from the clients that left

    def admit(self, conn: Connection, *, at_round: Callable[[], int]) -> ClientHandle | None:
        """Read `conn`'s JOIN and admit the client: its handle, in the table and WELCOMEd; or
        None, having sent one ERROR frame (too many JOINs from its address, or a malformed
        JOIN). `at_round` says the round a client admitted now joins at (read as it is
        admitted: rounds go on while its JOIN is awaited)."""
        join = conn.recv(expect=FedMsg.JOIN, timeout_s=self.fed.heartbeat_timeout_s)
        address = address_key(conn.peer_host)
        with self.lock:
            allowed = self._joins.allow(address)
            self.joins_refused += not allowed
            refused = self.joins_refused
            wait_s = 0.0 if allowed else self._joins.retry_after(address)
        if not allowed:
            conn.send_error(
                "rate_limited",
                f"too many JOINs from {address}: at most {self._joins.burst} at once, then "
                f"{self.fed.join_rate_per_address:g} a second (fed.join_rate_per_address); "
                f"yours in {wait_s:.1f}s",
                request_id=join.request_id,
                retry_after_s=wait_s,
            )
            if refused & (refused - 1) == 0:  # the 1st, 2nd, 4th...: a flood stays a trickle
                log.warning(
                    "refused a JOIN from %s: too many (%d refused so far)", address, refused
                )
            return None
        try:
            hello = parse_join(join.payload)
        except ValueError as exc:
            conn.send_error("bad_request", str(exc), request_id=join.request_id)
            return None
        num_examples = min(hello.num_examples, self.fed.max_examples_per_client)
        with self.lock:
            spent = self.budget.spent(conn.peer_host, hello.client_index)
            self.budget_refused += spent is not None
            refused = self.budget_refused
            if spent is None:  # given back with its first update
                self.budget.charge(conn.peer_host, hello.client_index)
        if spent is not None:
            conn.send_error(
                "rate_limited",
                f"{spent} has {self.budget.budget} sessions that sent no update since the last "
                "round (fed.idle_join_budget); try again after the next round",
                request_id=join.request_id,
            )
            if refused & (refused - 1) == 0:
                log.warning("refused a JOIN: %s spent its budget (%d so far)", spent, refused)
            return None
        with self.lock:
            client = ClientHandle(
                client_id=next(self._client_ids),
                name=hello.name,
                num_examples=num_examples,
                conn=conn,
                joined_round=at_round(),
                index=hello.client_index,
                eval_tokens=hello.eval_tokens,
            )
            self.clients[client.client_id] = client
            self._joined.notify_all()
        self.news.put(JOINED)
        conn.send_msg(FedMsg.WELCOME, {"client_id": client.client_id}, request_id=join.request_id)
        log.info(
            "%s joined at round %d (id %d, %d examples)",
            client.name,
            at_round(),
            client.client_id,
            hello.num_examples,
        )
        return client

    def leave(self, client: ClientHandle) -> None:
        """`client`'s session is over: it is dead, and whoever waits for its answer is woken."""
        with self.lock:
            client.alive = False
            client.task = None
            client.results.put_nowait(None)  # wakes a round waiting for this client
            self.news.put(client.client_id)
            # Gone from the table: nothing keeps its connection but a round that sampled
            # it, until that round ends. What it counted for stays in the totals.
            del self.clients[client.client_id]
            sent, received = self._departed_traffic
            self._departed_traffic = (
                sent + client.conn.bytes_sent,
                received + client.conn.bytes_received,
            )
            self._departed_dropped += client.dropped

    def took_update(self, client: ClientHandle) -> None:
        """A round took an answer from `client`'s session: its JOIN's charge comes back with
        the first. The caller holds the lock."""
        client.updates += 1
        if client.updates == 1:
            self.budget.refund(client.conn.peer_host, client.index)

    def round_counted(self) -> None:
        """A round had updates: every range and index gets its budget back."""
        with self.lock:
            self.budget.refill()

    def alive(self) -> list[ClientHandle]:
        with self.lock:
            return [c for c in self.clients.values() if c.alive]

    def wait_for(self, count: int, *, hoped: int = 0, grace_s: float = 0.0) -> list[ClientHandle]:
        """Block until `count` clients are alive (NotEnoughClientsError after wait_clients_s).

        With `hoped` > count, first wait up to `grace_s` for that many (the expected roster).
        """
        grace_end = time.monotonic() + grace_s

        def connected() -> str:  # read under the lock, as the loops below hold it
            return f"{sum(c.alive for c in self.clients.values())} connected"

        waiting = Wait(
            f"{max(count, hoped)} clients",
            key=f"fed.min_fit_clients={count}, fed.wait_clients_s={self.fed.wait_clients_s:g}",
            progress=connected,
        )
        with self.lock:
            while (
                sum(c.alive for c in self.clients.values()) < hoped and time.monotonic() < grace_end
            ):
                waiting.tick()
                self._joined.wait(timeout=max(0.0, min(grace_end - time.monotonic(), 1.0)))
        deadline = time.monotonic() + self.fed.wait_clients_s
        with self.lock:
            while sum(c.alive for c in self.clients.values()) < count:
                waiting.tick()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    alive = sum(c.alive for c in self.clients.values())
                    raise NotEnoughClientsError(
                        f"only {alive} of the {count} clients needed (fed.min_fit_clients) are "
                        f"connected after {self.fed.wait_clients_s:.0f}s"
                    )
                self._joined.wait(timeout=min(remaining, 1.0))
        return self.alive()

    def traffic(self, clients: list[ClientHandle] | None = None) -> tuple[int, int]:
        """(bytes sent to, bytes received from) `clients` (default: every client, those that
        left included) so far."""
        departed = (0, 0)
        if clients is None:
            with self.lock:
                clients = list(self.clients.values())
                departed = self._departed_traffic
        return (
            departed[0] + sum(c.conn.bytes_sent for c in clients),
            departed[1] + sum(c.conn.bytes_received for c in clients),
        )

    def dropped_results(self) -> int:
        """RESULTs dropped so far, over every client: they answered no outstanding task."""
        with self.lock:
            return self._departed_dropped + sum(c.dropped for c in self.clients.values())
