"""Sans-IO core: round trips of every codec and dtype, and one test per malformed input."""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netproto import codecs
from netproto.codecs import encode_bytes
from netproto.connection import Connection
from netproto.errors import LocalProtocolError, PeerProtocolError
from netproto.header import (
    DTYPE_CODES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    PROTOCOL_VERSION,
    Limits,
    Message,
    MsgType,
    PayloadKind,
    Registry,
)
from netproto.wire import FrameDecoder, frames

DTYPES = sorted(DTYPE_CODES, key=DTYPE_CODES.__getitem__)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_all(data: bytes, **kwargs) -> list[Message]:
    decoder = FrameDecoder(**kwargs)
    decoder.feed(data)
    messages = list(decoder)
    decoder.close()
    return messages


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy()
    )


@st.composite
def tensors(draw: st.DrawFn, dtype: torch.dtype | None = None) -> torch.Tensor:
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        values = draw(st.binary(min_size=numel, max_size=numel))
        raw = bytes(v & 1 for v in values)
    else:
        raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(dtype: torch.dtype) -> None:
    @SETTINGS
    @given(tensors(dtype))
    def check(tensor: torch.Tensor) -> None:
        [message] = decode_all(encode_bytes(Message(MsgType.DATA_TENSOR, tensor)))
        assert same_bits(message.payload, tensor)

    check()


@SETTINGS
@given(st.dictionaries(st.text(max_size=30), tensors(), max_size=6))
def test_named_tensor_dicts_round_trip_in_order(named: dict) -> None:
    ordered = OrderedDict(named)
    [message] = decode_all(encode_bytes(Message(MsgType.DATA_TENSORS, ordered)))
    assert list(message.payload) == list(ordered)
    assert all(same_bits(message.payload[k], v) for k, v in ordered.items())


@SETTINGS
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300),
    st.integers(0, 2**32 - 1),
    st.integers(0, 255),
)
def test_tokens_round_trip_with_request_id_and_flags(
    tokens: list[int], request_id: int, flags: int
) -> None:
    [message] = decode_all(encode_bytes(Message(MsgType.DATA_TOKENS, tokens, request_id, flags)))
    assert message.payload.dtype == torch.int32
    assert message.payload.tolist() == tokens
    assert (message.request_id, message.flags) == (request_id, flags)


@SETTINGS
@given(st.dictionaries(st.text(max_size=10), json_values, max_size=6))
def test_json_control_messages_round_trip(body: dict) -> None:
    [message] = decode_all(encode_bytes(Message(MsgType.DATA_JSON, body)))
    assert message.payload == json.loads(json.dumps(body))


@SETTINGS
@given(
    st.lists(st.sampled_from(["json", "tokens", "tensor", "bytes", "ping"]), max_size=8),
    st.integers(1, 64),
)
def test_a_stream_split_anywhere_decodes_to_the_same_messages(kinds: list[str], chunk: int) -> None:
    payloads = {
        "json": (MsgType.DATA_JSON, {"a": 1}),
        "tokens": (MsgType.DATA_TOKENS, [5, 6]),
        "tensor": (MsgType.DATA_TENSOR, torch.arange(6.0).view(2, 3)),
        "bytes": (MsgType.DATA_BYTES, b"\x00\xff"),
        "ping": (MsgType.PING, None),
    }
    messages = [Message(*payloads[k], request_id=i) for i, k in enumerate(kinds)]
    data = frames(messages)
    decoder = FrameDecoder()
    out: list[Message] = []
    for start in range(0, len(data), chunk):
        decoder.feed(data[start : start + chunk])
        out.extend(decoder)
    decoder.close()
    assert [(m.type, m.request_id) for m in out] == [(m.type, m.request_id) for m in messages]


