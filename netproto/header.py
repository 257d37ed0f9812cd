"""netproto's frame header and the vocabulary of every frame: magic and version, payload kinds,
message types and their registry, dtype codes, the caps (`Limits`); the header's encoder and
its parser. No sockets, no payloads (`codecs`), no stream reading (`wire.FrameDecoder`).

A frame is a fixed 20-byte header followed by `length` payload bytes (see PROTOCOL.md):

    offset size field       struct  meaning
    0      2    magic       2s      b"DL"
    2      1    version     B       PROTOCOL_VERSION (1)
    3      1    flags       B       application bits, passed through untouched
    4      2    type        H       message type (registered per module range)
    6      1    kind        B       payload encoding (PayloadKind)
    7      1    reserved    x       zero
    8      4    request_id  I       echoed by replies, pairs a request with its answer
    12     8    length      Q       payload bytes, capped by Limits.max_frame_bytes

Header integers are network byte order. Bulk element data (token ids, tensor elements) is
little-endian, as torch lays it out in memory on every platform it supports, so it goes out and
comes in without a copy. Every length, count and shape read from the wire is checked against a
`Limits` and against the bytes actually present before anything is allocated.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import torch

from netproto.errors import PeerProtocolError

if sys.byteorder != "little":  # pragma: no cover - no such host is supported by torch builds
    raise ImportError("netproto sends tensor bytes as laid out in memory: little-endian hosts only")

MAGIC = b"DL"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("!2sBBHBxIQ")
HEADER_BYTES = HEADER.size
MAX_REQUEST_ID = 2**32 - 1
MAX_TYPE = 2**16 - 1
TENSOR_ALIGN = 16
"""Tensor data starts at a multiple of this offset in the payload, so it can be viewed in place."""

_U8 = struct.Struct("!B")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_TENSOR_META = struct.Struct("!BB")  # dtype code, ndim
_INT32 = torch.int32


class PayloadKind(IntEnum):
    """How a payload is encoded; carried in the header and fixed per message type."""

    EMPTY = 0
    JSON = 1
    """A UTF-8 JSON object (control messages)."""
    TOKENS = 2
    """int32 token ids, little-endian, no other framing."""
    TENSOR = 3
    """One tensor: dtype code, ndim, ndim x uint64 dims, padding, raw element bytes."""
    TENSORS = 4
    """uint32 count, then per tensor: uint16 name length, UTF-8 name, then as TENSOR."""
    BYTES = 5
    """Opaque bytes (nonces, MACs)."""


_KINDS = {int(kind): kind for kind in PayloadKind}


class MsgType(IntEnum):
    """netproto's own message types (range 0x0000-0x00FF)."""

    ERROR = 0x0001
    PING = 0x0002
    PONG = 0x0003
    BYE = 0x0004
    AUTH_CHALLENGE = 0x0010
    AUTH_RESPONSE = 0x0011
    AUTH_PROOF = 0x0012
    AUTH_OK = 0x0013
    DATA_JSON = 0x0020
    DATA_TOKENS = 0x0021
    DATA_TENSOR = 0x0022
    DATA_TENSORS = 0x0023
    DATA_BYTES = 0x0024


# Stable wire codes: never renumber, only append. Dtypes this torch lacks are skipped.
_DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "complex64",
    "complex128",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "complex32",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
