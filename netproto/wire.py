"""The sans-IO core of netproto: frames <-> typed messages. No sockets here.

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

import array
import json
import math
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np
import torch

from netproto.errors import LocalProtocolError, PeerProtocolError

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


# ---------------------------------------------------------------- encoding


Buffer = bytes | bytearray | memoryview


_NUMPY_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    }
)


def _element_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's elements as bytes, without a copy when it is already contiguous on CPU."""
    if not (tensor.is_cpu and tensor.is_contiguous()):
        tensor = tensor.detach().to("cpu").contiguous()
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.numel() == 0:
        return memoryview(b"")
    if tensor.dtype in _NUMPY_DTYPES and tensor.dim():  # the cheap path (a few microseconds)
        return tensor.numpy().data.cast("B")
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _padding(offset: int) -> int:
    return -offset % TENSOR_ALIGN


def _tensor_parts(tensor: torch.Tensor, offset: int, limits: Limits) -> list[Buffer]:
    """Meta + padding + data of one tensor whose meta starts at payload offset `offset`."""
    code = DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise LocalProtocolError(f"dtype {tensor.dtype} cannot travel over netproto")
    if tensor.dim() > limits.max_ndim:
        raise LocalProtocolError(
            f"tensor of {tensor.dim()} dims exceeds max_ndim {limits.max_ndim}"
        )
    meta = _TENSOR_META.pack(code, tensor.dim()) + b"".join(_U64.pack(d) for d in tensor.shape)
    pad = _padding(offset + len(meta))
    return [meta + bytes(pad), _element_bytes(tensor)]


def encode_payload(kind: PayloadKind, payload: Any, *, limits: Limits) -> list[Buffer]:
    """The payload of a message as buffers ready for a scatter-gather send."""
    if kind == PayloadKind.EMPTY:
        if payload is not None:
            raise LocalProtocolError("an EMPTY message carries no payload")
        return []
    if kind == PayloadKind.JSON:
        if not isinstance(payload, Mapping):
            raise LocalProtocolError(f"JSON payload must be a dict, not {type(payload).__name__}")
        try:
            data = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise LocalProtocolError(f"payload is not JSON-serializable: {exc}") from exc
        if len(data) > limits.max_json_bytes:
            raise LocalProtocolError(
                f"JSON of {len(data)} bytes exceeds max_json_bytes {limits.max_json_bytes}"
            )
        return [data]
    if kind == PayloadKind.TOKENS:
        return [_token_bytes(payload)]
    if kind == PayloadKind.TENSOR:
        if not isinstance(payload, torch.Tensor):
            raise LocalProtocolError(f"TENSOR payload must be a tensor, not {type(payload)}")
        return _tensor_parts(payload, 0, limits)
    if kind == PayloadKind.TENSORS:
        return _encode_tensor_dict(payload, limits)
    if kind == PayloadKind.BYTES:
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise LocalProtocolError(f"BYTES payload must be bytes, not {type(payload)}")
        return [payload]
    raise LocalProtocolError(f"unknown payload kind {kind}")  # pragma: no cover


