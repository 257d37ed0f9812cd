"""netproto vs a raw socket vs gRPC, side by side on loopback: `python bench/netproto_bench.py`.

Each server runs in its own process (as on another host); this process is the client and sends
the same bytes through each transport:
  - bulk: a float32 tensor of 4 MiB and of 64 MiB, acknowledged by the server once it has all
    of it (throughput = bytes / time from first byte sent to ack received);
  - round trip: a 16-token message echoed back.
Baselines: (b) a raw TCP socket, `sendall` + `recv_into` a buffer preallocated once (by torch, as
netproto allocates its big payloads: huge pages where Linux allows), no
framing, sizes agreed in advance; (c) grpcio unary calls with the message-size limits raised.
Two more round-trip references show where a Python protocol's floor lies: the smallest framed
echo (a 20-byte struct header, one read and one write a side, no checks beyond magic, version
and length), first handing the application the payload as bytes, then as an int32 tensor at
both ends, as netproto does (a tensor built and read back costs microseconds in torch).
The transports take turns sample by sample, so the machine's noise falls on all of them alike;
each sample times several calls. Prints a table, writes bench/results/netproto_bench.json, and
ends with netproto's bulk throughput as a fraction of the raw socket's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lab.machine import announce_machine, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "netproto_bench.json"
BULK_SIZES_MIB = (4, 64)
BULK_BATCH = {4: 8, 64: 1}
"""Transfers timed together per sample: one 4 MiB transfer (about a millisecond) is at the
mercy of a single scheduling hiccup."""
TOKENS = 16
WARMUP = 2
RTT_WARMUP = 50
RTT_BATCH = 20
"""Round trips timed together per sample."""
RAW_SETUP = struct.Struct("!cQ")
"""Raw baseline: per connection, a mode (B: bulk, acked / E: echoed) and the message size."""
FRAME = struct.Struct("!2sBBHBxIQ")
"""The framed references' header: netproto's own layout (magic, version, flags, type, kind,
request id, length)."""
FRAME_CAP = 64 * 1024

Probes = dict[str, Callable[[], None]]


# ------------------------------------------------------------------ servers (child processes)


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < view.nbytes:
        count = sock.recv_into(view[got:], view.nbytes - got)
        if count == 0:
            return False
        got += count
    return True


def _raw_session(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    setup = bytearray(RAW_SETUP.size)
    with conn:
        if not _recv_exactly(conn, memoryview(setup)):
            return
        mode, size = RAW_SETUP.unpack(setup)
        # allocated once per connection, as netproto allocates big payloads (torch): torch
        # asks for huge pages for large buffers (Linux THP in `madvise` mode), into which
        # loopback receives about 3x faster than into a bytearray on the lab's machines
        view = torch.empty(size, dtype=torch.uint8).numpy().data
        while _recv_exactly(conn, view):
            conn.sendall(b"k" if mode == b"B" else view)


def _raw_server(ready: Any) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_raw_session, args=(conn,), daemon=True).start()


def _framed_session(conn: socket.socket, as_tensor: bool) -> None:
    """One read, unpack and check the header, (tensor), one write: a floor, not a protocol."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(FRAME_CAP))
    with conn:
        while count := conn.recv_into(view):
            magic, version, flags, kind_type, kind, request_id, length = FRAME.unpack_from(view)
            if magic != b"DL" or version != 1 or FRAME.size + length > count:
                return  # a reference for whole small frames only
            payload: bytes = bytes(view[FRAME.size : FRAME.size + length])
            if as_tensor:
                payload = torch.frombuffer(bytearray(payload), dtype=torch.int32).numpy().tobytes()
            conn.sendall(
                FRAME.pack(magic, version, flags, kind_type, kind, request_id, length) + payload
            )


def _framed_server(ready: Any, as_tensor: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_framed_session, args=(conn, as_tensor), daemon=True).start()


def _framed_bytes_server(ready: Any) -> None:
    _framed_server(ready, False)


def _framed_tensor_server(ready: Any) -> None:
    _framed_server(ready, True)


def _netproto_server(ready: Any) -> None:
    from netproto import Connection, MsgType, Server

    def handler(conn: Connection) -> None:
        while True:
            message = conn.recv()
            if message.type == MsgType.DATA_TENSOR:
                conn.send(MsgType.DATA_BYTES, b"k", request_id=message.request_id)
            else:
                conn.send(message.type, message.payload, request_id=message.request_id)

    server = Server(handler, read_timeout_s=None).start()
    ready.put(server.address[1])
    while True:
        time.sleep(3600)


