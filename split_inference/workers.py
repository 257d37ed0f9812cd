"""The RPC world of a split run: start, authenticate, serve, stop.

Ranks: the driver is rank 0 (`driver`), stage k is rank k (`stage1` ... `stageN`); the driver's
host runs the rendezvous store on `cluster.master`. torch.distributed.rpc (TensorPipe) carries
Python calls as pickles and has no authentication of its own, so this module adds both guards
the project asks for:

- Every process unpickles RPC messages with an allow-list (`SafeUnpickler`): exact (module,
  name) pairs of the functions and classes split runs call, tensors and RRefs, plain builtins
  and exception types; nothing named is called while unpickling and no state is set on what the
  message did not build. Anything else (`os.system`, `builtins.eval`, a dotted name under an
  allowed module, ...) is refused before it is looked up.
- With a shared secret (`cluster.secret` / LAB_SECRET), the driver and each stage prove it to
  each other (HMAC-SHA256 challenge-response, both ways) before any model is built; a stage
  serves nothing but the handshake until the driver has proved itself, and the driver aborts
  the run if a stage cannot.
"""

from __future__ import annotations

import builtins
import contextlib
import hmac
import io
import logging
import os
import pickle
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import internal as rpc_internal

from lab.config import Endpoint
from netproto.auth import NONCE_BYTES, mac
from split_inference.config import SplitConfig

log = logging.getLogger(__name__)

DRIVER = "driver"


def stage_name(rank: int) -> str:
    return f"stage{rank}"


class StageLostError(RuntimeError):
    """A stage did not answer (it died, hung, or the network between went away)."""


class UnsafeMessageError(pickle.UnpicklingError):
    """An RPC message named a global outside the allow-list."""


# ---------------------------------------------------------------------------- safe unpickling

_REFERENCES = {
    # What a split run's RPC messages name, exactly: the functions and classes it calls on a
    # peer (inside a PythonUDF), each one by its module and qualified name. Naming is not
    # calling: none of these runs while a message is unpickled.
    ("split_inference.stage", "Stage"),
    ("split_inference.stage", "describe_model"),
    ("split_inference.workers", "driver_alive"),
    ("split_inference.workers", "free_memory_bytes"),
    ("split_inference.workers", "release_stage"),
    ("split_inference.workers", "stage_accept_driver"),
    ("split_inference.workers", "stage_alive"),
    ("split_inference.workers", "stage_prove"),
    ("split_training.trainer", "StageAdamW"),
    ("split_training.trainer", "load_stage"),
    ("split_training.trainer", "save_stage"),
    # torch's RPC internals: RRef method calls, the start-up / shutdown all-gather, and
    # DistributedOptimizer creating and stepping each stage's local optimizer.
    ("torch.distributed.rpc.rref_proxy", "_local_invoke"),
    ("torch.distributed.rpc.api", "_rref_typeof_on_owner"),
    ("torch.distributed.rpc.api", "_gather_to_leader"),
    ("torch.distributed.rpc.api", "_broadcast_to_followers"),
    ("torch.distributed.optim.optimizer", "_new_local_optimizer"),
    ("torch.distributed.optim.optimizer", "_local_optimizer_step"),
    # The two records a message is built from (called while unpickling: see _may_call) and the
    # RPC pickler itself, whose receivers rebuild tensors and RRefs (see `_receiver`).
    ("torch.distributed.rpc.internal", "PythonUDF"),
    ("torch.distributed.rpc.internal", "RemoteException"),
    ("torch.distributed.rpc.internal", "_InternalRPCPickler"),
}
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
      `save_stage` or build a `Stage` while being unpickled; the call it carries runs later,
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


def install_safe_unpickler() -> None:
    """Make torch's RPC layer use `SafeUnpickler` in this process (idempotent)."""
    rpc_internal._unpickler = SafeUnpickler


def safe_loads(data: bytes) -> Any:
    """Unpickle with the RPC allow-list (for tests and tools)."""
    return SafeUnpickler(io.BytesIO(data)).load()


