"""Start an experiment's roles as separate processes on this machine and watch them.

`role=local` runs use this: each role (coordinator, client, verifier, stage, ...) is its own
OS process, exactly as on separate hosts, talking over loopback on ports chosen here. Logs are
streamed with a `[role]` prefix; the first role to fail stops the others and raises
`RoleFailedError` with the tail of its log. Nothing is left running afterwards: each role is
the leader of its own process group, which is killed on the way out (also on Ctrl-C or
SIGTERM), and on Linux a role dies with the launcher even when the launcher is SIGKILLed.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, TextIO

from lab.cli import UserError

log = logging.getLogger(__name__)

TAIL_LINES = 40
"""Lines of a failed role's output quoted in the error."""
DRAIN_S = 30.0
"""Longest a failed role's error waits for the launcher to have copied what the role wrote
(its last lines are its reason). Reached only where something else keeps writing into its
output, a grandchild say; an idle pipe ends the wait at once, however busy the machine."""


@dataclass
class Role:
    """One process of an experiment."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables (merged over the launcher's own)."""
    service: bool = False
    """A server: stopped (SIGTERM) once every non-service role has finished successfully."""
    ready: str | None = None
    """A line fragment the role prints once it serves; `ServiceGroup.wait_ready` waits for it,
    so nothing dials a server that is still loading its model."""


class PeerLostError(UserError, RuntimeError):
    """A process of the run died or stopped answering, so the run cannot go on: the message
    names it, and `details` may follow (a log's tail, quoted). `resume`, where the run can go
    on from what it saved, is the sentence with the command that does (set by
    `lab.experiment`, which knows the command); it is said on the error's first line."""

    resume: str = ""
    peer: str | None = None
    """The role (process) that is gone, where known: nobody waits for it any more."""

    def __init__(self, message: str, *, details: str = "") -> None:
        super().__init__(message)
        self.message, self.details = message, details

    def __str__(self) -> str:
        resume = f"; {self.resume}" if self.resume else ""
        return f"{self.message}{resume}{self.details}"


