"""A world's rendezvous store, served by the lab over netproto (the shared secret, capped).

torch.distributed meets through a key-value store: TensorPipe's and Gloo's addresses, RPC's
start-up all-gather and shutdown barrier, the elastic agent's rendezvous state and heartbeats.
torch's TCPStore server is C++ with no hooks: it answers anyone who reaches its port, keeps
values of any size (4 MiB each, without limit, in a test) and lets a stranger rewrite
`rpc_prefix_0/addrs/*` before a split run (both stages died) or a data_parallel run's
rendezvous state (the run ended with `The state object is corrupt`). Here rank 0 serves the
store itself: a netproto server (the secret's handshake when one is set, frames capped), keys
only in the key space of its kind of world (`KeySpace`: `SPLIT_KEYS`, `elastic_keys`,
`group_keys`), values and key counts capped, and each rank reaches it through
`NetprotoStoreClient`, which `AuthenticatedStore` hands to torch as its `dist.Store` (with the
batch calls the elastic agent makes: one round trip for `multi_get` / `multi_set`).

    client -> server  STORE_REQUEST  BYTES  fields: op, key..., value...
    server -> client  STORE_REPLY    BYTES  fields: status, value...
A field list is a uint16 count, then per field a uint32 length and its bytes (`pack_fields`).
Blocking reads (`get`, `wait`) poll: each request waits at most `POLL_WAIT_S` on the server, so
one thread's wait never holds the connection another thread of the same rank needs.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch.distributed as dist

from netproto import REGISTRY, Connection, Limits, PayloadKind, Server
from netproto.errors import ConnectionClosed, NetprotoError, NetTimeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeySpace:
    """The keys one kind of world uses: any other key is refused."""

    prefixes: tuple[str, ...]
    """Every key starts with one of these."""
    write_once: tuple[str, ...] = ()
    """Keys under these are written once: the first value stands (any later write of one,
    `set`, `add`, `compare_set` or `delete`, a hijack, is refused)."""
    name: str = "world"
    """What the refusals call it."""


SPLIT_KEYS = KeySpace(
    prefixes=("rpc_prefix_0/", "split/"),
    write_once=("rpc_prefix_0/addrs/", "rpc_prefix_0/names/"),
    name="split run",
)
"""A split run's world: torch's RPC start-up, its shutdown barrier and the Gloo group beside it
(all under `rpc_prefix_0/`: split_engine.workers numbers every world from 0) and the lab's own
words (`split/...`). Each worker publishes its name and address once (`addrs/`, `names/`)."""


def elastic_keys(run_id: str, *, own: tuple[str, ...] = ()) -> KeySpace:
    """The world of torch's elastic agents (torchrun) of run `run_id`: the rendezvous state
    (`torch.rendezvous.<run_id>`, rewritten at every join, heartbeat and round), each round's
    keys (`torch.rendezvous.<run_id>.<round>/...`: the agents' rank assignment, exit barrier,
    MASTER_ADDR/PORT), torch's `/torch/elastic/` store keys, the workers' process groups (each
    round's under `group_keys`' prefix) and the experiment's `own` prefixes. Nothing is
    write-once: the agent rewrites its state many times."""
    return KeySpace(
        prefixes=(f"torch.rendezvous.{run_id}", "/torch/elastic/", GROUP_PREFIX, *own),
        name=f"rendezvous {run_id}",
    )


GROUP_PREFIX = "group/"
"""Where the process groups of a world keep their keys: `group/<round>/...` (`round_prefix`)."""


def round_prefix(round_name: str) -> str:
    """The prefix of one round's process group: a group started again (after a failure, or a
    host joining) never reads its predecessors' gloo addresses."""
    return f"{GROUP_PREFIX}{round_name}"


def group_keys() -> KeySpace:
    """A world of fixed ranks that only builds process groups (`world.group.process_group`)."""
    return KeySpace(prefixes=(GROUP_PREFIX,), name="process group")


MAX_KEY_BYTES = 256
MAX_VALUE_BYTES = 64 * 2**10
"""TensorPipe's and Gloo's address records are a few hundred bytes."""
MAX_KEYS = 4096
MAX_TOTAL_BYTES = 16 * 2**20
MAX_FIELDS = 64
MAX_FRAME_BYTES = MAX_FIELDS * (MAX_VALUE_BYTES + 8) + 64
POLL_WAIT_S = 0.2
_COUNT = struct.Struct("!H")
_LENGTH = struct.Struct("!I")


class StoreMsg(IntEnum):
    STORE_REQUEST = 0x0301
    STORE_REPLY = 0x0302


REGISTRY.register(
    "world_store",
    0x0300,
    0x030F,
    {StoreMsg.STORE_REQUEST: PayloadKind.BYTES, StoreMsg.STORE_REPLY: PayloadKind.BYTES},
)