# ---------------------------------------------------------------------------- authentication


@dataclass
class _AuthState:
    secret: bytes | None = None
    driver_proved: bool = False
    nonce: bytes = b""


_auth = _AuthState()
_auth_lock = threading.Lock()


def stage_prove(driver_nonce: bytes) -> tuple[bytes, bytes]:
    """Stage side, step 1: our MAC over the driver's nonce, and a nonce for the driver to sign."""
    with _auth_lock:
        secret = _auth.secret
        if secret is None:
            return b"", b""
        _auth.nonce = secrets.token_bytes(NONCE_BYTES)
        name = rpc.get_worker_info().name.encode()
        return mac(secret, b"stage", name, driver_nonce, _auth.nonce), _auth.nonce


def stage_accept_driver(proof: bytes) -> bool:
    """Stage side, step 2: check the driver's MAC over our nonce; serve only if it holds."""
    with _auth_lock:
        secret, nonce = _auth.secret, _auth.nonce
        if secret is None:
            _auth.driver_proved = True
            return True
        ok = bool(nonce) and hmac.compare_digest(proof, mac(secret, b"driver", nonce))
        _auth.nonce = b""  # one use
        _auth.driver_proved = _auth.driver_proved or ok
        return ok


def require_driver() -> None:
    """Called first by every stage-side entry point: refuse work before the driver proved itself."""
    if not _auth.driver_proved:
        raise PermissionError("this stage serves only a driver that has proved the shared secret")


def authenticate_stages(secret: bytes | None, num_stages: int, *, timeout_s: float) -> None:
    """Driver side: mutual challenge-response with every stage; raises if one fails."""
    for rank in range(1, num_stages + 1):
        name = stage_name(rank)
        nonce = secrets.token_bytes(NONCE_BYTES)
        stage_mac, stage_nonce = rpc.rpc_sync(name, stage_prove, args=(nonce,), timeout=timeout_s)
        if secret is not None:
            expected = mac(secret, b"stage", name.encode(), nonce, stage_nonce)
            if not stage_mac or not hmac.compare_digest(stage_mac, expected):
                raise PermissionError(
                    f"{name} could not prove the shared secret (cluster.secret / LAB_SECRET "
                    f"differ, or it has none): stopping before sending it anything"
                )
            proof = mac(secret, b"driver", stage_nonce)
        else:
            if stage_mac:
                raise PermissionError(f"{name} expects a shared secret and this driver has none")
            proof = b""
        if not rpc.rpc_sync(name, stage_accept_driver, args=(proof,), timeout=timeout_s):
            raise PermissionError(f"{name} refused this driver's proof of the shared secret")


# ---------------------------------------------------------------------------- the world


@dataclass(frozen=True)
class World:
    """The RPC world this process is part of: its rank, where the world meets, how it talks."""

    rank: int
    master: Endpoint
    split: SplitConfig

    @property
    def name(self) -> str:
        return DRIVER if self.rank == 0 else stage_name(self.rank)

    @property
    def num_stages(self) -> int:
        return self.split.num_stages


def _options(world: World) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=world.split.rpc_threads,
        rpc_timeout=world.split.rpc_timeout_s,
        init_method=f"tcp://{world.master.host}:{world.master.port}",
        # TensorPipe's `uv` (TCP) transport, which is what crosses real hosts. Its default
        # on one host is shared memory, whose pollers cost more CPU than they save on a small
        # box: per-token latency of a 2-stage split over loopback halved with `uv` (2 cores).
        _transports=None if world.split.transport == "auto" else ["uv"],
    )


def _forget_previous_world() -> None:
    """Reset torch's per-process RPC counters before joining another world.

    torch numbers the rendezvous keys and its all-gathers (start-up, shutdown barrier) per
    process and per set of worker names; fresh stage processes count from 0. A driver process
    that joins a second world (a sweep, a test session) must count from 0 as well, or it waits
    at start or at shutdown for keys nobody writes. Each world has a store of its own, so the
    old numbers mean nothing any more.
    """
    from torch.distributed.rpc import api as rpc_api

    rpc._init_counter = 0
    with rpc_api._all_gather_dict_lock:
        rpc_api._all_gather_sequence_id.clear()
        rpc_api._all_gather_sequence_id_to_states.clear()