class RoleFailedError(PeerLostError):
    """A role's process failed: its own log, quoted, says why (its traceback too, for a bug).
    A role killed by SIGKILL is named in one line: nothing in its log can say why."""

    def __init__(self, role: str, returncode: int, tail: Sequence[str]) -> None:
        self.role = self.peer = role
        self.returncode = returncode
        self.tail = list(tail)
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            how = f"was killed by {name}"
        else:
            how = f"exited with code {returncode}"
        if returncode == -signal.SIGKILL:
            super().__init__(f"role {role!r} {how} (by a user, or the kernel out of memory)")
            return
        quoted = "".join(f"\n  [{role}] {line}" for line in self.tail[-15:])
        super().__init__(f"role {role!r} {how}", details=f"; its last output:{quoted}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; tiny race window before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: ask the kernel to SIGTERM this child when the launcher dies, even by SIGKILL."""
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class _Running:
    """A started role: its process, and a thread copying its output with a prefix."""

    def __init__(self, role: Role, *, out: TextIO, out_lock: threading.Lock) -> None:
        self.role = role
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.stopped_by_us = False
        self.ready = threading.Event()
        if role.ready is None:
            self.ready.set()
        self.process = subprocess.Popen(
            role.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **role.env},
            start_new_session=True,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
        self._copying = threading.Lock()
        """Held while a chunk of the role's output is read and copied (see finish_output)."""
        self._reader = threading.Thread(
            target=self._copy_output, args=(out, out_lock), name=f"launch-{role.name}", daemon=True
        )
        self._reader.start()

    def _copy_output(self, out: TextIO, lock: threading.Lock) -> None:
        stream: IO[bytes] | None = self.process.stdout
        assert stream is not None
        fd = stream.fileno()
        partial: list[bytes] = []  # the line under way, in pieces (a progress bar's \r-only
        # output can run long without a newline: joined once, when its newline comes)
        readable = select.poll()
        readable.register(fd, select.POLLIN)
        while True:
            readable.poll()  # bytes or the end (waited for outside `_copying`, read under it)
            with self._copying:
                chunk = os.read(fd, 1 << 16)
                lines: list[bytes] = []
                if not chunk:  # the end: a last line without its newline too
                    lines = [b"".join(partial)] if partial else []
                elif b"\n" not in chunk:
                    partial.append(chunk)
                else:
                    first, *lines, rest = chunk.split(b"\n")
                    lines.insert(0, b"".join([*partial, first]))
                    partial = [rest] if rest else []
                for raw in lines:
                    self._copy_line(raw.decode(errors="replace"), out, lock)
            if not chunk:
                return

    def _copy_line(self, line: str, out: TextIO, lock: threading.Lock) -> None:
        self.tail.append(line)
        if not self.ready.is_set() and self.role.ready and self.role.ready in line:
            self.ready.set()
        with lock:
            out.write(f"[{self.role.name}] {line}\n")
            out.flush()

    def signal_group(self, sig: int) -> None:
        _signal_group(self.process.pid, sig)

    def finish_output(self) -> None:
        """Return once every line the role wrote so far is copied (its tail complete): the pipe
        holds nothing unread, or it has ended. A wait on what is there, not a fixed time: on a
        busy machine the copying thread may run seconds after the role exited (DRAIN_S bounds
        it where something else keeps writing)."""
        deadline = time.monotonic() + DRAIN_S
        while self._reader.is_alive() and time.monotonic() < deadline:
            # bounded too: the copier holds the lock while it writes, and a launcher whose own
            # output nobody reads (`| less` paused, a stalled collector) blocks it there
            if not self._copying.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return
            try:
                if not self._reader.is_alive() or _unread(self.process.stdout) == 0:
                    return
            finally:
                self._copying.release()
            self._reader.join(timeout=0.01)


def _unread(stream: IO[bytes] | None) -> int:
    """Bytes waiting in the pipe `stream` reads (FIONREAD); 0 once it is closed."""
    if stream is None or stream.closed:
        return 0
    buffer = bytearray(4)
    try:
        fcntl.ioctl(stream.fileno(), termios.FIONREAD, buffer)
    except OSError:
        return 0
    return int.from_bytes(buffer, sys.byteorder)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while launching, so cleanup runs on `kill`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch(
    roles: Sequence[Role],
    *,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    poll_s: float = 0.05,
    out: TextIO | None = None,
) -> dict[str, int]:
    """Run `roles` to completion; returns each role's exit code.

    Raises RoleFailedError for the first role that exits non-zero (the others are stopped),
    TimeoutError when `timeout_s` passes first. Every process group is reaped before returning.
    """
    names = [role.name for role in roles]
    if len(set(names)) != len(names):
        raise ValueError(f"role names must be unique: {names}")
    if not any(not role.service for role in roles):
        raise ValueError("at least one role must not be a service, or nothing would end the run")
    out = out or sys.stdout
    lock = threading.Lock()
    running: list[_Running] = []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        with _sigterm_as_interrupt():
            for role in roles:
                running.append(_Running(role, out=out, out_lock=lock))
                log.debug(
                    "started %s (pid %d): %s",
                    role.name,
                    running[-1].process.pid,
                    " ".join(role.argv),
                )
            while True:
                for proc in running:
                    code = proc.process.poll()
                    if code not in (None, 0) and not proc.stopped_by_us:
                        proc.finish_output()
                        raise RoleFailedError(proc.role.name, code, proc.tail)
                workers = [p for p in running if not p.role.service]
                if all(p.process.poll() == 0 for p in workers):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    pending = [p.role.name for p in workers if p.process.poll() is None]
                    raise TimeoutError(f"roles {pending} still running after {timeout_s:.0f}s")
                time.sleep(poll_s)
            _stop(running, grace_s=grace_s)
            return {p.role.name: int(p.process.returncode) for p in running}
    finally:
        _stop(running, grace_s=grace_s)


def stop_groups(
    procs: Sequence[subprocess.Popen], *, grace_s: float, first: int = signal.SIGTERM
) -> None:
    """End the process groups `procs` lead (started with `start_new_session=True`): `first`
    (SIGTERM) to each live one, SIGKILL to what is still running `grace_s` later (one deadline
    for all), every one reaped. The one way the project ends a process tree it started."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc.pid, first)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _stop(running: Sequence[_Running], *, grace_s: float) -> None:
    """SIGTERM every live process group, SIGKILL what is left after `grace_s`, reap all."""
    alive = [p for p in running if p.process.poll() is None]
    for proc in alive:
        proc.stopped_by_us = True
    stop_groups([p.process for p in alive], grace_s=grace_s)
    for proc in running:
        proc.signal_group(signal.SIGKILL)  # grandchildren left in the group, if any
        proc.finish_output()


WATCH_S = 0.2
"""How often a `services` block's watcher looks at its roles."""
STOP_AFTER_S = 3.0
"""A role of a `services` block died unasked and the block has not ended this long after: the
watcher stops the others, so that whatever the block waits on ends (see `services`)."""


class ServiceGroup:
    """The background roles of a `services` block. Calling it checks them (RoleFailedError for
    any that has exited); `wait_exited` waits for roles told to leave to have left."""

    def __init__(self) -> None:
        self.running: list[_Running] = []
        self.died: RoleFailedError | None = None
        """The first role the watcher saw fail unasked (a non-zero exit), if any."""

    def __call__(self) -> None:
        for proc in self.running:
            code = proc.process.poll()
            if code is not None and not proc.stopped_by_us:
                proc.finish_output()
                raise RoleFailedError(proc.role.name, code, proc.tail)

    def process(self, name: str) -> subprocess.Popen[bytes]:
        """The running process of the role called `name` (KeyError if none)."""
        for proc in self.running:
            if proc.role.name == name:
                return proc.process
        raise KeyError(f"no role {name!r} in this group")

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until every role that announces readiness has (RoleFailedError if one exits
        first, TimeoutError naming the roles still loading after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not all(proc.ready.is_set() for proc in self.running):
            self()
            if time.monotonic() > deadline:
                pending = [p.role.name for p in self.running if not p.ready.is_set()]
                raise TimeoutError(f"roles {pending} not ready after {timeout_s:.0f}s")
            time.sleep(0.05)

    def watch(self, ending: threading.Event) -> None:
        """The block's watcher (a thread): notes the first role to fail unasked and, if the
        block is still running STOP_AFTER_S later, stops the others (the block's own waits
        on them then end); returns once `ending` is set."""
        noticed = 0.0
        while not ending.wait(WATCH_S):
            if self.died is None:
                for proc in self.running:
                    code = proc.process.poll()
                    if code not in (None, 0) and not proc.stopped_by_us:
                        proc.finish_output()  # its last lines (its reason) quoted, not lost
                        self.died = RoleFailedError(proc.role.name, code, proc.tail)
                        noticed = time.monotonic()
                        break
            elif noticed and time.monotonic() - noticed > STOP_AFTER_S:
                log.warning("%s, and the run has not ended: stopping its other roles", self.died)
                noticed = 0.0
                for proc in self.running:
                    if proc.process.poll() is None:
                        proc.stopped_by_us = True
                        proc.signal_group(signal.SIGTERM)

    def wait_exited(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every role to exit on its own; True if they all did.

        From here on an exit is expected, not a failure."""
        deadline = time.monotonic() + timeout_s
        for proc in self.running:
            proc.stopped_by_us = True
            try:
                proc.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True


@contextlib.contextmanager
def services(
    roles: Sequence[Role], *, grace_s: float = 5.0, out: TextIO | None = None
) -> Iterator[ServiceGroup]:
    """Start `roles` (servers) in the background for the length of a `with` block.

    Yields a `ServiceGroup`: call it to check the roles (RoleFailedError if any has exited).
    A watcher thread looks at the roles meanwhile: one that fails unasked while the block runs
    is what the block's error becomes, where the block raised no error of its own that a user
    can read (a peer's closed connection, say), and if the block has not ended STOP_AFTER_S
    after it, the watcher stops the other roles. On leaving the block, whatever happened inside
    it, every process group is stopped and reaped.
    """
    lock = threading.Lock()
    group = ServiceGroup()
    ending = threading.Event()
    try:
        with _sigterm_as_interrupt():
            for role in roles:
                group.running.append(_Running(role, out=out or sys.stdout, out_lock=lock))
            threading.Thread(
                target=group.watch, args=(ending,), name="launch-watch", daemon=True
            ).start()
            try:
                yield group
            except Exception as exc:
                if group.died is not None and not isinstance(exc, UserError):
                    raise group.died from exc
                raise
    finally:
        ending.set()
        _stop(group.running, grace_s=grace_s)


def settings_role(
    name: str,
    module: str,
    settings: object,
    *,
    schema: str,
    overrides: Sequence[str] = (),
    service: bool = False,
    ready: str | None = None,
) -> Role:
    """A role that runs `python -m module` with exactly this run's resolved settings.

    The settings (a schema dataclass) are written to `<run_dir>/<name>_config.yaml` and the
    child composes that file against `schema`; `overrides` then set what differs for this role
    (its `role=...`, its port...). A shared secret travels in the environment (LAB_SECRET),
    never in a file or in the argv, which any user of the machine can read with `ps`: the file
    says `cluster.secret: '***'`, and an override that sets the secret is moved to the
    environment too.
    """
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from lab.config import REDACTED, SECRET_ENV, LabConfig
    from lab.redact import redact_config, split_secret

    if not isinstance(settings, LabConfig):
        raise TypeError("settings_role needs a LabConfig (sub)class instance")
    run_dir = settings.paths.run_path.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    child_dir = run_dir / name
    overrides, secret_override = split_secret(overrides)
    resolved = settings.cluster.resolved_secret()
    secret = secret_override or (resolved.decode() if resolved else None)
    data = redact_config(asdict(settings))
    # the child reads the secret from LAB_SECRET (`***`: a run without it fails, saying so)
    data["cluster"]["secret"] = REDACTED if secret else None
    data["cluster"]["secret_file"] = None
    data["defaults"] = [schema, "_self_"]
    OmegaConf.save(OmegaConf.create(data), run_dir / f"{name}_config.yaml")
    argv = [
        sys.executable,
        "-m",
        module,
        f"--config-path={run_dir}",
        f"--config-name={name}_config",
        *overrides,
        f"paths.run_dir={child_dir}",
        f"hydra.run.dir={child_dir}",
        f"hydra.job.name={name}",  # its log is <role>/<role>.log (python -m would say __main__)
    ]
    env = {SECRET_ENV: secret} if secret else {}
    return Role(name, argv, env=env, service=service, ready=ready)
