"""One small gloo all-reduce across two namespace hosts: how many one-way delays does it wait for?

Run: `python bench/allreduce_link.py [--delays 0 1 5] [--count 100] [--wire realtime]
[--congestion reno] [--paths overlay] [--modes idle decode]` (root; network namespaces,
wireguard-go or the kernel's WireGuard, nftables): every combination, 2-3 minutes each delay.

The tensor_parallel grid's hosts (labtools.hosts, one core each, the delaying router), its
link rate (1 Gbit/s) and, on the `overlay` path, the lab's WireGuard overlay its ranks meet in
(world.group, `cluster.overlay.up=true`); the `plain` path is the same two ranks on the
namespaces' own addresses (`cluster.unsafe_plain_network=true`: a bench's private namespaces).
For each one-way delay and path, two ranks time:
- a TCP ping-pong of one byte (TCP_NODELAY) on gloo's path: the link's own round trip;
- `--count` all-reduces of a (1, 1, hidden) float32 tensor (the decode's, batch 1), in modes:
  `idle` back to back; `decode` each after a matrix-vector product of an (11/4 x hidden,
  hidden) weight and 30 small element-wise ops (a 1.1B decode's compute between two all-reduces
  on one of 2 ranks: memory-bound, then interpreter-bound); `contended` with a spinning process
  on each host's core (the ranks' cores busy while they wait); `idle-spin` and `decode-spin`
  with the spinner at SCHED_IDLE (it keeps the cores out of their idle state and yields to
  anything else).
Each in turn with the delaying forwarder at normal and at real-time priority (`--wire`), and
with the hosts' TCP congestion control reno and bbr (`--congestion`: bbr paces its segments at a
rate it estimates). Each row's one-way delays are (median at D - median at 0 ms) / D, for a step
(the compute before an all-reduce and the all-reduce) and for the all-reduce alone, beside
tensor_parallel.manifest.allreduce_delays(2) and the ping-pong's (2); the growth of the compute
says whether the ranks compute slower on a slower link; packets per all-reduce on each host's
link, gloo's TCP counters (`ss -ti`) and the forwarder's own lateness
(labtools.linkdelay.ForwardStats: what the emulated wire added beyond its delay) are kept.
Everything runs on this machine's cores beside whatever else runs there: read the load printed
beside each row.

Writes bench/results/allreduce_link.json; the last line is
`gloo all-reduce one-way delays at <D> ms, overlay, decode / model: R`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "allreduce_link.json"
WORK = Path("outputs/bench/allreduce_link")
MODES = ("idle", "decode", "decode-spin", "contended", "idle-spin")
PATHS = ("overlay", "plain")
PORT = 29540
RANK_TIMEOUT_S = 600.0
"""How long the driver waits for one pair of ranks (their overlay, group and every mode)."""
PING_PORT_OFFSET = 10
"""The ping-pong listens at the store's port + this (the overlay's hub takes port + 1)."""
SMALL_OPS = 30
"""Small element-wise ops after the decode mode's matrix-vector product (two torch calls each)."""
SPIN = "while True: pass"
IDLE_SPIN = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n" + SPIN


def uptime() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ----------------------------------------------------------------------------- in a host
def ping_pong(rank: int, host: str, port: int, count: int) -> list[float]:
    """Round trips (ms) of one byte each way between the two ranks, rank 1 timing."""
    import torch.distributed as dist

    if rank == 0:
        with socket.create_server((host, port)) as server:
            dist.barrier()  # listening: rank 1 may connect
            conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(count):
                conn.recv(1)
                conn.sendall(b"y")
        dist.barrier()
        return []
    dist.barrier()
    rtts = []
    with socket.create_connection((host, port), timeout=60) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            started = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            rtts.append((time.perf_counter() - started) * 1e3)
    dist.barrier()
    return rtts


def link_packets(interface: str) -> int:
    """Packets sent and received on `interface` of this host so far."""
    counters = Path("/sys/class/net") / interface / "statistics"
    return sum(int((counters / f"{way}_packets").read_text()) for way in ("tx", "rx"))


