"""The attack tool against an unfenced stage: the control arm every fence test reuses.

A fence test proves something only if the same attack, run the same way, succeeds without the
fence; here it does, against a minimal split world (`rpc_victim`: the options a split run uses,
no fence), and the tool says `connected: false` where nothing listens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab.launch import free_port
from tests.clocks import HANG_GUARD_S
from tests.split_engine.rpc_victim import Victim, start_victim

ROOT = Path(__file__).resolve().parents[2]


def rogue(*args: str) -> dict:
    """The tool as another process runs it: by its file, no project on its path."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "labtools" / "hosts" / "rogue_rpc.py"), *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,  # a process importing torch: minutes on a busy machine
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(line) == {"attack", "connected", "succeeded", "detail"}
    return line


@pytest.fixture
def victim(tmp_path: Path):
    world = start_victim(free_port(), tmp_path / "victim.json")
    yield world
    world.stop()


def test_file_read_then_kill_0xff_through_an_unfenced_stage(victim: Victim, tmp_path: Path) -> None:
    """Both attacks on one victim world: the read leaves the stage running, the kill ends it."""
    marker = tmp_path / "marker.txt"
    marker.write_bytes(b"what only the stage's user may read\n" * 3)
    got = rogue("--target", victim.target, "--attack", "file-read", "--path", str(marker))
    assert got["connected"] and got["succeeded"], got
    assert "equal" in got["detail"]
    assert victim.procs[1].poll() is None  # a read leaves the stage running

    got = rogue("--target", victim.target, "--attack", "kill-0xff", "--victim-pid", str(victim.pid))
    assert got["connected"] and got["succeeded"], got
    assert victim.procs[1].wait(timeout=HANG_GUARD_S) != 0


def test_nothing_listening_is_not_connected() -> None:
    got = rogue(
        "--target",
        f"127.0.0.1:{free_port()}",
        "--attack",
        "file-read",
        "--path",
        "/etc/hostname",
        "--timeout",
        "5",
    )
    assert not got["connected"] and not got["succeeded"], got
    got = rogue("--target", f"127.0.0.1:{free_port()}", "--attack", "kill-0xff")
    assert not got["connected"] and not got["succeeded"], got
