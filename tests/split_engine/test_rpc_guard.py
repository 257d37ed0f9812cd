"""Signed RPC calls: with a shared secret, a message without the world key's MAC is refused.

These run torch's own RPC pickling (`rpc_internal.serialize` / `deserialize`, what TensorPipe
calls for every Python message) in one process, switching `rpc_guard`'s state between the
sender's and the receiver's as two processes would hold it.
"""

from __future__ import annotations

import logging
import secrets

import pytest
import torch
from torch.distributed.rpc import internal as rpc_internal

from split_engine import handshake, rpc_guard, workers
from split_engine.rpc_guard import UnsafeMessageError

SECRET = b"shared secret"
WORLD = secrets.token_bytes(32)


@pytest.fixture(autouse=True)
def _guard():
    rpc_guard.install()
    yield
    rpc_guard.reset("", None)


def as_process(name: str, secret: bytes | None, *, world: bytes | None = WORLD, signing=True):
    """Put rpc_guard in the state a process named `name` holds after its handshake."""
    rpc_guard.reset(name, secret)
    if secret is not None and world is not None:
        rpc_guard.set_world_key(world)
        if signing:
            rpc_guard.start_signing()


def call(func, *args, to: str = "stage1") -> tuple[bytes, list[torch.Tensor]]:
    """A call as `rpc_sync(to, func, args)` pickles it (the wrapped sender names `to`)."""
    rpc_guard._destination.name = to
    try:
        return rpc_internal.serialize(rpc_internal.PythonUDF(func, args, {}))
    finally:
        rpc_guard._destination.name = ""


def reply(value) -> tuple[bytes, list[torch.Tensor]]:
    """A return value as the callee pickles it: addressed to no one."""
    return rpc_internal.serialize(value)


def receive(message: tuple[bytes, list[torch.Tensor]]):
    return rpc_internal.deserialize(*message)


def test_a_signed_call_with_tensors_goes_through() -> None:
    as_process("driver", SECRET)
    x = torch.randn(2, 3)
    message = call(workers.stage_alive, x, {"n": 1})
    as_process("stage1", SECRET)
    udf = receive(message)
    assert udf.func is workers.stage_alive
    assert torch.equal(udf.args[0], x) and udf.args[1] == {"n": 1}


def test_without_a_secret_calls_travel_unsigned_and_are_served() -> None:
    as_process("driver", None)
    message = call(workers.release_stage)
    as_process("stage1", None)
    assert receive(message).func is workers.release_stage


def test_a_changed_byte_of_the_pickle_is_refused() -> None:
    as_process("driver", SECRET)
    data, tensors = call(workers.stage_alive, "aaaa")
    tampered = data.replace(b"aaaa", b"aaab")
    assert tampered != data
    as_process("stage1", SECRET)
    with pytest.raises(UnsafeMessageError, match="without a valid MAC"):
        receive((tampered, tensors))


def test_a_swapped_tensor_shape_is_refused() -> None:
    as_process("driver", SECRET)
    data, _ = call(workers.stage_alive, torch.zeros(4, 4))
    as_process("stage1", SECRET)
    with pytest.raises(UnsafeMessageError, match="without a valid MAC"):
        receive((data, [torch.zeros(4096, 4096)]))


def test_a_replayed_message_is_refused() -> None:
    as_process("driver", SECRET)
    message = call(workers.release_stage)
    as_process("stage1", SECRET)
    receive(message)
    with pytest.raises(UnsafeMessageError, match="replayed"):
        receive(message)


def test_a_call_replayed_to_another_process_is_refused() -> None:
    """The receiver is signed: a recorded call to stage1 does not run on stage2."""
    as_process("driver", SECRET)
    message = call(workers.release_stage, to="stage1")
    as_process("stage2", SECRET)
    with pytest.raises(UnsafeMessageError, match="addressed to stage1, not to us"):
        receive(message)


def test_a_signed_call_addressed_to_no_one_is_refused_a_reply_is_served() -> None:
    """A reply's envelope names no receiver: it must not be able to carry a call."""
    as_process("stage1", SECRET)
    disguised, answer = reply(rpc_internal.PythonUDF(workers.release_stage, (), {})), reply(42)
    as_process("driver", SECRET)
    with pytest.raises(UnsafeMessageError, match="addressed to no one"):
        receive(disguised)
    assert receive(answer) == 42


def test_an_object_claiming_a_start_calls_name_is_not_one() -> None:
    """Before the handshake only START_CALLS run unsigned: by identity, not by name."""

    class Impostor(Exception):
        pass

    impostor = Impostor()
    impostor.__module__ = "split_engine.workers"
    impostor.__qualname__ = "stage_prove"  # type: ignore[attr-defined]
    assert not rpc_guard._is_start_call(impostor)
    assert rpc_guard._is_start_call(handshake.stage_prove)