def steal_ms() -> float:
    """CPU time this machine's cores have lost to the hypervisor so far (ms, all cores)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) * 1e3 / os.sysconf("SC_CLK_TCK")


def allreduces(mode: str, tensor: Any, count: int, interfaces: list[str]) -> dict[str, Any]:
    """`count` all-reduces of `tensor` in `mode` (after 10 untimed): each one's ms, each step's
    (the compute before it and the all-reduce: decode), the packets per all-reduce on each
    interface."""
    import torch
    import torch.distributed as dist

    spinner = None
    if mode in ("contended", "idle-spin", "decode-spin"):  # on this host's core (taskset)
        code = SPIN if mode == "contended" else IDLE_SPIN
        spinner = subprocess.Popen([sys.executable, "-c", code])
    hidden = tensor.shape[-1]
    # a 1.1B decode's compute between two all-reduces on one of 2 ranks: ~46 MB of weights
    # (half a layer's), and the small ops around them (norms, rotary, residuals)
    weight = torch.randn(11 * hidden // 4, hidden) if mode.startswith("decode") else None
    vector = torch.randn(hidden)
    try:
        for _ in range(10):
            dist.all_reduce(tensor)
        dist.barrier()
        before = {i: link_packets(i) for i in interfaces}
        steal_before = steal_ms()
        times, compute, small, steps, cpu = [], [], [], [], []
        for _ in range(count):
            began, cpu_began = time.perf_counter(), time.thread_time()
            if weight is not None:
                vector = torch.mv(weight, vector)[:hidden]
                mid = time.perf_counter()
                for _ in range(SMALL_OPS):
                    vector = (vector * 0.5).tanh_()
                compute.append((mid - began) * 1e3)
                small.append((time.perf_counter() - mid) * 1e3)
                cpu.append((time.thread_time() - cpu_began) * 1e3)
            started = time.perf_counter()
            dist.all_reduce(tensor)
            ended = time.perf_counter()
            times.append((ended - started) * 1e3)
            steps.append((ended - began) * 1e3)
        after = {i: link_packets(i) for i in interfaces}
        stolen = steal_ms() - steal_before
        dist.barrier()
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return {
        "ms": times,
        "step_ms": steps,
        "compute_ms": compute,
        "small_ops_ms": small,
        "compute_cpu_ms": cpu,
        "steal_ms_per_allreduce": stolen / count,
        "packets_per_allreduce": {i: (after[i] - before[i]) / count for i in interfaces},
    }


def tcp_counters() -> list[str]:
    """`ss -tin` lines of this host's established TCP connections (gloo's among them)."""
    said = subprocess.run(["ss", "-tin", "state", "established"], capture_output=True, text=True)
    return [" ".join(line.split()) for line in said.stdout.splitlines()[1:]]


def rank_main(args: argparse.Namespace) -> None:
    import torch

    from lab.config import ClusterConfig, Endpoint, OverlayConfig
    from world.group import process_group

    torch.set_num_threads(1)
    overlay = args.path == "overlay"
    cluster = ClusterConfig(
        master=Endpoint(args.master, PORT),
        overlay=OverlayConfig(up=overlay),
        unsafe_plain_network=not overlay,  # the bench's own namespaces, nobody else on them
    )
    with process_group(
        cluster, rank=args.rank, world_size=2, backend="gloo", name="arlink", timeout_s=120
    ) as group:
        gloo_interface = os.environ.get("GLOO_SOCKET_IFNAME", "eth0")
        interfaces = sorted({gloo_interface, "eth0"})
        record: dict[str, Any] = {"path": args.path, "rank": args.rank, "interface": gloo_interface}
        record["rtt_ms"] = ping_pong(
            args.rank, group.master.host, PORT + PING_PORT_OFFSET, args.pings
        )
        tensor = torch.zeros(1, 1, args.hidden)  # (B, T, hidden): the decode's, batch 1
        for mode in args.modes:
            record[mode] = allreduces(mode, tensor, args.count, interfaces)
            record[mode]["load"] = uptime()
        record["ss"] = tcp_counters()
    Path(args.out).write_text(json.dumps(record))


# ----------------------------------------------------------------------------- the driver
def run_pair(network: Any, args: argparse.Namespace, path: str, label: str) -> list[dict]:
    """Both ranks of one path, to completion; their records."""
    secret = os.urandom(16).hex()
    desktop = network["desktop"]
    procs, outs = [], []
    for rank, host in enumerate(network.hosts.values()):
        out = WORK / label / f"{host.name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "rank",
            "--rank",
            str(rank),
            "--master",
            desktop.address,
            "--path",
            path,
            "--count",
            str(args.count),
            "--pings",
            str(args.pings),
            "--hidden",
            str(args.hidden),
            "--modes",
            *args.modes,
            "--out",
            str(out.resolve()),
        ]
        procs.append(host.start(argv, out.with_suffix(".log"), env={"LAB_SECRET": secret}))
        outs.append(out)
    print(f"{label}: both ranks running (logs: {outs[0].parent})", flush=True)
    started = time.monotonic()
    while any(proc.poll() is None for proc in procs):
        waited = time.monotonic() - started
        if waited > RANK_TIMEOUT_S:
            raise RuntimeError(
                f"{label}: the ranks ran past {RANK_TIMEOUT_S:g} s ({outs[0].parent})"
            )
        time.sleep(1.0)
        if int(time.monotonic() - started) // 30 > int(waited) // 30:
            print(
                f"{label}: waiting for its ranks, {waited:.0f} s of {RANK_TIMEOUT_S:g}", flush=True
            )
    for proc, out in zip(procs, outs, strict=True):
        if proc.returncode != 0 or not out.exists():
            log = out.with_suffix(".log").read_text()[-3000:]
            raise RuntimeError(f"{label}: a rank failed ({out.with_suffix('.log')}):\n{log}")
    return [json.loads(out.read_text()) for out in outs]


def summarise(records: list[dict], modes: list[str]) -> dict[str, Any]:
    """Medians of one (delay, path): the round trip, and per mode the all-reduce (rank 0's)."""
    rank0, rank1 = records
    row: dict[str, Any] = {"rtt_ms": statistics.median(rank1["rtt_ms"])}
    for mode in modes:
        row[mode] = {
            "allreduce_ms": statistics.median(rank0[mode]["ms"]),
            "step_ms": statistics.median(rank0[mode]["step_ms"]),
            "allreduce_p90_ms": sorted(rank0[mode]["ms"])[int(0.9 * len(rank0[mode]["ms"]))],
            "compute_ms": statistics.median(rank0[mode]["compute_ms"] or [0.0]),
            "small_ops_ms": statistics.median(rank0[mode]["small_ops_ms"] or [0.0]),
            "compute_cpu_ms": statistics.median(rank0[mode]["compute_cpu_ms"] or [0.0]),
            "steal_ms": rank0[mode]["steal_ms_per_allreduce"],
            "packets": rank0[mode]["packets_per_allreduce"],
            "load": rank0[mode]["load"],
        }
    row["ss"] = {"rank0": rank0["ss"], "rank1": rank1["ss"]}
    return row


def delays_table(rows: dict[tuple[str, float, str], dict], args: argparse.Namespace) -> list[dict]:
    """Per (delay > 0, path, mode): one-way delays an all-reduce waits for, over the 0 ms row."""
    from tensor_parallel.manifest import allreduce_delays

    table = []
    for (congestion, delay, path), row in rows.items():
        base = rows.get((congestion, 0.0, path))
        if delay == 0 or base is None:
            continue
        rtt = (row["rtt_ms"] - base["rtt_ms"]) / delay
        for mode in args.modes:
            extra = row[mode]["step_ms"] - base[mode]["step_ms"]  # compute + all-reduce
            in_allreduce = row[mode]["allreduce_ms"] - base[mode]["allreduce_ms"]
            compute = [row[mode][k] - base[mode][k] for k in ("compute_ms", "small_ops_ms")]
            table.append(
                {
                    "congestion": congestion,
                    "delay_ms": delay,
                    "path": path,
                    "mode": mode,
                    "delays": extra / delay,
                    "delays_in_allreduce": in_allreduce / delay,
                    "compute_extra_ms": compute[0],
                    "small_ops_extra_ms": compute[1],
                    "model": allreduce_delays(2),
                    "rtt_delays": rtt,
                    "load": row[mode]["load"],
                }
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("rank", help="(internal) one rank, in its host's namespace")
    rank.add_argument("--rank", type=int, required=True)
    rank.add_argument("--master", required=True)
    rank.add_argument("--path", choices=PATHS, required=True)
    rank.add_argument("--out", required=True)
    for p in (parser, rank):
        p.add_argument("--count", type=int, default=100, help="timed all-reduces per mode")
        p.add_argument("--pings", type=int, default=50, help="timed one-byte round trips")
        p.add_argument("--hidden", type=int, default=2048, help="the tensor's width (1.1B: 2048)")
        p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--delays", nargs="+", type=float, default=[0.0, 1.0, 5.0])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument(
        "--wire",
        nargs="+",
        choices=("normal", "realtime"),
        default=["normal", "realtime"],
        help="the delaying forwarder's priority (labtools.linkdelay --realtime), each in turn",
    )
    parser.add_argument(
        "--congestion",
        nargs="+",
        default=["reno", "bbr"],
        help="TCP congestion control in the hosts (net.ipv4.tcp_congestion_control), each in "
        "turn; a namespace may choose only from net.ipv4.tcp_allowed_congestion_control (reno: "
        "loss-based like Linux's default cubic, and unpaced; bbr paces its segments)",
    )
    args = parser.parse_args()
    if args.command == "rank":
        rank_main(args)
        return
    if 0.0 not in args.delays or any(not 0 <= d <= 100 for d in args.delays):
        parser.error("--delays: 0 (the reference) and others within 0..100 ms")
    if args.count < 1 or args.pings < 1 or args.hidden < 2:
        parser.error("--count and --pings at least 1, --hidden at least 2")
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    choices = allowed.read_text().split() if allowed.exists() else []
    if any(c not in choices for c in args.congestion):
        parser.error(f"--congestion: a host may choose only from {choices} ({allowed})")
    from lab.machine import announce_machine, write_results
    from labtools.hosts.network import Network, cores_line, unavailable
    from world.overlay import unavailable as overlay_unavailable

    why = unavailable() or ("overlay" in args.paths and overlay_unavailable())
    if why:
        print(f"allreduce_link: needs network namespaces and WireGuard: {why}")
        sys.exit(2)
    machine = announce_machine()
    print(f"load {uptime()}", flush=True)
    rows: dict[tuple[str, float, str], dict] = {}
    with Network(["desktop", "laptop"], delay_ms=0, root=WORK / "hosts", cores_per_host=1) as net:
        print(cores_line(net), flush=True)
        for wire, congestion, delay, path in itertools.product(
            args.wire, args.congestion, sorted(args.delays), args.paths
        ):
            net.realtime_forwarder = wire == "realtime"
            congestion = f"{congestion}/{wire}"
            for host in net.hosts.values():
                host.run(
                    ["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={congestion.split('/')[0]}"]
                )
            net.set_link(delay_ms=delay, rate="1gbit")
            net.reset_forwarder()  # at this wire's priority
            records = run_pair(
                net, args, path, f"{congestion.replace('/', '-')}-{delay:g}ms-{path}"
            )
            row = rows[(congestion, delay, path)] = summarise(records, args.modes)
            row["forwarder"] = net.reset_forwarder()
            said = ", ".join(f"{m} {row[m]['allreduce_ms']:.2f}" for m in args.modes)
            if "decode" in args.modes:
                d = row["decode"]
                said += (
                    f" (decode's compute {d['compute_ms']:.2f} + {d['small_ops_ms']:.2f} ms, "
                    f"its CPU {d['compute_cpu_ms']:.2f} ms, "
                    f"steal {d['steal_ms']:.2f} ms an all-reduce)"
                )
            late = row["forwarder"] or {}
            print(
                f"{congestion} {delay:4g} ms {path:>7}: rtt {row['rtt_ms']:.2f} ms; all-reduce "
                f"ms (median) {said}; packets/all-reduce {row[args.modes[0]]['packets']}; "
                f"forwarder late mean {late.get('late_mean_ms', 0):.3f} max "
                f"{late.get('late_max_ms', 0):.2f} ms (load {uptime()})",
                flush=True,
            )
    table = delays_table(rows, args)
    print(
        f"\none-way delays a step waits for over the 0 ms row (step: the compute before an "
        f"all-reduce and the all-reduce; in it: the all-reduce alone), the model's, the round "
        f"trip's; the compute's growth (ms: matrix-vector, small ops)\n"
        f"{'tcp/wire':>13} {'delay':>5} {'path':>7} {'mode':>11} {'step':>6} {'in it':>6} "
        f"{'model':>5} {'rtt/D':>6} {'mv +ms':>7} {'ops +ms':>7}  load"
    )
    for t in table:
        print(
            f"{t['congestion']:>13} {t['delay_ms']:5g} {t['path']:>7} {t['mode']:>11} "
            f"{t['delays']:6.2f} {t['delays_in_allreduce']:6.2f} {t['model']:5d} "
            f"{t['rtt_delays']:6.2f} "
            f"{t['compute_extra_ms']:7.2f} {t['small_ops_extra_ms']:7.2f}  {t['load']}"
        )
    results = {
        "load_after": uptime(),
        "args": vars(args),
        "rows": [{"congestion": c, "delay_ms": d, "path": p, **r} for (c, d, p), r in rows.items()],
        "delays": table,
    }
    write_results(RESULTS, results, machine=machine)
    last = max(args.delays)
    path = "overlay" if "overlay" in args.paths else args.paths[0]
    mode = "decode" if "decode" in args.modes else args.modes[0]
    pick = [
        t
        for t in table
        if (t["congestion"], t["delay_ms"], t["path"], t["mode"])
        == (f"{args.congestion[0]}/{args.wire[-1]}", last, path, mode)
    ]
    if pick:
        print(
            f"gloo all-reduce one-way delays at {last:g} ms, {path}, {mode} / model: "
            f"{pick[0]['delays'] / pick[0]['model']:.2f}"
        )


if __name__ == "__main__":
    main()
