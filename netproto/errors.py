"""netproto's typed errors: who broke what, so the right connection (and only it) is closed."""

from __future__ import annotations

MAX_PEER_TEXT_CHARS = 2000
"""Longest text from a peer that reaches an exception message or a log line."""


def peer_text(text: object, *, limit: int = MAX_PEER_TEXT_CHARS) -> str:
    """`text` made safe to log: capped at `limit` characters, control characters (newlines
    included) and other unprintable ones shown escaped, so a peer cannot forge a log line."""
    text = str(text)
    shown = text[:limit]
    if not shown.isprintable():
        shown = "".join(
            char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
            for char in shown
        )
    if len(shown) < len(text) or len(shown) > limit:
        return shown[:limit] + "..."
    return shown


class NetprotoError(Exception):
    """Base of every netproto error."""


class ProtocolError(NetprotoError):
    """A frame or payload that violates the wire format."""


class PeerProtocolError(ProtocolError):
    """The peer broke the protocol (bad magic or version, oversize or truncated frame, a shape
    that lies, bad JSON, an unknown type...). The connection it came on is closed."""


class TruncatedFrame(PeerProtocolError):
    """The peer's side ended inside a frame: its process died while sending (or it cut the
    frame on purpose). The connection is lost, like a close, but nothing of the frame is used."""


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol cannot carry (too big, unknown type or dtype).
    Nothing was sent; the connection is still usable."""


class ConnectionClosed(NetprotoError):
    """The peer closed the connection at a frame boundary (or we already closed it)."""


class NetTimeout(NetprotoError, TimeoutError):
    """Connecting or waiting for a frame took longer than its timeout."""


class ListenError(NetprotoError, OSError):
    """This process cannot listen where it was told to (the port is taken, the address is not
    this host's): a setting to change, said in one line."""


class AuthenticationError(NetprotoError):
    """The shared-secret handshake failed: wrong or missing secret, or a replayed handshake."""


class RemoteError(NetprotoError):
    """The peer answered with an ERROR message: it refused or failed our request.

    `code` and `message` are the peer's text, escaped (see `peer_text`): safe to log."""

    def __init__(self, code: str, message: str) -> None:
        self.code = peer_text(code, limit=100)
        self.message = peer_text(message)
        super().__init__(f"peer error [{self.code}]: {self.message}")
