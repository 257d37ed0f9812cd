"""The fence around a run's listeners (world.fence): another local user reaches none of a split
run's ports, each attack with its control arm (the same attack, fence off, gets through)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from labtools.attacks.local_user import (
    TRAIN,
    Listening,
    SplitRun,
    attack_local_split_run,
    dial_as_other_user,
    held_still,
    listening,
    losses,
    marker,
    other_user_unavailable,
    rogue,
    split_run,
    tensorpipe_listener,
)
from world import fence

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
    return subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True
    ).stdout


def test_only_the_runs_user_reaches_the_fenced_address() -> None:
    with fence.nftables_fence() as fenced, socket.create_server((fenced.address, 0)) as server:
        port = server.getsockname()[1]
        assert fenced.table is not None
        assert fenced.address.startswith("127.") and fenced.address != "127.0.0.1"
        assert f"inet {fenced.address}/32" in _lo_addresses()
        assert fenced.table in _tables()
        socket.create_connection((fenced.address, port), timeout=3).close()  # the run's user
        (other,) = dial_as_other_user([(fenced.address, port)])
        assert other.startswith("no connection"), other
    # gone with the block
    assert fenced.table is not None and fenced.table not in _tables()
    assert f"inet {fenced.address}/32" not in _lo_addresses()
    # control arm: the same dial, unfenced, connects
    with socket.create_server((fenced.address, 0)) as server:
        (other,) = dial_as_other_user([(fenced.address, server.getsockname()[1])])
        assert other == "connected"


def test_a_killed_launchers_fence_is_swept_by_the_next_run(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom world import fence\nwith fence.nftables_fence() as f:\n"
            "    print(f.table, f.address, flush=True)\n    time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    table, address = holder.stdout.readline().split()
    assert table in _tables()
    run_id = table.removeprefix(fence.TABLE_PREFIX)
    assert run_id not in fence.sweep_stale()  # its launcher lives: kept
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert table in _tables()  # nothing ran its teardown
    # something still listens on its address (a role that outlived it): kept, or its ports
    # would be open to every user (removing the address closes nothing: 127/8 is all lo's)
    with socket.create_server((address, 0)):
        assert run_id not in fence.sweep_stale()
        assert table in _tables()
    assert run_id in fence.sweep_stale()
    assert table not in _tables()
    assert f"inet {address}/32" not in _lo_addresses()


ARMS = {"nftables": {}, "namespace": {"LAB_FENCE": "namespace"}, "off": {"LAB_FENCE": "off"}}
LONG_RUNS = {
    "split_training": ("split.steps=400", "split.rpc_timeout_s=600"),
    "data_parallel": ("dp.steps=400",),
}
"""Runs that outlast the test's look at them (stopped at its end)."""


def _listeners_once_up(run: SplitRun, minimum: int) -> list[Listening]:
    """The run's listeners, once at least `minimum` are up and a second has passed with no
    new one (Gloo's follow TensorPipe's and the store's)."""
    deadline = time.monotonic() + 300
    seen = -1
    while True:
        assert run.proc.poll() is None, "the run ended early:\n" + "".join(run.lines[-40:])
        assert time.monotonic() < deadline, listening(run.proc.pid)
        found = listening(run.proc.pid)
        count = sum(len(item.inet) for item in found)
        if count >= minimum and count == seen:
            return found
        seen = count
        time.sleep(1.0)


@pytest.mark.parametrize(
    ("module", "arm"),
    [("split_training", arm) for arm in ARMS]
    + [("data_parallel", "nftables"), ("data_parallel", "off")],
)
def test_a_runs_listeners_are_on_its_address_only_and_fenced(
    tmp_path: Path, module: str, arm: str
) -> None:
    """Every listener of the run's processes is on the run's own address (TensorPipe's, Gloo's,
    the stores'), none a unix socket; another user connects to none of them, behind nftables or
    in the run's private namespace. Control arm: with LAB_FENCE=off the same listeners take the
    same user's connections."""
    with split_run(tmp_path, *LONG_RUNS[module], module=module, env=ARMS[arm]) as run:
        found = _listeners_once_up(run, minimum=3)  # a store, and per worker Gloo's at least
        address = run.address
        inet = [(item.name, a) for item in found for a in item.inet]
        assert {host for _, (host, _) in inet} == {address}, inet
        assert not [item for item in found if item.unix], found
        assert (address != "127.0.0.1") == (arm == "nftables")
        dialled = dial_as_other_user([a for _, a in inet])
        if arm == "off":
            assert all(d == "connected" for d in dialled), dialled
        else:
            assert all(d.startswith("no connection") for d in dialled), dialled