class Op(IntEnum):
    SET = 1
    GET = 2  # key -> value, waits up to POLL_WAIT_S
    ADD = 3  # key, decimal amount -> new value
    COMPARE_SET = 4  # key, expected, desired -> value now
    CHECK = 5  # keys -> b"1" / b"0"
    WAIT = 6  # keys -> b"1" when all present, else b"0" after POLL_WAIT_S
    DELETE = 7  # key -> b"1" / b"0"
    NUM_KEYS = 8
    MULTI_GET = 9  # keys -> values, waits up to POLL_WAIT_S for all ("missing" if not)
    MULTI_SET = 10  # key, value, key, value, ... -> ok


OK, MISSING, REFUSED = b"ok", b"missing", b"refused"
_WRITES = (Op.SET, Op.ADD, Op.COMPARE_SET, Op.DELETE, Op.MULTI_SET)


class StoreRefused(ValueError):
    """A request the store does not take (a key outside the run's prefixes, a cap exceeded)."""


def pack_fields(fields: Sequence[bytes]) -> bytes:
    parts = [_COUNT.pack(len(fields))]
    for value in fields:
        parts += [_LENGTH.pack(len(value)), value]
    return b"".join(parts)


def unpack_fields(data: bytes) -> list[bytes]:
    """The fields of a request or reply; ValueError for anything malformed (count, lengths,
    trailing bytes), checked before any slice is taken."""
    if len(data) < _COUNT.size:
        raise ValueError("store message shorter than its field count")
    (count,) = _COUNT.unpack_from(data)
    if count > MAX_FIELDS:
        raise ValueError(f"store message of {count} fields (at most {MAX_FIELDS})")
    fields, offset = [], _COUNT.size
    for _ in range(count):
        if offset + _LENGTH.size > len(data):
            raise ValueError("store message cut inside a field length")
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if length > len(data) - offset:
            raise ValueError("store field longer than the message")
        fields.append(bytes(data[offset : offset + length]))
        offset += length
    if offset != len(data):
        raise ValueError("trailing bytes after the store message's fields")
    return fields


def _key(raw: bytes, space: KeySpace) -> str:
    if len(raw) > MAX_KEY_BYTES:
        raise StoreRefused(f"store key of {len(raw)} bytes (at most {MAX_KEY_BYTES})")
    try:
        key = raw.decode()
    except UnicodeDecodeError:
        raise StoreRefused("store key is not UTF-8") from None
    if not key.startswith(space.prefixes) or not key.isprintable():
        raise StoreRefused(f"store key {key[:64]!r} is outside the {space.name}'s key space")
    return key