def _token_bytes(tokens: Any) -> Buffer:
    """int32 little-endian bytes of token ids: no conversion when they already are int32."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype == torch.int32 and tokens.dim() <= 1:
            return _element_bytes(tokens)
        return _element_bytes(_as_token_tensor(tokens))
    try:
        return memoryview(array.array("i", tokens)).cast("B")
    except OverflowError:
        raise LocalProtocolError("token ids must fit in int32") from None
    except TypeError as exc:
        raise LocalProtocolError(f"tokens must be integers: {exc}") from None


def _as_token_tensor(tokens: Any) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dim() > 1:
            raise LocalProtocolError(
                f"tokens must be a 1-D integer tensor, got {tokens.dtype} "
                f"of shape {tuple(tokens.shape)}"
            )
        wide = tokens.to(torch.int64)
    else:
        try:
            wide = torch.tensor(list(tokens), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise LocalProtocolError(f"tokens must be integers: {exc}") from exc
    wide = wide.reshape(-1)
    if wide.numel() and (wide.min() < -(2**31) or wide.max() >= 2**31):
        raise LocalProtocolError("token ids must fit in int32")
    return wide.to(torch.int32)


def _encode_tensor_dict(tensors: Any, limits: Limits) -> list[Buffer]:
    if not isinstance(tensors, Mapping):
        raise LocalProtocolError(f"TENSORS payload must be a mapping, not {type(tensors)}")
    if len(tensors) > limits.max_tensors:
        raise LocalProtocolError(f"{len(tensors)} tensors exceed max_tensors {limits.max_tensors}")
    parts: list[Buffer] = [_U32.pack(len(tensors))]
    offset = _U32.size
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise LocalProtocolError("TENSORS payload must map str names to tensors")
        raw_name = name.encode()
        if len(raw_name) > limits.max_name_bytes:
            raise LocalProtocolError(
                f"tensor name of {len(raw_name)} bytes exceeds "
                f"max_name_bytes {limits.max_name_bytes}"
            )
        head = _U16.pack(len(raw_name)) + raw_name
        meta, data = _tensor_parts(tensor, offset + len(head), limits)
        parts += [head + meta, data]
        offset += len(head) + len(meta) + len(data)
    return parts


def encode_frame(
    spec: MessageSpec, payload: Any, request_id: int, flags: int, limits: Limits
) -> tuple[list[Buffer], int]:
    """Header + payload buffers of one frame of a registered type (send them in order), and
    the frame's size in bytes.

    This runs once per message on every connection, so it builds nothing it does not send:
    empty messages and token ids that already are a 1-D int32 CPU tensor take a short path.
    """
    if not (0 <= request_id <= MAX_REQUEST_ID and 0 <= flags <= 255):
        raise LocalProtocolError("request_id must fit in uint32 and flags in uint8")
    kind = spec.kind
    if payload is None and kind is PayloadKind.EMPTY:
        return [HEADER.pack(MAGIC, PROTOCOL_VERSION, flags, spec.type, kind, request_id, 0)], (
            HEADER_BYTES
        )
    if kind is PayloadKind.TOKENS and type(payload) is torch.Tensor and payload.dtype is _INT32:
        try:  # numpy() refuses what cannot be viewed as plain CPU memory (grad, device)
            array = payload.numpy()
        except (RuntimeError, TypeError):
            array = None
        if array is not None and array.ndim == 1:
            data = array.tobytes()  # C order, whatever the strides
            length = len(data)
            if length <= limits.max_frame_bytes:
                header = HEADER.pack(
                    MAGIC, PROTOCOL_VERSION, flags, spec.type, kind, request_id, length
                )
                return [header, data], HEADER_BYTES + length
    parts = encode_payload(kind, payload, limits=limits)
    length = sum(memoryview(p).nbytes for p in parts)
    if length > limits.max_frame_bytes:
        raise LocalProtocolError(
            f"{spec.name} of {length} bytes exceeds max_frame_bytes {limits.max_frame_bytes}"
        )
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, flags, spec.type, kind, request_id, length)
    return [header, *parts], HEADER_BYTES + length


def registered(msg_type: int, registry: Registry) -> MessageSpec:
    """The spec of a type we are about to send; LocalProtocolError if it is not registered."""
    spec = registry.spec(msg_type)
    if spec is None:
        raise LocalProtocolError(f"message type {msg_type:#06x} is not registered")
    return spec


def encode(
    message: Message, *, limits: Limits = Limits(), registry: Registry = REGISTRY
) -> list[Buffer]:
    """Header + payload buffers of `message` (send them in order, e.g. with sendmsg)."""
    spec = registered(message.type, registry)
    parts, _ = encode_frame(spec, message.payload, message.request_id, message.flags, limits)
    return parts


def encode_bytes(message: Message, **kwargs: Any) -> bytes:
    """The whole frame as one bytes object (tests, small messages)."""
    return b"".join(bytes(p) for p in encode(message, **kwargs))


# ---------------------------------------------------------------- decoding


_ZERO_PAD = bytes(TENSOR_ALIGN)
_DIMS = tuple(struct.Struct(f"!{ndim}Q") for ndim in range(256))  # ndim is one byte
MIN_ENTRY_BYTES = 4
"""Fewest bytes a TENSORS entry takes (name length and dtype/ndim): bounds a count early."""


class _Reader:
    """Bounds-checked cursor over a (length,) uint8 payload buffer.

    Fields are unpacked from a memoryview of the buffer (no tensor op per field) and tensors
    are views of one whole-buffer view per dtype, so each entry costs a few microseconds.
    """

    def __init__(self, buffer: torch.Tensor, what: str) -> None:
        self.buffer = buffer
        self.array = buffer.numpy()
        self.view = self.array.data
        self.size = buffer.numel()
        self.pos = 0
        self.what = what
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def take(self, count: int) -> memoryview:
        if count > self.size - self.pos:
            raise PeerProtocolError(
                f"{self.what}: payload truncated ({count} bytes needed, {self.remaining} left)"
            )
        start = self.pos
        self.pos += count
        return self.view[start : self.pos]

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        return fmt.unpack(self.take(fmt.size))

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer's whole elements viewed as `dtype` (made once per dtype and payload)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self.buffer[: self.size - self.size % dtype.itemsize].view(dtype)
            self._typed[dtype] = typed
        return typed


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return strides[::-1]


def _read_tensor(reader: _Reader, limits: Limits, *, exact: bool) -> torch.Tensor:
    what = reader.what
    code, ndim = reader.unpack(_TENSOR_META)
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise PeerProtocolError(f"{what}: unknown dtype code {code}")
    if ndim > limits.max_ndim:
        raise PeerProtocolError(f"{what}: ndim {ndim} exceeds max_ndim {limits.max_ndim}")
    shape = list(reader.unpack(_DIMS[ndim]))
    if any(dim > limits.max_frame_bytes for dim in shape):
        raise PeerProtocolError(f"{what}: shape {shape} has a dim over the frame cap")
    pad = _padding(reader.pos)
    if reader.take(pad) != _ZERO_PAD[:pad]:
        raise PeerProtocolError(f"{what}: nonzero padding")
    itemsize = dtype.itemsize
    if 0 in shape:
        # No elements, but torch still computes strides from the other dims: bound them, as if
        # the tensor were full, so no stride can overflow.
        extent = 1
        for dim in shape:
            extent *= dim or 1
            if extent > limits.max_frame_bytes:
                raise PeerProtocolError(
                    f"{what}: empty tensor of shape {shape} has other dims whose product "
                    f"exceeds the frame cap"
                )
        numel = 0
    else:
        numel = 1
        for dim in shape:  # dims >= 1: the product only grows; stop once too big
            numel *= dim
            if numel * itemsize > reader.remaining:
                raise PeerProtocolError(
                    f"{what}: shape {shape} of {dtype} needs more than "
                    f"the {reader.remaining} bytes left"
                )
    nbytes = numel * itemsize
    if exact and nbytes != reader.remaining:
        raise PeerProtocolError(
            f"{what}: shape {shape} of {dtype} is {nbytes} bytes, payload has {reader.remaining}"
        )
    offset = reader.pos
    reader.take(nbytes)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool and int(reader.array[offset : offset + nbytes].max()) > 1:
        raise PeerProtocolError(f"{what}: bool tensor holds bytes other than 0 and 1")
    typed = reader.typed(dtype)
    first = offset // itemsize  # data starts 16-aligned: a whole number of elements in
    if ndim == 1:
        return typed[first : first + numel]
    return typed.as_strided(shape, _contiguous_strides(shape), typed.storage_offset() + first)


def decode_payload(
    header: Header,
    payload: torch.Tensor | Buffer,
    *,
    limits: Limits,
    registry: Registry = REGISTRY,
) -> Any:
    """Decode a complete payload of `header.length` bytes (a uint8 tensor, or bytes).

    Tensors come back as views into a uint8 tensor payload (no copy); they keep it alive. A
    payload given as bytes (or a view of a read buffer) is copied out first where needed.
    Whatever is wrong with the payload raises PeerProtocolError, never another exception.
    """
    kind = header.kind
    if kind is PayloadKind.TOKENS and not isinstance(payload, torch.Tensor):
        # the commonest small frame, decoded without the general path's bookkeeping
        length = header.length
        if memoryview(payload).nbytes == length and not length % 4:
            if not length:
                return torch.empty(0, dtype=torch.int32)
            return torch.frombuffer(bytearray(payload), dtype=torch.int32)
    what = registry.name(header.type)
    try:
        return _decode_payload(header, payload, limits, what)
    except PeerProtocolError:
        raise
    except (ArithmeticError, LookupError, RuntimeError, TypeError, ValueError, struct.error) as exc:
        # A case the checks above missed is still the peer's bytes: refuse them, say what broke.
        raise PeerProtocolError(
            f"{what}: undecodable payload ({type(exc).__name__}: {exc})"
        ) from None


def _decode_payload(
    header: Header, payload: torch.Tensor | Buffer, limits: Limits, what: str
) -> Any:
    size = payload.numel() if isinstance(payload, torch.Tensor) else memoryview(payload).nbytes
    if size != header.length:
        raise PeerProtocolError(f"{what}: {size} payload bytes, header says {header.length}")
    kind = header.kind
    if kind == PayloadKind.EMPTY:
        return None
    if kind in (PayloadKind.BYTES, PayloadKind.JSON, PayloadKind.TOKENS):
        data = payload.numpy().tobytes() if isinstance(payload, torch.Tensor) else bytes(payload)
        if kind == PayloadKind.BYTES:
            return data
        if kind == PayloadKind.TOKENS:
            if header.length % 4:
                raise PeerProtocolError(
                    f"{what}: {header.length} bytes is not a whole number of int32 tokens"
                )
            if not data:
                return torch.empty(0, dtype=torch.int32)
            return torch.frombuffer(bytearray(data), dtype=torch.int32)
        return _decode_json(data, what)
    if not isinstance(payload, torch.Tensor):  # tensors are viewed in place: own the bytes
        raw = payload
        payload = new_payload_buffer(header.length)
        if header.length:
            payload.numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
    reader = _Reader(payload, what)
    if kind == PayloadKind.TENSOR:
        return _read_tensor(reader, limits, exact=True)
    # TENSORS
    (count,) = reader.unpack(_U32)
    if count > limits.max_tensors:
        raise PeerProtocolError(f"{what}: {count} tensors exceed max_tensors {limits.max_tensors}")
    if count * MIN_ENTRY_BYTES > reader.remaining:
        raise PeerProtocolError(
            f"{what}: payload truncated ({count} tensors cannot fit in {reader.remaining} bytes)"
        )
    tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
    for _ in range(count):
        (name_len,) = reader.unpack(_U16)
        if name_len > limits.max_name_bytes:
            raise PeerProtocolError(
                f"{what}: tensor name of {name_len} bytes exceeds "
                f"max_name_bytes {limits.max_name_bytes}"
            )
        try:
            name = str(reader.take(name_len), "utf-8")
        except UnicodeDecodeError:
            raise PeerProtocolError(f"{what}: tensor name is not UTF-8") from None
        if name in tensors:
            raise PeerProtocolError(f"{what}: duplicate tensor name {name!r}")
        tensors[name] = _read_tensor(reader, limits, exact=False)
    if reader.remaining:
        raise PeerProtocolError(f"{what}: {reader.remaining} bytes after the last tensor")
    return tensors


def _decode_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(
            data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float
        )
    except RecursionError:
        raise PeerProtocolError(f"{what}: bad JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of 4300+ digits
        raise PeerProtocolError(f"{what}: bad JSON ({exc})") from None
    if not isinstance(value, dict):
        raise PeerProtocolError(
            f"{what}: JSON payload must be an object, got {type(value).__name__}"
        )
    return value


def _no_constant(name: str) -> Any:
    """JSON has no NaN or Infinity: the encoder refuses them (allow_nan=False), so does this."""
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    """A JSON number as a float; one too big for a float (1e999) would be infinite: refused."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]}{'...' if len(text) > 32 else ''} is not finite")
    return value


