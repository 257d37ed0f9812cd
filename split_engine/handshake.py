"""The handshake of a split run's RPC world: the driver and each stage prove the shared secret
to each other before any model is built (HMAC-SHA256 challenge-response, both ways).

    driver                                     stage
      | -- stage_prove(driver_nonce) ----------> |  MAC(secret, "stage", name, driver_nonce,
      | <------------ (stage MAC, stage_nonce) - |      stage_nonce)
      | -- stage_accept_driver(MAC(secret,     ->|  checked against its pending nonces; then
      |      "driver", stage_nonce, world_nonce),|  both sign every later call under the key
      |      world_nonce)                        |  derived from world_nonce (rpc_guard)

A stage serves nothing but these two calls until the driver has proved itself
(`require_driver`), and the driver aborts the run if a stage cannot (`SecretMismatchError`).
"""

from __future__ import annotations

import hmac
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed.rpc as rpc

from lab.cli import UserError
from netproto.auth import NONCE_BYTES, mac
from split_engine import rpc_guard


class SecretMismatchError(UserError, PermissionError):
    """A stage and the driver could not prove the same shared secret to each other: said in
    one line, naming the role whose secret differs."""


@dataclass
class _AuthState:
    secret: bytes | None = None
    driver_proved: bool = False
    nonces: list[bytes] = field(default_factory=list)  # ours, awaiting a proof (newest last)
    world_nonce: bytes = b""  # the driver's: fresh per world, the seed of the call-signing key
    name: str = ""  # this process's worker name


MAX_PENDING_NONCES = 8
_auth = _AuthState()
_auth_lock = threading.Lock()


def begin_world(secret: bytes | None, name: str, *, driver: bool) -> None:
    """A new world for this process (worker `name`): nobody has proved anything yet; the driver
    draws the world's nonce, the seed of the call-signing key (rpc_guard), when there is a
    secret."""
    with _auth_lock:
        _auth.secret, _auth.driver_proved, _auth.nonces = secret, False, []
        _auth.world_nonce, _auth.name = b"", name
        if secret is not None and driver:
            _auth.world_nonce = secrets.token_bytes(NONCE_BYTES)
            rpc_guard.set_world_key(_auth.world_nonce)


def world_secret() -> bytes | None:
    """The shared secret of this process's world (None: a world without one)."""
    return _auth.secret


def driver_unproven() -> bool:
    """This stage's world has a secret and its driver has not proved it yet."""
    return _auth.secret is not None and not _auth.driver_proved


def stage_prove(driver_nonce: bytes) -> tuple[bytes, bytes]:
    """Stage side, step 1: our MAC over the driver's nonce, and a nonce for the driver to sign."""
    if not isinstance(driver_nonce, bytes) or len(driver_nonce) != NONCE_BYTES:
        raise ValueError("stage_prove takes a 32-byte nonce")
    with _auth_lock:
        secret = _auth.secret
        if secret is None or _auth.driver_proved:  # one handshake per world
            return b"", b""
        # a few outstanding at once: a stranger asking too cannot spoil the driver's handshake
        nonce = secrets.token_bytes(NONCE_BYTES)
        _auth.nonces = [*_auth.nonces, nonce][-MAX_PENDING_NONCES:]
        return mac(secret, b"stage", _auth.name.encode(), driver_nonce, nonce), nonce


def stage_accept_driver(proof: bytes, world_nonce: bytes) -> bool:
    """Stage side, step 2: check the driver's MAC over our nonce and the world nonce; serve only
    if it holds, and from then on sign and require signed calls under the world's key."""
    if not isinstance(proof, bytes) or not isinstance(world_nonce, bytes):
        raise ValueError("stage_accept_driver takes bytes")
    with _auth_lock:
        secret = _auth.secret
        if secret is None:
            _auth.driver_proved = True
            return True
        if _auth.driver_proved:
            return False  # one handshake per world
        ok = len(world_nonce) == NONCE_BYTES and any(
            hmac.compare_digest(proof, mac(secret, b"driver", nonce, world_nonce))
            for nonce in _auth.nonces
        )
        if ok:
            rpc_guard.set_world_key(world_nonce)
            rpc_guard.start_signing()  # this call's own reply is the first signed message
            _auth.driver_proved, _auth.nonces = True, []
        return ok


def require_driver() -> None:
    """Called first by every stage-side entry point: refuse work before the driver proved itself."""
    if not _auth.driver_proved:
        raise PermissionError("this stage serves only a driver that has proved the shared secret")


def authenticate_stages(secret: bytes | None, names: Sequence[str], *, timeout_s: float) -> None:
    """Driver side: mutual challenge-response with every stage, one after the other; raises if
    one fails. A stage that accepted signs and requires signed calls from then on, so the
    driver signs everything once any stage has (the release at the end of a failed start
    included; a stage not yet accepted then leaves when the driver does)."""
    accepted = 0
    try:
        for name in names:
            authenticate_stage(name, secret, _auth.world_nonce, timeout_s=timeout_s)
            accepted += 1
    finally:
        if secret is not None and accepted:
            rpc_guard.start_signing()


def authenticate_stage(
    name: str, secret: bytes | None, world_nonce: bytes, *, timeout_s: float
) -> None:
    """Driver side, one stage: check its proof of the secret, then prove ours and hand it the
    world nonce (bound into our proof)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    reply = rpc.rpc_sync(name, stage_prove, args=(nonce,), timeout=timeout_s)
    if not (
        isinstance(reply, tuple)
        and len(reply) == 2
        and all(isinstance(part, bytes) and len(part) <= 64 for part in reply)
    ):
        raise SecretMismatchError(f"{name} answered the handshake with something else than 2 MACs")
    stage_mac, stage_nonce = reply
    if secret is not None:
        expected = mac(secret, b"stage", name.encode(), nonce, stage_nonce)
        if not stage_mac or not hmac.compare_digest(stage_mac, expected):
            raise SecretMismatchError(
                f"{name} could not prove the shared secret: its cluster.secret / LAB_SECRET "
                "differs from this driver's, or it has none; the run is stopped"
            )
        proof = mac(secret, b"driver", stage_nonce, world_nonce)
    else:
        if stage_mac:
            raise SecretMismatchError(
                f"{name} expects a shared secret and this driver has none: set cluster.secret "
                "(or LAB_SECRET) to the stages' secret"
            )
        proof = b""
    accepted = rpc.rpc_sync(name, stage_accept_driver, args=(proof, world_nonce), timeout=timeout_s)
    if accepted is not True:
        raise SecretMismatchError(f"{name} refused this driver's proof of the shared secret")
