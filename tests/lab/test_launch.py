"""The local launcher: prefixed logs, first failure propagated, never an orphan process."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from lab.launch import Role, RoleFailedError, free_port, launch
from tests.clocks import HANG_GUARD_S

PY = sys.executable


def py_role(name: str, code: str, *, service: bool = False) -> Role:
    return Role(name=name, argv=[PY, "-c", textwrap.dedent(code)], service=service)


SLEEPER = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"


def announcing_sleeper(marker: Path) -> str:
    """SLEEPER that creates `marker` once its pid is out: a role waits on that, not a sleep."""
    return (
        "import os, pathlib, time; print('pid', os.getpid(), flush=True); "
        f"pathlib.Path({str(marker)!r}).touch(); time.sleep(120)"
    )


def after(marker: Path, code: str) -> str:
    """`code`, run once `marker` exists (another role has printed its pid), a wait bounded by
    the hang guard, not a sleep a busy machine may outlast before the other role has started."""
    return (
        f"import pathlib, time\nfor _ in range({int(HANG_GUARD_S * 100)}):\n"
        f"    if pathlib.Path({str(marker)!r}).exists(): break\n    time.sleep(0.01)\n{code}"
    )


def running_with(token: str) -> list[int]:
    """Live (not zombie) processes whose command line holds `token`, whether or not they ever
    printed their pid."""
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if token in " ".join(p.info["cmdline"] or []) and alive(p.pid)
    ]


def pids_in(text: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"pid (\d+)", text)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, just not yet reaped
        return stat.read().split(")")[-1].split()[0] != "Z"


def wait_dead(pids: list[int], timeout_s: float = HANG_GUARD_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_roles_run_with_prefixed_output_and_report_exit_codes() -> None:
    out = io.StringIO()
    codes = launch(
        [py_role("alpha", "print('hello from a')"), py_role("beta", "print('hello from b')")],
        out=out,
        timeout_s=60,
    )
    assert codes == {"alpha": 0, "beta": 0}
    assert "[alpha] hello from a" in out.getvalue()
    assert "[beta] hello from b" in out.getvalue()


def test_first_failure_stops_the_others_and_names_the_role(tmp_path: Path) -> None:
    out = io.StringIO()
    started = tmp_path / "server-started"
    with pytest.raises(RoleFailedError) as info:
        launch(
            [
                py_role("server", announcing_sleeper(started)),
                py_role("client", after(started, "print('bad input'); raise SystemExit(3)")),
            ],
            out=out,
            timeout_s=60,
        )
    assert info.value.role == "client" and info.value.returncode == 3
    assert "bad input" in str(info.value)
    [server_pid] = pids_in(out.getvalue())
    assert not alive(server_pid)


def test_services_are_stopped_when_the_workers_finish(tmp_path: Path) -> None:
    out = io.StringIO()
    started = tmp_path / "verifier-started"
    codes = launch(
        [
            py_role("verifier", announcing_sleeper(started), service=True),
            py_role("drafter", after(started, "pass")),
        ],
        out=out,
        timeout_s=60,
    )
    assert codes["drafter"] == 0 and codes["verifier"] == -signal.SIGTERM
    assert not alive(pids_in(out.getvalue())[0])


def test_timeout_reaps_everything(tmp_path: Path) -> None:
    # The role is found by a token in its command line: within the 1 s timeout a busy machine
    # may not even have printed its pid (Popen returns after the exec, so the token is there).
    token = f"slow role of {tmp_path}"
    with pytest.raises(TimeoutError, match=r"\['slow'\] still running"):
        launch([py_role("slow", f"{SLEEPER}  # {token}")], out=io.StringIO(), timeout_s=1.0)
    assert not running_with(token)


def test_grandchildren_are_reaped_with_their_role() -> None:
    spawner = f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], stdout=subprocess.PIPE)
        print(child.stdout.readline().decode(), end='', flush=True)  # its pid, then fail
        raise SystemExit(1)
    """
    out = io.StringIO()
    with pytest.raises(RoleFailedError):
        launch([py_role("spawner", spawner)], out=out, timeout_s=60)
    grandchild = pids_in(out.getvalue())
    assert len(grandchild) == 1 and wait_dead(grandchild)


