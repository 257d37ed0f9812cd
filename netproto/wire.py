"""The sans-IO core of netproto: frames <-> typed messages. No sockets here.

The frame's header and vocabulary live in `netproto.header`, the payload codecs in
`netproto.codecs`; this module reads frames from a stream (`FrameDecoder`). Each name has one
import path: the module that defines it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from netproto.codecs import (
    Buffer,
    decode_payload,
    encode_bytes,
    new_payload_buffer,
)
from netproto.errors import PeerProtocolError
from netproto.header import (
    _INT32,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    PROTOCOL_VERSION,
    REGISTRY,
    Header,
    Limits,
    Message,
    PayloadKind,
    Registry,
    _new_message,
    parse_header,
)

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