def test_attacks_from_another_user_reach_no_stage_and_the_run_trains_as_unattacked(
    tmp_path: Path,
) -> None:
    """Behind the fence, uid nobody's file read, file write, memory hold and three kills on each
    stage's TensorPipe listener all fail to connect, and the run's losses equal an unattacked
    run's. (The same attacks unfenced succeed: the test below.)"""
    with split_run(tmp_path, *TRAIN) as unattacked:
        assert unattacked.proc.wait(timeout=600) == 0, "".join(unattacked.lines[-30:])
    expected = losses(unattacked.run_dir)
    assert len(expected) == 12
    got = attack_local_split_run(tmp_path)
    assert got.returncode == 0 and all(got.stages_alive.values()), got
    for name, results in got.outcomes.items():
        for attack, result in results.items():
            assert not result["connected"] and not result["succeeded"], (name, attack, result)
    assert got.files_written == 0
    assert got.losses == expected


@pytest.fixture
def seen_by_others() -> Iterator[Path]:
    """A folder another user may look into (pytest's are root's alone): where the attacker
    checks the file it made the stage write."""
    folder = Path(tempfile.mkdtemp(prefix="fence-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("channels", ["basic", "network"])
def test_control_arm_the_same_attacks_unfenced_succeed(
    tmp_path: Path, seen_by_others: Path, channels: str
) -> None:
    """LAB_FENCE=off: the same script reads a root-only file through stage1, writes one, makes
    it hold memory and kills it; kills stage2 with an out-of-bounds operator. With
    split.channels=network (16 lane listeners a process), junk on a lane kills a stage too."""
    with split_run(tmp_path, *TRAIN, f"split.channels={channels}", env={"LAB_FENCE": "off"}) as run:
        run.wait_for("joined the run", count=2)
        stages = run.stage_pids()
        first, second = (tensorpipe_listener(stages[f"stage{k}"]) for k in (1, 2))
        with held_still(run):
            if channels == "network":
                got = rogue(first, "kill-lane", "--victim-pid", str(stages["stage1"]))
                assert got["connected"] and got["succeeded"], got
                return
            path, digest = marker(tmp_path)
            for attack, args in {
                "file-read": ("--path", str(path), "--expect-sha256", digest),
                "file-write": ("--path", str(seen_by_others / "written-by-stage-1.bin")),
                "memory": ("--victim-pid", str(stages["stage1"])),
                "kill-0xff": ("--victim-pid", str(stages["stage1"])),
            }.items():
                got = rogue(first, attack, *args)
                assert got["connected"] and got["succeeded"], (attack, got)
            got = rogue(second, "kill-segment", "--victim-pid", str(stages["stage2"]))
            assert got["connected"] and got["succeeded"], got
    assert (seen_by_others / "written-by-stage-1.bin").stat().st_uid == os.geteuid()


def test_ctrl_c_reaches_a_run_in_its_private_namespace(tmp_path: Path) -> None:
    """The namespace fence re-runs the command inside `unshare -rn`: Ctrl-C on the command a
    user started still ends the run as Ctrl-C does (exit 130, its line about what was kept),
    with none of its processes left behind."""
    with split_run(tmp_path, "split.steps=400", env={"LAB_FENCE": "namespace"}) as run:
        run.wait_for("joined the run", count=2)
        os.kill(run.proc.pid, signal.SIGINT)
        assert run.proc.wait(timeout=120) == 130, "".join(run.lines[-30:])
    assert any(line.startswith("interrupted") for line in run.lines), run.lines[-10:]
    # the driver inside heard it, and released its stages in order (a driver killed outright,
    # its stages dying with it, says nothing of the kind)
    assert any("the driver stopped the run: KeyboardInterrupt" in line for line in run.lines)
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(run.run_dir) in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, left


def test_a_launcher_in_another_pid_namespace_is_never_taken_for_dead() -> None:
    """A container sharing this network namespace but not its PIDs: its launcher's pid means
    nothing here, so its fence is kept (sweeping it opened a live run's ports to every user)."""
    here = fence._owner_comment()
    assert fence._owner_alive(here)
    pid = here.split()[0]
    assert not fence._owner_alive(f"{pid} start=1 ns={here.split('ns=')[1]}")  # reused pid
    assert fence._owner_alive(f"{pid} start=1 ns=pid:[1]")  # another namespace: can't tell


def test_each_job_of_a_multirun_runs_in_its_own_namespace(tmp_path: Path) -> None:
    """Where only the namespace can fence, a multirun's jobs (run in one process by Hydra's
    launcher) are each re-run inside one, and the sweep's table still gets their metrics."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "split_inference",
            "-m",
            "model.lab_preset=debug",
            "tracking.wandb=false",
            "num_threads=1",
            "generate.num_prompts=2",
            "generate.max_new_tokens=4,8",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "LAB_FENCE": "namespace"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("re-running this job in a private network namespace") == 2
    for job in ("0", "1"):
        logged = (tmp_path / job / "split_inference.log").read_text()
        assert "fence: a private network namespace" in logged
    header, *rows = (tmp_path / "summary.csv").read_text().splitlines()
    column = header.split(",").index("token_ms_p50")  # the jobs' metrics came back out
    assert [row.split(",")[0] for row in rows] == ["4", "8"]
    assert all(float(row.split(",")[column]) > 0 for row in rows), rows
