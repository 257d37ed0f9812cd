"""Another local user against a local split run: a process as uid nobody, a split run to attack,
the sockets a process tree listens on, and labtools.hosts.rogue_rpc's six attacks on each
stage's TensorPipe listener. The fence tests (tests/multihost/test_fence.py) and
bench/abuse_bench.py run the same attacks from here."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lab.launch import stop_groups

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: the run's and the attacker's PYTHONPATH and working folder."""
OTHER_UID = 65534
"""`nobody`: another local user, as on a shared server."""


def other_user_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "running a process as another user needs root"
    if shutil.which("setpriv") is None:
        return "no setpriv (util-linux)"
    return None


def as_other_user(argv: list[str], *, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run `argv` as uid nobody. It keeps CAP_DAC_READ_SEARCH, a capability over files only, so
    that it can read this checkout's interpreter and packages wherever they are (under /root,
    mode 700, here): the network sees uid 65534, which is what the fence decides by."""
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={OTHER_UID}",
            f"--regid={OTHER_UID}",
            "--clear-groups",
            "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search",
            *argv,
        ],
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONDONTWRITEBYTECODE": "1",
            "HOME": "/tmp",
            "LAB_SECRET": "",
        },
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd="/tmp",
        check=False,
    )


def dial_as_other_user(targets: list[tuple[str, int]]) -> list[str]:
    """For each (address, port): `connected` or why not, dialled as another user."""
    script = (
        "import json, socket, sys\n"
        "out = []\n"
        "for host, port in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=3).close()\n"
        "        out.append('connected')\n"
        "    except OSError as exc:\n"
        "        out.append(f'no connection: {exc}')\n"
        "print(json.dumps(out))\n"
    )
    done = as_other_user([sys.executable, "-c", script, json.dumps(targets)])
    if done.returncode != 0:
        raise RuntimeError(f"the dial as another user failed: {done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


@dataclass
class Listening:
    pid: int
    name: str
    inet: list[tuple[str, int]] = field(default_factory=list)
    unix: list[str] = field(default_factory=list)


def _hex_address(text: str) -> tuple[str, int]:
    """/proc/net/tcp's `0100007F:1F90` (or tcp6's 32 hex digits) as (address, port)."""
    import ipaddress

    host, port = text.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
    return str(ipaddress.ip_address(words)), int(port, 16)


def _process_listeners(pid: int) -> tuple[list[tuple[str, int]], list[str]]:
    """The TCP and unix sockets `pid` listens on, read from its own network namespace's tables
    (/proc/PID/net/...: psutil reads the caller's, and misses a process in another namespace);
    TCP in the order they were made (socket inode): a stage's TensorPipe listener first, its
    agent's, then Gloo's."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    by_inode: list[tuple[int, tuple[str, int]]] = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                by_inode.append((int(fields[9]), _hex_address(fields[1])))
    inet = [address for _, address in sorted(by_inode)]  # in the order they were made
    unix = []
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[3], 16) & 0x10000 and fields[6] in inodes:  # __SO_ACCEPTCON: listening
            unix.append(fields[7] if len(fields) > 7 else "(unnamed)")
    return inet, unix


def listening(root_pid: int) -> list[Listening]:
    """Every listening socket of `root_pid` and its descendants, by process."""
    found = []
    try:
        procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for proc in procs:
        try:
            inet, unix = _process_listeners(proc.pid)
            found.append(Listening(proc.pid, " ".join(proc.cmdline()[-3:]), inet, unix))
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
    return found


FENCE_LINE = re.compile(
    r"fence: (nftables|none|a private network namespace)\S*.*? listens on ([0-9a-f.:]*[0-9a-f])"
)


