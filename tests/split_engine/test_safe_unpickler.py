"""RPC messages are unpickled through an allow-list: a peer cannot make a stage run code."""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import subprocess
import sys

import pytest
import torch
from torch.distributed.rpc import internal as rpc_internal

import split_training.trainer  # noqa: F401  (allows its RPC names, as its processes do)
from split_engine import rpc_guard
from split_engine.rpc_guard import UnsafeMessageError, safe_loads
from tests.clocks import HANG_GUARD_S


class RunsCommand:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class Evaluates:
    def __reduce__(self):
        return (eval, ("1+1",))


class ReachesThroughGetattr:
    """The classic escape: getattr on an allowed type walks to object.__subclasses__ and on."""

    def __reduce__(self):
        return (getattr, (str, "__mro__"))


@pytest.mark.parametrize("payload", [RunsCommand(), Evaluates(), ReachesThroughGetattr()])
def test_code_execution_payloads_are_refused(payload) -> None:
    with pytest.raises(UnsafeMessageError, match="refused"):
        safe_loads(pickle.dumps(payload))


def test_an_arbitrary_class_is_refused() -> None:
    from collections import Counter

    with pytest.raises(UnsafeMessageError, match=r"collections\.Counter"):
        safe_loads(pickle.dumps(Counter("ab")))


def test_what_split_runs_send_still_goes_through() -> None:
    """Tensors (via the RPC pickler's tensor table), plain data and exceptions."""
    rpc_guard.install()
    rpc_guard.reset("driver", None)
    x = torch.arange(6).view(2, 3)
    kwargs = {"request": 3, "last_only": True}
    data, tensors = rpc_internal.serialize({"x": x, "kwargs": kwargs})
    back: dict = rpc_internal.deserialize(data, tensors)
    assert torch.equal(back["x"], x) and back["kwargs"] == kwargs
    assert isinstance(safe_loads(pickle.dumps(ValueError("bad"))), ValueError)
    with pytest.raises(UnsafeMessageError, match=r"posix\.system"):
        rpc_internal.deserialize(*rpc_internal.serialize(RunsCommand()))


# ---------------------------------------------------------------------------- crafted pickles
# Hand-built opcodes, at every protocol a peer might use (2-3: GLOBAL, 4-5: STACK_GLOBAL), for
# what an attacker would send rather than what pickle.dumps of a friendly object produces.

PROTOCOLS = [2, 3, 4, 5]


def _str(text: str) -> bytes:
    data = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _global(module: str, name: str, protocol: int) -> bytes:
    if protocol >= 4:
        return _str(module) + _str(name) + pickle.STACK_GLOBAL
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _message(body: bytes, protocol: int) -> bytes:
    return pickle.PROTO + bytes([protocol]) + body + pickle.STOP


def _call(func: bytes, *args: bytes) -> bytes:
    return func + pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE


def _build(target: bytes, state: dict[str, str]) -> bytes:
    items = b"".join(_str(k) + _str(v) for k, v in state.items())
    # (None, {attr: value}): the slot-state form, which setattr()s on anything without a dict
    state_dict = pickle.EMPTY_DICT + pickle.MARK + items + pickle.SETITEMS
    return target + pickle.NONE + state_dict + pickle.TUPLE2 + pickle.BUILD


ALLOWED_MODULES = sorted({module for module, _ in rpc_guard._REFERENCES} | {"builtins"})


@pytest.mark.parametrize(("module", "name"), sorted(rpc_guard._REFERENCES | rpc_guard.START_CALLS))
def test_every_allowed_name_is_where_pickle_finds_it(module: str, name: str) -> None:
    """The allow-list stays honest when modules move: each pair resolves, names the object by its
    own module and qualified name (what pickle writes for it), and the guard lets it back in."""
    obj = getattr(importlib.import_module(module), name)
    assert (obj.__module__, obj.__qualname__) == (module, name)
    for protocol in PROTOCOLS:
        assert safe_loads(pickle.dumps(obj, protocol=protocol)) is obj