def _grpc_server(ready: Any) -> None:
    from concurrent import futures

    import grpc

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    handlers = {
        "Bulk": grpc.unary_unary_rpc_method_handler(lambda request, context: b"k"),
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.put(port)
    server.wait_for_termination()


def start_server(target: Callable[[Any], None]) -> tuple[Any, int]:
    context = mp.get_context("spawn")
    ready = context.Queue()
    process = context.Process(target=target, args=(ready,), daemon=True)
    process.start()
    return process, ready.get(timeout=60)


# ------------------------------------------------------------------ clients: one call per probe


def raw_probes(
    port: int, tensors: dict[int, torch.Tensor], tokens: torch.Tensor
) -> tuple[Probes, Callable[[], None]]:
    sockets: list[socket.socket] = []

    def connect(mode: bytes, size: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(RAW_SETUP.pack(mode, size))
        sockets.append(sock)
        return sock

    probes: Probes = {}
    ack = memoryview(bytearray(1))
    for mib, tensor in tensors.items():
        data = tensor.view(torch.uint8).numpy().data
        bulk_sock = connect(b"B", data.nbytes)

        def send_bulk(sock: socket.socket = bulk_sock, data: memoryview = data) -> None:
            sock.sendall(data)
            _recv_exactly(sock, ack)

        probes[f"bulk_{mib}mib"] = send_bulk
    token_bytes = tokens.numpy().data
    echo = memoryview(bytearray(token_bytes.nbytes))
    echo_sock = connect(b"E", token_bytes.nbytes)

    def round_trip() -> None:
        echo_sock.sendall(token_bytes)
        _recv_exactly(echo_sock, echo)

    probes["rtt_16_tokens"] = round_trip

    def close() -> None:
        for sock in sockets:
            sock.close()

    return probes, close


def framed_probes(
    port: int, tokens: torch.Tensor, *, as_tensor: bool
) -> tuple[Probes, Callable[[], None]]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(FRAME_CAP))
    token_bytes = tokens.numpy().tobytes()

    def round_trip() -> None:
        payload = tokens.numpy().tobytes() if as_tensor else token_bytes
        sock.sendall(FRAME.pack(b"DL", 1, 0, 0x21, 2, 1, len(payload)) + payload)
        count = sock.recv_into(view)
        magic, version, _, _, _, _, length = FRAME.unpack_from(view)
        if magic != b"DL" or version != 1 or FRAME.size + length > count:
            raise RuntimeError("framed reference: a reply not whole in one read")
        if as_tensor:
            torch.frombuffer(bytearray(view[FRAME.size : FRAME.size + length]), dtype=torch.int32)
        else:
            bytes(view[FRAME.size : FRAME.size + length])

    return {"rtt_16_tokens": round_trip}, sock.close


def framed_bytes_probes(
    port: int, tensors: dict[int, torch.Tensor], tokens: torch.Tensor
) -> tuple[Probes, Callable[[], None]]:
    return framed_probes(port, tokens, as_tensor=False)


def framed_tensor_probes(
    port: int, tensors: dict[int, torch.Tensor], tokens: torch.Tensor
) -> tuple[Probes, Callable[[], None]]:
    return framed_probes(port, tokens, as_tensor=True)


def netproto_probes(
    port: int, tensors: dict[int, torch.Tensor], tokens: torch.Tensor
) -> tuple[Probes, Callable[[], None]]:
    from netproto import Connection, MsgType

    conn = Connection.connect("127.0.0.1", port, read_timeout_s=120)
    probes: Probes = {}
    for mib, tensor in tensors.items():

        def send_bulk(tensor: torch.Tensor = tensor) -> None:
            conn.send_tensor(MsgType.DATA_TENSOR, tensor)
            conn.recv(expect=MsgType.DATA_BYTES)

        probes[f"bulk_{mib}mib"] = send_bulk

    def round_trip() -> None:
        conn.send_tokens(MsgType.DATA_TOKENS, tokens)
        conn.recv_tokens(MsgType.DATA_TOKENS)

    probes["rtt_16_tokens"] = round_trip
    return probes, conn.close


def grpc_probes(
    port: int, tensors: dict[int, torch.Tensor], tokens: torch.Tensor
) -> tuple[Probes, Callable[[], None]]:
    import grpc

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    # The same bytes: the serializer turns the tensor into the bytes gRPC's Python API needs.
    bulk = channel.unary_unary("/bench/Bulk", request_serializer=lambda t: t.numpy().tobytes())
    echo = channel.unary_unary("/bench/Echo", request_serializer=lambda t: t.numpy().tobytes())
    probes: Probes = {}
    for mib, tensor in tensors.items():

        def send_bulk(tensor: torch.Tensor = tensor) -> None:
            bulk(tensor)

        probes[f"bulk_{mib}mib"] = send_bulk
    probes["rtt_16_tokens"] = lambda: echo(tokens)
    return probes, channel.close


def measure(
    probes: dict[str, Probes], metric: str, *, repeats: int, batch: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per call of `metric` for each transport, taking turns in a shuffled order.

    Each sample times `batch` consecutive calls.
    """
    probes = {name: transport for name, transport in probes.items() if metric in transport}
    for transport in probes.values():
        for _ in range(warmup):
            transport[metric]()
    samples: dict[str, list[float]] = {name: [] for name in probes}
    order = list(probes)
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)  # no transport always runs right after the same other one
        for name in order:
            run_once = probes[name][metric]
            started = time.perf_counter()
            for _ in range(batch):
                run_once()
            samples[name].append((time.perf_counter() - started) / batch)
    return samples


# ------------------------------------------------------------------ report


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (smoke run)")
    args = parser.parse_args()
    machine = announce_machine()
    repeats = {4: 10, 64: 4} if args.quick else {4: 40, 64: 12}
    rtt_repeats = 20 if args.quick else 100
    tensors = {mib: torch.randn(mib * 2**20 // 4) for mib in BULK_SIZES_MIB}
    tokens = torch.arange(TOKENS, dtype=torch.int32)

    servers = {
        "netproto": (_netproto_server, netproto_probes),
        "raw socket": (_raw_server, raw_probes),
        "grpc": (_grpc_server, grpc_probes),
        "framed bytes": (_framed_bytes_server, framed_bytes_probes),
        "framed tensor": (_framed_tensor_server, framed_tensor_probes),
    }
    processes, closers = [], []
    probes: dict[str, Probes] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    try:
        for name, (server_target, make_probes) in servers.items():
            process, port = start_server(server_target)
            processes.append(process)
            probes[name], close = make_probes(port, tensors, tokens)
            closers.append(close)
        for mib in BULK_SIZES_MIB:
            print(f"bulk {mib} MiB ...", file=sys.stderr)
            samples[f"bulk_{mib}mib"] = measure(
                probes,
                f"bulk_{mib}mib",
                repeats=repeats[mib],
                batch=BULK_BATCH[mib],
                warmup=WARMUP,
            )
        print("round trips ...", file=sys.stderr)
        samples["rtt_16_tokens"] = measure(
            probes, "rtt_16_tokens", repeats=rtt_repeats, batch=RTT_BATCH, warmup=RTT_WARMUP
        )
    finally:
        for close in closers:
            close()
        for process in processes:
            process.kill()
            process.join()

    table: dict[str, dict[str, float]] = {name: {} for name in servers}
    for name in servers:
        for mib in BULK_SIZES_MIB:
            if name in samples[f"bulk_{mib}mib"]:
                seconds = statistics.median(samples[f"bulk_{mib}mib"][name])
                table[name][f"bulk_{mib}mib_MBps"] = mib * 2**20 / seconds / 1e6
        table[name]["rtt_16_tokens_us"] = statistics.median(samples["rtt_16_tokens"][name]) * 1e6

    def ratio(metric: str, baseline: str) -> float:
        return table["netproto"][metric] / table[baseline][metric]

    ratios = {
        f"bulk_{mib}mib_vs_{short}": ratio(f"bulk_{mib}mib_MBps", baseline)
        for short, baseline in (("raw", "raw socket"), ("grpc", "grpc"))
        for mib in BULK_SIZES_MIB
    }
    ratios["rtt_vs_raw"] = ratio("rtt_16_tokens_us", "raw socket")
    ratios["rtt_vs_grpc"] = ratio("rtt_16_tokens_us", "grpc")
    ratios["rtt_vs_framed_tensor"] = ratio("rtt_16_tokens_us", "framed tensor")
    floors = {
        f"{name}_vs_raw": table[name]["rtt_16_tokens_us"] / table["raw socket"]["rtt_16_tokens_us"]
        for name in ("framed bytes", "framed tensor")
    }
    targets = {
        "bulk_4mib_vs_raw": ">= 0.9",
        "bulk_64mib_vs_raw": ">= 0.9",
        "bulk_4mib_vs_grpc": ">= 3",
        "bulk_64mib_vs_grpc": ">= 3",
        "rtt_vs_raw": "<= 2",
        "rtt_vs_grpc": "<= 0.5",
        "rtt_vs_framed_tensor": "(netproto's own work)",
    }

    columns = list(table["netproto"])
    print(f"{'transport':<14}" + "".join(f"{metric:>20}" for metric in columns))
    for name, row in table.items():
        cells = (f"{row[c]:>20.1f}" if c in row else f"{'':>20}" for c in columns)
        print(f"{name:<14}" + "".join(cells))
    print()
    for key, value in ratios.items():
        print(f"{key:<24}{value:>8.2f}x   target {targets[key]}")
    for key, value in floors.items():
        print(f"{key.replace(' ', '_') + '_rtt':<24}{value:>8.2f}x   (reference: a Python floor)")
    write_results(
        RESULTS,
        {
            "table": table,
            "ratios": ratios,
            "floors": floors,
            "samples": {
                "bulk": repeats,
                "bulk_batch": BULK_BATCH,
                "rtt": rtt_repeats,
                "rtt_batch": RTT_BATCH,
            },
        },
        machine=machine,
    )
    bulk_vs_raw = min(ratios[f"bulk_{mib}mib_vs_raw"] for mib in BULK_SIZES_MIB)
    print(f"netproto bulk throughput / raw socket: {bulk_vs_raw:.2f}x")


if __name__ == "__main__":
    main()
