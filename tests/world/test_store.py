"""A world's rendezvous store (world.store): torch's TCPStore answered anyone,
held values of any size and let a stranger rewrite a worker's address before a run. Each
attack here has its own test, against the real server over loopback."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from netproto import Connection
from netproto.errors import AuthenticationError, NetprotoError
from netproto.header import HEADER, Header, Limits, PayloadKind, pack_header
from tests.clocks import HANG_GUARD_S
from world.store import (
    MAX_FRAME_BYTES,
    MAX_KEYS,
    MAX_VALUE_BYTES,
    AuthenticatedStore,
    NetprotoStoreClient,
    Op,
    StoreMsg,
    StoreRefused,
    StoreServer,
    StoreState,
    elastic_keys,
    pack_fields,
    unpack_fields,
)

SECRET = b"store-secret"
LIMITS = Limits(max_frame_bytes=MAX_FRAME_BYTES, max_json_bytes=4096)


@pytest.fixture
def server() -> Iterator[StoreServer]:
    store = StoreServer(host="127.0.0.1", port=0, secret=SECRET, timeout_s=HANG_GUARD_S).start()
    try:
        yield store
    finally:
        store.stop()


def client(server: StoreServer, secret: bytes | None = SECRET) -> NetprotoStoreClient:
    """Its waits are the hang guard's: a get waiting for another thread's set, or any reply,
    may take seconds on a busy machine (a wait that must lapse passes its own timeout)."""
    conn = Connection.connect(
        *server.address, secret=secret, limits=LIMITS, connect_timeout_s=HANG_GUARD_S
    )
    return NetprotoStoreClient(conn, timeout=timedelta(seconds=HANG_GUARD_S))


def test_the_operations_torch_uses_behave_as_tcpstores_do(server: StoreServer) -> None:
    store = client(server)
    store.set("rpc_prefix_0/addrs/driver", b"\x00address")
    assert store.get("rpc_prefix_0/addrs/driver") == b"\x00address"
    assert store.add("rpc_prefix_0/counter", 2) == 2
    assert store.add("rpc_prefix_0/counter", 3) == 5
    assert store.check(["rpc_prefix_0/counter", "rpc_prefix_0/addrs/driver"])
    assert not store.check(["rpc_prefix_0/nothing"])
    assert store.compare_set("split/cas", "", "first") == b"first"  # absent and expected empty
    assert store.compare_set("split/cas", "wrong", "second") == b"first"
    assert store.compare_set("split/cas", "first", "second") == b"second"
    assert store.num_keys() == 3
    assert store.delete_key("split/cas") and not store.delete_key("split/cas")
    store.close()


def test_a_get_waits_for_a_key_another_rank_sets(server: StoreServer) -> None:
    waiting, setting = client(server), client(server)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(waiting.get("split/leave")))
    reader.start()
    setting.set("split/leave", "orderly")
    reader.join(timeout=HANG_GUARD_S)
    assert not reader.is_alive()
    assert got == [b"orderly"]


def test_a_wait_for_a_key_nobody_sets_times_out_as_a_store_error(server: StoreServer) -> None:
    store = client(server)
    with pytest.raises(dist.DistStoreError, match="timed out"):
        store.wait(["split/left/1"], timedelta(seconds=0.5))


def test_a_peer_without_the_secret_never_reaches_the_store(server: StoreServer) -> None:
    with pytest.raises((AuthenticationError, NetprotoError)):
        client(server, secret=b"another secret")
    with contextlib.suppress(AuthenticationError, NetprotoError):
        stranger = client(server, secret=None)  # TCP connects; the server waits for a handshake
        with pytest.raises(dist.DistStoreError):
            stranger.set("rpc_prefix_0/addrs/stage1", b"attacker")
    assert server.state.apply(Op.NUM_KEYS, []) == [b"ok", b"0"]


def test_a_key_outside_the_worlds_prefixes_is_refused(server: StoreServer) -> None:
    store = client(server)
    for key in ("rpc_prefix_1/addrs/x", "/etc/passwd", "default_pg/0", "rpc_prefix_0/\x00"):
        with pytest.raises(dist.DistStoreError, match="outside the split run's key space"):
            store.set(key, b"x")
    store.set("rpc_prefix_0/fine", b"x")  # the session goes on after a refusal
    assert server.refused == 4


def test_a_workers_address_cannot_be_rewritten_once_published(server: StoreServer) -> None:
    owner, hijacker = client(server), client(server)
    owner.set("rpc_prefix_0/addrs/stage1", b"honest")
    with pytest.raises(dist.DistStoreError, match="written once"):
        hijacker.set("rpc_prefix_0/addrs/stage1", b"attacker")
    assert owner.get("rpc_prefix_0/addrs/stage1") == b"honest"


def test_values_and_keys_are_capped_before_they_are_kept(server: StoreServer) -> None:
    store = client(server)
    with pytest.raises(dist.DistStoreError, match="store value of"):
        store.set("rpc_prefix_0/big", b"x" * (MAX_VALUE_BYTES + 1))
    assert not store.check(["rpc_prefix_0/big"])
    state = StoreState()
    for index in range(MAX_KEYS):
        state.apply(Op.SET, [f"split/{index}".encode(), b""])
    with pytest.raises(StoreRefused, match="maximum"):
        state.apply(Op.SET, [b"split/one-more", b""])


def test_a_frame_past_the_stores_cap_closes_only_that_connection(server: StoreServer) -> None:
    honest, rogue = client(server), client(server)
    # a header announcing more than the store's frame cap: refused before anything is allocated
    header = Header(StoreMsg.STORE_REQUEST, PayloadKind.BYTES, 0, 1, MAX_FRAME_BYTES + 1)
    rogue.conn._sock.sendall(pack_header(header))
    with pytest.raises(NetprotoError):
        rogue.conn.recv(expect=StoreMsg.STORE_REPLY, timeout_s=HANG_GUARD_S)
    honest.set("split/still", b"here")
    assert honest.get("split/still") == b"here"


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("empty", b""),
        ("count past the cap", struct.pack("!H", 65535)),
        ("cut inside a length", struct.pack("!H", 1) + b"\x00\x00"),
        ("field longer than the message", struct.pack("!HI", 1, 1000) + b"abc"),
        ("trailing bytes", pack_fields([b"a"]) + b"!"),
    ],
)
def test_a_malformed_field_list_is_refused(name: str, data: bytes) -> None:
    with pytest.raises(ValueError):
        unpack_fields(data)


@pytest.mark.parametrize(
    ("name", "op", "args"),
    [
        ("unknown op", 99, [b"split/x"]),
        ("set without a value", Op.SET, [b"split/x"]),
        ("counter that is not a number", Op.ADD, [b"split/x", b"1e9"]),
        ("key that is not UTF-8", Op.GET, [b"split/\xff"]),
        ("no key", Op.GET, []),
    ],
)
def test_a_malformed_request_is_refused_and_the_session_goes_on(
    server: StoreServer, name: str, op: int, args: list[bytes]
) -> None:
    store = client(server)
    reply = store.conn.request(
        StoreMsg.STORE_REQUEST, pack_fields([bytes([op]), *args]), expect=StoreMsg.STORE_REPLY
    )
    assert unpack_fields(reply.payload)[0] == b"refused"
    store.set("split/after", b"ok")
    assert store.get("split/after") == b"ok"


def test_a_raw_garbage_connection_costs_only_itself(server: StoreServer) -> None:
    with socket.create_connection(server.address, timeout=HANG_GUARD_S) as raw:
        raw.sendall(b"\xff" * HEADER.size)  # what killed a TensorPipe port: one packet
        raw.settimeout(HANG_GUARD_S)
        with contextlib.suppress(ConnectionResetError):
            while raw.recv(4096):  # an ERROR frame saying why, then the end: the server closed it
                pass
    store = client(server)
    store.set("split/alive", b"yes")
    assert store.get("split/alive") == b"yes"


@pytest.mark.parametrize(
    ("name", "op", "args"),
    [
        ("compare-set with the value read", Op.COMPARE_SET, [b"honest", b"attacker"]),
        ("delete, then set", Op.DELETE, []),
        ("add to a numeric address", Op.ADD, [b"1"]),
    ],
)
def test_a_published_address_cannot_be_rewritten_by_another_write(
    server: StoreServer, name: str, op: Op, args: list[bytes]
) -> None:
    owner, hijacker = client(server), client(server)
    key = "rpc_prefix_0/addrs/stage1"
    value = b"7" if op == Op.ADD else b"honest"
    owner.set(key, value)
    with pytest.raises(dist.DistStoreError, match="written once"):
        hijacker._request(op, key.encode(), *args)
    with contextlib.suppress(dist.DistStoreError):
        hijacker.set(key, b"attacker")
    assert owner.get(key) == value
    assert server.state._total == len(value)


@pytest.fixture
def elastic_server() -> Iterator[StoreServer]:
    keys = elastic_keys("data_parallel-7", own=("data_parallel/",))
    store = StoreServer(
        host="127.0.0.1", port=0, secret=SECRET, timeout_s=HANG_GUARD_S, keys=keys
    ).start()
    try:
        yield store
    finally:
        store.stop()


def test_the_elastic_key_space_takes_the_agents_keys_and_lets_the_state_be_rewritten(
    elastic_server: StoreServer,
) -> None:
    """The rendezvous state is compare-set at every join and heartbeat (not write-once, unlike
    a split run's addresses); another run's state, or a split run's keys, are refused."""
    store = client(elastic_server)
    state = "torch.rendezvous.data_parallel-7"
    assert store.compare_set(state, "", "Y2FuaW1hZGFt") == b"Y2FuaW1hZGFt"
    for version in (b"round 0", b"round 0, 2 nodes", b"round 1"):
        current = store.get(state)
        assert store.compare_set(state, current, version) == version
    store.set("torch.rendezvous.data_parallel-7.1/torchelastic/role_info/0", b"info")
    store.set("/torch/elastic/store/x", b"1")
    store.set("group/ab12/0//cpu//0/0", b"gloo address")
    store.set("data_parallel/job", b"token")
    for key in ("torch.rendezvous.data_parallel-8", "rpc_prefix_0/addrs/stage1", "default_pg/0"):
        with pytest.raises(dist.DistStoreError, match="outside the rendezvous data_parallel-7"):
            store.set(key, b"x")


def test_the_batch_calls_are_one_round_trip_each(elastic_server: StoreServer) -> None:
    """What the elastic agent's rank assignment makes (multi_set by rank 0, multi_get of every
    agent's role): one request each, counted by the server."""
    store = AuthenticatedStore(client(elastic_server))
    keys = [f"group/r/torchelastic/role_info/{i}" for i in range(8)]
    before = elastic_server.requests
    store.multi_set(keys, [f"role {i}" for i in range(8)])
    assert store.multi_get(keys) == [f"role {i}".encode() for i in range(8)]
    assert elastic_server.requests - before == 2
    prefixed = dist.PrefixStore("group/p", store)  # torch's C++ PrefixStore calls them too
    prefixed.multi_set(["a", "b"], ["1", "2"])  # type: ignore[attr-defined]
    assert prefixed.multi_get(["a", "b"]) == [b"1", b"2"]
    assert elastic_server.requests - before == 4


def test_a_multi_set_with_one_refused_key_writes_none() -> None:
    state = StoreState(elastic_keys("r"))
    with pytest.raises(StoreRefused):
        state.apply(Op.MULTI_SET, [b"group/a", b"1", b"elsewhere/b", b"2"])
    assert state.apply(Op.NUM_KEYS, []) == [b"ok", b"0"]
    assert state.apply(Op.MULTI_GET, [b"group/a"], wait_s=0.0) == [b"missing"]
