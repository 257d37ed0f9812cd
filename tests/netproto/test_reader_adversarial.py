"""The frame reader against a misbehaving peer: its fast path for small frames must refuse exactly
what `parse_header` refuses, however the bytes are cut and wherever a frame starts in the read
buffer; no declared length is allocated before it has passed the caps; a bad frame closes only
its connection."""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netproto import Connection, MsgType, PeerProtocolError
from netproto.codecs import decode_payload, encode_bytes
from netproto.header import (
    AUTH_LIMITS,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    PROTOCOL_VERSION,
    REGISTRY,
    Limits,
    Message,
    PayloadKind,
    parse_header,
)
from netproto.wire import READ_CHUNK_BYTES, FrameDecoder
from tests.clocks import HANG_GUARD_S

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SEEDS = [
    encode_bytes(Message(MsgType.DATA_JSON, {"k": [1, 2, 3]}, request_id=1)),
    encode_bytes(Message(MsgType.DATA_TOKENS, list(range(16)), request_id=2, flags=3)),
    encode_bytes(Message(MsgType.DATA_TOKENS, [])),
    encode_bytes(Message(MsgType.DATA_TENSOR, torch.arange(15.0).view(3, 5))),
    encode_bytes(
        Message(
            MsgType.DATA_TENSORS,
            {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.arange(6).view(2, 3)},
        )
    ),
    encode_bytes(Message(MsgType.PING, request_id=9)),
    encode_bytes(Message(MsgType.DATA_BYTES, b"x" * 100)),
    encode_bytes(Message(MsgType.DATA_BYTES, b"")),
]
PING = encode_bytes(Message(MsgType.PING))
LENGTHS = [0, 1, 3, 4, 5, 44, 45, 100, 4096, 4097, 2**16 - 20, 2**16 - 19, 2**20, 2**64 - 1]
"""Declared lengths around every boundary the reader has (small limits, 64-byte and default
read buffers, AUTH_LIMITS, the default JSON cap) and one no cap allows."""
DECODERS = [
    {},
    {"chunk_bytes": 64},
    {"chunk_bytes": HEADER_BYTES},
    {"limits": AUTH_LIMITS},
    {"limits": Limits(max_frame_bytes=50, max_json_bytes=30)},
    {"limits": Limits(max_frame_bytes=64, max_json_bytes=100), "chunk_bytes": 83},
    {"limits": Limits(max_frame_bytes=2**20, max_json_bytes=16)},
]


def header(
    msg_type: int,
    kind: int,
    length: int,
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    request_id: int = 0,
    flags: int = 0,
) -> bytes:
    return HEADER.pack(magic, version, flags, msg_type, kind, request_id, length)


def summary(payload: Any) -> Any:
    """A payload as plain comparable values (dtype, shape and bytes for tensors)."""
    if isinstance(payload, torch.Tensor):
        raw = payload.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return (str(payload.dtype), tuple(payload.shape), raw)
    if (
        isinstance(payload, dict)
        and payload
        and isinstance(next(iter(payload.values())), torch.Tensor)
    ):
        return [(name, summary(value)) for name, value in payload.items()]
    return payload


class Outcome(NamedTuple):
    messages: list[tuple[Any, ...]]
    error: str | None
    """The PeerProtocolError's text (close() included: a stream cut mid-frame)."""
    frame_bytes: int


