"""The fence around a run's listeners (lab.fence): another local user reaches none of a split
run's ports, each attack with its control arm (the same attack, fence off, gets through)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import fence
from tests.multihost.fence_support import (
    dial_as_other_user,
    listening,
    other_user_unavailable,
    split_run,
)

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.skipif(
        fence.nftables_unavailable() is not None or other_user_unavailable() is not None,
        reason=f"the nftables fence: {fence.nftables_unavailable() or other_user_unavailable()}",
    ),
]


def _tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


def _lo_addresses() -> str:
    return subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", "lo"], capture_output=True,
                          text=True).stdout  # fmt: skip


def test_only_the_runs_user_reaches_the_fenced_address() -> None:
    with fence.nftables_fence() as fenced, socket.create_server((fenced.address, 0)) as server:
        port = server.getsockname()[1]
        assert fenced.address.startswith("127.") and fenced.address != "127.0.0.1"
        assert f"inet {fenced.address}/32" in _lo_addresses()
        assert fenced.table in _tables()
        socket.create_connection((fenced.address, port), timeout=3).close()  # the run's user
        (other,) = dial_as_other_user([(fenced.address, port)])
        assert other.startswith("no connection"), other
    # gone with the block
    assert fenced.table not in _tables()
    assert f"inet {fenced.address}/32" not in _lo_addresses()
    # control arm: the same dial, unfenced, connects
    with socket.create_server((fenced.address, 0)) as server:
        (other,) = dial_as_other_user([(fenced.address, server.getsockname()[1])])
        assert other == "connected"


def test_a_killed_launchers_fence_is_swept_by_the_next_run(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import time\nfrom lab import fence\nwith fence.nftables_fence() as f:\n"
         "    print(f.table, f.address, flush=True)\n    time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None
    table, address = holder.stdout.readline().split()
    assert table in _tables()
    assert fence.sweep_stale() == []  # its launcher lives: kept
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert table in _tables()  # nothing ran its teardown
    assert fence.sweep_stale() == [table.removeprefix(fence.TABLE_PREFIX)]
    assert table not in _tables()
    assert f"inet {address}/32" not in _lo_addresses()


ARMS = {"nftables": {}, "namespace": {"LAB_FENCE": "namespace"}, "off": {"LAB_FENCE": "off"}}


@pytest.mark.parametrize("arm", list(ARMS))
def test_a_split_runs_listeners_are_on_its_address_only_and_fenced(
    tmp_path: Path, arm: str
) -> None:
    """Every listener of the run's processes is on the run's own address (TensorPipe's one,
    Gloo's, the store's), none a unix socket; another user connects to none of them, behind
    nftables or in the run's private namespace. Control arm: with LAB_FENCE=off the same
    listeners take the same user's connections."""
    with split_run(tmp_path, "split.steps=400", "split.rpc_timeout_s=600", env=ARMS[arm]) as run:
        run.wait_for("joined the run", count=2)
        address = run.address
        time.sleep(1.0)  # Gloo's listeners follow TensorPipe's
        found = listening(run.proc.pid)
        inet = [(item.name, a) for item in found for a in item.inet]
        assert len(inet) >= 3, found  # the store, and per process TensorPipe's and Gloo's
        assert {host for _, (host, _) in inet} == {address}, inet
        assert not [item for item in found if item.unix], found
        assert (address != "127.0.0.1") == (arm == "nftables")
        dialled = dial_as_other_user([a for _, a in inet])
        if arm == "off":
            assert all(d == "connected" for d in dialled), dialled
        else:
            assert all(d.startswith("no connection") for d in dialled), dialled