def test_the_wrapped_senders_name_the_receiver() -> None:
    """rpc_sync / rpc_async / RRef proxies (through _invoke_rpc) and remote say where a call
    goes; without that a stage would refuse every signed call as addressed to no one."""
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc import api

    rpc_guard.install()
    rpc_guard.install()  # idempotent: wrapped once
    for sender in (api._invoke_rpc, api.remote, rpc.remote):
        assert getattr(sender, "__wrapped_sender__", False)
        assert not getattr(getattr(sender, "__wrapped__", None), "__wrapped_sender__", False)
    seen = []
    addressed = rpc_guard._addressed(lambda to, func: seen.append(rpc_guard._destination.name))
    addressed("stage2", workers.stage_alive)
    assert seen == ["stage2"] and rpc_guard._destination.name == ""


def test_messages_out_of_order_are_served_once_each() -> None:
    as_process("driver", SECRET)
    first, second, third = (call(workers.stage_alive, i) for i in range(3))
    as_process("stage1", SECRET)
    assert [receive(m).args for m in (third, first, second)] == [(2,), (0,), (1,)]
    with pytest.raises(UnsafeMessageError, match="replayed"):
        receive(first)


@pytest.mark.parametrize(
    ("sender_secret", "sender_world"),
    [(b"another secret", WORLD), (SECRET, secrets.token_bytes(32))],
    ids=["another-secret", "another-world"],
)
def test_a_message_signed_under_another_key_is_refused(sender_secret, sender_world) -> None:
    """A stranger's secret, or the same secret in an earlier run (a recorded message)."""
    as_process("driver", sender_secret, world=sender_world)
    message = call(workers.release_stage)
    as_process("stage1", SECRET)
    with pytest.raises(UnsafeMessageError, match="without a valid MAC"):
        receive(message)


def test_once_signing_an_unsigned_message_is_refused_even_a_start_up_call() -> None:
    as_process("rogue", None)
    messages = [call(workers.release_stage), call(handshake.stage_accept_driver, b"x", b"y")]
    as_process("stage1", SECRET)
    for message in messages:
        with pytest.raises(UnsafeMessageError, match="unsigned message from rogue"):
            receive(message)


def test_before_the_handshake_only_start_up_calls_are_served_unsigned() -> None:
    as_process("rogue", None)
    hello = call(handshake.stage_prove, b"n" * 32)
    release = call(workers.release_stage)
    as_process("stage1", SECRET, world=None)
    assert receive(hello).func is handshake.stage_prove
    with pytest.raises(UnsafeMessageError, match="unsigned call to 'release_stage'"):
        receive(release)


def test_a_signed_message_to_a_process_without_a_secret_says_what_to_fix() -> None:
    as_process("driver", SECRET)
    message = call(workers.release_stage)
    as_process("stage1", None)
    with pytest.raises(UnsafeMessageError, match=r"set the same cluster\.secret"):
        receive(message)


@pytest.mark.parametrize(
    "data",
    [b"", b"\x80\x05N.", b"LRPC", b"XRPC\x02\x00" + bytes(10)],
    ids=["empty", "bare-pickle", "truncated-envelope", "bad-magic"],
)
def test_a_message_without_an_envelope_is_refused(data: bytes) -> None:
    as_process("stage1", SECRET)
    with pytest.raises(UnsafeMessageError, match="envelope"):
        receive((data, []))


def test_a_sender_name_cannot_forge_log_lines(caplog) -> None:
    rpc_guard.reset("rogue\nCRITICAL fake line", None)
    message = call(workers.release_stage)
    as_process("stage1", SECRET)
    with caplog.at_level(logging.WARNING), pytest.raises(UnsafeMessageError):
        receive(message)
    assert caplog.records and all("\n" not in r.getMessage() for r in caplog.records)


def test_a_stage_and_its_optimizer_are_never_pickled_for_a_peer() -> None:
    """TensorPipe serves RRef fetches in C++: the value must refuse to travel."""
    from split_engine.stage import Stage
    from split_training.pipeline import PipelineStage, StageAdamW

    as_process("stage1", SECRET)
    for cls in (Stage, PipelineStage, StageAdamW):
        with pytest.raises(TypeError, match="never leaves"):
            rpc_internal.serialize(cls.__new__(cls))


def test_the_stage_handshake_sets_the_key_only_for_the_right_proof() -> None:
    """The driver's proof binds the world nonce: a changed nonce is refused, and one handshake
    per world (a second proof, even a right one, is not taken)."""
    from netproto.auth import mac

    rpc_guard.reset("stage1", SECRET)
    handshake._auth.secret, handshake._auth.driver_proved, handshake._auth.name = (
        SECRET,
        False,
        "stage1",
    )
    try:
        _, stage_nonce = handshake.stage_prove(b"d" * 32)
        assert not handshake.stage_accept_driver(
            mac(SECRET, b"driver", stage_nonce, WORLD), b"w" * 32
        )
        _, stage_nonce = handshake.stage_prove(b"d" * 32)
        assert handshake.stage_accept_driver(mac(SECRET, b"driver", stage_nonce, WORLD), WORLD)
        assert rpc_guard._calls.signing and rpc_guard._calls.key == rpc_guard.world_key(
            SECRET, WORLD
        )
        assert not handshake.stage_accept_driver(mac(SECRET, b"driver", stage_nonce, WORLD), WORLD)
    finally:
        handshake._auth.secret, handshake._auth.driver_proved = None, False