def new_payload_buffer(length: int) -> torch.Tensor:
    """An uninitialised (length,) uint8 buffer to receive a payload into."""
    return torch.empty(length, dtype=torch.uint8)


READ_CHUNK_BYTES = 64 * 1024
"""A frame of up to this size (header and payload) is read into, and decoded in, one buffer."""

PayloadAllocator = Callable[[int], torch.Tensor]


class FrameDecoder:
    """The one frame reader (sans-IO): bytes in, typed messages out.

    A connection receives straight into `writable()` and reports how many bytes came with
    `wrote(n)`; tests and fuzzers `feed()` bytes. Both take the same path. A frame that fits
    the read buffer (header and payload) is decoded where it lies, usually after one receive;
    a bigger payload gets a buffer of its own, allocated (by `allocate`) only once its header
    has passed the caps, and `writable()` then points into that buffer, so the rest of it is
    received in place and its tensors are views of it.

    After a PeerProtocolError it stays broken (every later call raises): the caller must close
    the connection, since the byte stream can no longer be trusted.
    """

    def __init__(
        self,
        *,
        limits: Limits = Limits(),
        registry: Registry = REGISTRY,
        allocate: PayloadAllocator = new_payload_buffer,
        chunk_bytes: int = READ_CHUNK_BYTES,
    ) -> None:
        if chunk_bytes < HEADER_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes} cannot hold a header")
        self.registry = registry
        self._specs = registry.specs
        self.frame_bytes = 0
        """Bytes of the whole frames decoded so far (headers included)."""
        self._allocate = allocate
        self._buffer = memoryview(bytearray(chunk_bytes))
        self._pos = 0  # unread bytes are self._buffer[self._pos:self._end]
        self._end = 0
        self._header: Header | None = None  # parsed; its payload has not all arrived
        self._payload: torch.Tensor | None = None  # a big payload's own buffer ...
        self._payload_view = memoryview(b"")  # ... as bytes
        self._payload_got = 0
        self.in_payload = False
        """Whether `writable()` is a big payload's own buffer (to be filled whole)."""
        self._backlog = bytearray()  # fed bytes not yet moved into the buffer
        self._error: PeerProtocolError | None = None
        self.limits = limits

    @property
    def limits(self) -> Limits:
        """Caps for the next header parsed (a connection narrows them during its handshake)."""
        return self._limits

    @limits.setter
    def limits(self, limits: Limits) -> None:
        self._limits = limits
        # a frame this small, whole in the buffer, of a registered type of its kind, passes
        # every cap of parse_header: the fast path checks exactly that much
        self._fast_bytes = min(
            len(self._buffer) - HEADER_BYTES, limits.max_frame_bytes, limits.max_json_bytes
        )

    # ------------------------------------------------------------ receiving into it

    def writable(self) -> memoryview:
        """Where the next received bytes go (never empty while a frame is incomplete)."""
        if self._payload is not None:
            return self._payload_view[self._payload_got :]
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._pos:
            header = self._header
            need = HEADER_BYTES + (header.length if header is not None else 0)
            if len(self._buffer) - self._pos < need:  # the frame cannot finish here: compact
                unread = self._end - self._pos
                self._buffer[:unread] = self._buffer[self._pos : self._end]
                self._pos, self._end = 0, unread
        return self._buffer[self._end :]

    def wrote(self, count: int) -> None:
        """`count` bytes were received into the view `writable()` returned."""
        if self._payload is not None:
            self._payload_got += count
        else:
            self._end += count

    @property
    def mid_frame(self) -> bool:
        """Whether bytes of an incomplete frame have arrived (an end of stream now truncates)."""
        return (
            self._header is not None
            or self._payload is not None
            or self._end > self._pos
            or bool(self._backlog)
        )

    @property
    def frame_progress(self) -> int:
        """Bytes of the incomplete frame that have arrived, its header's included (0 between
        frames): how far its deadline has moved (`Limits.frame_allowance_s`)."""
        if self._payload is not None:
            return HEADER_BYTES + self._payload_got
        pending = self._end - self._pos + len(self._backlog)
        return pending + HEADER_BYTES if self._header is not None else pending

    @property
    def buffered(self) -> bool:
        """Whether a frame has begun to arrive (a whole one may be waiting, undecoded)."""
        return self.mid_frame

    def feed(self, data: Buffer) -> None:
        """Bytes that arrived, in order (they are decoded by `next_message`)."""
        self._check()
        self._backlog += data

    def _pull_backlog(self) -> bool:
        """Move fed bytes into the buffer; whether any moved."""
        if not self._backlog:
            return False
        view = self.writable()
        count = min(len(view), len(self._backlog))
        view[:count] = self._backlog[:count]
        del self._backlog[:count]
        self.wrote(count)
        return True

    # ------------------------------------------------------------ messages out

    def next_message(self) -> Message | None:
        """The next complete message, or None until more bytes arrive."""
        if (
            self._error is None
            and self._header is None
            and self._payload is None
            and not self._backlog
        ):  # the common case, a small frame whole in the buffer: decoded in one go
            pos, end = self._pos, self._end
            if end - pos < HEADER_BYTES:
                return None
            magic, version, flags, msg_type, kind, request_id, length = HEADER.unpack_from(
                self._buffer, pos
            )
            spec = self._specs.get(msg_type)
            start = pos + HEADER_BYTES
            stop = start + length
            if (
                stop <= end
                and length <= self._fast_bytes
                and spec is not None
                and spec.kind == kind
                and magic == MAGIC
                and version == PROTOCOL_VERSION
                and (kind or not length)  # an EMPTY frame carries nothing
            ):
                self._pos = stop
                self.frame_bytes += HEADER_BYTES + length
                if kind == PayloadKind.TOKENS and not length % 4:
                    value: Any = (
                        torch.frombuffer(bytearray(self._buffer[start:stop]), dtype=_INT32)
                        if length
                        else torch.empty(0, dtype=_INT32)
                    )
                elif kind == PayloadKind.EMPTY:
                    value = None
                else:
                    header = Header(msg_type, spec.kind, flags, request_id, length)
                    try:
                        value = decode_payload(
                            header,
                            self._buffer[start:stop],
                            limits=self._limits,
                            registry=self.registry,
                        )
                    except PeerProtocolError as exc:
                        self._error = exc
                        raise
                return _new_message(Message, (msg_type, value, request_id, flags))
        # anything else: a frame still arriving, a big payload, fed bytes, or a bad header
        self._check()
        try:
            while True:
                message = self._decode_next()
                if message is not None or not self._pull_backlog():
                    return message
        except PeerProtocolError as exc:
            self._error = exc
            raise

    def _decode_next(self) -> Message | None:
        header = self._header
        if self._payload is not None:  # a big payload, received in place
            assert header is not None
            if self._payload_got < header.length:
                return None
            payload: torch.Tensor | memoryview = self._payload
            self._payload, self._payload_view = None, memoryview(b"")
            self._payload_got = 0  # else close() would count it as part of the next frame
            self.in_payload = False
        else:
            pos = self._pos
            if header is None:
                if self._end - pos < HEADER_BYTES:
                    return None
                header = parse_header(
                    self._buffer[pos : pos + HEADER_BYTES],
                    limits=self.limits,
                    registry=self.registry,
                )
                pos = self._pos = pos + HEADER_BYTES
                if HEADER_BYTES + header.length > len(self._buffer):
                    self._start_big_payload(header)
                    return None
                self._header = header
            end = pos + header.length
            if end > self._end:
                return None
            payload = self._buffer[pos:end]
            self._pos = end
        self._header = None
        self.frame_bytes += HEADER_BYTES + header.length
        value = decode_payload(header, payload, limits=self.limits, registry=self.registry)
        return Message(header.type, value, header.request_id, header.flags)

    def _start_big_payload(self, header: Header) -> None:
        """A payload bigger than the buffer: its own buffer, holding what has arrived of it."""
        length = header.length
        payload = self._allocate(length)
        view = payload.numpy().data
        buffered = min(self._end - self._pos, length)
        view[:buffered] = self._buffer[self._pos : self._pos + buffered]
        self._pos += buffered
        self._header, self._payload, self._payload_view = header, payload, view
        self._payload_got = buffered
        self.in_payload = True

    def __iter__(self) -> Iterator[Message]:
        while (message := self.next_message()) is not None:
            yield message

    def fail(self, error: PeerProtocolError) -> PeerProtocolError:
        """Mark the stream broken (the caller found it so); returns `error` to raise."""
        self._error = error
        return error

    def _check(self) -> None:
        if self._error is not None:
            raise PeerProtocolError(f"stream already failed: {self._error}")

    def close(self) -> None:
        """End of stream: raises PeerProtocolError if it stopped in the middle of a frame."""
        self._check()
        if self.mid_frame:
            pending = (self._end - self._pos) + self._payload_got + len(self._backlog)
            self._error = PeerProtocolError(
                f"stream ended mid-frame ({pending} bytes of an incomplete frame)"
            )
            raise self._error

    def release(self) -> None:
        """Drop the buffers (a closed connection keeps no payload alive)."""
        self._payload, self._payload_view = None, memoryview(b"")
        self.in_payload = False
        self._backlog = bytearray()


def frames(messages: Sequence[Message], **kwargs: Any) -> bytes:
    """Several messages as one byte string (tests, fuzzing)."""
    return b"".join(encode_bytes(m, **kwargs) for m in messages)
