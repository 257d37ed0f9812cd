"""A minimal unfenced split world for attack tests: `python -m tests.split_engine.rpc_victim
RANK PORT OUT`.

Two processes meet in a torch RPC world on loopback with the options a split run uses
(`split_engine.workers._options`: TensorPipe's `uv` transport, its default channels): rank 0
"driver", rank 1 "stage1". Neither installs the RPC guard: the attacks `labtools.hosts.rogue_rpc`
runs go through TensorPipe's C++ paths (builtin operators, raw frames), which the guard does not
see, so what this world shows is what an unfenced stage shows. The stage writes OUT (JSON: its pid
and its TensorPipe URL, as its agent published it) once the world is up; both then idle until
killed. `start_victim` starts the pair and waits for OUT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from tests.clocks import HANG_GUARD_S

STAGE = "stage1"


@dataclass
class Victim:
    procs: list[subprocess.Popen]
    pid: int
    url: str
    """TensorPipe's URL of the stage, `uv://127.0.0.1:PORT`."""

    @property
    def target(self) -> str:
        return self.url.split("://", 1)[-1]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)


def start_victim(port: int, out: Path, timeout_s: float = HANG_GUARD_S) -> Victim:
    """The driver and the stage, started; returns once the stage has published its URL (two
    processes importing torch: on a busy machine, minutes; the guard is against a hang)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.split_engine.rpc_victim", str(rank), str(port), str(out)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]
    victim = Victim(procs, 0, "")
    deadline = time.monotonic() + timeout_s
    while not out.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            victim.stop()
            errors = b"".join(p.stderr.read() for p in procs if p.stderr).decode()[-2000:]
            raise RuntimeError(f"the victim world did not come up: {errors}")
        time.sleep(0.1)
    found = json.loads(out.read_text())
    victim.pid, victim.url = found["pid"], found["url"]
    return victim


def main(rank: int, port: int, out: Path) -> None:
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc import api

    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=8,
        rpc_timeout=30,
        init_method=f"tcp://127.0.0.1:{port}",
        _transports=["uv"],  # as split_engine.workers._options
    )
    name = "driver" if rank == 0 else STAGE
    rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 1:
        agent = cast(rpc.TensorPipeAgent, api._get_current_rpc_agent())
        url = agent.store.get(f"addrs/{STAGE}").decode()
        partial = out.with_suffix(".partial")
        partial.write_text(json.dumps({"pid": os.getpid(), "url": url}))
        partial.rename(out)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
