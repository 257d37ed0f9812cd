"""netproto's typed errors: who broke what, so the right connection (and only it) is closed."""

from __future__ import annotations

MAX_PEER_TEXT_CHARS = 2000
"""Longest text from a peer that reaches an exception message or a log line."""
MAX_RETRY_AFTER_S = 3600.0
"""The longest wait an ERROR's `retry_after_s` may ask for; past it (or not a finite number
>= 0) the field is ignored: a peer cannot park a client for good."""


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

    `code` and `message` are the peer's text, escaped (see `peer_text`): safe to log.
    `retry_after_s`: when the peer says to ask again (a refusal for now, e.g. rate limited),
    checked by `retry_after`: None when it did not say or said something invalid."""

    def __init__(self, code: str, message: str, *, retry_after_s: object = None) -> None:
        self.code = peer_text(code, limit=100)
        self.message = peer_text(message)
        self.retry_after_s = retry_after(retry_after_s)
        super().__init__(f"peer error [{self.code}]: {self.message}")


def retry_after(value: object) -> float | None:
    """An ERROR's `retry_after_s` as the peer sent it, if it is a number in
    [0, MAX_RETRY_AFTER_S] (not a bool, not NaN); else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not 0 <= value <= MAX_RETRY_AFTER_S:  # NaN too; an int past float's range before float()
        return None
    return float(value)
