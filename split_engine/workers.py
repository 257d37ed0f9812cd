"""The RPC world of a split run: start, serve, stop (the handshake: split_engine.handshake).

Ranks: the driver is rank 0 (`driver`), stage k is rank k (`stage1` ... `stageN`); the driver's
host runs the rendezvous store on `cluster.master`. torch.distributed.rpc (TensorPipe) has no
authentication of its own; every process installs `rpc_guard` (allow-list unpickling, signed
calls) when it joins. With a shared secret (`cluster.secret` / LAB_SECRET), the driver and each
stage prove it to each other (HMAC-SHA256 challenge-response, both ways) before any model is
built; the driver's proof carries the run's fresh world nonce, from which both derive the key
that signs every later call (see `rpc_guard`). A stage serves nothing but the handshake until
the driver has proved itself, and the driver aborts the run if a stage cannot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
import torch.distributed.rpc as rpc

from lab.config import Endpoint
from lab.launch import PeerLostError
from lab.waiting import Wait
from netproto import Connection, Limits
from netproto.errors import AuthenticationError, ConnectionClosed, NetTimeout
from split_engine import handshake, rpc_guard
from split_engine.config import SplitConfig
from world.network import listening_towards
from world.store import MAX_FRAME_BYTES, SPLIT_KEYS, NetprotoStoreClient, StoreServer

log = logging.getLogger(__name__)


class StageLostError(PeerLostError):
    """A stage did not answer (it died, hung, or the network between went away)."""


# ---------------------------------------------------------------------------- the world


@dataclass(frozen=True)
class World:
    """The RPC world this process is part of: its rank, where the world meets, how it talks."""

    rank: int
    master: Endpoint
    split: SplitConfig

    @property
    def name(self) -> str:
        return DRIVER if self.rank == 0 else stage_name(self.rank)

    @property
    def num_stages(self) -> int:
        return self.split.num_stages


DRIVER = "driver"
"""Rank 0's worker name; stage k is rank k (`stage_name`)."""


def stage_name(rank: int) -> str:
    return f"stage{rank}"


RENDEZVOUS_SCHEME = "labtcp"

_BARRIER_KEY = re.compile(r"^(.*/shutdown/(?:ACTIVE_CALLS|PROCESS_COUNT|READY)_ID_)(\d+)$")
"""The keys of TensorPipe's shutdown barrier (`agent.join`), ending in the barrier's number."""


