"""Live netproto servers on loopback for the tests in this folder."""

from __future__ import annotations

import shutil
import subprocess
import time
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


def wait_for(condition: Callable[[], bool], timeout_s: float = 120.0) -> bool:
    """Server threads update their counters just after the client sees the result."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1: (cert.pem, key.pem)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl command not available")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)