DTYPE_CODES: dict[torch.dtype, int] = {
    getattr(torch, name): code
    for code, name in enumerate(_DTYPE_NAMES, start=1)
    if isinstance(getattr(torch, name, None), torch.dtype)
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Limits:
    """Caps on what a peer may make us allocate, parse or wait for; checked before allocation."""

    max_frame_bytes: int = 256 * 2**20
    max_json_bytes: int = 2**20
    max_ndim: int = 8
    max_tensors: int = 8192
    """Entries in one TENSORS payload. Real messages carry far fewer (a LoRA adapter of every
    linear layer of Llama 3 8B: 448; of a 70B model: 1,120); each entry costs CPU to decode."""
    max_name_bytes: int = 1024
    min_frame_bytes_per_s: float = 125_000.0
    """Once a frame's first byte is in, the rest must keep coming at least this fast: its first
    n bytes within `frame_grace_s + n / min_frame_bytes_per_s` of that byte, else the
    connection is closed (a peer dribbling a frame, slowloris, is cut however short each of its
    pauses). 1 Mbit/s, a tenth of the slowest link the lab's harness emulates. 0: no bound
    (a frame may then take as long as its reads each stay within the read timeout)."""
    frame_grace_s: float = 10.0
    """What any frame may take on top of its size at the minimum rate: the header's own
    deadline, and room for a stall or a lost packet's retransmission mid-frame."""

    def __post_init__(self) -> None:
        for name in (
            "max_frame_bytes",
            "max_json_bytes",
            "max_ndim",
            "max_tensors",
            "max_name_bytes",
            "frame_grace_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be > 0")
        if self.max_frame_bytes >= 2**63:
            raise ValueError("Limits.max_frame_bytes must be < 2**63")
        if not 0 <= self.min_frame_bytes_per_s < math.inf:
            raise ValueError("Limits.min_frame_bytes_per_s must be finite and >= 0")
        if not math.isfinite(self.frame_grace_s):
            raise ValueError("Limits.frame_grace_s must be finite")

    def frame_allowance_s(self, received_bytes: int) -> float:
        """How long after a frame's first byte more than its first `received_bytes` bytes may
        take to arrive (inf without a minimum rate): the frame's deadline, moved on by each
        byte that comes."""
        if not self.min_frame_bytes_per_s:
            return math.inf
        return self.frame_grace_s + received_bytes / self.min_frame_bytes_per_s


AUTH_LIMITS = Limits(
    max_frame_bytes=4096, max_json_bytes=4096, max_ndim=1, max_tensors=1, max_name_bytes=1
)
"""What an unauthenticated peer may send: a handshake, nothing bigger."""


@dataclass(frozen=True)
class MessageSpec:
    type: int
    name: str
    kind: PayloadKind
    owner: str


class Registry:
    """Known message types. Each module reserves a range of types and registers its own."""

    def __init__(self) -> None:
        self._specs: dict[int, MessageSpec] = {}
        self._ranges: list[tuple[int, int, str]] = []

    def register(
        self, owner: str, first: int, last: int, kinds: Mapping[IntEnum, PayloadKind]
    ) -> None:
        """Reserve types `first..last` for `owner` and register `kinds` (all inside the range).

        Registering the same owner and range again is a no-op (modules may be re-imported).
        """
        if not 0 <= first <= last <= MAX_TYPE:
            raise ValueError(f"bad message type range {first:#x}..{last:#x}")
        for start, stop, other in self._ranges:
            if first <= stop and start <= last and (other, start, stop) != (owner, first, last):
                raise ValueError(
                    f"{owner} range {first:#x}..{last:#x} overlaps {other}'s {start:#x}..{stop:#x}"
                )
        if (first, last, owner) not in self._ranges:
            self._ranges.append((first, last, owner))
        for member, kind in kinds.items():
            if not first <= int(member) <= last:
                raise ValueError(f"{member!r} is outside {owner}'s range {first:#x}..{last:#x}")
            self._specs[int(member)] = MessageSpec(
                int(member), member.name, PayloadKind(kind), owner
            )

    def spec(self, msg_type: int) -> MessageSpec | None:
        return self._specs.get(msg_type)

    @property
    def specs(self) -> Mapping[int, MessageSpec]:
        """Every registered type (a live view: later registrations show in it)."""
        return self._specs

    def name(self, msg_type: int) -> str:
        spec = self._specs.get(msg_type)
        return spec.name if spec else f"{msg_type:#06x}"


REGISTRY = Registry()
REGISTRY.register(
    "netproto",
    0x0000,
    0x00FF,
    {
        MsgType.ERROR: PayloadKind.JSON,
        MsgType.PING: PayloadKind.EMPTY,
        MsgType.PONG: PayloadKind.EMPTY,
        MsgType.BYE: PayloadKind.EMPTY,
        MsgType.AUTH_CHALLENGE: PayloadKind.BYTES,
        MsgType.AUTH_RESPONSE: PayloadKind.BYTES,
        MsgType.AUTH_PROOF: PayloadKind.BYTES,
        MsgType.AUTH_OK: PayloadKind.EMPTY,
        MsgType.DATA_JSON: PayloadKind.JSON,
        MsgType.DATA_TOKENS: PayloadKind.TOKENS,
        MsgType.DATA_TENSOR: PayloadKind.TENSOR,
        MsgType.DATA_TENSORS: PayloadKind.TENSORS,
        MsgType.DATA_BYTES: PayloadKind.BYTES,
    },
)


class Header(NamedTuple):
    type: int
    kind: PayloadKind
    flags: int
    request_id: int
    length: int


class Message(NamedTuple):
    """A decoded message. `payload` by kind: None, dict, int32 tensor, tensor,
    OrderedDict[str, tensor], bytes. (NamedTuples: one is built per frame, cheaply.)"""

    type: int
    payload: Any = None
    request_id: int = 0
    flags: int = 0


_new_message = tuple.__new__
"""Builds a Message from a tuple in C (NamedTuple's own __new__ is a Python function)."""

# ---------------------------------------------------------------- header


def pack_header(header: Header) -> bytes:
    return HEADER.pack(
        MAGIC,
        PROTOCOL_VERSION,
        header.flags,
        header.type,
        header.kind,
        header.request_id,
        header.length,
    )


def parse_header(
    data: bytes | bytearray | memoryview, *, limits: Limits, registry: Registry = REGISTRY
) -> Header:
    """Validate a 20-byte header; raises PeerProtocolError naming what is wrong."""
    if len(data) < HEADER_BYTES:
        raise PeerProtocolError(f"truncated header: {len(data)} of {HEADER_BYTES} bytes")
    magic, version, flags, msg_type, kind, request_id, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PeerProtocolError(
            f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a netproto peer"
        )
    if version != PROTOCOL_VERSION:
        raise PeerProtocolError(
            f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})"
        )
    if kind not in _KINDS:
        raise PeerProtocolError(f"unknown payload kind {kind}")
    spec = registry.spec(msg_type)
    if spec is None:
        raise PeerProtocolError(f"unknown message type {msg_type:#06x}")
    if spec.kind != kind:
        raise PeerProtocolError(
            f"{spec.name} must carry {spec.kind.name}, frame says {PayloadKind(kind).name}"
        )
    if length > limits.max_frame_bytes:
        raise PeerProtocolError(
            f"{spec.name} frame of {length} bytes exceeds the cap of {limits.max_frame_bytes}"
        )
    if kind == PayloadKind.EMPTY and length:
        raise PeerProtocolError(f"{spec.name} must be empty, frame says {length} bytes")
    if kind == PayloadKind.JSON and length > limits.max_json_bytes:
        raise PeerProtocolError(
            f"{spec.name} JSON of {length} bytes exceeds the cap of {limits.max_json_bytes}"
        )
    return Header(msg_type, _KINDS[kind], flags, request_id, length)