class _WorldStore(dist.Store):
    """One world's rendezvous store (a TCPStore) as torch's RPC layer sees it, except that the
    rounds of TensorPipe's shutdown barrier are numbered from 1 in every world.

    That barrier (`agent.join(shutdown=True)`, what lets every agent know the world is ending
    before any pipe closes) names its store keys by a counter that C++ keeps per *process*
    and that cannot be reset: fresh stage processes count from 1, a driver in its second world
    (a sweep, a test session) from 4, and each would wait for keys nobody writes. Each world
    has a store of its own, so the first barrier key a process uses in it sets its offset.

    c10d's Python store trampoline calls these methods by their C++ names where they differ.
    """

    def __init__(self, store: dist.Store) -> None:
        super().__init__()
        self.store = store
        self._offset: int | None = None
        self._lock = threading.Lock()

    def _key(self, key: str) -> str:
        match = _BARRIER_KEY.match(key)
        if match is None:
            return key
        number = int(match.group(2))
        with self._lock:
            if self._offset is None:
                self._offset = number - 1
            return f"{match.group(1)}{number - self._offset}"

    def set(self, key: str, value: Any) -> None:
        self.store.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self.store.get(self._key(key))

    def add(self, key: str, value: int) -> int:
        return self.store.add(self._key(key), value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.store.compare_set(self._key(key), expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.store.check([self._key(key) for key in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.store.wait([self._key(key) for key in keys])
        else:
            self.store.wait([self._key(key) for key in keys], timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        """The store's timeout (init_rpc sets split.rpc_timeout_s): the TCPStore's own, which
        every wait without one of its own (TensorPipe's barrier rounds) is bounded by."""
        super().set_timeout(timeout)
        self.store.set_timeout(timeout)

    def deleteKey(self, key: str) -> bool:  # the C++ name, which the trampoline calls
        return self.store.delete_key(self._key(key))

    def getNumKeys(self) -> int:  # the C++ name, which the trampoline calls
        return self.store.num_keys()


LEAVE_KEY = "split/leave"
"""The driver's word, in the world's store, on how the world ends (`ORDERLY`, `ORDERLY_KEPT`,
`ABRUPT`)."""
ORDERLY, ORDERLY_KEPT, ABRUPT = "orderly", "orderly, the driver's RRefs kept", "abrupt"
LEFT_KEY = "split/left/{rank}"
"""Set by each stage once past the shutdown barrier: the store's host waits for these before
it lets the store go (a stage's last barrier step reads the store)."""
LEFT_TIMEOUT_S = 10.0


_rref_context_spent = False
"""torch's RRef bookkeeping is one per process, bound to the first RPC agent and marked
destroyed at the first shutdown, for good: in a later world of this process (a test session)
the RRefs it holds can no longer be deleted on their owners."""


@dataclass
class _WorldEnd:
    """How this process's current world ends (see `joined`)."""

    store: _WorldStore | None = None
    """The world's store; held here for the world's life (torch's C++ side calls back into it
    and does not keep the Python object alive)."""
    word: str = ABRUPT
    """Driver: how the world ends, as `release_all` told the stages (`LEAVE_KEY`)."""
    server: Any = None
    """Driver: the world's store server (`store.StoreServer`), stopped when the world ends."""
    client: Any = None
    """This rank's connection to the store, closed when the world ends."""


_end = _WorldEnd()


_abandoned: list[str] = [""]
"""Why the join watchdog gave up on this process's world ("" while it has not)."""
ABANDON_GRACE_S = 30.0
"""How long the watchdog, having given up, waits for init_rpc to raise before ending the process."""


def _store_on_master_host(
    url: str, timeout: timedelta = timedelta(seconds=300), **_: Any
) -> Iterator[tuple[Any, int, int]]:
    """The rendezvous of a split run: rank 0 serves the lab's store (`store.StoreServer`,
    netproto with the shared secret, keys and values capped) on the master host only, and every
    rank, rank 0 too, reaches it through a `NetprotoStoreClient` wrapped in a `_WorldStore`.

    torch's own tcp:// rendezvous serves a TCPStore: C++, unauthenticated, uncapped, and bound
    to every interface whatever host the URL names."""
    parts = urlparse(url)
    query = parse_qs(parts.query)
    rank, world_size = int(query["rank"][0]), int(query["world_size"][0])
    host, port = parts.hostname or "127.0.0.1", int(parts.port or 0)
    secret = handshake.world_secret()
    if rank == 0:
        try:
            _end.server = StoreServer(
                host=host,
                port=port,
                secret=secret,
                timeout_s=timeout.total_seconds(),
                keys=SPLIT_KEYS,
            ).start()
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    deadline = time.monotonic() + timeout.total_seconds()
    while True:  # the driver's store may not be up yet
        try:
            conn = Connection.connect(
                host, port, secret=secret, connect_timeout_s=10.0, read_timeout_s=60.0,
                limits=Limits(max_frame_bytes=MAX_FRAME_BYTES, max_json_bytes=4096),
            )  # fmt: skip
            break
        except AuthenticationError as exc:
            raise StageLostError(
                f"the run's rendezvous store at {host}:{port} refused this process: {exc}"
            ) from None
        except (ConnectionClosed, NetTimeout):
            if time.monotonic() > deadline or _abandoned[0]:
                raise
            time.sleep(0.2)
    _end.client = NetprotoStoreClient(conn, timeout=timeout)
    _end.client.abandoned = _abandoned[0]
    _end.store = _WorldStore(_end.client)
    yield _end.store, rank, world_size
    raise RuntimeError("a split run's rendezvous cannot be repeated")


def _register_rendezvous() -> None:
    with contextlib.suppress(RuntimeError):  # already registered in this process
        dist.register_rendezvous_handler(RENDEZVOUS_SCHEME, _store_on_master_host)


CHANNEL_LISTS: dict[str, list[str] | None] = {
    "basic": ["basic"],
    "auto": None,
    "network": ["mpt_uv", "basic"],
}
"""`split.channels` -> TensorPipe's `_channels` (None: every channel it has)."""


def _options(world: World) -> rpc.TensorPipeRpcBackendOptions:
    host = f"[{world.master.host}]" if ":" in world.master.host else world.master.host
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=world.split.rpc_threads,
        rpc_timeout=world.split.rpc_timeout_s,
        init_method=f"{RENDEZVOUS_SCHEME}://{host}:{world.master.port}",
        # TensorPipe's `uv` (TCP) transport, which is what crosses real hosts. Its default
        # on one host is shared memory, whose pollers cost more CPU than they save on a small
        # box (per-token latency of a 2-stage split over loopback halved with `uv`, 2 cores),
        # and which listens on an abstract unix socket that any process of the host reaches.
        _transports=None if world.split.transport == "auto" else ["uv"],
        # The channels that carry tensors. `basic` (the default): inline on the transport's
        # connection, TensorPipe's one listener and nothing more. Left to itself (`auto`)
        # TensorPipe also offers `cma` (process_vm_readv), which it picks whenever two
        # processes share a boot id, and `mpt_uv` (multiplexed TCP), which listens on 16 lane
        # ports a process: junk sent to one aborted a stage (`Unexpected Encoding Type`).
        _channels=CHANNEL_LISTS[world.split.channels],
    )


def _forget_previous_world() -> None:
    """Reset torch's per-process RPC counters before joining another world.

    torch numbers the rendezvous keys and its RPC all-gathers (the one at start-up) per process
    and per set of worker names; fresh stage processes count from 0. A driver process that joins
    a second world (a sweep, a test session) must count from 0 as well, or it waits at start for
    keys nobody writes. Each world has a store of its own, so the old numbers mean nothing any
    more. (TensorPipe's shutdown barrier counts in C++, where it cannot be reset: `_WorldStore`.)
    """
    from torch.distributed.rpc import api as rpc_api

    rpc._init_counter = 0
    with rpc_api._all_gather_dict_lock:
        rpc_api._all_gather_sequence_id.clear()
        rpc_api._all_gather_sequence_id_to_states.clear()


@contextmanager
def joined(
    world: World,
    *,
    secret: bytes | None,
    check: Callable[[], None] = lambda: None,
) -> Iterator[None]:
    """Be part of the RPC world for the length of the block; always leave it.

    Joining waits for every rank. torch's rendezvous would wait 30 minutes for a missing one
    and cannot be interrupted, so a watchdog ends this process with a clear message after
    `split.join_timeout_s` instead, or as soon as `check()` raises (a local stage process that
    died while the driver waited for it). Leaving is in order when the driver found every stage
    there to release it, immediate otherwise (see `_leave`).
    """
    _close_store()
    _end.word = ABRUPT
    _released.clear()
    _release_reason[0] = ""
    rpc_guard.install()
    rpc_guard.reset(world.name, secret)
    handshake.begin_world(secret, world.name, driver=world.rank == 0)
    log.info(
        "%s joining the RPC world on %s:%d (%d stages)",
        world.name,
        world.master.host,
        world.master.port,
        world.num_stages,
    )

    if world.split.channels != "basic":
        log.warning(
            "split.channels=%s: TensorPipe's mpt_uv channel opens 16 more listeners in each "
            "process, which whoever reaches the run's address reaches too (the default, basic, "
            "opens none)",
            world.split.channels,
        )
    if world.split.transport == "auto":
        log.warning(
            "split.transport=auto: TensorPipe's shared-memory transport listens on an abstract "
            "unix socket, which every process in this network namespace reaches, whatever the "
            "fence (the default, tcp, does not)"
        )
    assembled = threading.Event()

    waiting = Wait(
        "the driver and the other stages" if world.rank else f"{world.num_stages} stage(s)",
        where=f"{world.master.host}:{world.master.port}",
        key=f"split.join_timeout_s={world.split.join_timeout_s:g}",
        limit_s=world.split.join_timeout_s,
    )

    def watch() -> None:  # pragma: no cover - ends the process
        join_timeout_s = world.split.join_timeout_s
        deadline = time.monotonic() + join_timeout_s
        while not assembled.wait(1.0):
            waiting.tick()  # said within seconds, then every 30 s: not a silent hang
            try:
                check()
            except Exception as exc:
                reason = str(exc)
                break
            if time.monotonic() > deadline:
                reason = (
                    f"the RPC world (driver + {world.num_stages} stages at {world.master.host}:"
                    f"{world.master.port}) did not assemble within {join_timeout_s:.0f}s; check "
                    f"that every stage runs with the same cluster.master and split.num_stages"
                )
                refused = _end.server.server.handshakes_failed if _end.server else 0
                if refused:  # a stage with another secret, most likely (or a stranger)
                    reason = (
                        f"the RPC world (driver + {world.num_stages} stages) did not assemble "
                        f"within {join_timeout_s:.0f}s: {refused} connection(s) to its "
                        "rendezvous store failed the shared-secret handshake; cluster.secret / "
                        "LAB_SECRET must be the same on the driver and every stage"
                    )
                break
        else:
            return
        # The store is ours: its waits end now, and init_rpc raises in this process's own
        # thread. Only if torch is stuck elsewhere (a Gloo connect) does this process end.
        _abandoned[0] = reason
        if _end.client is not None:
            _end.client.abandoned = reason
        if assembled.wait(ABANDON_GRACE_S):
            return
        log.error("%s: %s", world.name, reason)
        logging.shutdown()
        os._exit(3)

    _abandoned[0] = ""
    threading.Thread(target=watch, daemon=True, name="rpc-join-watchdog").start()
    _forget_previous_world()
    _register_rendezvous()
    try:
        with listening_towards(world.master), warnings.catch_warnings():
            # torch's own start-up (`_tensorpipe_init_backend_handler`) hands the Gloo backend
            # it builds to `all_gather_object`, which then warns that a Backend is used as a
            # ProcessGroup: torch's internal call, nothing this code passes or could change.
            warnings.filterwarnings(
                "ignore",
                message=r"You are using a Backend .*ProcessGroupGloo.* as a ProcessGroup",
                category=UserWarning,
                module=r"torch\.distributed\.distributed_c10d",
            )
            rpc.init_rpc(
                world.name,
                rank=world.rank,
                world_size=world.num_stages + 1,
                rpc_backend_options=_options(world),
            )
    except BaseException:
        _close_store()
        if _abandoned[0]:
            raise StageLostError(_abandoned[0]) from None
        raise
    finally:
        assembled.set()
    try:
        yield
    finally:
        _leave(world)


def _leave(world: World) -> None:
    """Leave the world: in order when the driver says every stage is there to, at once if not.

    In order: every process drops its RRefs and waits for the deletions of those it owns to
    arrive (torch's `_delete_all_user_and_unforked_owner_rrefs`: no RRef is left to report as
    leaked), then all enter TensorPipe's shutdown barrier (`agent.join(shutdown=True)`, made to
    work in any world of a process by `_WorldStore`): it waits for every call in flight to be
    answered, and every agent marks itself as shutting down before anyone closes a pipe, so
    the pipes closing are not reported as errors. Each wait is bounded by split.rpc_timeout_s.
    Not torch's whole graceful shutdown: its RPC all-gather first would wait for a peer that
    died; here the driver's word (`release_all`) says whether everyone is there.
    Where this driver process has been in a world before (`_rref_context_spent`), its RRefs
    cannot be deleted any more, and nobody waits for them (`ORDERLY_KEPT`): the stages then
    report them as leaked.
    At once (a stage died, or did not accept this driver): close now; TensorPipe then reports
    the pipes its peers close, which that run's own error explains.
    """
    global _rref_context_spent
    timeout_s = world.split.rpc_timeout_s
    store = _end.store
    word = _end.word if world.rank == 0 else _driver_word(timeout_s)
    orderly = word in (ORDERLY, ORDERLY_KEPT)
    if orderly:
        try:
            _leave_in_order(timeout_s, drop_rrefs=word == ORDERLY)
        except RuntimeError as exc:
            orderly = False
            log.warning(
                "%s could not leave the RPC world in order: %s",
                world.name,
                str(exc).splitlines()[0][:300],
            )
    if orderly and store is not None and world.rank != 0:
        with contextlib.suppress(RuntimeError):
            store.store.set(LEFT_KEY.format(rank=world.rank), "")
    try:
        rpc.shutdown(graceful=False)
    finally:
        _rref_context_spent = True
    if orderly and store is not None and world.rank == 0:
        left = [LEFT_KEY.format(rank=rank) for rank in range(1, world.num_stages + 1)]
        with contextlib.suppress(RuntimeError):
            store.store.wait(left, timedelta(seconds=LEFT_TIMEOUT_S))
    _close_store()


def _close_store() -> None:
    """This rank's store connection closed, and on the driver the store's server stopped."""
    client, server = _end.client, _end.server
    _end.store = _end.client = _end.server = None
    if client is not None:
        client.close()
    if server is not None:
        server.stop()


def _leave_in_order(timeout_s: float, *, drop_rrefs: bool) -> None:
    from torch.distributed.rpc import api as rpc_api

    if drop_rrefs and not _rref_context_spent:
        rpc_api._delete_all_user_and_unforked_owner_rrefs(timedelta(seconds=timeout_s))
    if _end.store is not None:
        _end.store.set_timeout(timedelta(seconds=timeout_s))  # each barrier round's wait
    rpc_api._get_current_rpc_agent().join(shutdown=True)


def _driver_word(timeout_s: float) -> str:
    """Stage side: how the driver, having released us, says the world ends (it says so once
    every stage has acknowledged its release, or failed to)."""
    store = _end.store
    if not _released.is_set() or store is None:
        return ABRUPT  # the driver vanished, or never released us: nobody to leave in order with
    try:
        store.store.wait([LEAVE_KEY], timedelta(seconds=timeout_s))
        return store.store.get(LEAVE_KEY).decode()
    except (RuntimeError, UnicodeDecodeError):  # the driver, who hosts the store, is gone
        return ABRUPT


# ---------------------------------------------------------------------------- stage serving

_released = threading.Event()
_release_reason: list[str] = [""]


def release_stage(reason: str = "") -> None:
    """Driver -> stage: the run is over, leave the world (`reason`: why it failed, if it did)."""
    _release_reason[0] = reason[:500] if isinstance(reason, str) else ""
    _released.set()


def driver_alive() -> bool:
    return True


def stage_alive() -> bool:
    return True


def serve_until_released(*, ping_s: float, timeout_s: float) -> None:
    """Stage main loop: serve RPCs until the driver releases us; raise if the driver vanishes.
    (`joined` clears the release of a previous world: one that arrives before this loop
    starts counts.)"""
    while not _released.wait(ping_s):
        try:
            rpc.rpc_sync(DRIVER, driver_alive, timeout=timeout_s)
        except RuntimeError as exc:
            if handshake.driver_unproven():
                raise StageLostError(
                    "the driver left before proving the shared secret to this stage: its secret "
                    "differs from this stage's, or it stopped at another stage whose secret "
                    "differs (the driver's error names it); cluster.secret / LAB_SECRET must be "
                    "the same on the driver and every stage"
                ) from None
            raise StageLostError(f"the driver stopped answering ({exc}); leaving the run") from None
    if _release_reason[0]:
        said = f"the driver stopped the run: {_release_reason[0]}"
        # said now, not only as this stage's error at its end: the driver passes the world's
        # shutdown once this stage is there too, and its launcher then stops the stage's
        # process, which on a loaded host can come before the error is printed
        print(f"{said}; leaving the world", flush=True)
        raise StageLostError(said)


def release_all(num_stages: int, *, reason: str = "", gone: str | None = None) -> bool:
    """Driver side: tell every stage to leave, and why when the run failed (best effort: some
    may be gone, and one that has not accepted this driver refuses it). Then tell them all, in
    the world's store, whether the world ends in order: only if every stage acknowledged (its
    answer has arrived, so no stage leaves before its answer is sent). Returns that.
    `gone`: a stage known to be dead, not waited for (its host may not even say no)."""
    futures = []
    for rank in range(1, num_stages + 1):
        if stage_name(rank) == gone:
            continue
        with contextlib.suppress(RuntimeError):
            futures.append(
                rpc.rpc_async(stage_name(rank), release_stage, args=(reason,), timeout=5.0)
            )
    acknowledged = 0
    for future in futures:
        with contextlib.suppress(RuntimeError):
            future.wait()
            acknowledged += 1
    # Stages wait for this driver's RRefs to be deleted only where it can still delete them
    # (see `_rref_context_spent`); where not, they leave in order all the same.
    word = ABRUPT
    if acknowledged == num_stages and gone is None:
        word = ORDERLY_KEPT if _rref_context_spent else ORDERLY
    try:
        if _end.store is not None:
            _end.store.store.set(LEAVE_KEY, word)
    except RuntimeError:  # the store failed: the stages waiting for the word hear it fail
        word = ABRUPT
    _end.word = word if _end.store is not None else ABRUPT
    return _end.word != ABRUPT
