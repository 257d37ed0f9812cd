"""A live server fed thousands of random and mutated frames keeps serving a good client."""

from __future__ import annotations

import random
import socket
import threading

import torch

from netproto import Connection, MsgType
from netproto.codecs import encode_bytes
from netproto.header import Message
from tests.clocks import HANG_GUARD_S

from .conftest import wait_for

SEEDS = [
    encode_bytes(Message(MsgType.DATA_JSON, {"k": [1, 2, 3]})),
    encode_bytes(Message(MsgType.DATA_TOKENS, list(range(16)))),
    encode_bytes(Message(MsgType.DATA_TENSOR, torch.randn(3, 5))),
    encode_bytes(
        Message(
            MsgType.DATA_TENSORS,
            {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.arange(6).view(2, 3)},
        )
    ),
    encode_bytes(Message(MsgType.PING)),
]


def mutate(rng: random.Random) -> bytes:
    frame = bytearray(rng.choice(SEEDS))
    choice = rng.randrange(5)
    if choice == 0:  # random bytes
        return rng.randbytes(rng.randrange(1, 200))
    if choice == 1:  # flip a few bytes anywhere, header included
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
    elif choice == 2:  # truncate
        del frame[rng.randrange(1, len(frame)) :]
    elif choice == 3:  # lie about the length
        frame[12:20] = rng.randrange(2**64).to_bytes(8, "big")
    else:  # valid frame followed by garbage
        frame += rng.randbytes(rng.randrange(1, 50))
    return bytes(frame)


def test_server_survives_thousands_of_bad_frames_while_serving_a_good_client(start_server) -> None:
    # No short read timeout: the good client's gaps between requests are the machine's load
    # (a stalled thread), and a 1 s timeout once could cut it there; bad sessions end at EOF.
    server = start_server(read_timeout_s=HANG_GUARD_S)
    stop = threading.Event()
    good_replies, good_errors = [0], []

    def good_client() -> None:
        try:
            with Connection.connect(*server.address) as conn:
                while not stop.is_set():
                    value = torch.randn(64)
                    reply = conn.request(
                        MsgType.DATA_TENSOR,
                        value,
                        expect=MsgType.DATA_TENSOR,
                        timeout_s=HANG_GUARD_S,
                    )
                    assert torch.equal(reply.payload, value)
                    good_replies[0] += 1
        except BaseException as exc:
            good_errors.append(exc)

    thread = threading.Thread(target=good_client)
    thread.start()
    rng = random.Random(1234)
    num_frames = 3000
    for index in range(num_frames):
        if index % 250 == 0:  # the good client is served between the bad frames, not after
            # them: a reply counted at each of 12 checkpoints, whatever the threads' speeds
            assert wait_for(lambda: good_replies[0] > index // 250 or bool(good_errors))  # noqa: B023
        with socket.create_connection(server.address) as sock:
            sock.sendall(mutate(rng))
            if index % 10 == 0:  # sometimes end our side and wait for the server's verdict
                try:
                    sock.shutdown(socket.SHUT_WR)
                    sock.settimeout(5)
                    sock.recv(4096)
                except OSError:
                    pass  # the server already closed on us
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the honest client hung"
    assert not good_errors, good_errors
    assert good_replies[0] > 10
    # the accept loop may still be draining its backlog
    assert wait_for(lambda: server.sessions_started >= num_frames, timeout_s=HANG_GUARD_S)
    with Connection.connect(*server.address) as conn:  # and it still takes new clients
        conn.ping()