@contextmanager
def joined(
    world: World,
    *,
    secret: bytes | None,
    check: Callable[[], None] = lambda: None,
) -> Iterator[None]:
    """Be part of the RPC world for the length of the block; always leave it.

    Joining waits for every rank. torch's rendezvous would wait 30 minutes for a missing one
    and cannot be interrupted, so a watchdog ends this process with a clear message after
    `split.join_timeout_s` instead, or as soon as `check()` raises (a local stage process that
    died while the driver waited for it). Leaving is immediate (see the comment there).
    """
    install_safe_unpickler()
    _auth.secret, _auth.driver_proved, _auth.nonce = secret, False, b""
    log.info(
        "%s joining the RPC world on %s:%d (%d stages)",
        world.name,
        world.master.host,
        world.master.port,
        world.num_stages,
    )

    assembled = threading.Event()

    def watch() -> None:  # pragma: no cover - ends the process
        join_timeout_s = world.split.join_timeout_s
        deadline = time.monotonic() + join_timeout_s
        while not assembled.wait(1.0):
            try:
                check()
            except Exception as exc:
                reason = str(exc)
                break
            if time.monotonic() > deadline:
                reason = (
                    f"the RPC world (driver + {world.num_stages} stages at {world.master.host}:"
                    f"{world.master.port}) did not assemble within {join_timeout_s:.0f}s; check "
                    f"that every stage runs with the same cluster.master and split.num_stages"
                )
                break
        else:
            return
        log.error("%s: %s", world.name, reason)
        logging.shutdown()
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="rpc-join-watchdog").start()
    _forget_previous_world()
    try:
        rpc.init_rpc(
            world.name,
            rank=world.rank,
            world_size=world.num_stages + 1,
            rpc_backend_options=_options(world),
        )
    finally:
        assembled.set()
    try:
        yield
    finally:
        # Not torch's graceful shutdown: its barrier counts worlds per process in C++ (a second
        # world in one process waits for keys nobody writes) and it waits for peers that died.
        # The run's end is agreed explicitly instead: the driver releases every stage and waits
        # for each to acknowledge (`release_all`) before anyone leaves.
        rpc.shutdown(graceful=False)


# ---------------------------------------------------------------------------- stage serving

_released = threading.Event()


def release_stage() -> None:
    """Driver -> stage: the run is over, leave the world."""
    _released.set()


def driver_alive() -> bool:
    return True


def stage_alive() -> bool:
    return True


def serve_until_released(*, ping_s: float, timeout_s: float) -> None:
    """Stage main loop: serve RPCs until the driver releases us; raise if the driver vanishes."""
    _released.clear()
    while not _released.wait(ping_s):
        try:
            rpc.rpc_sync(DRIVER, driver_alive, timeout=timeout_s)
        except RuntimeError as exc:
            raise StageLostError(f"the driver stopped answering ({exc}); leaving the run") from None


def release_all(num_stages: int) -> None:
    """Driver side: tell every stage to leave (best effort: some may be gone)."""
    futures = []
    for rank in range(1, num_stages + 1):
        with contextlib.suppress(RuntimeError):
            futures.append(rpc.rpc_async(stage_name(rank), release_stage, timeout=5.0))
    for future in futures:
        with contextlib.suppress(RuntimeError):
            future.wait()


def peak_memory() -> dict[str, float]:
    """This process's peak and current resident memory (and CUDA peak where CUDA is used)."""
    import resource

    import psutil

    stats = {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_mib": psutil.Process().memory_info().rss / 2**20,
        "cpu_s": time.process_time(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return stats


def free_memory_bytes() -> float:
    """Memory a stage could still fill: free CUDA memory on a GPU host, available RAM otherwise."""
    require_driver()
    from lab.device import detect_device

    device = detect_device()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    import psutil

    return float(psutil.virtual_memory().available)