def test_an_experiment_allows_only_its_own_top_level_names() -> None:
    with pytest.raises(ValueError, match="not imported"):
        rpc_guard.allow("no_such_module_here", "f")
    with pytest.raises(ValueError, match="not a top-level"):
        rpc_guard.allow("split_training.trainer", "Path")  # imported there, pathlib's
    with pytest.raises(ValueError, match="not a top-level"):
        rpc_guard.allow("split_training.trainer", "missing")
    assert ("split_training.trainer", "Path") not in rpc_guard._REFERENCES


def test_a_process_without_split_training_refuses_its_names() -> None:
    """The engine names no experiment: split training's calls are allowed where it runs only
    (a split_inference stage unpickles no checkpoint call)."""
    code = (
        "import pickle, sys\n"
        "from split_engine.rpc_guard import UnsafeMessageError, safe_loads\n"
        "data = b'\\x80\\x04c' + b'split_training.pipeline\\nPipelineStage\\n' + b'.'\n"
        "try:\n    safe_loads(data)\nexcept UnsafeMessageError:\n    sys.exit(0)\n"
        "sys.exit('allowed')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_start_calls_are_allowed_names() -> None:
    assert rpc_guard.START_CALLS <= rpc_guard._REFERENCES


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("module", "name"),
    [
        # where the engine lived before split_engine (issue 28): no such module any more
        ("split_inference.workers", "stage_prove"),
        ("split_inference.workers", "stage_accept_driver"),
        ("split_inference.stage", "Stage"),
        # moved out of split_engine.workers by job: refused where they were
        ("split_engine.workers", "stage_prove"),
        ("split_engine.workers", "stage_accept_driver"),
        ("split_engine.workers", "free_memory_bytes"),
    ],
)
def test_the_engines_old_module_names_are_refused(module: str, name: str, protocol: int) -> None:
    with pytest.raises(UnsafeMessageError, match="refused"):
        safe_loads(_message(_global(module, name, protocol), protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("module", ALLOWED_MODULES)
@pytest.mark.parametrize(
    "name", ["os.system", "builtins.eval", "hmac.compare_digest", "torch.load"]
)
def test_dotted_names_under_an_allowed_module_are_refused(
    module: str, name: str, protocol: int
) -> None:
    """At protocol 4+ pickle walks `a.b.c`: under an allowed module it reached its imports."""
    with pytest.raises(UnsafeMessageError, match="refused"):
        safe_loads(_message(_global(module, name, protocol), protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("split_engine.handshake", "_auth"),  # the stage's "driver proved the secret" state
        ("split_engine.rpc_guard", "_calls"),  # the call-signing key and replay windows
        ("split_engine.workers", "hmac"),
        ("split_engine.workers", "os"),
        ("split_engine.rpc_guard", "install"),
        ("split_engine.stage", "torch"),
        ("split_training.trainer", "Path"),
        ("torch.distributed.rpc.internal", "_internal_rpc_pickler"),
        ("torch.distributed.rpc.api", "shutdown"),
        ("builtins", "open"),
        ("builtins", "__import__"),
        ("builtins", "exec"),
        ("builtins", "type"),
        ("builtins", "object"),
    ],
)
def test_a_name_outside_the_exact_list_is_refused(module: str, name: str, protocol: int) -> None:
    with pytest.raises(UnsafeMessageError, match="refused"):
        safe_loads(_message(_global(module, name, protocol), protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("split_engine.stage", "Stage"),  # a class: would change every stage
        ("split_engine.handshake", "stage_prove"),  # a function
        ("split_engine.handshake", "stage_accept_driver"),
        ("torch.distributed.rpc.internal", "_InternalRPCPickler"),
        ("builtins", "ValueError"),  # even a harmless type, when not built here
    ],
)
def test_state_is_never_set_on_a_global(module: str, name: str, protocol: int) -> None:
    before = getattr(importlib.import_module(module), name).__dict__.get("forward")
    crafted = _build(_global(module, name, protocol), {"forward": "pwned"})
    with pytest.raises(UnsafeMessageError, match="sets state on"):
        safe_loads(_message(crafted, protocol))
    assert getattr(importlib.import_module(module), name).__dict__.get("forward") == before


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("module", "name", "args"),
    [
        ("split_training.pipeline", "PipelineStage", ["a", "b"]),  # would hold an optimizer
        ("split_engine.stage", "Stage", ["model"]),  # would load a model
        ("split_engine.stage", "describe_model", ["x"]),
        ("split_engine.workers", "release_stage", []),
        ("split_engine.handshake", "stage_accept_driver", ["proof"]),
        ("torch.distributed.rpc.rref_proxy", "_local_invoke", ["a", "b"]),
    ],
)
def test_allowed_functions_are_never_called_while_unpickling(
    module: str, name: str, args: list[str], protocol: int
) -> None:
    """A message names the call it carries; only the RPC layer runs it, after its checks."""
    crafted = _call(_global(module, name, protocol), *(_str(a) for a in args))
    with pytest.raises(UnsafeMessageError, match="calls"):
        safe_loads(_message(crafted, protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_getattr_reaches_only_the_rpc_receivers(protocol: int) -> None:
    pickler = _global("torch.distributed.rpc.internal", "_InternalRPCPickler", protocol)
    for attribute in ("_script_module_receiver", "deserialize", "__init__", "__class__"):
        crafted = _call(_global("builtins", "getattr", protocol), pickler, _str(attribute))
        with pytest.raises(UnsafeMessageError, match="attribute"):
            safe_loads(_message(crafted, protocol))


@pytest.mark.parametrize(
    "crafted",
    [
        # protocol 0/1 instance building: INST names a class inline, OBJ takes it from the stack
        pickle.MARK + pickle.INST + b"builtins\nValueError\n",
        pickle.MARK + _global("builtins", "ValueError", 2) + pickle.OBJ,
    ],
    ids=["INST", "OBJ"],
)
def test_inst_and_obj_opcodes_are_refused(crafted: bytes) -> None:
    with pytest.raises(UnsafeMessageError, match="INST/OBJ"):
        safe_loads(crafted + pickle.STOP)


@pytest.mark.parametrize("protocol", [3, 4, 5])  # protocol 2 writes bytes as _codecs.encode(...)
def test_a_pickle_nested_in_data_is_carried_not_run(protocol: int) -> None:
    """Bytes holding a pickle (in an exception, as a tensor's content) stay bytes."""
    inner = pickle.dumps(RunsCommand(), protocol=protocol)
    exc = safe_loads(pickle.dumps(ValueError(inner), protocol=protocol))
    assert isinstance(exc, ValueError) and exc.args == (inner,)
    x = torch.frombuffer(bytearray(inner), dtype=torch.uint8)
    back = rpc_internal.deserialize(*rpc_internal.serialize(x))
    assert bytes(back.numpy()) == inner
    # a tensor pickled the ordinary way (not through the RPC pickler's table) is refused
    with pytest.raises(UnsafeMessageError, match="refused"):
        safe_loads(pickle.dumps(x, protocol=protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_remote_exception_naming_a_dangerous_type_is_refused(protocol: int) -> None:
    crafted = _call(
        _global("torch.distributed.rpc.internal", "RemoteException", protocol),
        _str("boom"),
        _global("posix", "system", protocol),
    )
    with pytest.raises(UnsafeMessageError, match=r"posix\.system"):
        safe_loads(_message(crafted, protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_state_on_an_object_the_message_built_still_loads(protocol: int) -> None:
    """What legitimate messages need: exceptions carry their attributes across."""
    error = ValueError("bad")
    error.note = "kept"  # type: ignore[attr-defined]
    back = safe_loads(pickle.dumps(error, protocol=protocol))
    assert isinstance(back, ValueError) and getattr(back, "note", None) == "kept"
