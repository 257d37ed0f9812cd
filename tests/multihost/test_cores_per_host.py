"""`--cores-per-host`: every process a namespace host starts, and their children, run on that
host's own cores; the harness says which cores each host got."""

from __future__ import annotations

import os
import sys

import pytest

from labtools.hosts.network import Network, cores_line, host_cpus

pytestmark = pytest.mark.multihost

CHILD_AFFINITY = (
    "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)), subprocess.run("
    "[sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
    "capture_output=True, text=True).stdout.strip())"
)


def test_each_host_runs_its_processes_on_its_own_cores() -> None:
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip(f"needs 2 cores to give 2 hosts one each; this process has {available}")
    with Network(["desktop", "laptop"], cores_per_host=1) as network:
        seen = {name: host.run([sys.executable, "-c", CHILD_AFFINITY]).strip().split(maxsplit=1)
                for name, host in network.hosts.items()}  # fmt: skip
        line = cores_line(network)
    assert seen["desktop"] == [f"[{available[0]}]", f"[{available[0]}]"]  # it, and its child
    assert seen["laptop"] == [f"[{available[1]}]", f"[{available[1]}]"]
    assert line.startswith(f"cores: desktop {available[0]}, laptop {available[1]} (taskset")
    assert "shared:" not in line


def test_more_hosts_than_cores_share_and_say_so() -> None:
    available = sorted(os.sched_getaffinity(0))
    spread = host_cpus(len(available) + 1, 1)
    assert spread[-1] == spread[0] == (available[0],)
    with pytest.raises(ValueError, match="--cores-per-host"):
        host_cpus(2, len(available) + 1)