class Spy:
    """An allocator that records what the reader asked it for."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, length: int) -> torch.Tensor:
        self.sizes.append(length)
        return torch.empty(length, dtype=torch.uint8)


@contextlib.contextmanager
def no_longer_than(seconds: float) -> Iterator[None]:
    """A reader that loops fails the test instead of hanging it."""

    def expire(signum: int, frame: object) -> None:
        raise AssertionError(f"the reader still ran after {seconds} s: a loop that never ends?")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def message_row(message: Message) -> tuple[Any, ...]:
    return (message.type, summary(message.payload), message.request_id, message.flags)


def fed(data: bytes, cuts: list[int], **kwargs: Any) -> Outcome:
    """Decoded through `feed` (the backlog, then the buffer), in pieces cut at `cuts`."""
    decoder = FrameDecoder(**kwargs)
    out: list[tuple[Any, ...]] = []
    bounds = sorted({0, len(data), *cuts})
    try:
        with no_longer_than(10):
            for start, stop in itertools.pairwise(bounds):
                decoder.feed(data[start:stop])
                for message in decoder:  # one by one: those before an error count
                    out.append(message_row(message))
            decoder.close()
    except PeerProtocolError as exc:
        return Outcome(out, str(exc), decoder.frame_bytes)
    return Outcome(out, None, decoder.frame_bytes)


def received(data: bytes, cuts: list[int], **kwargs: Any) -> Outcome:
    """Decoded as a Connection receives: straight into `writable()`, one piece per receive."""
    decoder = FrameDecoder(**kwargs)
    out: list[tuple[Any, ...]] = []
    bounds = sorted({0, len(data), *cuts})
    try:
        with no_longer_than(10):
            for start, stop in itertools.pairwise(bounds):
                index = start
                while True:
                    while (message := decoder.next_message()) is not None:
                        out.append(message_row(message))
                    if index >= stop:
                        break
                    view = decoder.writable()
                    # an empty view would read as the peer closing (recv_into returns 0)
                    assert view.nbytes > 0, "writable() is empty while a frame is incomplete"
                    count = min(view.nbytes, stop - index)
                    view[:count] = data[index : index + count]
                    decoder.wrote(count)
                    index += count
            decoder.close()
    except PeerProtocolError as exc:
        return Outcome(out, str(exc), decoder.frame_bytes)
    return Outcome(out, None, decoder.frame_bytes)


def every_way(data: bytes, cuts: list[int], **kwargs: Any) -> list[Outcome]:
    """Whole, cut at `cuts`, and a byte at a time, fed and received."""
    ways = [[], cuts, list(range(len(data)))]
    return [how(data, way, **kwargs) for how in (fed, received) for way in ways]


def reference(data: bytes, limits: Limits = Limits()) -> Outcome:
    """What the stream means, frame by frame: parse_header, then decode_payload (no reader)."""
    out: list[tuple[Any, ...]] = []
    pos = 0
    try:
        while pos < len(data):
            if len(data) - pos < HEADER_BYTES:
                return Outcome(out, "mid-frame", pos)
            parsed = parse_header(data[pos : pos + HEADER_BYTES], limits=limits)
            if len(data) - pos - HEADER_BYTES < parsed.length:
                return Outcome(out, "mid-frame", pos)
            start = pos + HEADER_BYTES
            pos = start + parsed.length
            payload = decode_payload(parsed, data[start:pos], limits=limits)
            out.append((parsed.type, summary(payload), parsed.request_id, parsed.flags))
    except PeerProtocolError as exc:
        return Outcome(out, str(exc), pos)
    return Outcome(out, None, pos)


def as_reference(outcome: Outcome) -> Outcome:
    """A reader's outcome with a truncation's byte count left out (the reference has none)."""
    if outcome.error is not None and outcome.error.startswith("stream ended mid-frame"):
        return outcome._replace(error="mid-frame")
    return outcome


@st.composite
def mutated_streams(draw: st.DrawFn) -> bytes:
    """Valid frames, some of them broken the ways a peer can break one."""
    frames = []
    for seed in draw(st.lists(st.sampled_from(SEEDS), min_size=1, max_size=4)):
        frame = bytearray(seed)
        how = draw(st.integers(0, 7))
        if how == 1:  # one byte anywhere, header included
            frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
        elif how == 2:  # cut short
            del frame[draw(st.integers(1, len(frame) - 1)) :]
        elif how == 3:  # a lying length
            frame[12:20] = draw(st.sampled_from(LENGTHS)).to_bytes(8, "big")
        elif how == 4:  # another type, kind or both
            frame[4:7] = draw(st.binary(min_size=3, max_size=3))
        elif how == 5:  # the magic
            frame[0:2] = draw(st.binary(min_size=2, max_size=2))
        elif how == 6:  # the version alone
            frame[2] = draw(st.integers(0, 255))
        frames.append(bytes(frame))
    return b"".join(frames)


@SETTINGS
@given(mutated_streams(), st.lists(st.integers(0, 400), max_size=4), st.sampled_from(DECODERS))
def test_fast_and_slow_paths_agree_on_any_mutated_stream(
    data: bytes, cuts: list[int], kwargs: dict[str, Any]
) -> None:
    """Fed whole (the slow path), received whole (the fast path at every frame boundary) or a
    byte at a time: the same messages, then the same error, word for word."""
    outcomes = every_way(data, [c for c in cuts if c < len(data)], **kwargs)
    assert all(outcome == outcomes[0] for outcome in outcomes[1:]), outcomes
    assert as_reference(outcomes[0]) == reference(data, kwargs.get("limits", Limits()))


@SETTINGS
@given(st.binary(max_size=300), st.sampled_from(DECODERS))
def test_fast_and_slow_paths_agree_on_random_bytes_after_a_good_frame(
    noise: bytes, kwargs: dict[str, Any]
) -> None:
    data = PING + noise
    outcomes = every_way(data, [len(data) // 2], **kwargs)
    assert all(outcome == outcomes[0] for outcome in outcomes[1:]), outcomes
    assert as_reference(outcomes[0]) == reference(data, kwargs.get("limits", Limits()))
    assert outcomes[0].messages[:1] == [(MsgType.PING, None, 0, 0)]


REGISTERED = sorted(REGISTRY.specs)


@st.composite
def headed_frames(draw: st.DrawFn) -> bytes:
    """A header with one field or none wrong (mostly right, so the others are reached)."""
    msg_type = draw(st.sampled_from(REGISTERED) | st.integers(0, 2**16 - 1))
    spec = REGISTRY.spec(msg_type)
    kind = draw(st.just(int(spec.kind)) if spec and draw(st.booleans()) else st.integers(0, 7))
    body = draw(st.binary(max_size=300))
    length = draw(st.just(len(body)) | st.sampled_from(LENGTHS) | st.integers(0, 300))
    if kind == PayloadKind.EMPTY and draw(st.booleans()):
        length = 0
    magic = draw(st.sampled_from([MAGIC, MAGIC, MAGIC, b"LD", b"\0\0", b"GE"]))
    version = draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2, 255]))
    return header(msg_type, kind, length, magic=magic, version=version, request_id=7) + body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame=headed_frames(), kwargs=st.sampled_from(DECODERS))
def test_a_frame_after_a_good_one_is_judged_exactly_as_parse_header_judges_it(
    frame: bytes, kwargs: dict[str, Any]
) -> None:
    """The second frame of a receive starts mid-buffer, where only the fast path looks at it
    first: its verdict is parse_header's (then decode_payload's), the same error text."""
    limits = kwargs.get("limits", Limits())
    msg_type = HEADER.unpack_from(frame)[3]
    body = frame[HEADER_BYTES:]
    got = received(PING + frame, [], **kwargs)
    assert got.messages[:1] == [(MsgType.PING, None, 0, 0)]
    try:
        parsed = parse_header(frame[:HEADER_BYTES], limits=limits)
    except PeerProtocolError as exc:
        assert (got.messages[1:], got.error) == ([], str(exc))
        return
    if parsed.length > len(body):  # not all here: the stream ends mid-frame
        assert got.messages[1:] == [] and got.error is not None and "mid-frame" in got.error
        return
    try:
        payload = decode_payload(parsed, body[: parsed.length], limits=limits)
    except PeerProtocolError as exc:
        assert (got.messages[1:], got.error) == ([], str(exc))
        return
    assert got.messages[1] == (msg_type, summary(payload), 7, 0)


# ---------------------------------------------------------------- each cap, exactly and one over

SMALL = Limits(max_frame_bytes=1000, max_json_bytes=300)


def json_body(length: int) -> bytes:
    """A JSON object of exactly `length` bytes."""
    return b'{"a":"' + b"x" * (length - 8) + b'"}'


@pytest.mark.parametrize(
    ("limits", "chunk_bytes", "msg_type", "kind", "length", "error"),
    [
        # the frame cap, below and above the read buffer
        (SMALL, READ_CHUNK_BYTES, MsgType.DATA_BYTES, PayloadKind.BYTES, 1000, None),
        (SMALL, READ_CHUNK_BYTES, MsgType.DATA_BYTES, PayloadKind.BYTES, 1001, "cap of 1000"),
        (SMALL, 256, MsgType.DATA_BYTES, PayloadKind.BYTES, 1000, None),
        (SMALL, 256, MsgType.DATA_BYTES, PayloadKind.BYTES, 1001, "cap of 1000"),
        # the JSON cap, under the frame cap
        (SMALL, READ_CHUNK_BYTES, MsgType.DATA_JSON, PayloadKind.JSON, 300, None),
        (SMALL, READ_CHUNK_BYTES, MsgType.DATA_JSON, PayloadKind.JSON, 301, "JSON of 301"),
        # a JSON cap over the frame cap: the frame cap holds
        (
            Limits(max_frame_bytes=200, max_json_bytes=300),
            READ_CHUNK_BYTES,
            MsgType.DATA_JSON,
            PayloadKind.JSON,
            201,
            "cap of 200",
        ),
        # AUTH_LIMITS: what a stranger may send
        (AUTH_LIMITS, READ_CHUNK_BYTES, MsgType.AUTH_RESPONSE, PayloadKind.BYTES, 4096, None),
        (AUTH_LIMITS, READ_CHUNK_BYTES, MsgType.AUTH_RESPONSE, PayloadKind.BYTES, 4097, "4096"),
        (AUTH_LIMITS, READ_CHUNK_BYTES, MsgType.DATA_JSON, PayloadKind.JSON, 4096, None),
        (AUTH_LIMITS, READ_CHUNK_BYTES, MsgType.DATA_JSON, PayloadKind.JSON, 4097, "4096"),
        # the read buffer, exactly (decoded in it) and one byte over (a buffer of its own)
        (Limits(), 256, MsgType.DATA_BYTES, PayloadKind.BYTES, 256 - HEADER_BYTES, None),
        (Limits(), 256, MsgType.DATA_BYTES, PayloadKind.BYTES, 256 - HEADER_BYTES + 1, None),
        (Limits(), 256, MsgType.DATA_JSON, PayloadKind.JSON, 256 - HEADER_BYTES, None),
        (Limits(), 256, MsgType.DATA_JSON, PayloadKind.JSON, 256 - HEADER_BYTES + 1, None),
        # an EMPTY type carries nothing, not even one byte
        (Limits(), READ_CHUNK_BYTES, MsgType.PING, PayloadKind.EMPTY, 1, "must be empty"),
        (Limits(), READ_CHUNK_BYTES, MsgType.AUTH_OK, PayloadKind.EMPTY, 1, "must be empty"),
    ],
    ids=[
        "frame_cap",
        "frame_cap_plus_1",
        "frame_cap_big_path",
        "frame_cap_plus_1_big_path",
        "json_cap",
        "json_cap_plus_1",
        "json_cap_over_frame_cap",
        "auth_bytes_cap",
        "auth_bytes_cap_plus_1",
        "auth_json_cap",
        "auth_json_cap_plus_1",
        "bytes_fill_the_buffer",
        "bytes_one_over_the_buffer",
        "json_fill_the_buffer",
        "json_one_over_the_buffer",
        "ping_with_a_byte",
        "auth_ok_with_a_byte",
    ],
)
def test_each_cap_exactly_and_one_over(
    limits: Limits, chunk_bytes: int, msg_type: int, kind: int, length: int, error: str | None
) -> None:
    """After a PING, so the frame starts mid-buffer; whole and a byte at a time. Over a cap,
    nothing is allocated; at it, a payload bigger than the buffer gets exactly its length."""
    body = json_body(length) if kind == PayloadKind.JSON else b"\x07" * length
    data = PING + header(msg_type, kind, length) + body
    for cuts in ([], list(range(len(data)))):
        for how in (fed, received):
            spy = Spy()
            got = how(data, cuts, limits=limits, chunk_bytes=chunk_bytes, allocate=spy)
            assert got.messages[0][0] == MsgType.PING
            if error is None:
                assert got.error is None and len(got.messages) == 2
                assert got.frame_bytes == len(data)
                big = HEADER_BYTES + length > chunk_bytes
                assert spy.sizes == ([length] if big else [])
            else:
                assert got.error is not None and error in got.error
                assert len(got.messages) == 1 and spy.sizes == []


@pytest.mark.parametrize("chunk_bytes", [HEADER_BYTES, 64, READ_CHUNK_BYTES])
def test_a_header_cut_at_every_offset_then_a_bad_magic(chunk_bytes: int) -> None:
    """A good frame, then one whose magic is wrong, the stream cut at every offset up to the
    end of the bad header: the good one arrives, then the bad magic is named, never more."""
    good = SEEDS[1]
    data = good + b"GE" + header(MsgType.DATA_BYTES, PayloadKind.BYTES, 2**40)[2:] + b"xyz"
    for cut in range(len(good) + HEADER_BYTES + 1):
        for how in (fed, received):
            got = how(data, [cut], chunk_bytes=chunk_bytes)
            assert [m[0] for m in got.messages] == [MsgType.DATA_TOKENS]
            assert got.error is not None and got.error.startswith("bad magic b'GE'")


def test_many_tiny_frames_in_one_buffer() -> None:
    """Thousands of frames of 20-24 bytes in one receive: each decoded in place, none lost."""
    kinds = [
        Message(MsgType.PING, request_id=1),
        Message(MsgType.DATA_TOKENS, [], request_id=2),
        Message(MsgType.DATA_TOKENS, [7], request_id=3),
        Message(MsgType.DATA_BYTES, b"", request_id=4),
        Message(MsgType.DATA_BYTES, b"!", request_id=5),
    ]
    messages = [kinds[i % len(kinds)] for i in range(5000)]
    data = b"".join(encode_bytes(m) for m in messages)
    for cuts in ([], list(range(0, len(data), 4093))):
        for how in (fed, received):
            got = how(data, cuts)
            assert got.error is None and got.frame_bytes == len(data)
            assert [m[2] for m in got.messages] == [m.request_id for m in messages]


def test_a_stream_cut_after_a_big_payload_counts_only_the_cut_frames_bytes() -> None:
    """A big payload's byte count was left behind when it completed, so a later truncation
    claimed its bytes too (177 of a 17-byte header)."""
    data = SEEDS[1] + encode_bytes(Message(MsgType.DATA_TOKENS, list(range(40))))
    data += PING[:17]
    for how in (fed, received):
        got = how(data, [], chunk_bytes=64)
        assert len(got.messages) == 2
        assert got.error == "stream ended mid-frame (17 bytes of an incomplete frame)"


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (b"GE" + PING[2:], "bad magic b'GE'"),
        (header(MsgType.PING, PayloadKind.EMPTY, 0, version=0), "unsupported protocol version 0"),
        (header(MsgType.PING, PayloadKind.EMPTY, 0, version=2), "unsupported protocol version 2"),
        (header(MsgType.PING, 9, 0), "unknown payload kind 9"),
        (header(0x7777, PayloadKind.EMPTY, 0), "unknown message type 0x7777"),
        (header(MsgType.PING, PayloadKind.BYTES, 0), "PING must carry EMPTY, frame says BYTES"),
        (header(MsgType.DATA_BYTES, PayloadKind.EMPTY, 0), "DATA_BYTES must carry BYTES"),
        (header(MsgType.PING, PayloadKind.EMPTY, 4) + b"abcd", "PING must be empty"),
        (header(MsgType.DATA_JSON, PayloadKind.JSON, 40) + json_body(40), "JSON of 40 bytes"),
        (header(MsgType.DATA_BYTES, PayloadKind.BYTES, 200) + bytes(200), "cap of 100"),
        (header(MsgType.DATA_TOKENS, PayloadKind.TOKENS, 5) + bytes(5), "whole number of int32"),
    ],
    ids=[
        "magic",
        "version_0",
        "version_2",
        "unknown_kind",
        "unknown_type",
        "empty_type_says_bytes",
        "bytes_type_says_empty",
        "empty_type_with_payload",
        "json_over_its_cap",
        "frame_over_its_cap",
        "tokens_of_5_bytes",
    ],
)
def test_a_bad_frame_whole_in_the_buffer_behind_a_good_one(bad: bytes, error: str) -> None:
    """Each field the fast path checks, wrong, in a frame it sees whole (so it alone judges it):
    refused with parse_header's words, the PING after it never decoded."""
    limits = Limits(max_frame_bytes=100, max_json_bytes=32)
    data = PING + bad + PING
    for cuts in ([], [len(PING)], list(range(len(data)))):
        for how in (fed, received):
            got = how(data, cuts, limits=limits)
            assert got.messages == [(MsgType.PING, None, 0, 0)]
            assert got.error is not None and error in got.error
            assert got.frame_bytes in (len(PING), len(PING) + len(bad))