class StoreState:
    """The store's contents and the operations on them (no I/O: the server's sessions call it)."""

    def __init__(self, keys: KeySpace = SPLIT_KEYS) -> None:
        self.keys = keys
        self._values: dict[str, bytes] = {}
        self._total = 0
        self._changed = threading.Condition()

    def _put(self, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:
            raise StoreRefused(f"store value of {len(value)} bytes (at most {MAX_VALUE_BYTES})")
        old = self._values.get(key)
        if old is None and len(self._values) >= MAX_KEYS:
            raise StoreRefused(f"the store holds its maximum of {MAX_KEYS} keys")
        total = self._total - len(old or b"") + len(value)
        if total > MAX_TOTAL_BYTES:
            raise StoreRefused(f"the store holds its maximum of {MAX_TOTAL_BYTES} bytes")
        self._values[key], self._total = value, total
        self._changed.notify_all()

    def _wait_for(self, keys: list[str], wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while not all(key in self._values for key in keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.wait(left)
        return True

    def apply(self, op: int, args: list[bytes], *, wait_s: float = POLL_WAIT_S) -> list[bytes]:
        """One request's answer (its status first). Raises StoreRefused or ValueError."""
        if not args and op != Op.NUM_KEYS:
            raise ValueError("store request without a key")
        with self._changed:
            if op == Op.NUM_KEYS:
                return [OK, str(len(self._values)).encode()]
            if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET):
                keys = [_key(raw, self.keys) for raw in args]
                if op == Op.MULTI_GET:
                    if not self._wait_for(keys, wait_s):
                        return [MISSING]
                    return [OK, *(self._values[key] for key in keys)]
                present = (
                    all(k in self._values for k in keys)
                    if op == Op.CHECK
                    else self._wait_for(keys, wait_s)
                )
                return [OK, b"1" if present else b"0"]
            if op == Op.MULTI_SET:
                if len(args) % 2:
                    raise ValueError("store MULTI_SET with a key without its value")
                pairs = [(_key(args[i], self.keys), args[i + 1]) for i in range(0, len(args), 2)]
                for key, _ in pairs:  # all refused or all written
                    self._check_rewrite(key)
                for key, value in pairs:
                    self._put(key, value)
                return [OK]
            key = _key(args[0], self.keys)
            if op in _WRITES:
                self._check_rewrite(key)
            if op == Op.SET and len(args) == 2:
                self._put(key, args[1])
                return [OK]
            if op == Op.GET and len(args) == 1:
                if not self._wait_for([key], wait_s):
                    return [MISSING]
                return [OK, self._values[key]]
            if op == Op.ADD and len(args) == 2:
                amount = _integer(args[1])
                now = _integer(self._values.get(key, b"0")) + amount
                self._put(key, str(now).encode())
                return [OK, str(now).encode()]
            if op == Op.COMPARE_SET and len(args) == 3:
                expected, desired = args[1], args[2]
                current = self._values.get(key)
                if (current is None and expected == b"") or current == expected:
                    self._put(key, desired)
                    return [OK, desired]
                return [OK, expected if current is None else current]
            if op == Op.DELETE and len(args) == 1:
                old = self._values.pop(key, None)
                self._total -= len(old or b"")
                return [OK, b"1" if old is not None else b"0"]
        raise ValueError(f"store request op {op} with {len(args)} arguments")

    def _check_rewrite(self, key: str) -> None:
        # every write, not only SET: a compare-set, an add or a delete then a set would rewrite
        # a published address as surely
        if key.startswith(self.keys.write_once) and key in self._values:
            raise StoreRefused(f"store key {key!r} is written once, and it has been")


def _integer(raw: bytes) -> int:
    if len(raw) > 20 or not raw.lstrip(b"-").isdigit():
        raise StoreRefused("store counter is not a decimal integer")
    return int(raw)


class StoreServer:
    """The world's store, served on `host:port` by rank 0 until `stop`, taking keys in `keys`."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        secret: bytes | None,
        timeout_s: float,
        keys: KeySpace = SPLIT_KEYS,
    ) -> None:
        self.state = StoreState(keys)
        limits = Limits(max_frame_bytes=MAX_FRAME_BYTES, max_json_bytes=4096)
        self.server = Server(
            self._session,
            host=host,
            port=port,
            secret=secret,
            limits=limits,
            read_timeout_s=None,  # ranks hold their connection for the world's life
            handshake_timeout_s=timeout_s,
            max_connections=64,
            max_unauthenticated=16,
            name="rendezvous store",
        )
        self.refused = 0
        self.requests = 0
        """Requests answered (every round trip a rank made)."""

    def start(self) -> StoreServer:
        self.server.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def _session(self, conn: Connection) -> None:
        while True:
            message = conn.recv(expect=StoreMsg.STORE_REQUEST, timeout_s=None)
            self.requests += 1
            try:
                fields = unpack_fields(message.payload)
                if not fields or len(fields[0]) != 1:
                    raise ValueError("store request without its op")
                reply = self.state.apply(fields[0][0], fields[1:])
            except ValueError as exc:  # StoreRefused too: that request fails, the session goes on
                self.refused += 1
                reply = [REFUSED, str(exc)[:300].encode()]
            conn.send(StoreMsg.STORE_REPLY, pack_fields(reply), request_id=message.request_id)

    def stop(self) -> None:
        self.server.stop()


class NetprotoStoreClient:
    """One rank's connection to the world's store, with TCPStore's Python methods (the ones
    `AuthenticatedStore` calls). Thread-safe: one request at a time on the connection."""

    def __init__(self, conn: Connection, *, timeout: timedelta) -> None:
        self.conn = conn
        self.timeout = timeout
        self._lock = threading.Lock()
        self.abandoned = ""
        """Set (to why) by whoever gives up on this world: every wait then ends with it."""

    def _request(self, op: Op, *args: bytes) -> list[bytes]:
        with self._lock:
            try:
                reply = self.conn.request(
                    StoreMsg.STORE_REQUEST,
                    pack_fields([bytes([op]), *args]),
                    expect=StoreMsg.STORE_REPLY,
                )
                fields = unpack_fields(reply.payload)
            except (NetprotoError, ValueError) as exc:
                raise dist.DistStoreError(f"rendezvous store: {exc}") from None
        if not fields or fields[0] not in (OK, MISSING):
            detail = fields[1].decode(errors="replace") if len(fields) > 1 else "no reason"
            raise dist.DistStoreError(f"rendezvous store refused {op.name}: {detail}")
        if fields[0] == OK and len(fields) < (1 if op in (Op.SET, Op.MULTI_SET) else 2):
            raise dist.DistStoreError(f"rendezvous store answered {op.name} without its value")
        return fields

    def _until(self, timeout: timedelta | None, op: Op, *args: bytes) -> list[bytes]:
        """Repeat a waiting request until it succeeds or the timeout passes."""
        limit = (timeout or self.timeout).total_seconds()
        started = time.monotonic()
        deadline = started + limit
        say_at = 5.0
        while True:
            waited = time.monotonic() - started
            if waited >= say_at:  # within 5 s, then every 30 s
                names = b", ".join(args).decode(errors="replace")[:200]
                log.info("waiting for %s in the rendezvous store at %s (%.0fs of %.0fs)",
                         names, self.conn.peer, waited, limit)  # fmt: skip
                say_at += 30.0
            if self.abandoned:
                raise dist.DistStoreError(f"rendezvous abandoned: {self.abandoned}")
            fields = self._request(op, *args)
            if fields[0] == OK and (op != Op.WAIT or fields[1] == b"1"):
                return fields
            if time.monotonic() > deadline:
                names = b", ".join(args).decode(errors="replace")[:200]
                raise dist.DistStoreError(
                    f"rendezvous store: timed out after {limit:.0f}s waiting for {names}"
                )

    @staticmethod
    def _bytes(value: str | bytes) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: str | bytes) -> None:
        self._request(Op.SET, key.encode(), self._bytes(value))

    def get(self, key: str) -> bytes:
        return self._until(None, Op.GET, key.encode())[1]

    def add(self, key: str, value: int) -> int:
        return int(self._request(Op.ADD, key.encode(), str(int(value)).encode())[1])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        fields = self._request(
            Op.COMPARE_SET, key.encode(), self._bytes(expected), self._bytes(desired)
        )
        return fields[1]

    def check(self, keys: list[str]) -> bool:
        return self._request(Op.CHECK, *(key.encode() for key in keys))[1] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._until(timeout, Op.WAIT, *(key.encode() for key in keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key's value in one round trip (waiting, as `get` does, until all are there)."""
        return self._until(None, Op.MULTI_GET, *(key.encode() for key in keys))[1:]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        pairs = [part for key, value in zip(keys, values, strict=True)
                 for part in (key.encode(), self._bytes(value))]  # fmt: skip
        self._request(Op.MULTI_SET, *pairs)

    def delete_key(self, key: str) -> bool:
        return self._request(Op.DELETE, key.encode())[1] == b"1"

    def num_keys(self) -> int:
        return int(self._request(Op.NUM_KEYS)[1])

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def close(self) -> None:
        self.conn.close()


class AuthenticatedStore(dist.Store):
    """A world's store as torch sees it (`init_process_group(store=...)`, `PrefixStore`, the
    elastic agent's `C10dRendezvousBackend`): every call one request on the rank's netproto
    connection. c10d's Python store trampoline calls these methods by their C++ names where
    they differ (`deleteKey`, `getNumKeys`); `multi_get` / `multi_set` are one round trip."""

    def __init__(self, client: NetprotoStoreClient) -> None:
        super().__init__()
        self.client = client

    def set(self, key: str, value: Any) -> None:
        self.client.set(key, value)

    def get(self, key: str) -> bytes:
        return self.client.get(key)

    def add(self, key: str, value: int) -> int:
        return self.client.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.client.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.client.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.client.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.client.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.client.multi_set(keys, values)

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.client.set_timeout(timeout)

    def deleteKey(self, key: str) -> bool:  # the C++ name, which the trampoline calls
        return self.client.delete_key(key)

    def getNumKeys(self) -> int:  # the C++ name, which the trampoline calls
        return self.client.num_keys()


class StoreUnreachableError(ConnectionError):
    """No store answered at the address within the timeout."""


def connect(
    host: str,
    port: int,
    *,
    secret: bytes | None,
    timeout_s: float,
    abandoned: Callable[[], str] = lambda: "",
    describe: Callable[[float], str] | None = None,
) -> NetprotoStoreClient:
    """This rank's connection to the world's store at host:port, retried until rank 0 serves it
    or `timeout_s` passes (StoreUnreachableError), or `abandoned()` says why to stop. A store
    that refuses the secret raises AuthenticationError at once. `describe(waited_s)`: the line
    logged within 5 s and every 30 s while it waits (what it waits for, where, which key)."""
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    said = 0.0
    while True:
        try:
            conn = Connection.connect(
                host, port, secret=secret, connect_timeout_s=min(10.0, timeout_s),
                read_timeout_s=60.0,
                limits=Limits(max_frame_bytes=MAX_FRAME_BYTES, max_json_bytes=4096),
            )  # fmt: skip
            break
        except (ConnectionClosed, NetTimeout):
            waited = time.monotonic() - started
            if time.monotonic() > deadline or abandoned():
                raise StoreUnreachableError(
                    f"no rendezvous store answered at {host}:{port} within {timeout_s:g}s"
                ) from None
            if describe is not None and waited >= said:
                log.info("%s", describe(waited))
                said = 5.0 if said == 0.0 else said + 30.0
            time.sleep(0.2)
    return NetprotoStoreClient(conn, timeout=timedelta(seconds=timeout_s))
