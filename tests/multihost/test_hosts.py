"""The modules across network hosts (namespaces on this machine), as a user runs them on a
laptop and a desktop: the harness itself (addresses, isolation, cleanup), a stranger without
the secret, and each module's result across hosts against the same run on loopback."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lab.tracking import METRICS_FILE, OUTPUTS_FILE, read_records
from labtools.costmodel import report
from labtools.hosts import (
    PREFIX,
    Documented,
    Network,
    check,
    curves,
    documented_runs,
    fault_names,
    faults,
    measure_link,
    modules,
    remove_stale,
    run_documented,
    scenarios,
)
from labtools.linkdelay import PROBE_BYTES
from tests.clocks import HANG_GUARD_S
from world.overlay import unavailable as overlay_unavailable

pytestmark = pytest.mark.multihost

PYTHON = sys.executable
SERVE = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, peer = server.accept()
conn.sendall(f"hello {peer[0]}".encode())
"""
DIAL = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
        print(conn.recv(100).decode())
except OSError as exc:
    print(f"refused: {exc}")
"""


OVERLAID = ("split_inference", "split_training", "data_parallel")
"""Modules whose runs across hosts listen only inside the lab's WireGuard overlay (world)."""


def skip_split_without_wireguard(module: str) -> None:
    """Split and data_parallel runs across hosts listen only inside the lab's overlay."""
    why = overlay_unavailable()
    if module in OVERLAID and why is not None:
        pytest.skip(f"{module} runs across hosts need the overlay: {why} (make multihost-deps)")


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split(" ", 1)[0] for line in listed.stdout.splitlines() if line.strip()}


def test_hosts_reach_each_other_by_address_and_not_through_loopback(tmp_path: Path) -> None:
    """Each host has a network stack of its own: a server on A's address answers B, and B's
    loopback is B's alone (what a hard-coded 127.0.0.1 would dial between two machines)."""
    with Network(["a", "b"], root=tmp_path) as net:
        a, b = net["a"], net["b"]
        server = a.start([PYTHON, "-c", SERVE, a.address], tmp_path / "serve.log")
        deadline = time.monotonic() + HANG_GUARD_S
        while not (tmp_path / "serve.log").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        port = (tmp_path / "serve.log").read_text().split()[0]
        assert b.run([PYTHON, "-c", DIAL, "127.0.0.1", port]).startswith("refused")
        assert b.run([PYTHON, "-c", DIAL, a.address, port]).strip() == f"hello {b.address}"
        server.wait(timeout=HANG_GUARD_S)


def test_each_host_has_its_own_home_and_model_cache(tmp_path: Path) -> None:
    with Network(["a", "b"], root=tmp_path) as net:
        a, b = net["a"], net["b"]
        script = "import os; from lab.config import default_cache_dir; "
        script += "print(os.environ['HOME'], default_cache_dir())"
        assert a.run([PYTHON, "-c", script]).split() == [str(a.home), str(a.cache)]
        assert b.run([PYTHON, "-c", script]).split() == [str(b.home), str(b.cache)]
        a.run([PYTHON, "-c", "import pathlib; (pathlib.Path.home() / 'model').write_text('x')"])
        assert (a.home / "model").is_file() and not (b.home / "model").exists()


def test_a_rate_cap_shapes_each_hosts_link(tmp_path: Path) -> None:
    with Network(["a", "b"], rate="10mbit", root=tmp_path) as net:
        for host in net.hosts.values():
            shown = host.run(["tc", "qdisc", "show", "dev", "eth0"])
            assert "tbf" in shown and "rate 10Mbit" in shown


def test_a_delayed_link_holds_every_packet_and_a_rate_cap_holds_with_it(tmp_path: Path) -> None:
    """The routed network's forwarder delays each direction: a round trip cannot take less than
    twice the one-way delay (a floor, not a timing: nothing arrives before it is released), and
    changing the link between runs takes effect."""
    with Network(["a", "b"], delay_ms=0, root=tmp_path) as net:
        fast = measure_link(net, "a", "b")
        net.set_link(delay_ms=20, rate="10mbit")
        slow = measure_link(net, "a", "b")
        shown = net["a"].run(["tc", "qdisc", "show", "dev", "eth0"])
        forwarder = net._forwarder
        assert forwarder is not None and forwarder.poll() is None
    assert forwarder.poll() is not None  # stopped with the network
    # a floor only: the 20 ms link holds each packet 20 ms each way; how fast the 0 ms link
    # answered is the machine's load (the forwarders' own stats below say what each held)
    assert slow["rtt_ms"] / 2 >= 20 and fast["rtt_ms"] > 0
    assert slow["mbit_s"] < 10.5 and "rate 10Mbit" in shown
    # each forwarder said what it held, and for how long at least (linkdelay.ForwardStats)
    at_zero, at_twenty = net.forwarder_stats
    assert at_zero["delay_ms"] == 0 and at_twenty["delay_ms"] == 20
    assert at_twenty["packets"] >= PROBE_BYTES // 1500  # the bulk bytes, 1500-byte frames
    assert at_twenty["min_hold_ms"] >= 20
    assert sum(at_twenty["late_counts"]) == at_twenty["packets"]