def test_a_failed_decoder_stays_failed_on_the_receive_path() -> None:
    decoder = FrameDecoder()
    bad = b"GE" + PING[2:] + PING
    view = decoder.writable()
    view[: len(bad)] = bad
    decoder.wrote(len(bad))
    with pytest.raises(PeerProtocolError, match="bad magic"):
        decoder.next_message()
    with pytest.raises(PeerProtocolError, match="stream already failed: bad magic"):
        decoder.next_message()  # the PING after it is never trusted


# ---------------------------------------------------------------- over a socket


def over_a_socket(
    data: bytes, *, limits: Limits = Limits(), cuts: tuple[int, ...] = (), count: int = 1
) -> tuple[list[Message], Exception | None, Connection, list[int], bytes]:
    """`data` written to a Connection in pieces (the peer then ends its side); what it received,
    the error that ended it, the connection, what it allocated, and what it answered."""
    ours, theirs = socket.socketpair()
    bounds = sorted({0, len(data), *(c for c in cuts if 0 < c < len(data))})
    gap = threading.Event()

    def write() -> None:
        try:
            for start, stop in itertools.pairwise(bounds):
                theirs.sendall(data[start:stop])
                gap.wait(0.001)
            theirs.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader refused a frame before reading all of it

    writer = threading.Thread(target=write)
    writer.start()
    conn = Connection(ours, limits=limits, read_timeout_s=10, peer="test peer")
    spy = Spy()
    conn._reader._allocate = spy  # what the reader would have allocated
    got: list[Message] = []
    error: Exception | None = None
    try:
        for _ in range(count):
            got.append(conn.recv(expect=set(REGISTERED)))
    except Exception as exc:
        error = exc
    finally:
        writer.join(timeout=30)
        assert not writer.is_alive()
        ours.close()  # a socketpair: what we answered stays readable on their side
        theirs.settimeout(10)
        answer = b""
        while chunk := theirs.recv(65536):
            answer += chunk
        theirs.close()
    return got, error, conn, spy.sizes, answer