def test_received_tensors_are_views_of_one_buffer_and_aligned() -> None:
    tensors_in = OrderedDict(a=torch.arange(3, dtype=torch.int8), b=torch.randn(5, 7))
    [message] = decode_all(encode_bytes(Message(MsgType.DATA_TENSORS, tensors_in)))
    a, b = message.payload["a"], message.payload["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert (b.data_ptr() - b.untyped_storage().data_ptr()) % 16 == 0
    torch.testing.assert_close(b, tensors_in["b"])


def test_noncontiguous_and_cuda_free_tensors_are_sent_by_value() -> None:
    t = torch.arange(12.0).view(3, 4).t()  # non-contiguous
    [message] = decode_all(encode_bytes(Message(MsgType.DATA_TENSOR, t)))
    assert torch.equal(message.payload, t)


# ------------------------------------------------------------------ malformed input

GOOD = encode_bytes(Message(MsgType.DATA_JSON, {"ok": True}))


def header(
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    flags: int = 0,
    msg_type: int = MsgType.DATA_JSON,
    kind: int = PayloadKind.JSON,
    request_id: int = 0,
    length: int = 0,
) -> bytes:
    return HEADER.pack(magic, version, flags, msg_type, kind, request_id, length)


def expect_peer_error(data: bytes, match: str, *, limits: Limits = Limits()) -> None:
    """`data` is refused by the sans-IO decoder and by the production reader (a Connection over
    a socket), which also answers `protocol_error` saying the same (unless the frame was cut
    short: the peer is gone)."""
    with pytest.raises(PeerProtocolError, match=match):
        decode_all(data, limits=limits)
    ours, theirs = socket.socketpair()

    def send_and_end() -> None:
        try:
            theirs.sendall(data)
            theirs.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader refused the frame before reading all of it

    writer = threading.Thread(target=send_and_end)
    writer.start()
    try:
        conn = Connection(ours, limits=limits, read_timeout_s=10, peer="test peer")
        with pytest.raises(PeerProtocolError, match=match):
            while True:
                conn.recv()
        assert conn.closed
        writer.join(timeout=30)
        assert not writer.is_alive()
        theirs.settimeout(10)
        answer = FrameDecoder()
        while chunk := theirs.recv(65536):
            answer.feed(chunk)
        replies = list(answer)
    finally:
        ours.close()
        theirs.close()
    if "mid-frame" not in match:
        assert [(m.type, m.payload["code"]) for m in replies] == [(MsgType.ERROR, "protocol_error")]
        assert re.search(match, replies[0].payload["message"])


def test_bad_magic() -> None:
    expect_peer_error(b"GE" + GOOD[2:], "bad magic")


def test_http_request_is_not_a_netproto_peer() -> None:
    expect_peer_error(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "not a netproto peer")


def test_bad_version() -> None:
    expect_peer_error(
        header(version=PROTOCOL_VERSION + 1) + b"{}", "unsupported protocol version 2"
    )


def test_truncated_header() -> None:
    expect_peer_error(GOOD[: HEADER_BYTES - 3], "mid-frame")


def test_truncated_payload() -> None:
    expect_peer_error(GOOD[:-2], "mid-frame")


def test_length_over_the_frame_cap_is_refused_before_the_payload_arrives() -> None:
    decoder = FrameDecoder(limits=Limits(max_frame_bytes=1024))
    with pytest.raises(PeerProtocolError, match="exceeds the cap of 1024"):
        decoder.feed(header(msg_type=MsgType.DATA_BYTES, kind=PayloadKind.BYTES, length=2**62))
        decoder.next_message()


def test_json_over_its_cap() -> None:
    expect_peer_error(
        header(length=5000) + b" " * 5000,
        "JSON of 5000 bytes exceeds",
        limits=Limits(max_json_bytes=4096),
    )


def test_json_nested_thousands_deep() -> None:
    body = b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"
    expect_peer_error(header(length=len(body)) + body, "bad JSON \\(nested too deeply\\)")


def test_json_integer_of_5000_digits() -> None:
    body = b'{"a":' + b"7" * 5000 + b"}"
    expect_peer_error(header(length=len(body)) + body, "bad JSON .*integer string conversion")


@pytest.mark.parametrize("number", [b"1e999", b"-1e999", b"1" + b"0" * 400 + b".0"])
def test_json_number_too_big_for_a_float(number: bytes) -> None:
    """Python would read these as infinity: as non-finite as a literal Infinity."""
    body = b'{"temperature":' + number + b"}"
    expect_peer_error(header(length=len(body)) + body, "bad JSON .*is not finite")


def test_unknown_message_type() -> None:
    expect_peer_error(header(msg_type=0x7777), "unknown message type 0x7777")


def test_unknown_payload_kind() -> None:
    expect_peer_error(header(kind=99), "unknown payload kind 99")


def test_kind_that_does_not_match_the_type() -> None:
    expect_peer_error(
        header(kind=PayloadKind.TOKENS, length=4) + b"\0" * 4, "DATA_JSON must carry JSON"
    )


def test_bad_json() -> None:
    expect_peer_error(header(length=5) + b"{nope", "bad JSON")


def test_json_that_is_not_an_object() -> None:
    expect_peer_error(header(length=2) + b"[]", "must be an object")


def test_non_utf8_json() -> None:
    expect_peer_error(header(length=4) + b'"\xff"\n', "bad JSON")


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_json_with_a_non_finite_number(constant: bytes) -> None:
    """Python's json would read them; the encoder never writes them; a peer's are refused."""
    body = b'{"temperature":' + constant + b"}"
    expect_peer_error(
        header(length=len(body)) + body, f"{constant.decode().lstrip('-')} is not JSON"
    )


def test_empty_message_with_a_payload() -> None:
    expect_peer_error(
        header(msg_type=MsgType.PING, kind=PayloadKind.EMPTY, length=1) + b"x", "must be empty"
    )


def test_tokens_not_a_multiple_of_four_bytes() -> None:
    expect_peer_error(
        header(msg_type=MsgType.DATA_TOKENS, kind=PayloadKind.TOKENS, length=6) + b"\0" * 6,
        "not a whole number of int32 tokens",
    )


def tensor_frame(meta: bytes, data: bytes) -> bytes:
    payload = meta + data
    return (
        header(msg_type=MsgType.DATA_TENSOR, kind=PayloadKind.TENSOR, length=len(payload)) + payload
    )


def tensor_meta(code: int, shape: list[int]) -> bytes:
    meta = struct.pack("!BB", code, len(shape)) + b"".join(struct.pack("!Q", d) for d in shape)
    return meta + bytes(-len(meta) % 16)


FLOAT32 = DTYPE_CODES[torch.float32]


def test_tensor_with_unknown_dtype_code() -> None:
    expect_peer_error(tensor_frame(tensor_meta(250, [1]), b"\0"), "unknown dtype code 250")


def test_tensor_ndim_over_the_cap() -> None:
    expect_peer_error(
        tensor_frame(tensor_meta(FLOAT32, [1] * 9), b"\0" * 4), "ndim 9 exceeds max_ndim 8"
    )


def test_tensor_shape_claiming_more_bytes_than_sent() -> None:
    expect_peer_error(
        tensor_frame(tensor_meta(FLOAT32, [1000, 1000]), b"\0" * 16), "needs more than"
    )


def test_tensor_shape_whose_product_overflows_int64() -> None:
    expect_peer_error(
        tensor_frame(tensor_meta(FLOAT32, [2**27, 2**27, 2**27]), b"\0" * 16), "needs more than"
    )


def test_empty_tensor_with_an_absurd_dim() -> None:
    expect_peer_error(tensor_frame(tensor_meta(FLOAT32, [2**63, 0]), b""), "dim over the frame cap")


def test_empty_tensor_whose_other_dims_would_overflow_its_strides() -> None:
    """Each dim under the cap, no elements, but strides of 2**196: torch would raise."""
    expect_peer_error(
        tensor_frame(tensor_meta(FLOAT32, [0] + [2**28] * 7), b""), "product exceeds the frame cap"
    )


def test_empty_tensor_with_overflowing_dims_inside_a_tensor_dict() -> None:
    shape = [2**28, 2**28, 0, 2**28]
    payload = struct.pack("!IH", 1, 1) + b"w" + struct.pack("!BB4Q", FLOAT32, 4, *shape)
    payload += bytes(-len(payload) % 16)  # the elements (none) start 16-aligned
    expect_peer_error(tensors_frame(payload), "product exceeds the frame cap")


def test_empty_tensor_with_large_dims_under_the_cap_decodes() -> None:
    [message] = decode_all(tensor_frame(tensor_meta(FLOAT32, [0, 2**20, 64]), b""))
    assert message.payload.shape == (0, 2**20, 64)


def test_tensor_shape_claiming_fewer_bytes_than_sent() -> None:
    expect_peer_error(tensor_frame(tensor_meta(FLOAT32, [2]), b"\0" * 12), "payload has 12")


def test_tensor_meta_truncated() -> None:
    expect_peer_error(tensor_frame(struct.pack("!BB", FLOAT32, 3) + b"\0" * 4, b""), "truncated")


def test_tensor_nonzero_padding() -> None:
    meta = bytearray(tensor_meta(FLOAT32, [1]))
    meta[-1] = 7
    expect_peer_error(tensor_frame(bytes(meta), b"\0" * 4), "nonzero padding")


def test_bool_tensor_holding_other_bytes() -> None:
    expect_peer_error(
        tensor_frame(tensor_meta(DTYPE_CODES[torch.bool], [2]), b"\x01\x02"), "other than 0 and 1"
    )


def tensors_frame(payload: bytes) -> bytes:
    return (
        header(msg_type=MsgType.DATA_TENSORS, kind=PayloadKind.TENSORS, length=len(payload))
        + payload
    )


def test_tensor_dict_count_over_the_cap() -> None:
    expect_peer_error(tensors_frame(struct.pack("!I", 10**9)), "exceed max_tensors")


def test_tensor_dict_count_larger_than_its_entries() -> None:
    expect_peer_error(tensors_frame(struct.pack("!I", 3)), "truncated")


def test_tensor_dict_count_its_bytes_cannot_hold() -> None:
    expect_peer_error(
        tensors_frame(struct.pack("!I", 8000) + bytes(100)), "8000 tensors cannot fit in 100 bytes"
    )


def test_tensor_dict_at_the_default_cap_decodes_and_one_more_is_refused() -> None:
    cap = Limits().max_tensors
    assert cap >= 2 * 1120  # every linear layer's LoRA pair of a 70B Llama, with margin
    at_cap = {f"layer{i}": torch.full((2,), float(i)) for i in range(cap)}
    [message] = decode_all(encode_bytes(Message(MsgType.DATA_TENSORS, at_cap)))
    assert list(message.payload) == list(at_cap)
    assert torch.equal(message.payload[f"layer{cap - 1}"], at_cap[f"layer{cap - 1}"])
    over = {**at_cap, "one_more": torch.zeros(1)}
    with pytest.raises(LocalProtocolError, match="exceed max_tensors"):
        encode_bytes(Message(MsgType.DATA_TENSORS, over))
    frame = encode_bytes(Message(MsgType.DATA_TENSORS, over), limits=Limits(max_tensors=cap + 1))
    expect_peer_error(frame, f"{cap + 1} tensors exceed max_tensors {cap}")


def test_tensors_of_every_rank_come_back_as_views_of_the_payload() -> None:
    tensors_in = OrderedDict(
        scalar=torch.tensor(3.5, dtype=torch.float64),
        vector=torch.arange(5, dtype=torch.int16),
        matrix=torch.randn(3, 4),
        cube=torch.arange(24, dtype=torch.uint8).view(2, 3, 4),
        flags=torch.tensor([[True, False], [False, True]]),
    )
    [message] = decode_all(encode_bytes(Message(MsgType.DATA_TENSORS, tensors_in)))
    storage = message.payload["scalar"].untyped_storage().data_ptr()
    for name, tensor in tensors_in.items():
        received = message.payload[name]
        assert same_bits(received, tensor) and received.is_contiguous(), name
        assert received.untyped_storage().data_ptr() == storage, name


def test_decoder_bug_is_still_answered_as_the_peers_protocol_error(monkeypatch) -> None:
    """An error no check anticipated still maps to protocol_error, never to `internal`."""

    def broken(*args, **kwargs):
        raise RuntimeError("Stride calculation overflowed")

    monkeypatch.setattr(codecs, "_read_tensor", broken)  # where the payload decoder lives
    expect_peer_error(
        encode_bytes(Message(MsgType.DATA_TENSOR, torch.zeros(2))),
        r"undecodable payload \(RuntimeError: Stride calculation overflowed\)",
    )


def test_tensor_dict_name_over_the_cap() -> None:
    expect_peer_error(
        tensors_frame(struct.pack("!IH", 1, 5000) + b"x" * 5000), "name of 5000 bytes exceeds"
    )


def test_tensor_dict_name_not_utf8() -> None:
    expect_peer_error(tensors_frame(struct.pack("!IH", 1, 2) + b"\xff\xfe"), "not UTF-8")


def test_tensor_dict_duplicate_names() -> None:
    good = encode_bytes(Message(MsgType.DATA_TENSORS, {"w": torch.zeros(1)}))
    entry = good[HEADER_BYTES + 4 :]
    expect_peer_error(tensors_frame(struct.pack("!I", 2) + entry + entry), "duplicate tensor name")


def test_tensor_dict_trailing_bytes() -> None:
    good = encode_bytes(Message(MsgType.DATA_TENSORS, {"w": torch.zeros(1)}))
    expect_peer_error(tensors_frame(good[HEADER_BYTES:] + b"junk"), "bytes after the last tensor")


def test_decoder_stays_failed_after_a_protocol_error() -> None:
    decoder = FrameDecoder()
    decoder.feed(b"XX" + GOOD[2:])
    with pytest.raises(PeerProtocolError):
        decoder.next_message()
    with pytest.raises(PeerProtocolError, match="already failed"):
        decoder.feed(GOOD)


# ------------------------------------------------------------------ sending side


def test_sending_what_the_protocol_cannot_carry_is_our_error() -> None:
    with pytest.raises(LocalProtocolError, match="exceeds max_frame_bytes"):
        encode_bytes(Message(MsgType.DATA_BYTES, b"x" * 2000), limits=Limits(max_frame_bytes=1000))
    with pytest.raises(LocalProtocolError, match="not registered"):
        encode_bytes(Message(0x7777, None))
    with pytest.raises(LocalProtocolError, match="int32"):
        encode_bytes(Message(MsgType.DATA_TOKENS, [2**40]))
    with pytest.raises(LocalProtocolError, match="JSON-serializable"):
        encode_bytes(Message(MsgType.DATA_JSON, {"x": object()}))
    with pytest.raises(LocalProtocolError, match="must be a dict"):
        encode_bytes(Message(MsgType.DATA_JSON, [1, 2]))
    with pytest.raises(LocalProtocolError, match="max_ndim"):
        encode_bytes(Message(MsgType.DATA_TENSOR, torch.zeros([1] * 9)))


def test_modules_register_their_own_ranges_without_overlap() -> None:
    from enum import IntEnum

    class Mine(IntEnum):
        HELLO = 0x0901

    registry = Registry()
    registry.register("mine", 0x0900, 0x09FF, {Mine.HELLO: PayloadKind.JSON})
    registry.register("mine", 0x0900, 0x09FF, {Mine.HELLO: PayloadKind.JSON})  # re-import: ok
    assert registry.name(0x0901) == "HELLO"
    with pytest.raises(ValueError, match="overlaps mine"):
        registry.register("theirs", 0x09F0, 0x0A0F, {})
    with pytest.raises(ValueError, match="outside"):
        registry.register("other", 0x0B00, 0x0BFF, {Mine.HELLO: PayloadKind.JSON})
