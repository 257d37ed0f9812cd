"""Live netproto servers on loopback for the tests in this folder."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from netproto import Connection, Server


def echo_handler(conn: Connection) -> None:
    """Answer every message with itself (same type, payload and request id)."""
    while True:
        message = conn.recv()
        conn.send(message.type, message.payload, request_id=message.request_id)


@pytest.fixture
def start_server() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def _start(handler: Callable[[Connection], None] = echo_handler, **kwargs) -> Server:
        server = Server(handler, **kwargs).start()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.stop()