def answered(answer: bytes) -> list[tuple[int, str]]:
    decoder = FrameDecoder()
    decoder.feed(answer)
    return [(m.type, m.payload["code"]) for m in decoder]


def test_a_length_over_the_cap_allocates_nothing_and_closes_only_that_connection() -> None:
    limits = Limits(max_frame_bytes=2**20)
    data = PING + header(MsgType.DATA_BYTES, PayloadKind.BYTES, 2**20 + 1) + b"x" * 100
    got, error, conn, sizes, answer = over_a_socket(data, limits=limits, count=2)
    assert [m.type for m in got] == [MsgType.PING] or got == []  # PINGs are answered, not returned
    assert isinstance(error, PeerProtocolError) and "exceeds the cap of 1048576" in str(error)
    assert sizes == [] and conn.closed
    assert (MsgType.ERROR, "protocol_error") in answered(answer)


def test_a_length_at_the_cap_gets_exactly_its_buffer_and_a_cut_payload_is_a_truncation() -> None:
    limits = Limits(max_frame_bytes=2**20)
    data = header(MsgType.DATA_BYTES, PayloadKind.BYTES, 2**20) + b"x" * 5000
    got, error, conn, sizes, _ = over_a_socket(data, limits=limits, cuts=(7, 30, 4000))
    assert got == [] and isinstance(error, PeerProtocolError) and "mid-frame" in str(error)
    assert sizes == [2**20] and conn.closed
    assert conn._spares == [] and not conn._reader.in_payload  # the buffer let go


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 3), st.lists(st.integers(1, 2 * READ_CHUNK_BYTES), max_size=5))
def test_a_frame_that_exactly_fills_the_read_buffer_after_others_arrives_whole(
    before: int, cuts: list[int]
) -> None:
    """Frames before it leave it starting mid-buffer: the reader must make room, not allocate
    (it fits the buffer) and not take a receive of nothing for the peer closing."""
    body = bytes(range(256)) * ((READ_CHUNK_BYTES - HEADER_BYTES) // 256 + 1)
    exact = header(MsgType.DATA_BYTES, PayloadKind.BYTES, READ_CHUNK_BYTES - HEADER_BYTES)
    exact += body[: READ_CHUNK_BYTES - HEADER_BYTES]
    tokens = encode_bytes(Message(MsgType.DATA_TOKENS, [1, 2, 3]))
    data = tokens * before + exact + tokens
    got, error, conn, sizes, _ = over_a_socket(data, cuts=tuple(cuts), count=before + 2)
    assert error is None, error
    assert [m.type for m in got] == [MsgType.DATA_TOKENS] * before + [
        MsgType.DATA_BYTES,
        MsgType.DATA_TOKENS,
    ]
    assert got[before].payload == body[: READ_CHUNK_BYTES - HEADER_BYTES]
    assert sizes == [] and conn.bytes_received == len(data)


def test_many_tiny_frames_over_a_socket() -> None:
    messages = [Message(MsgType.DATA_TOKENS, [i], request_id=i + 1) for i in range(3000)]
    data = b"".join(encode_bytes(m) for m in messages)
    got, error, conn, sizes, _ = over_a_socket(data, cuts=(1, 4097, 33333), count=len(messages))
    assert error is None and sizes == []
    assert [int(m.payload[0]) for m in got] == list(range(3000))
    assert conn.bytes_received == len(data)


@pytest.mark.parametrize(
    "bad",
    [
        header(MsgType.PING, PayloadKind.EMPTY, 1) + b"x",
        header(MsgType.DATA_JSON, PayloadKind.BYTES, 2) + b"{}",
        header(0x7777, PayloadKind.BYTES, 0),
        header(MsgType.DATA_TOKENS, PayloadKind.TOKENS, 6) + b"\0" * 6,
        header(MsgType.DATA_JSON, PayloadKind.JSON, 2**20 + 1) + b"{}",
    ],
    ids=[
        "ping_with_a_byte",
        "kind_mismatch",
        "unknown_type",
        "tokens_of_6_bytes",
        "json_over_its_cap",
    ],
)
def test_a_server_closes_only_the_connection_a_bad_frame_came_on(start_server, bad: bytes) -> None:
    """The bad frame follows a good one in the same receive (the fast path judges it)."""
    server = start_server(read_timeout_s=5.0)
    with socket.create_connection(server.address) as sock:
        sock.sendall(SEEDS[0] + bad)
        sock.settimeout(HANG_GUARD_S)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    decoder = FrameDecoder()
    decoder.feed(answer)
    replies = list(decoder)
    assert [m.type for m in replies] == [MsgType.DATA_JSON, MsgType.ERROR]  # echo, then refusal
    assert replies[1].payload["code"] == "protocol_error"
    with Connection.connect(*server.address) as good:  # the server still serves
        reply = good.request(
            MsgType.DATA_TOKENS, [5, 6], expect=MsgType.DATA_TOKENS, timeout_s=HANG_GUARD_S
        )
        assert reply.payload.tolist() == [5, 6]


def test_header_fields_are_network_byte_order() -> None:
    """A length written little-endian is a huge one: refused, not read as a small frame."""
    frame = bytearray(header(MsgType.DATA_BYTES, PayloadKind.BYTES, 0))
    frame[12:20] = struct.pack("<Q", 4)
    got = received(bytes(frame) + b"abcd", [])
    assert got.messages == [] and got.error is not None and "exceeds the cap" in got.error


# ------------------------------------------------- each header field, bad, in the fast position

FAST_LIMITS = Limits(max_frame_bytes=100, max_json_bytes=32)


@pytest.mark.parametrize(
    "bad_header",
    [
        HEADER.pack(b"GE", PROTOCOL_VERSION, 0, MsgType.PING, PayloadKind.EMPTY, 0, 0),
        header(MsgType.PING, PayloadKind.EMPTY, 0, version=PROTOCOL_VERSION + 1),
        header(0x7777, PayloadKind.BYTES, 0),
        header(MsgType.DATA_JSON, PayloadKind.BYTES, 2),
        header(MsgType.DATA_BYTES, PayloadKind.BYTES, FAST_LIMITS.max_frame_bytes + 1),
        header(MsgType.DATA_JSON, PayloadKind.JSON, FAST_LIMITS.max_json_bytes + 1),
        header(MsgType.PING, PayloadKind.EMPTY, 1),
    ],
    ids=[
        "magic",
        "version",
        "unknown_type",
        "kind_mismatch",
        "length_over_frame_cap",
        "json_over_json_cap",
        "empty_with_payload",
    ],
)
def test_a_bad_header_in_the_fast_position_is_refused_in_parse_headers_words(
    bad_header: bytes,
) -> None:
    """One receive holds a good small frame, then the bad header (and enough bytes for any
    payload it declares): the second frame starts mid-buffer, where only the fast path reads it.
    Its error is parse_header's, word for word, and the decoder stays failed after it."""
    with pytest.raises(PeerProtocolError) as expected:
        parse_header(bad_header, limits=FAST_LIMITS)
    decoder = FrameDecoder(limits=FAST_LIMITS)
    data = PING + bad_header + b"{}" + PING
    view = decoder.writable()
    assert view.nbytes >= len(data)  # all of it in one receive
    view[: len(data)] = data
    decoder.wrote(len(data))
    first = decoder.next_message()
    assert first is not None and first.type == MsgType.PING
    with pytest.raises(PeerProtocolError) as got:
        decoder.next_message()
    assert str(got.value) == str(expected.value)
    failed = re.escape(f"stream already failed: {expected.value}")
    with pytest.raises(PeerProtocolError, match=failed):
        decoder.next_message()  # the PING behind it is never trusted
    with pytest.raises(PeerProtocolError, match=failed):
        decoder.feed(PING)
