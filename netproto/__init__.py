"""netproto: the lab's struct-packed binary TCP protocol (wire format in PROTOCOL.md).

from netproto import Connection, Server, MsgType
with Server(handler, secret=b"s3cret").start() as server:
    with Connection.connect(*server.address, secret=b"s3cret") as conn:
        conn.send_tensors(MsgType.DATA_TENSORS, {"w": torch.zeros(4)})
"""

from netproto.codecs import EncodedFrame, decode_payload, encode, encode_bytes
from netproto.connection import Connection, client_ssl_context, server_ssl_context
from netproto.errors import (
    AuthenticationError,
    ConnectionClosed,
    LocalProtocolError,
    NetprotoError,
    NetTimeout,
    PeerProtocolError,
    ProtocolError,
    RemoteError,
    TruncatedFrame,
)
from netproto.header import REGISTRY, Limits, Message, MsgType, PayloadKind, Registry, parse_header
from netproto.link import LinkEmulator, LinkEmulatorProcess
from netproto.server import Server
from netproto.wire import FrameDecoder

__all__ = [
    "REGISTRY",
    "AuthenticationError",
    "Connection",
    "ConnectionClosed",
    "EncodedFrame",
    "FrameDecoder",
    "Limits",
    "LinkEmulator",
    "LinkEmulatorProcess",
    "LocalProtocolError",
    "Message",
    "MsgType",
    "NetTimeout",
    "NetprotoError",
    "PayloadKind",
    "PeerProtocolError",
    "ProtocolError",
    "Registry",
    "RemoteError",
    "Server",
    "TruncatedFrame",
    "client_ssl_context",
    "decode_payload",
    "encode",
    "encode_bytes",
    "parse_header",
    "server_ssl_context",
]