LAUNCHER = f"""
import sys, textwrap
from lab.launch import Role, launch
launch([Role("a", [sys.executable, "-c", {SLEEPER!r}]),
        Role("b", [sys.executable, "-c", {SLEEPER!r}])], timeout_s=120)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_killing_the_launcher_leaves_no_orphans(sig: signal.Signals) -> None:
    if sig == signal.SIGKILL and not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    # A shell's background job (`make test &`) starts with SIGINT ignored, and Python keeps
    # ignoring it: give the launcher the default a terminal's Ctrl-C would meet.
    parent = subprocess.Popen(
        [PY, "-c", LAUNCHER],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert parent.stdout is not None
    pids: list[int] = []
    while len(pids) < 2:
        line = parent.stdout.readline()
        assert line, "launcher exited early"
        pids += pids_in(line)
    parent.send_signal(sig)
    parent.wait(timeout=30)
    assert wait_dead(pids), f"orphans left after {sig.name}"


def test_free_ports_are_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_role_names_must_be_unique_and_someone_must_finish() -> None:
    with pytest.raises(ValueError, match="unique"):
        launch([py_role("a", "pass"), py_role("a", "pass")])
    with pytest.raises(ValueError, match="not be a service"):
        launch([py_role("a", "pass", service=True)])


def test_services_run_in_the_background_and_are_reaped() -> None:
    from lab.launch import services

    out = io.StringIO()
    with services([py_role("server", SLEEPER)], out=out) as check:
        deadline = time.monotonic() + HANG_GUARD_S
        while not pids_in(out.getvalue()) and time.monotonic() < deadline:
            time.sleep(0.01)
        check()  # alive: no error
        [pid] = pids_in(out.getvalue())
        assert alive(pid)
    assert not alive(pid)


def test_a_dead_service_is_reported_by_check() -> None:
    from lab.launch import services

    with services(
        [py_role("server", "print('cannot bind'); raise SystemExit(2)")], out=io.StringIO()
    ) as check:
        deadline = time.monotonic() + HANG_GUARD_S
        with pytest.raises(RoleFailedError, match="cannot bind"):
            while time.monotonic() < deadline:
                check()
                time.sleep(0.01)


def test_a_service_killed_by_sigkill_is_named_in_one_line_with_how_to_go_on() -> None:
    """Nothing in a SIGKILLed role's log can say why: the error is one line, and the command
    that goes on (set by lab.experiment where the run can resume) is on that line."""
    from lab.launch import PeerLostError

    killed = RoleFailedError("stage2", -signal.SIGKILL, ["step 14", "step 15"])
    assert isinstance(killed, PeerLostError)
    assert (
        str(killed)
        == "role 'stage2' was killed by SIGKILL (by a user, or the kernel out of memory)"
    )
    killed.resume = "go on from its last checkpoint with: python -m m split.resume=true"
    assert "\n" not in str(killed) and str(killed).endswith("split.resume=true")
    failed = RoleFailedError("stage1", 1, ["Traceback", "ValueError: bad"])
    failed.resume = "go on with: python -m m"
    first, *quoted = str(failed).splitlines()
    assert first == "role 'stage1' exited with code 1; go on with: python -m m; its last output:"
    assert quoted == ["  [stage1] Traceback", "  [stage1] ValueError: bad"]


def test_a_service_that_dies_while_the_block_waits_on_another_ends_the_block() -> None:
    """The block waits on something the dead role was to give (here: another role's exit),
    checking nothing: the launcher's watcher stops the other roles, so the wait ends, and the
    error the block then raises (a closed connection, say) becomes the dead role's."""
    from lab.launch import services

    dying = py_role("stage2", "import time; time.sleep(0.5); raise SystemExit(3)", service=True)
    waiting = py_role("stage1", SLEEPER, service=True)
    with (
        pytest.raises(RoleFailedError, match="'stage2' exited with code 3") as info,
        services([dying, waiting], out=io.StringIO()) as group,
    ):
        try:
            group.process("stage1").wait(timeout=100)
        except subprocess.TimeoutExpired:
            pytest.fail("the watcher did not stop the roles left after one died")
        raise ConnectionResetError("the peer closed the connection")
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert not alive(group.process("stage1").pid)


class _SlowPipe(io.StringIO):
    """A launcher's stdout that drains slowly (a CI log collector, `| tee`): each role line
    copied takes a moment, as on a busy machine where the copying thread runs late."""

    def write(self, text: str) -> int:
        time.sleep(0.005)
        return super().write(text)


def test_a_dead_services_error_quotes_its_last_line_however_late_its_output_is_copied() -> None:
    """The watcher's error for a role that died unasked quotes its output's tail; the role's
    last line (its reason) is there even where copying its output lags its exit by a second:
    the error waits until the pipe holds nothing unread, not a fixed time (it was taken from
    whatever had been copied when the exit was seen)."""
    from lab.launch import services

    dying = py_role(
        "stage2",
        """
        for i in range(200):
            print('step', i)
        print('ValueError: the reason it stopped', flush=True)
        raise SystemExit(3)
        """,
        service=True,
    )
    with (
        pytest.raises(RoleFailedError, match="'stage2' exited with code 3") as info,
        services([dying, py_role("stage1", SLEEPER, service=True)], out=_SlowPipe()) as group,
    ):
        group.process("stage1").wait(timeout=HANG_GUARD_S)  # stopped by the watcher
        raise ConnectionResetError("the peer closed the connection")
    assert str(info.value).splitlines()[-1] == "  [stage2] ValueError: the reason it stopped"


class _UnreadPipe(io.StringIO):
    """The launcher's own output when nobody reads it (`| less` paused, a stalled collector):
    a write blocks until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.release = threading.Event()
        self.outwaited = False
        """A write waited the whole hang guard: the launcher waited on the unread output."""

    def write(self, text: str) -> int:
        if not self.release.wait(HANG_GUARD_S):
            self.outwaited = True
        return super().write(text)


def test_a_failed_roles_error_comes_even_when_nobody_reads_the_launchers_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The drain before naming a failed role is bounded by DRAIN_S even where copying is stuck
    writing to an unread output: the error comes and the other roles are stopped (the copier
    held its lock while blocked, and the drain waited on that lock with no bound)."""
    import lab.launch

    monkeypatch.setattr(lab.launch, "DRAIN_S", 0.5)
    out = _UnreadPipe()
    try:
        with pytest.raises(RoleFailedError, match="'dying' exited with code 3"):
            launch([py_role("dying", "print('bye', flush=True); raise SystemExit(3)")], out=out)
        assert not out.outwaited  # the error came while the output was still unread
    finally:
        out.release.set()


def test_a_long_line_arrives_whole_and_a_last_line_without_its_newline_too() -> None:
    """A line written in many pieces (a progress bar without newlines) is copied as one line;
    the output's last line is copied though no newline ends it."""
    out = io.StringIO()
    code = """
        import sys
        for _ in range(50):
            sys.stdout.write('x' * 4000)
            sys.stdout.flush()
        sys.stdout.write('\\nthe end')
        """
    assert launch([py_role("bar", code)], out=out) == {"bar": 0}
    assert out.getvalue().splitlines() == ["[bar] " + "x" * 200_000, "[bar] the end"]