def test_a_realtime_forwarder_holds_every_packet_ahead_of_the_hosts_work(tmp_path: Path) -> None:
    """`realtime_forwarder`: the wire runs at SCHED_FIFO (no ordinary process holds a due packet
    back), and still holds every packet its delay."""
    with Network(["a", "b"], delay_ms=2, root=tmp_path, realtime_forwarder=True) as net:
        forwarder = net._forwarder
        assert forwarder is not None
        assert os.sched_getscheduler(forwarder.pid) == os.SCHED_FIFO
        got = measure_link(net, "a", "b")
    assert got["rtt_ms"] >= 2 * 2
    (stats,) = net.forwarder_stats
    assert stats["delay_ms"] == 2 and stats["min_hold_ms"] >= 2
    assert stats["packets"] >= PROBE_BYTES // 1500


def test_everything_is_removed_after_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), Network(["a", "b"], root=tmp_path) as net:
        made = set(net.namespaces())
        sleeper = net["a"].start([PYTHON, "-c", "import time; time.sleep(600)"], tmp_path / "s")
        assert made <= namespaces()
        raise RuntimeError("boom")
    assert not made & namespaces()
    assert sleeper.poll() is not None  # its processes stopped too


def test_namespaces_of_a_harness_killed_outright_are_removed_by_the_next(tmp_path: Path) -> None:
    script = (
        "import sys, time; from labtools.hosts import Network; "
        f"net = Network(['a'], delay_ms=1, root=__import__('pathlib').Path({str(tmp_path)!r}))"
        ".__enter__(); print(net.tag, net._forwarder.pid, flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([PYTHON, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    tag, forwarder = proc.stdout.readline().split()
    proc.kill()  # SIGKILL: no cleanup ran
    proc.wait()
    left = {name for name in namespaces() if name.startswith(f"{tag}-")}
    assert left  # what a harness killed outright leaves
    assert psutil.pid_exists(int(forwarder))  # its delaying forwarder, still holding packets
    assert set(remove_stale()) >= left
    deadline = time.monotonic() + HANG_GUARD_S
    while psutil.pid_exists(int(forwarder)) and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            psutil.Process(int(forwarder)).wait(timeout=0.1)  # reaped if it was our child
        time.sleep(0.05)
    assert not psutil.pid_exists(int(forwarder))
    assert not {name for name in namespaces() if name.startswith(f"{tag}-")}


def test_ctrl_c_removes_the_hosts_and_says_so(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "labtools.hosts",
            "check",
            "--only",
            "spec_decoding",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # printed once the hosts exist
    assert first.startswith("hosts: desktop 10.213.0.1"), first
    assert any(name.startswith(f"{PREFIX}{proc.pid}-") for name in namespaces())
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 130, stderr
    assert "interrupted; the namespaces are removed" in stderr
    assert not any(name.startswith(f"{PREFIX}{proc.pid}-") for name in namespaces())


def test_a_drafter_without_the_secret_is_refused_across_hosts(tmp_path: Path) -> None:
    """The verifier has the run's secret; a drafter on another host without it gets nothing."""
    scenario = scenarios()["spec_decoding"]
    with Network(["desktop", "laptop"], root=tmp_path / "hosts") as net:
        desktop, laptop = net["desktop"], net["laptop"]
        laptop.run([PYTHON, "-m", "lab.pretrain", "pretrain=debug"], timeout_s=600)
        shutil.copytree(laptop.cache, desktop.cache)
        common = [
            *scenario.common,
            f"spec.verifier.host={desktop.address}",
            "spec.verifier.port=29520",
            "tracking.wandb=false",
        ]
        log = tmp_path / "verifier.log"
        desktop.start(
            [PYTHON, "-m", "spec_decoding", "role=verifier", *common,
             f"hydra.run.dir={tmp_path / 'verifier'}"],
            log, env={"LAB_SECRET": "the-run's-secret"},
        )  # fmt: skip
        deadline = time.monotonic() + HANG_GUARD_S
        while "verifier ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "verifier ready" in log.read_text(), log.read_text()[-2000:]
        stranger = subprocess.run(
            ["ip", "netns", "exec", laptop.netns, PYTHON, "-m", "spec_decoding", "role=drafter",
             *common, "cluster.connect_timeout_s=60", f"hydra.run.dir={tmp_path / 'drafter'}"],
            env=laptop.env(), capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
        )  # fmt: skip
        assert stranger.returncode != 0
        said = stranger.stdout + stranger.stderr
        assert "this server requires the shared secret (set cluster.secret or LAB_SECRET)" in said
        assert not (tmp_path / "drafter" / "outputs.jsonl").exists()  # nothing was generated


@pytest.mark.parametrize("module", modules())
def test_a_module_across_hosts_gives_what_it_gives_on_loopback(tmp_path: Path, module: str) -> None:
    """Each role on its own host, with the secret (and TLS for the netproto modules): greedy
    outputs token for token, training losses within labtools.hosts.LOSS_RTOL."""
    skip_split_without_wireguard(module)
    netproto = scenarios()[module].netproto
    lines: list[str] = []

    class Log:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

    (outcome,) = check([module], out=tmp_path, tls=netproto, log=Log())  # type: ignore[arg-type]
    assert outcome.identical, outcome.detail
    # every host's link carried traffic; a split's activations all crossed the stage hosts'
    # (with split.channels=auto, TensorPipe's cma copy left about 800 KB of them off the links)
    assert outcome.link_bytes and all(count > 0 for count in outcome.link_bytes.values())
    if module == "split_inference":
        assert outcome.run_dir is not None
        summary = [
            r for r in read_records(outcome.run_dir / METRICS_FILE) if r["kind"] == "summary"
        ]
        rows = read_records(outcome.run_dir / OUTPUTS_FILE)
        tokens = sum(len(row["tokens"]) for row in rows)  # padding left out: fewer
        between = summary[-1]["bytes_between_stages_per_token"] * tokens
        assert outcome.link_bytes["laptop"] >= between and outcome.link_bytes["pc"] >= between
    if module == "data_parallel":  # the rendezvous and gloo met inside the overlay (world)
        assert outcome.run_dir is not None
        log = outcome.run_dir.with_name(outcome.run_dir.name + ".log").read_text()
        assert "rendezvous store listening on 10.213.128.1:" in log and "(auth)" in log
    assert "".join(lines).strip().endswith("modules identical across hosts: 1 of 1")


@pytest.mark.parametrize(
    "run", documented_runs(), ids=lambda run: f"{run.source}:{run.lines[0][1][2]}"
)
def test_the_documented_two_machine_commands_run_across_hosts(
    tmp_path: Path, run: Documented
) -> None:
    """The `host$ python -m ...` lines of docs/two_machines.md and the README, as written, each
    on its host, the serving one at conf/cluster/two_hosts.yaml's address, with the secret."""
    skip_split_without_wireguard(run.lines[0][1][2])
    ok, detail = run_documented(run, tmp_path)
    assert ok, detail


def test_the_documents_hold_a_multi_machine_run_of_each_serving_module() -> None:
    """So the test above cannot pass by finding nothing to run."""
    modules = {(run.source, run.lines[0][1][2]) for run in documented_runs()}
    for source in ("docs/two_machines.md", "README.md"):
        assert {m for s, m in modules if s == source} >= {
            "spec_decoding",
            "fed_learn",
            "split_inference",
        }


def test_fed_learn_across_hosts_recovers_from_a_dead_client_and_a_dead_coordinator(
    tmp_path: Path,
) -> None:
    """Three hosts, secret and TLS on. A client's machine dies as round 2 begins: the rounds go
    on with the other client, exactly as the same fault on one machine's loopback. The
    coordinator's machine dies after round 1 and comes back with fed.resume=true: the clients
    redial it and every round's validation loss is the uninterrupted loopback run's."""
    fed = [(module, name) for module, name in fault_names() if module == "fed_learn"]
    outcomes = faults(fed, out=tmp_path, tls=True, timeout_s=300)
    assert [o.identical for o in outcomes] == [True, True], [o.detail for o in outcomes]
    assert "clients per round [2, 1, 1]" in outcomes[0].detail
    resumed = tmp_path / "fed_learn-faults" / "coordinator-killed-and-resumed" / "hosts"
    assert "(round 1)" in (resumed / "desktop-coordinator-resumed.log").read_text()


def test_data_parallel_across_hosts_goes_on_from_its_checkpoint_after_a_worker_is_killed(
    tmp_path: Path,
) -> None:
    """The laptop's worker process is SIGKILLed after step 6, its agent alive: both hosts'
    agents start their workers again, which load the step-5 checkpoint from the shared folder
    (the desktop's agent counted no restart of its own), and every step's loss is the
    uninterrupted loopback run's."""
    (outcome,) = faults([("data_parallel", "worker killed mid-run")], out=tmp_path, timeout_s=300)
    assert outcome.identical, outcome.detail
    assert "restarted from step 5" in outcome.detail


def test_curves_put_a_link_under_every_protocol_and_predict_it_from_the_local_run(
    tmp_path: Path,
) -> None:
    """split_inference's TensorPipe traffic crosses the delaying router too: at 25 ms one way a
    token, which waits for stage 1 -> stage 2 and back, cannot take less than 50 ms (a floor,
    not a timing). The report sets the prediction from the local run beside it and draws it."""
    curves(["split_inference"], out=tmp_path, delays_ms=[25.0], rates=["100mbit"])
    report(tmp_path, ["split_inference"])
    rows = read_records(tmp_path / "split_inference" / "report" / "results.jsonl")
    assert [r["status"] for r in rows] == ["ok"]
    metrics = rows[0]["metrics"]
    assert metrics["measured"] >= 50.0
    assert metrics["predicted"] >= 50.0 and math.isfinite(metrics["measured_over_predicted"])
    drawn = tmp_path / "split_inference" / "report" / "heatmaps"
    assert {p.name for p in drawn.glob("*.png")} == {
        "measured.png",
        "predicted.png",
        "measured_over_predicted.png",
    }