@dataclass
class SplitRun:
    proc: subprocess.Popen[str]
    lines: list[str]
    run_dir: Path

    def wait_for(self, fragment: str, *, count: int = 1, timeout_s: float = 300.0) -> None:
        """Until `count` lines hold `fragment` (the run failing first fails the test)."""
        deadline = time.monotonic() + timeout_s
        while sum(fragment in line for line in self.lines) < count:
            if self.proc.poll() is not None:
                raise RuntimeError("the run ended early:\n" + "".join(self.lines[-40:]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {fragment!r} after {timeout_s:.0f} s")
            time.sleep(0.2)

    @property
    def address(self) -> str:
        for line in self.lines:
            match = FENCE_LINE.search(line)
            if match:
                return match.group(2)
        raise RuntimeError("the run said no fence line:\n" + "".join(self.lines[-40:]))

    def stage_pids(self) -> dict[str, int]:
        stages = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with_rank = [a for a in child.cmdline() if a.startswith("split.rank=")]
            if with_rank:
                stages[f"stage{with_rank[0].split('=')[1]}"] = child.pid
        return stages


@contextmanager
def split_run(
    tmp: Path, *overrides: str, module: str = "split_training", env: dict[str, str] | None = None
) -> Iterator[SplitRun]:
    """A local split run in the background, its output collected; stopped on leaving."""
    import threading

    run_dir = tmp / f"run-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            "model.lab_preset=debug",
            "tracking.wandb=false",
            "num_threads=1",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield SplitRun(proc, lines, run_dir)
    finally:
        stop_groups([proc], grace_s=60)
        reader.join(timeout=10)


def losses(run_dir: Path) -> list[float]:
    """The training losses a split_training run recorded, step by step."""
    from lab.records import read_records

    records = read_records(run_dir / "metrics.jsonl")
    return [r["loss"] for r in records if r.get("kind") == "metrics" and "loss" in r]


def rogue(target: tuple[str, int], attack: str, *args: str) -> dict[str, object]:
    """labtools.hosts.rogue_rpc's `attack` on `target`, as another local user (root starts it
    and it drops to uid nobody before its first connection: the interpreter may live where
    nobody cannot read it)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "labtools.hosts.rogue_rpc",
            "--target",
            f"{target[0]}:{target[1]}",
            "--attack",
            attack,
            "--as-user",
            str(OTHER_UID),
            "--timeout",
            "10",
            "--wait",
            "10",
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LAB_SECRET": ""},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rogue_rpc {attack} failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def marker(folder: Path) -> tuple[Path, str]:
    """A file only the run's user (root) may read, and its bytes' sha256."""
    import hashlib
    import secrets

    path = folder / "only-the-runs-user.bin"
    path.write_bytes(secrets.token_bytes(256))
    path.chmod(0o600)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def tensorpipe_listener(pid: int) -> tuple[str, int]:
    """A stage's TensorPipe listener: the first it made (its agent's, before Gloo's)."""
    (found,) = [item for item in listening(pid) if item.pid == pid]
    return found.inet[0]


def all_attacks(stage: int, target: tuple[str, int], folder: Path) -> dict[str, dict[str, object]]:
    """The review's six attacks on the TensorPipe listener `target` of stage pid `stage`, the
    kills last: each rogue_rpc's JSON (`connected`, `succeeded`, `detail`)."""
    path, digest = marker(folder)
    written = folder / f"written-by-stage-{stage}.bin"
    pid = ["--victim-pid", str(stage)]
    return {
        "file-read": rogue(target, "file-read", "--path", str(path), "--expect-sha256", digest),
        "file-write": rogue(target, "file-write", "--path", str(written)),
        "memory": rogue(target, "memory", *pid),
        "kill-lane": rogue(target, "kill-lane", *pid),
        "kill-segment": rogue(target, "kill-segment", *pid),
        "kill-0xff": rogue(target, "kill-0xff", *pid),
    }


@contextmanager
def held_still(run: SplitRun) -> Iterator[None]:
    """The driver stopped (SIGSTOP) for the block, so the attacks meet a run that is still
    there however slow the machine: its stages wait for it (split.rpc_timeout_s and
    split.heartbeat_timeout_s 600 s, in TRAIN)."""
    os.kill(run.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(run.proc.pid, signal.SIGCONT)


TRAIN = (
    "split.steps=12",
    "split.rpc_timeout_s=600",
    "split.heartbeat_timeout_s=600",
    "split.checkpoint_every=0",
)
"""A short fenced split_training run: the attacks' target."""


@dataclass
class LocalAttack:
    """Another local user's six attacks on each stage of a fenced local split run."""

    fence: str
    """The run's start-up line naming its fence."""
    outcomes: dict[str, dict[str, dict[str, object]]]
    """Per stage, per attack: rogue_rpc's JSON."""
    stages_alive: dict[str, bool]
    """Per stage: alive once the attacks were over."""
    returncode: int | None
    losses: list[float]
    """The run's training losses, step by step."""
    files_written: int


def attack_local_split_run(folder: Path, *, module: str = "split_training") -> LocalAttack:
    """A fenced local `module` run (debug model, 12 steps) attacked as uid nobody, driver held
    still during the attacks; then the run goes on to its end. Needs root, nft and setpriv."""
    with split_run(folder, *TRAIN, module=module) as run:
        run.wait_for("joined the run", count=2)
        fence_line = next((line.strip() for line in run.lines if "fence:" in line), "")
        stages = run.stage_pids()
        with held_still(run):
            outcomes = {
                name: all_attacks(pid, tensorpipe_listener(pid), folder)
                for name, pid in stages.items()
            }
            alive = {name: psutil.pid_exists(pid) for name, pid in stages.items()}
        returncode = run.proc.wait(timeout=600)
    return LocalAttack(
        fence_line,
        outcomes,
        alive,
        returncode,
        losses(run.run_dir),
        len(list(folder.glob("written-by-stage-*"))),
    )
