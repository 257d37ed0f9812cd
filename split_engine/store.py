"""A split run's rendezvous store, served by the lab over netproto (the shared secret, capped).

torch.distributed.rpc meets through a key-value store: TensorPipe's and Gloo's addresses, the
start-up all-gather, the shutdown barrier. torch's TCPStore server is C++ with no hooks: it
answers anyone who reaches its port, keeps values of any size (4 MiB each, without limit, in a
test) and lets a stranger rewrite `rpc_prefix_0/addrs/*` before a run (both stages died). Here
the driver serves the store itself: a netproto server (the secret's handshake when one is set,
frames capped), keys only under the prefixes torch's RPC and Gloo use, values and key counts
capped, and each rank reaches it through `NetprotoStoreClient`, which `workers._WorldStore`
hands to torch as its `Store`.

    client -> server  STORE_REQUEST  BYTES  fields: op, key..., value...
    server -> client  STORE_REPLY    BYTES  fields: status, value...
A field list is a uint16 count, then per field a uint32 length and its bytes (`pack_fields`).
Blocking reads (`get`, `wait`) poll: each request waits at most `POLL_WAIT_S` on the server, so
one thread's wait never holds the connection another thread of the same rank needs.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from enum import IntEnum

import torch.distributed as dist

from netproto import REGISTRY, Connection, Limits, PayloadKind, Server
from netproto.errors import NetprotoError

KEY_PREFIXES = ("rpc_prefix_0/", "split/")
"""The keys of one world: torch's RPC start-up, its shutdown barrier and the Gloo group beside it
(all under `rpc_prefix_0/`: `workers._forget_previous_world` numbers every world from 0) and the
lab's own words (`split/...`); any other key is refused."""
WRITE_ONCE = ("rpc_prefix_0/addrs/", "rpc_prefix_0/names/")
"""Where each worker publishes its name and address: the first value stands (any later write
of one, `set`, `add`, `compare_set` or `delete`, a hijack, is refused)."""
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
    "split_store",
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


OK, MISSING, REFUSED = b"ok", b"missing", b"refused"
_WRITES = (Op.SET, Op.ADD, Op.COMPARE_SET, Op.DELETE)


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


def _key(raw: bytes) -> str:
    if len(raw) > MAX_KEY_BYTES:
        raise StoreRefused(f"store key of {len(raw)} bytes (at most {MAX_KEY_BYTES})")
    try:
        key = raw.decode()
    except UnicodeDecodeError:
        raise StoreRefused("store key is not UTF-8") from None
    if not key.startswith(KEY_PREFIXES) or not key.isprintable():
        raise StoreRefused(f"store key {key[:64]!r} is outside this run's prefixes")
    return key


class StoreState:
    """The store's contents and the operations on them (no I/O: the server's sessions call it)."""

    def __init__(self) -> None:
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
            if op in (Op.CHECK, Op.WAIT):
                keys = [_key(raw) for raw in args]
                present = (
                    all(k in self._values for k in keys)
                    if op == Op.CHECK
                    else self._wait_for(keys, wait_s)
                )
                return [OK, b"1" if present else b"0"]
            key = _key(args[0])
            if op in _WRITES and key.startswith(WRITE_ONCE) and key in self._values:
                # every write, not only SET: a compare-set, an add or a delete then a set
                # would rewrite a published address as surely
                raise StoreRefused(f"store key {key!r} is written once, and it has been")
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


def _integer(raw: bytes) -> int:
    if len(raw) > 20 or not raw.lstrip(b"-").isdigit():
        raise StoreRefused("store counter is not a decimal integer")
    return int(raw)


class StoreServer:
    """The run's store, served on `host:port` by the driver (rank 0) until `stop`."""

    def __init__(self, *, host: str, port: int, secret: bytes | None, timeout_s: float) -> None:
        self.state = StoreState()
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

    def start(self) -> StoreServer:
        self.server.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def _session(self, conn: Connection) -> None:
        while True:
            message = conn.recv(expect=StoreMsg.STORE_REQUEST, timeout_s=None)
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
    """One rank's connection to the run's store, with TCPStore's Python methods (the ones
    `workers._WorldStore` calls). Thread-safe: one request at a time on the connection."""

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
        if fields[0] == OK and len(fields) < (1 if op == Op.SET else 2):
            raise dist.DistStoreError(f"rendezvous store answered {op.name} without its value")
        return fields

    def _until(self, timeout: timedelta | None, op: Op, *args: bytes) -> list[bytes]:
        """Repeat a waiting request until it succeeds or the timeout passes."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
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

    def delete_key(self, key: str) -> bool:
        return self._request(Op.DELETE, key.encode())[1] == b"1"

    def num_keys(self) -> int:
        return int(self._request(Op.NUM_KEYS)[1])

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def close(self) -> None:
        self.conn.close()
