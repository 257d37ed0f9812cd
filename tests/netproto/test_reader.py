"""The one frame reader: what a test feeds `FrameDecoder` is what a Connection decodes off its
socket, whatever way the bytes are cut, small frames decoded in the read buffer and big ones
received in place."""

from __future__ import annotations

import itertools
import socket
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netproto import Connection, MsgType, PeerProtocolError, TruncatedFrame
from netproto.header import HEADER_BYTES, Message
from netproto.wire import READ_CHUNK_BYTES, FrameDecoder, frames

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PAYLOADS = {
    "json": (MsgType.DATA_JSON, {"a": [1, 2], "b": "x" * 40}),
    "tokens": (MsgType.DATA_TOKENS, torch.arange(16, dtype=torch.int32)),
    "no tokens": (MsgType.DATA_TOKENS, torch.empty(0, dtype=torch.int32)),
    "tensor": (MsgType.DATA_TENSOR, torch.arange(12.0).view(3, 4)),
    "tensors": (MsgType.DATA_TENSORS, {"q": torch.rand(2, 5), "t": torch.tensor([7, 8])}),
    # bigger than the read buffer: received straight into a buffer of its own
    "big tensor": (MsgType.DATA_TENSOR, torch.arange(READ_CHUNK_BYTES // 2, dtype=torch.int32)),
    "bytes": (MsgType.DATA_BYTES, b"\x00\xff" * 9),
    "ping": (MsgType.PING, None),
}


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def stream(kinds: list[str]) -> tuple[list[Message], bytes]:
    messages = [Message(*PAYLOADS[kind], request_id=i + 1) for i, kind in enumerate(kinds)]
    return messages, frames(messages)


def received_over_a_socket(data: bytes, cuts: list[float], count: int) -> list[Message]:
    """`data` written in pieces, cut at the fractions `cuts` of its length, with a pause
    between them, so the reader sees frames arrive cut there; what a Connection receives."""
    ours, theirs = socket.socketpair()
    offsets = sorted({0, len(data), *(int(cut * len(data)) for cut in cuts)})
    pieces = [data[a:b] for a, b in itertools.pairwise(offsets) if b > a]
    sent = threading.Event()

    def write() -> None:
        for piece in pieces:
            theirs.sendall(piece)
            sent.wait(0.0005)  # a gap: the reader takes what has come so far
        sent.set()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        conn = Connection(ours, read_timeout_s=10, peer="test peer")
        return [conn.recv(expect=[t for t, _ in PAYLOADS.values()]) for _ in range(count)]
    finally:
        writer.join(timeout=30)
        assert not writer.is_alive()
        ours.close()
        theirs.close()


@SETTINGS
@given(
    st.lists(st.sampled_from(sorted(PAYLOADS)), min_size=1, max_size=6),
    st.lists(st.floats(0, 1), max_size=12),
)
def test_a_connection_receives_what_the_decoder_decodes_however_the_bytes_are_cut(
    kinds: list[str], cuts: list[float]
) -> None:
    messages, data = stream(kinds)
    decoder = FrameDecoder()
    decoder.feed(data)
    decoded = list(decoder)
    decoder.close()
    received = received_over_a_socket(data, cuts, len(messages))
    for want, fed, got in zip(messages, decoded, received, strict=True):
        assert (got.type, got.request_id, got.flags) == (want.type, want.request_id, want.flags)
        assert (fed.type, fed.request_id) == (want.type, want.request_id)
        assert same(got.payload, want.payload) and same(fed.payload, want.payload)


@SETTINGS
@given(
    st.lists(st.sampled_from(sorted(set(PAYLOADS) - {"big tensor"})), min_size=1, max_size=8),
    st.integers(1, 17),
)
def test_a_small_read_buffer_takes_the_big_frame_path_and_compacts_between_frames(
    kinds: list[str], piece: int
) -> None:
    """With a 64-byte read buffer most frames are 'big' and the buffer must keep making room:
    the same path a 64 KiB buffer takes for a 4 MiB tensor, cut at every offset."""
    messages, data = stream(kinds)
    decoder = FrameDecoder(chunk_bytes=64)
    out: list[Message] = []
    for start in range(0, len(data), piece):
        decoder.feed(data[start : start + piece])
        out.extend(decoder)
    decoder.close()
    assert [(m.type, m.request_id) for m in out] == [(m.type, m.request_id) for m in messages]
    assert all(same(got.payload, want.payload) for got, want in zip(out, messages, strict=True))
    assert decoder.frame_bytes == len(data)


def test_big_payload_tensors_are_views_of_the_buffer_they_were_received_into() -> None:
    _, data = stream(["big tensor"])
    buffers: list[torch.Tensor] = []

    def allocate(length: int) -> torch.Tensor:
        buffers.append(torch.empty(length, dtype=torch.uint8))
        return buffers[-1]

    decoder = FrameDecoder(allocate=allocate)
    decoder.feed(data)
    [message] = list(decoder)
    assert len(buffers) == 1
    assert message.payload.untyped_storage().data_ptr() == buffers[0].data_ptr()


def test_a_frame_cut_inside_its_header_ends_as_a_truncation_not_a_close() -> None:
    _, data = stream(["tokens"])
    ours, theirs = socket.socketpair()
    theirs.sendall(data[: HEADER_BYTES - 1])
    theirs.close()
    conn = Connection(ours, read_timeout_s=10, peer="test peer")
    # a TruncatedFrame: still a PeerProtocolError, and what a client treats as a lost peer (its
    # process died sending), never as a frame to use
    with pytest.raises(TruncatedFrame, match="mid-frame"):
        conn.recv()
    assert issubclass(TruncatedFrame, PeerProtocolError)
    assert conn.closed
