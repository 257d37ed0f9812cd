"""netproto's typed errors: who broke what, so the right connection (and only it) is closed."""

from __future__ import annotations


class NetprotoError(Exception):
    """Base of every netproto error."""


class ProtocolError(NetprotoError):
    """A frame or payload that violates the wire format."""


class PeerProtocolError(ProtocolError):
    """The peer broke the protocol (bad magic or version, oversize or truncated frame, a shape
    that lies, bad JSON, an unknown type...). The connection it came on is closed."""


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol cannot carry (too big, unknown type or dtype).
    Nothing was sent; the connection is still usable."""


class ConnectionClosed(NetprotoError):
    """The peer closed the connection at a frame boundary (or we already closed it)."""


class NetTimeout(NetprotoError, TimeoutError):
    """Connecting or waiting for a frame took longer than its timeout."""


class AuthenticationError(NetprotoError):
    """The shared-secret handshake failed: wrong or missing secret, or a replayed handshake."""


class RemoteError(NetprotoError):
    """The peer answered with an ERROR message: it refused or failed our request."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"peer error [{code}]: {message}")
