"""What guards a split run's RPC traffic: an allow-list unpickler and signed Python calls.

torch.distributed.rpc (TensorPipe) carries Python calls and their results as pickles and has no
authentication of its own. Every process of a split run installs two guards (`install`):

- **Allow-list unpickling** (`SafeUnpickler`): exact (module, name) pairs of the functions and
  classes split runs call, tensors and RRefs, plain builtins and exception types; nothing named
  is called while unpickling and no state is set on what the message did not build.
- **Signed calls** (`EnvelopePickler` / `RpcUnpickler`): every pickle this process sends goes
  out in an envelope naming its sender and a sequence number. With a shared secret, once the
  driver has proved it (see `handshake.authenticate_stages`), every envelope carries an
  HMAC-SHA256 over the envelope, the pickle and each tensor's dtype and shape, under a key only
  holders of the secret can derive from that run's fresh world nonce. A receiver checks the MAC
  and the sequence number (no replay) before it unpickles anything. Before the handshake only
  the start-up calls (`START_CALLS`: torch's start-up barrier, the handshake itself, liveness)
  are served unsigned; after it, a message without a valid MAC is refused, whoever sends it.
  Tensor contents are not covered by the MAC (see docs/security.md).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import hmac
import io
import itertools
import logging
import pickle
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch.distributed.rpc import internal as rpc_internal

from netproto.auth import mac

log = logging.getLogger(__name__)


class UnsafeMessageError(pickle.UnpicklingError):
    """An RPC message named a global outside the allow-list."""


# ---------------------------------------------------------------------------- safe unpickling

_REFERENCES = {
    # What a split run's RPC messages name, exactly: the functions and classes it calls on a
    # peer (inside a PythonUDF), each one by its module and qualified name. Naming is not
    # calling: none of these runs while a message is unpickled.
    ("split_engine.stage", "Stage"),
    ("split_engine.stage", "describe_model"),
    ("split_engine.handshake", "stage_accept_driver"),
    ("split_engine.handshake", "stage_prove"),
    ("split_engine.memory_probes", "free_memory_bytes"),
    ("split_engine.workers", "driver_alive"),
    ("split_engine.workers", "release_stage"),
    ("split_engine.workers", "stage_alive"),
    # torch's RPC internals: RRef method calls and the start-up / shutdown all-gather.
    ("torch.distributed.rpc.rref_proxy", "_local_invoke"),
    ("torch.distributed.rpc.api", "_rref_typeof_on_owner"),
    ("torch.distributed.rpc.api", "_gather_to_leader"),
    ("torch.distributed.rpc.api", "_broadcast_to_followers"),
    # The two records a message is built from (called while unpickling: see _may_call) and the
    # RPC pickler itself, whose receivers rebuild tensors and RRefs (see `_receiver`).
    ("torch.distributed.rpc.internal", "PythonUDF"),
    ("torch.distributed.rpc.internal", "RemoteException"),
    ("torch.distributed.rpc.internal", "_InternalRPCPickler"),
}
"""The engine's own names and torch's; an experiment on the engine adds its own with `allow`."""


def allow(module: str, *names: str) -> None:
    """Let RPC messages name `module`'s `names` (an experiment's own remote calls: split
    training's optimizer and checkpoint functions). Call it at the module's import, so a role's
    process allows them before any message arrives, and only in the processes of the
    experiment that calls them (a split_inference stage still refuses split_training's). Each
    name must be what pickle writes for the object: a top-level function or class of `module`."""
    loaded = sys.modules.get(module)
    if loaded is None:
        raise ValueError(f"rpc_guard.allow: {module} is not imported (call it from the module)")
    for name in names:
        obj = getattr(loaded, name, None)
        if obj is None or (
            getattr(obj, "__module__", None),
            getattr(obj, "__qualname__", None),
        ) != (module, name):
            raise ValueError(
                f"rpc_guard.allow: {module}.{name} is not a top-level function or class of {module}"
            )
        _REFERENCES.add((module, name))


_SAFE_BUILTINS = {
    "dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str", "bytes",
    "complex", "slice", "range",
}  # fmt: skip


_RECEIVERS = ("_tensor_receiver", "_rref_receiver", "_py_rref_receiver")


def _receiver(owner: Any, name: str) -> Any:
    """The only `getattr` a message may call: the RPC pickler's own receiver classmethods."""
    if owner is rpc_internal._InternalRPCPickler and name in _RECEIVERS:
        return getattr(owner, name)
    raise UnsafeMessageError(f"RPC message refused: it asks for attribute {name!r}")


def _may_call(func: Any) -> bool:
    """What a message may call while it is unpickled: the records it is built from, the RPC
    pickler's receivers, plain builtin types and exception types. Nothing with effects."""
    if func in (rpc_internal.PythonUDF, rpc_internal.RemoteException):
        return True
    pickler = rpc_internal._InternalRPCPickler
    if any(func == getattr(pickler, name, None) for name in _RECEIVERS):
        return True
    if isinstance(func, type) and func.__module__ == "builtins":
        return func.__name__ in _SAFE_BUILTINS or issubclass(func, BaseException)
    return False


_PyUnpickler: Any = pickle._Unpickler
"""The pure-Python unpickler: its opcodes can be overridden one by one (the C one's cannot)."""


class SafeUnpickler(_PyUnpickler):
    """An unpickler that resolves only allow-listed globals, calls only harmless constructors
    and sets state only on objects it built itself from this message.

    - `find_class`: exact (module, qualified name) pairs from `_REFERENCES`, builtin value types
      and exception types; no dotted names (protocol 4 would walk `module.a.b` to anything the
      module imported), no other module.
    - REDUCE / NEWOBJ / NEWOBJ_EX: only `_may_call` callables (a message cannot run
      build a `PipelineStage` or a `Stage` while being unpickled; the call it carries runs later,
      after the RPC layer's own checks).
    - BUILD: only on an object this message built, never on a class, function or module
      global (the stage's auth state, `hmac.compare_digest`, ...).
    - INST / OBJ (protocols 0-1 instance building): refused.

    It is the pure-Python unpickler (`pickle._Unpickler`), whose opcodes can be overridden one
    by one; RPC messages are small (tensors travel beside the pickle, not in it).
    """

    dispatch: ClassVar[dict[int, Callable[..., None]]] = dict(_PyUnpickler.dispatch)

    def __init__(self, file: Any, **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._built: set[int] = set()
        self._keep: list[Any] = []  # so that no id in _built is reused by another object

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:  # Python 2 names, as protocols 0-2 write them
            import _compat_pickle

            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if "." in name:
            raise UnsafeMessageError(f"RPC message refused: it names {module}.{name}")
        if module == "builtins":
            if name == "getattr":  # classmethods are pickled as getattr(cls, name)
                return _receiver
            value = getattr(builtins, name, None)
            if name in _SAFE_BUILTINS:
                return value
            if isinstance(value, type) and issubclass(value, BaseException):
                return value  # remote exceptions are re-raised by type
        elif (module, name) in _REFERENCES:
            return super().find_class(module, name)
        raise UnsafeMessageError(f"RPC message refused: it names {module}.{name}")

    def _made(self, obj: Any) -> Any:
        self._built.add(id(obj))
        self._keep.append(obj)
        return obj

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if func is not _receiver and not _may_call(func):
            raise UnsafeMessageError(f"RPC message refused: it calls {func!r}")
        self.stack[-1] = self._made(func(*args))

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack[-1]
        if not _may_call(cls):
            raise UnsafeMessageError(f"RPC message refused: it builds {cls!r}")
        self.stack[-1] = self._made(cls.__new__(cls, *args))

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack[-1]
        if not _may_call(cls):
            raise UnsafeMessageError(f"RPC message refused: it builds {cls!r}")
        self.stack[-1] = self._made(cls.__new__(cls, *args, **kwargs))

    def _load_build(self) -> None:
        if id(self.stack[-2]) not in self._built:
            raise UnsafeMessageError(
                f"RPC message refused: it sets state on {type(self.stack[-2]).__name__}, "
                "which it did not build"
            )
        super().load_build()

    def _refuse_instance(self) -> None:
        raise UnsafeMessageError("RPC message refused: it uses INST/OBJ instance building")

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build
    dispatch[pickle.INST[0]] = _refuse_instance
    dispatch[pickle.OBJ[0]] = _refuse_instance


def safe_loads(data: bytes) -> Any:
    """Unpickle with the RPC allow-list alone, no envelope (for tests and tools)."""
    return SafeUnpickler(io.BytesIO(data)).load()


# ---------------------------------------------------------------------------- signed calls

ENVELOPE = struct.Struct("!4sBBQBB")
"""magic, version, key, sequence number, sender name length, receiver name length (then the
two names, then the MAC when signed). The receiver is named on calls; a reply names none."""
MAGIC = b"LRPC"
VERSION = 2
UNSIGNED, SIGNED = 0, 1
MAC_BYTES = hashlib.sha256().digest_size
REPLAY_WINDOW = 1 << 16
"""How far out of order a sender's messages may arrive (TensorPipe runs calls concurrently)."""

START_CALLS = frozenset(
    {
        # torch's own start-up barrier, run inside init_rpc before anyone can authenticate
        ("torch.distributed.rpc.api", "_gather_to_leader"),
        ("torch.distributed.rpc.api", "_broadcast_to_followers"),
        # the handshake, and the liveness ping a stage starts as soon as it has joined
        ("split_engine.handshake", "stage_prove"),
        ("split_engine.handshake", "stage_accept_driver"),
        ("split_engine.workers", "driver_alive"),
    }
)
"""What a process serves unsigned, and only until its world key is set."""


def _is_start_call(func: Any) -> bool:
    """Whether `func` is one of START_CALLS itself (by identity: a message can build an object
    whose __module__ and __qualname__ say anything)."""
    import importlib

    for module, name in START_CALLS:
        with contextlib.suppress(ImportError):
            if func is getattr(importlib.import_module(module), name, None):
                return True
    return False


_destination = threading.local()
"""The worker a call being pickled on this thread goes to (see `_addressed`)."""


def _worker_name(to: Any) -> str:
    if isinstance(to, str):
        return to
    if isinstance(to, int):
        import torch.distributed.rpc as rpc

        return str(rpc.get_worker_info(to).name)
    return str(getattr(to, "name", ""))


def _addressed(send: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap one of torch's call senders so the envelope of the call names its receiver."""

    @functools.wraps(send)
    def addressed(to: Any, *args: Any, **kwargs: Any) -> Any:
        previous = getattr(_destination, "name", "")
        _destination.name = _worker_name(to)
        try:
            return send(to, *args, **kwargs)
        finally:
            _destination.name = previous

    addressed.__wrapped_sender__ = True  # type: ignore[attr-defined]
    return addressed


@dataclass
class _Window:
    """The sequence numbers seen from one sender: each is accepted once."""

    highest: int = -1
    seen: set[int] = field(default_factory=set)

    def accept(self, seq: int) -> bool:
        if seq <= self.highest - REPLAY_WINDOW or seq in self.seen:
            return False
        self.seen.add(seq)
        if seq > self.highest:
            self.highest = seq
            if len(self.seen) > 2 * REPLAY_WINDOW:
                floor = seq - REPLAY_WINDOW
                self.seen = {s for s in self.seen if s > floor}
        return True


@dataclass
class _CallAuth:
    """This process's side of call signing; reset each time it joins a world."""

    name: str = ""
    secret: bytes | None = None
    key: bytes | None = None  # the world key, once known
    signing: bool = False  # whether what we send is signed (after our side of the handshake)
    windows: dict[str, _Window] = field(default_factory=dict)
    counter: Any = field(default_factory=lambda: itertools.count())
    refused: int = 0
    last_warning: float = 0.0


_calls = _CallAuth()
_calls_lock = threading.Lock()


def reset(name: str, secret: bytes | None) -> None:
    """Joining a world as `name`: nothing signed yet, no world key, no sequence numbers seen."""
    global _calls
    with _calls_lock:
        _calls = _CallAuth(name=name, secret=secret)


def world_key(secret: bytes, world_nonce: bytes) -> bytes:
    return mac(secret, b"rpc-world", world_nonce)


def set_world_key(world_nonce: bytes) -> None:
    """The world nonce is known (the driver chose it; a stage got it in the handshake): from now
    on, accept signed messages under the key it gives."""
    with _calls_lock:
        if _calls.secret is None:
            raise RuntimeError("no shared secret: there is no world key to set")
        _calls.key = world_key(_calls.secret, world_nonce)


def start_signing() -> None:
    """Sign everything we send and refuse everything unsigned we receive from now on."""
    with _calls_lock:
        if _calls.key is None:
            raise RuntimeError("start_signing before the world key is set")
        _calls.signing = True


def _tensor_meta(tensors: list[Any]) -> bytes:
    """What the MAC covers of the tensors travelling beside the pickle: dtype and shape."""
    return "|".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors).encode()


def _signature(key: bytes, head: bytes, body: bytes, tensors: list[Any]) -> bytes:
    return hmac.new(key, head + _tensor_meta(tensors) + b"\0" + body, hashlib.sha256).digest()


class EnvelopePickler(pickle.Pickler):
    """torch's RPC pickler with our envelope in front: sender, sequence number, MAC."""

    def __init__(self, file: Any, *args: Any, **kwargs: Any) -> None:
        self._out = file
        self._body = io.BytesIO()
        super().__init__(self._body, *args, **kwargs)

    def dump(self, obj: Any) -> None:
        super().dump(obj)
        body = self._body.getvalue()
        calls = _calls
        name = calls.name.encode()[:255]
        receiver = getattr(_destination, "name", "").encode()[:255]
        signed = calls.signing and calls.key is not None
        seq = next(calls.counter)
        kind = SIGNED if signed else UNSIGNED
        head = ENVELOPE.pack(MAGIC, VERSION, kind, seq, len(name), len(receiver))
        head += name + receiver
        if signed:
            assert calls.key is not None
            tensors = getattr(rpc_internal._thread_local_tensor_tables, "send_tables", [])
            head += _signature(calls.key, head, body, tensors)
        self._out.write(head)
        self._out.write(body)


class RpcUnpickler(SafeUnpickler):
    """Reads the envelope, checks it, then unpickles the body with the allow-list."""

    def __init__(self, file: Any, **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._source = file

    def load(self) -> Any:
        calls = _calls
        sender, signed, addressed = self._open_envelope(calls)
        value = super().load()
        is_call = isinstance(value, rpc_internal.PythonUDF)
        if is_call and signed and not addressed:  # a reply's envelope cannot carry a call
            self._refuse(calls, f"a call from {sender} addressed to no one")
        if is_call and not signed and calls.secret is not None and not _is_start_call(value.func):
            what = ascii(getattr(value.func, "__qualname__", type(value.func).__name__))
            self._refuse(
                calls,
                f"an unsigned call to {what[:80]} from {sender}, which has not proved the "
                "shared secret to this process (is cluster.secret / LAB_SECRET the same on "
                "every host?)",
            )
        return value

    def _open_envelope(self, calls: _CallAuth) -> tuple[str, bool, bool]:
        """(sender, signed, addressed to this process) of a message, or refused."""
        head = self._source.read(ENVELOPE.size)
        if len(head) < ENVELOPE.size:
            self._refuse(calls, "a message without an envelope (not a lab RPC peer?)")
        magic, version, kind, seq, name_len, receiver_len = ENVELOPE.unpack(head)
        if magic != MAGIC or version != VERSION or kind not in (UNSIGNED, SIGNED):
            self._refuse(calls, "a message with a bad envelope (not a lab RPC peer?)")
        raw_name, raw_receiver = self._source.read(name_len), self._source.read(receiver_len)
        sender = ascii(raw_name.decode("utf-8", "replace"))[1:-1][:64]  # peer text: escaped
        head += raw_name + raw_receiver
        if raw_receiver and raw_receiver != calls.name.encode():
            receiver = ascii(raw_receiver.decode("utf-8", "replace"))[1:-1][:64]
            self._refuse(calls, f"a message from {sender} addressed to {receiver}, not to us")
        if kind == UNSIGNED:
            if calls.signing:
                self._refuse(calls, f"an unsigned message from {sender} (no shared secret there?)")
            return sender, False, bool(raw_receiver)
        if calls.secret is None:
            self._refuse(
                calls,
                f"a signed message from {sender}: it has a shared secret and this side has "
                "none (set the same cluster.secret / LAB_SECRET everywhere)",
            )
        signature = self._source.read(MAC_BYTES)
        body = self._source.read()
        tensors = getattr(rpc_internal._thread_local_tensor_tables, "recv_tables", [])
        key = calls.key
        if key is None or not hmac.compare_digest(signature, _signature(key, head, body, tensors)):
            self._refuse(calls, f"a message claiming to come from {sender} without a valid MAC")
        with _calls_lock:
            fresh = calls.windows.setdefault(sender, _Window()).accept(seq)
        if not fresh:
            self._refuse(calls, f"a replayed message (sequence {seq} from {sender} seen before)")
        self._source = io.BytesIO(body)
        self._file_read, self._file_readline = self._source.read, self._source.readline
        return sender, True, bool(raw_receiver)

    @staticmethod
    def _refuse(calls: _CallAuth, what: str) -> None:
        with _calls_lock:
            calls.refused += 1
            now = time.monotonic()
            loud = now - calls.last_warning > 10.0
            if loud:
                calls.last_warning = now
        if loud:  # one line per 10 s at most: a flood of refusals must not flood the log
            log.warning("RPC: refused %s (%d refused so far)", what, calls.refused)
        raise UnsafeMessageError(f"RPC message refused: {what}")


def install() -> None:
    """Make torch's RPC layer sign what this process sends and check what it receives, and
    name each call's receiver in its envelope (torch's pickler is not told where a call goes:
    its senders are wrapped to say it)."""
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc import api

    rpc_internal._pickler = EnvelopePickler
    rpc_internal._unpickler = RpcUnpickler
    # every Python call goes through _invoke_rpc (rpc_sync, rpc_async, RRef proxies) or remote
    if not getattr(api._invoke_rpc, "__wrapped_sender__", False):
        api._invoke_rpc = _addressed(api._invoke_rpc)
    if not getattr(api.remote, "__wrapped_sender__", False):
        api.remote = rpc.remote = _addressed(api.remote)


def never_sent(cls: type) -> None:
    """Objects of `cls` never leave their process: the RPC pickler refuses them.

    TensorPipe serves an RRef fetch (`to_here`) in C++ without asking Python who sent it, and
    pickles the value it finds; for a stage's model or optimizer that would hand out the
    weights. Nothing in a split run fetches these, so their pickling is refused outright.
    """

    def refuse(obj: Any) -> Any:
        raise TypeError(f"a {cls.__name__} never leaves the process that holds it")

    rpc_internal._internal_rpc_pickler._register_reducer(cls, refuse)
