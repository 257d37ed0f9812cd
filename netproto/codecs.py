"""netproto's payload codecs: typed payloads (JSON, token ids, tensors, named tensors, bytes)
to buffers and back, every length, count and shape checked against `Limits` and the bytes
present before anything is allocated. Sans-IO: the header is `header`'s, the stream `wire`'s."""

from __future__ import annotations

import array
import json
import math
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from netproto.errors import LocalProtocolError, PeerProtocolError
from netproto.header import (
    _INT32,
    _TENSOR_META,
    _U16,
    _U32,
    _U64,
    CODE_DTYPES,
    DTYPE_CODES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_REQUEST_ID,
    PROTOCOL_VERSION,
    REGISTRY,
    TENSOR_ALIGN,
    Header,
    Limits,
    Message,
    MessageSpec,
    PayloadKind,
    Registry,
)

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


@dataclass(frozen=True)
class EncodedFrame:
    """One frame encoded once, to go as it is to many connections (`Connection.encode`, then
    `Connection.send_encoded` on each): a broadcast is encoded and joined once, not once per
    peer. Its bytes are a snapshot: a tensor changed after encoding does not change them.

    A frame carries no per-connection state: netproto authenticates a connection once, at its
    handshake (no per-frame MAC or counter), TLS encrypts below the frame, and `request_id`
    is the caller's (0: not a request), so the same bytes are the same message on every
    connection. `spec` and `limits` are what it was checked against: a connection sends it
    only if they are its own (its registry's spec for the type, its limits)."""

    spec: MessageSpec
    request_id: int
    flags: int
    limits: Limits
    data: bytes
    """Header and payload, joined."""

    @classmethod
    def of(
        cls, spec: MessageSpec, payload: Any, *, limits: Limits, request_id: int = 0, flags: int = 0
    ) -> EncodedFrame:
        buffers, _ = encode_frame(spec, payload, request_id, flags, limits)
        return cls(spec, request_id, flags, limits, b"".join(buffers))

    @property
    def size(self) -> int:
        return len(self.data)


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
        value = _JSON.decode(data.decode("utf-8"))
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


_JSON = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)
"""Every JSON payload's decoder (`json.loads` with these hooks would build one a call), shared
by every thread as `json`'s own default decoder is."""


def new_payload_buffer(length: int) -> torch.Tensor:
    """An uninitialised (length,) uint8 buffer to receive a payload into, from the C heap
    (numpy's allocation, 16-byte aligned as TENSOR_ALIGN needs): torch's CPU allocator maps
    fresh pages for every buffer over ~128 KiB, which the kernel zeroes at first touch (a
    secure round's 90 masked inputs of 128 KiB: ~2,800 page faults, a fifth of the
    coordinator's session threads' CPU, measured by perf); freed heap memory is reused."""
    return torch.from_numpy(np.empty(length, dtype=np.uint8))
