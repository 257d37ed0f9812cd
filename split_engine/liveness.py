"""Whether the peers a split process waits on are still there: a heartbeat over the run's own
RPC world, and (where this process started them) their processes.

A wait for a peer's message (a stage waiting for an activation or a gradient, the driver
waiting for a step's answers) may be long by design: `split.rpc_timeout_s` times the
micro-batches of a pipeline fill. A peer that died must not be found out only then, nor by
the wrong process: each such wait wakes every `WATCH_S` and checks its peers, and the error
names the one that is gone. A process that died is found at once (its connections closed:
the heartbeat's call fails); one that hangs, or a host that vanished without closing them,
within `ping_timeout_s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed.rpc as rpc

from lab.launch import PeerLostError
from split_engine.workers import DRIVER, driver_alive, stage_alive

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""How often a waiting process asks each peer it waits on whether it is there."""
PING_TIMEOUT_S = 4.0
"""Longest a heartbeat may go unanswered by default (split.heartbeat_timeout_s; at most
split.rpc_timeout_s): the peer is lost. A
peer answers from a thread of its own, so a busy peer answers too; one whose host went away
without closing its connections (power off, its overlay gone with it) is known only by this."""
WATCH_S = 0.5
"""How often a wait wakes to look at its peers (heartbeats go out every HEARTBEAT_S only)."""
SETTLE_S = 1.0
"""After a failed call, how long a local peer's process has to be seen exiting."""


def heartbeat_timeout_s(split: Any) -> float:
    """How long a heartbeat may go unanswered in this run: split.heartbeat_timeout_s, at most
    split.rpc_timeout_s."""
    return float(min(split.heartbeat_timeout_s, split.rpc_timeout_s))


class PeerGoneError(PeerLostError, RuntimeError):
    """A peer of this split process died or stopped answering: the message names it."""

    def __init__(self, peer: str, why: str) -> None:
        self.peer = peer
        super().__init__(f"{peer} is gone: {why}")


class PeerWatch:
    """Heartbeats to `peers` (worker names of this RPC world), sent without blocking: `check()`
    raises PeerGoneError for a peer whose last heartbeat failed or went unanswered for
    `ping_timeout_s`, and sends the next heartbeat to each that answered, every HEARTBEAT_S.
    `local`: a check of the peers' processes where this process started them (the launcher's
    `ServiceGroup`), run first: it names the peer and how its process ended."""

    def __init__(
        self,
        peers: Iterable[str],
        *,
        ping_timeout_s: float,
        local: Callable[[], None] | None = None,
    ) -> None:
        self.peers = list(peers)
        self.ping_timeout_s = ping_timeout_s
        self.local = local
        self._pings: dict[str, tuple[float, torch.futures.Future]] = {}

    def check(self) -> None:
        """Raise for a peer that is gone; else send the heartbeats that are due. Cheap: it
        never waits for an answer."""
        if self.local is not None:
            self.local()
        now = time.monotonic()
        for peer in self.peers:
            sent = self._pings.get(peer)
            if sent is not None:
                at, future = sent
                if not future.done():
                    if now - at > self.ping_timeout_s:
                        raise PeerGoneError(peer, self._silent())
                    continue
                try:
                    future.wait()
                except RuntimeError as exc:
                    raise PeerGoneError(peer, self._why(exc)) from None
                if now - at < HEARTBEAT_S:
                    continue
            self._ping(peer, now)

    def settle(self) -> None:
        """A call into a peer just failed: find out now whether a peer is gone, rather than at
        the next heartbeat. Where the peers are this process's children, the one that died
        has SETTLE_S to be seen exiting (the error then says how it ended); elsewhere every
        peer gets a heartbeat at once, and one that fails, or goes unanswered for
        `ping_timeout_s`, is named. Returns where every peer answers (the call was refused)."""
        if self.local is not None:
            deadline = time.monotonic() + SETTLE_S
            while time.monotonic() < deadline:
                self.local()
                time.sleep(0.05)
            self.check()
            return
        for peer in self.peers:
            self._ping(peer, time.monotonic())
        deadline = time.monotonic() + self.ping_timeout_s + WATCH_S
        while time.monotonic() < deadline:
            futures = [future for _, future in self._pings.values()]
            if all(f.done() for f in futures) or any(f.done() and _failed(f) for f in futures):
                break
            time.sleep(0.05)
        self.check()

    def _ping(self, peer: str, now: float) -> None:
        try:
            alive = driver_alive if peer == DRIVER else stage_alive
            future = rpc.rpc_async(peer, alive, timeout=self.ping_timeout_s)
        except RuntimeError as exc:
            raise PeerGoneError(peer, self._why(exc)) from None
        self._pings[peer] = (now, future)

    def _silent(self) -> str:
        return (
            f"it did not answer a heartbeat within {self.ping_timeout_s:g} s (its host is down "
            "or cut off, or the process hangs)"
        )

    def _why(self, exc: BaseException) -> str:
        """A failed heartbeat in words: torch's timeout, or the connection torch saw fail."""
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        said = lines[0] if lines else type(exc).__name__
        if "timeout" in said.lower():
            return self._silent()
        said = said.split(" (this error originated at")[0]  # TensorPipe's source file
        return f"its connection to this process failed ({said[:200]}): the process is gone"


def wait_watching(futures: list[torch.futures.Future], watch: PeerWatch) -> None:
    """Wait until every future is done or one has failed in transport (a RuntimeError: a peer
    gone or a call timed out), checking `watch` (which raises for a lost peer) every WATCH_S
    meanwhile. Returns early on such a failure: the caller finds it. A peer's refusal (its
    own exception type, a ValueError say) does not end the wait: the other calls end soon,
    told by the refusing peer, and one left running would overlap its stage's next call."""
    import threading

    settled = threading.Event()
    pending = [len(futures)]
    lock = threading.Lock()

    def done(future: torch.futures.Future) -> None:
        with lock:
            pending[0] -= 1
            if pending[0] == 0 or _failed(future):
                settled.set()

    for future in futures:
        future.add_done_callback(done)
    if not futures:
        return
    while not settled.wait(WATCH_S):
        watch.check()


def _failed(future: torch.futures.Future) -> bool:
    """Whether `future` failed in transport (never raises: it runs as a done callback)."""
    try:
        future.wait()
    except RuntimeError:
        return True
    except Exception:  # a refusal: waited out with the others
        return False
    return False
