"""`python bench/spec_decoding_bench.py --capacity`: one verifier serving four drafters.

Capacity: tokens delivered per second of the target host's CPU (psutil: user + system of the
verifier process and its threads, children included). Four closed-loop clients, each its own
process (one thread), go through the lab's link emulator (netproto.LinkEmulatorProcess, the
link every other delay row of the bench uses) at 0 and 50 ms one-way, to one verifier process
started as `python -m spec_decoding` starts it (one thread), in two arms alternated:
  - speculative, four ways (`POLICIES`): each client a pipelined drafter, `gamma=auto`, the
    verifier decoding alone when it holds no draft (the default) or waiting for drafts
    (`spec.decode_alone=false`); or each client in DRAFT rounds (`spec.pipeline=false`): a
    window drafted, sent in one frame and checked in one forward, without or with each
    session consenting to be held for the others (`spec.batch_hold_ms`: `HOLD_MS`);
  - the target alone: each client a session that sends no drafts (`drafting: false`), the
    verifier decoding every token itself: the lab's own batched loop, the same batcher
    (spec_decoding/batching.py) batching the four clients' one-token forwards.
Both greedy: the texts must be the same (checked). At each delay, before and after the runs,
the shared loop's CPU a forward over a grid of sessions and drafted tokens (its sessions in
threads through one batcher, no link, this process's CPU), and before them, on the same link,
one client of each kind alone (its frames' cost a forward): spec_decoding/capacity.py predicts
both arms from those, nothing from the four-client runs. Writes
bench/results/spec_decoding_capacity.json; the last line is the ratio at 50 ms with measured /
predicted.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import psutil
import torch

from lab import experiment
from lab.config import ModelConfig
from lab.corpus import held_out_prompts
from lab.machine import write_results
from lab.models import load_model, load_tokenizer
from netproto import Connection, LinkEmulatorProcess
from spec_decoding.batching import BatchedTarget, BatchStats
from spec_decoding.cache import CachedDecoder
from spec_decoding.capacity import (
    FrameCosts,
    LoopCosts,
    idle_per_forward,
    predict_rounds,
    predict_speculative,
    predict_target_alone,
)
from spec_decoding.config import SpecConfig
from spec_decoding.drafter import Drafter
from spec_decoding.gamma import GammaController
from spec_decoding.protocol import SpecMsg
from spec_decoding.run import EXPERIMENT, summarize
from spec_decoding.verifier import vocab_hash

CLIENTS = 4
DELAYS_MS = (0, 50)
REPEATS = 3
"""Runs of every arm at each delay, alternated; the capacity is the median run's ratio. (Two
runs, their median their mean: one slow spell of the 2-core box moved a target alone's run
by 30% and the ratio with it, 1.65x and 2.32x in one bench.)"""
PROMPTS_PER_CLIENT = 4
RESULTS_NAME = "spec_decoding_capacity.json"
HOLD_MS = 20.0
"""The held rounds arm's `spec.batch_hold_ms`: each session consents to wait up to 20 ms (a
sixth of a round across 50 ms one way) for the others to share its forward."""
POLICIES = {
    "spec": (True, True, 0.0),
    "spec, verifier waits": (True, False, 0.0),
    "spec, rounds": (False, False, 0.0),
    "spec, rounds held": (False, False, HOLD_MS),
}
"""The speculative arms, (`spec.pipeline`, `spec.decode_alone`, `spec.batch_hold_ms`):
pipelined with the verifier
decoding by itself whenever it holds no draft (the default: a token that costs what the target
alone's does); pipelined with the verifier waiting for drafts, idle (its CPU spent on checking
them only, but each drafted token its own frame and, as they trickle in, forwards of one or
two drafts); DRAFT rounds (a window drafted, sent in one frame, checked in one forward, the
drafter idle a round trip a round), and the same with each session consenting to be held for
the others (`HOLD_MS`). The bench's last line reports the held rounds': the arm a shared target
host across a link would run for capacity."""


# -- the clients: one process each ---------------------------------------------------------


def _client(index: int, sources: dict[str, str], commands: Any, results: Any, go: Any) -> None:
    """A client process: loads the draft, then runs what it is told, starting on `go`."""
    torch.set_num_threads(1)
    draft_cfg = ModelConfig(name="draft", pretrained=sources["draft"], lab_preset=sources["preset"])
    cache_dir = Path(sources["cache_dir"])
    model = load_model(draft_cfg, cache_dir=cache_dir)
    tokenizer = load_tokenizer(draft_cfg, cache_dir=cache_dir)
    results.put(("ready", index, None))
    while True:
        command = commands.get()
        if command is None:
            return
        kind, address, prompts, max_new = command
        go.wait()
        try:
            with Connection.connect(*address, read_timeout_s=300) as conn:
                if kind in POLICIES:
                    pipeline, decode_alone, hold_ms = POLICIES[kind]
                    outcome = _speculative(
                        model,
                        tokenizer,
                        conn,
                        prompts,
                        max_new,
                        pipeline=pipeline,
                        decode_alone=decode_alone,
                        hold_ms=hold_ms,
                    )
                else:
                    outcome = _target_alone(tokenizer, conn, prompts, max_new)
            results.put((kind, index, outcome))
        except Exception as exc:  # reported by the parent, which stops
            results.put(("error", index, f"{type(exc).__name__}: {exc}"))


def _speculative(
    model: Any, tokenizer: Any, conn: Connection, prompts: list[list[int]], max_new: int,
    *, pipeline: bool, decode_alone: bool, hold_ms: float,
) -> dict[str, Any]:  # fmt: skip
    spec = SpecConfig()
    drafter = Drafter(
        model, tokenizer, conn, gamma=GammaController(fixed=None, max_gamma=spec.max_gamma),
        pipeline=pipeline, decode_alone=decode_alone, batch_hold_ms=hold_ms,
    )  # fmt: skip
    generations = [drafter.generate(p, max_new_tokens=max_new, seed=0) for p in prompts]
    metrics = summarize(generations, [], greedy=True)
    forwards = [c.fed for g in generations for c in g.checks if c.fed]
    forwards += [c.forward_before[0] for g in generations for c in g.checks if c.forward_before]
    forwards += [r.drafted + 1 for g in generations for r in g.rounds]  # rounds: one a round
    return {
        "plan": [_delivered(g) for g in generations],
        "outputs": [g.tokens for g in generations],
        "seconds": sum(g.seconds for g in generations),
        "forwards": forwards,
        "prefill_ms": statistics.mean(g.prefill_ms for g in generations),
        "draft_open_s": statistics.mean(g.open_s for g in generations),
        "acceptance": metrics["acceptance_rate"],
        "acceptance_after_wrong": metrics.get("acceptance_after_wrong"),
        "pipeline": pipeline,
        "draft_s": metrics["draft_ms_per_token"] / 1e3,
        "rtt_s": metrics["rtt_ms"] / 1e3,
        "window": metrics["mean_gamma"],
        "alone_share": metrics.get("alone_share", 0.0),  # rounds: the verifier never is
    }


def _delivered(generation: Any) -> list[tuple[int, int]]:
    """A generation's DRAFT rounds, in order: (drafted, tokens delivered), the last cut to the
    tokens the generation kept (capacity.simulate_rounds's plan)."""
    rounds, left = [], len(generation.tokens)
    for r in generation.rounds:
        got = min(r.accepted + 1, left)
        rounds.append((r.drafted, got))
        left -= got
    return rounds


def _target_alone(
    tokenizer: Any, conn: Connection, prompts: list[list[int]], max_new: int
) -> dict[str, Any]:
    """The target alone served: sessions that send no drafts; the verifier decodes each token."""
    outputs, started, opened = [], time.perf_counter(), []
    eos = tokenizer.eos_token_id
    for prompt in prompts:
        body = {
            "prompt": prompt, "vocab_hash": vocab_hash(tokenizer), "pipeline": True,
            "max_new_tokens": max_new, "drafting": False, "temperature": 0.0, "seed": 0,
        }  # fmt: skip
        conn.send_msg(SpecMsg.OPEN, body)
        tokens: list[int] = []
        while len(tokens) < max_new and (eos is None or eos not in tokens):
            message = conn.recv(expect={SpecMsg.OPENED, SpecMsg.PROGRESS})
            if message.type == SpecMsg.OPENED:
                opened.append(float(message.payload["prefill_ms"]))
            else:
                tokens.extend(message.payload["tokens"])
        conn.send(SpecMsg.CLOSE)
        if eos is not None and eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        outputs.append(tokens[:max_new])
    return {
        "outputs": outputs,
        "seconds": time.perf_counter() - started,
        "forwards": [1] * sum(len(o) for o in outputs),
        "prefill_ms": statistics.mean(opened),
    }


class Clients:
    """CLIENTS client processes, their models loaded once; `run` starts them together."""

    def __init__(self, sources: dict[str, str]) -> None:
        context = mp.get_context("spawn")
        self.go = context.Event()
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(CLIENTS)]
        self.procs = [
            context.Process(
                target=_client,
                args=(i, sources, self.commands[i], self.results, self.go),
                daemon=True,
            )
            for i in range(CLIENTS)
        ]
        for proc in self.procs:
            proc.start()
        for _ in range(CLIENTS):
            self._next(600)

    def _next(self, timeout_s: float) -> tuple[str, int, Any]:
        kind, index, outcome = self.results.get(timeout=timeout_s)
        if kind == "error":
            raise RuntimeError(f"client {index} failed: {outcome}")
        return kind, index, outcome

    def run(
        self, kind: str, address: tuple[str, int], work: list[list[list[int]]], max_new: int,
        verifier: psutil.Process, probe: tuple[str, int] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Each of len(work) clients runs its prompts; the verifier's CPU seconds meanwhile,
        and (`probe`: the verifier's own address) what its batcher did (`batches`)."""
        self.go.clear()
        for index, prompts in enumerate(work):
            self.commands[index].put((kind, address, prompts, max_new))
        first = batcher_stats(probe) if probe else None  # (outside the CPU counted)
        before, started = cpu_seconds(verifier), time.perf_counter()
        self.go.set()
        outcomes: list[Any] = [None] * len(work)
        for _ in work:
            _, index, outcome = self._next(900)
            outcomes[index] = outcome
        cpu, wall = cpu_seconds(verifier) - before, time.perf_counter() - started
        tokens = sum(len(o) for outcome in outcomes for o in outcome["outputs"])
        batches = batch_figures(first, batcher_stats(probe)) if first and probe else None
        return {
            "clients": outcomes,
            "batches": batches,
            "tokens": tokens,
            "verifier_cpu_s": cpu,
            "wall_s": wall,
            "tokens_per_cpu_s": tokens / cpu,
            "per_client_tokens_per_s": statistics.mean(
                sum(len(o) for o in c["outputs"]) / c["seconds"] for c in outcomes
            ),
            "load": os.getloadavg(),
        }

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()


def batcher_stats(address: tuple[str, int]) -> dict[str, Any]:
    """The verifier's batcher counts so far (its STATS_DONE: batching.BatchStats)."""
    with Connection.connect(*address, read_timeout_s=60) as conn:
        stats = conn.request(SpecMsg.STATS, expect=SpecMsg.STATS_DONE).payload
        conn.send(SpecMsg.CLOSE)
    return stats


def batch_figures(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """What the batcher did between two STATS: sessions (rows) a forward, the tokens and the
    drafted tokens (fed beyond the committed sequence) a forward, the forwards by their rows,
    and its leaders' waits for sessions in flight."""
    diff = {k: then[k] - first[k] for k in ("forwards", "rows", "tokens", "drafted")}
    extra = ["gather_waits", "gather_missed", "turnarounds", "turnaround_s", "padding_refused"]
    extra += ["hold_waits", "held_s", "drift_holds", "slots"]
    diff.update({k: then.get(k, 0) - first.get(k, 0) for k in extra})
    forwards = max(diff["forwards"], 1)
    by_rows = {r: n - first["by_rows"].get(r, 0) for r, n in then["by_rows"].items()}
    return {
        **diff,
        "rows_per_forward": diff["rows"] / forwards,
        "tokens_per_forward": diff["tokens"] / forwards,
        "drafted_per_forward": diff["drafted"] / forwards,
        "padded_drafted": max(diff["slots"] - diff["rows"], diff["drafted"]),
        "turnaround_ms": 1e3 * diff["turnaround_s"] / max(diff["turnarounds"], 1),
        "by_rows": {r: n for r, n in by_rows.items() if n},
    }


def describe_batches(b: dict[str, Any] | None) -> str:
    if not b:
        return "(no batcher figures)"
    hist = ", ".join(f"{r}: {n}" for r, n in sorted(b["by_rows"].items(), key=lambda x: int(x[0])))
    return (
        f"{b['forwards']} forwards, {b['rows_per_forward']:.2f} sessions, "
        f"{b['tokens_per_forward']:.2f} tokens ({b['drafted_per_forward']:.2f} drafted) a forward;"
        f" forwards by sessions {{{hist}}}; waits {b['gather_waits']}, missed {b['gather_missed']}"
        f", turnaround {b['turnaround_ms']:.2f} ms; refused for padding {b['padding_refused']}"
        f"; held {b.get('hold_waits', 0)} forwards ({b.get('drift_holds', 0)} to drift), "
        f"{1e3 * b.get('held_s', 0.0):.0f} ms in all"
    )


def accounted(run: dict[str, Any], loop: LoopCosts, frames: FrameCosts) -> dict[str, float] | None:
    """A check of the costs, not of the model: the share of a run's measured verifier CPU
    that the loop's costs of the forwards its batcher did run (their sessions and drafted
    tokens, the padding to each forward's longest row priced as drafted tokens, as STATS
    counted them) and each session-forward's frames account for. Near 1:
    the per-forward costs are right and a miss of the prediction is in the batches it
    foresaw; far from 1: the costs themselves miss something the run pays."""
    b = run.get("batches")
    if not b or not b["forwards"]:
        return None
    idle_s = idle_per_forward(
        wall_s=run["wall_s"], cpu_s=run["verifier_cpu_s"], forwards=b["forwards"]
    )
    cost = (
        b["forwards"] * (loop.base_s + loop.cold_s(idle_s))
        + b["rows"] * (loop.per_session_s + frames.per_forward_s)
        + b["padded_drafted"] * loop.per_drafted_s
    )
    return {"accounted_cpu_s": cost, "share": cost / run["verifier_cpu_s"]}


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU seconds of `process` (all its threads) and its live children."""
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


# -- the shared loop's cost, measured here ---------------------------------------------------

LOOP_SESSIONS = (1, 2, CLIENTS)
LOOP_DRAFTED = (0, 2, 6)
"""The grid the loop is measured over: sessions, and drafted tokens each feeds a forward."""
LOOP_ROUNDS = 4
"""Times the grid (and the cold starts) are measured, interleaved; the median is kept."""
Point = tuple[float, float, float]


def _sink(ports: Any) -> None:
    """A process that reads and drops whatever its connections send: the loop's sessions'
    peers (its CPU is not the loop's)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ports.put(server.getsockname()[1])
        while True:
            peer, _ = server.accept()
            threading.Thread(target=_drain, args=(peer,), daemon=True).start()


def _drain(peer: socket.socket) -> None:
    with peer:
        while peer.recv(1 << 16):
            pass


class Sink:
    """The `_sink` process, started once; `connect` opens a netproto connection to it."""

    def __init__(self) -> None:
        context = mp.get_context("spawn")
        ports = context.Queue()
        self.proc = context.Process(target=_sink, args=(ports,), daemon=True)
        self.proc.start()
        self.port = ports.get(timeout=600)

    def connect(self) -> Connection:
        return Connection(socket.create_connection(("127.0.0.1", self.port), timeout=60))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.join(timeout=10)


def loop_points(
    target: Any, prompts: list[list[int]], sink: Sink, *, steps: int = 32, rounds: int = LOOP_ROUNDS
) -> tuple[list[Point], dict[str, list[float]]]:
    """The shared loop's CPU a forward (spec_decoding.capacity.LoopCosts): for each (sessions,
    drafted tokens k) of the grid, that many sessions each in its own thread through one batcher
    (as the verifier's sessions run, without the link), each `steps` times feeding its next
    committed token and k drafted ones, taking the argmax, committing one token (the drafts
    cropped from its cache, as a rejection does) and sending its PROGRESS frame, as the
    verifier's does, over TCP to `sink` (another process); this process's CPU
    (time.process_time: every thread, the kernel's sends included) over the forwards the
    batcher ran. The grid is walked `rounds` times, its points interleaved, each point the
    median of its rounds: one point measured once (32 forwards, 0.1-0.3 s of CPU) swung
    1.5x between runs on the lab's 2-core VM. Returns the grid's (sessions a forward, drafted
    tokens a forward, CPU seconds a forward), and the same (ms) by "sessions x drafted"."""

    def run(count: int, drafted: int) -> tuple[BatchStats, float]:
        batched = BatchedTarget(target)
        batched.sessions = count
        decoders = [CachedDecoder(target, p, batched=batched) for p in prompts[:count]]
        for decoder in decoders:
            decoder.prefill()
        conns = [sink.connect() for _ in decoders]

        def session(decoder: CachedDecoder, conn: Connection) -> None:
            for step in range(steps):
                feed = decoder.tokens[-drafted:] if drafted else []
                logits = decoder.extend(feed)
                token = int(logits[0].argmax())
                decoder.commit([token])
                progress = {
                    "epoch": 0,
                    "at": step,
                    "accepted": 0,
                    "tokens": [token],
                    "alone": not feed,
                    "fed": len(feed) + 1,
                    "verify_ms": 1.0,
                }
                conn.send_msg(SpecMsg.PROGRESS, progress)

        workers = [
            threading.Thread(target=session, args=(d, c))
            for d, c in zip(decoders, conns, strict=True)
        ]
        started = time.process_time()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        cpu = time.process_time() - started
        for conn in conns:
            conn.close()
        return batched.stats, cpu

    run(CLIENTS, 2)  # warm-up
    grid = [(count, drafted) for count in LOOP_SESSIONS for drafted in LOOP_DRAFTED]
    taken: dict[tuple[int, int], list[Point]] = {key: [] for key in grid}
    for _ in range(rounds):  # the grid's points interleaved: a slow spell spreads over all
        for count, drafted in grid:
            stats, cpu = run(count, drafted)
            forwards = max(stats.forwards, 1)
            taken[count, drafted].append(
                (stats.rows / forwards, stats.drafted / forwards, cpu / forwards)
            )
    points, table = [], {}
    for (count, drafted), found in taken.items():
        rows, fed, cpu_s = (statistics.median(column) for column in zip(*found, strict=True))
        points.append((rows, fed, cpu_s))
        table[f"{count}x{drafted}"] = [round(rows, 2), round(fed, 2), round(cpu_s * 1e3, 3)]
    return points, table


COLD_PAUSES_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
"""The idle before a forward that `cold_points` measures it after."""


def cold_points(
    target: Any, prompts: list[list[int]], *, steps: int = 12, rounds: int = LOOP_ROUNDS
) -> dict[str, float]:
    """What a forward costs after the verifier idled (LoopCosts.cold): one session through the
    batcher feeding its committed token and 2 drafted ones, `steps` forwards back to back and
    then `steps` after each pause of COLD_PAUSES_S, each forward's CPU (time.process_time,
    the pause not counted); the extra CPU seconds a forward over the back-to-back one's, by
    pause (seconds, as str), the median of `rounds` rounds."""
    batched = BatchedTarget(target)
    batched.sessions = 1
    decoder = CachedDecoder(target, prompts[0], batched=batched)
    decoder.prefill()

    def forwards(pause_s: float) -> float:
        cpu = 0.0
        for _ in range(steps):
            if pause_s:
                time.sleep(pause_s)
            started = time.process_time()
            logits = decoder.extend(decoder.tokens[-2:])
            decoder.commit([int(logits[0].argmax())])
            cpu += time.process_time() - started
        return cpu / steps

    forwards(0.0)  # warm-up
    extra: dict[str, list[float]] = {str(pause): [] for pause in COLD_PAUSES_S}
    for _ in range(rounds):  # each round's pauses against that round's back-to-back forwards
        hot = forwards(0.0)
        for pause in COLD_PAUSES_S:
            extra[str(pause)].append(forwards(pause) - hot)
    return {pause: statistics.median(found) for pause, found in extra.items()}


def fit_loop(
    *measured: tuple[list[Point], dict[str, list[float]]], cold: list[dict[str, float]]
) -> LoopCosts:
    """The loop's costs over every measurement of the grid (taken before and after a delay's
    runs, so the load they ran under is the runs'), its fill from CLIENTS sessions without
    drafts, its cold starts the mean of `cold`'s measurements by pause."""
    fill = statistics.mean(table[f"{CLIENTS}x0"][0] for _, table in measured)
    points = [p for found, _ in measured for p in found]
    pauses = [(float(k), statistics.mean(c[k] for c in cold)) for k in cold[0]] if cold else []
    return LoopCosts.fit(points, sessions=CLIENTS, rows_per_forward=fill, cold=pauses)


def describe_loop(loop: LoopCosts) -> str:
    cold = ", ".join(f"{g * 1e3:g} ms {e * 1e3:+.2f}" for g, e in loop.cold)
    return (
        f"a forward {loop.base_s * 1e3:.3f} ms + {loop.per_session_s * 1e3:.3f} ms a session + "
        f"{loop.per_drafted_s * 1e3:.3f} ms a drafted token; {loop.rows_per_forward:.2f} of "
        f"{loop.sessions} sessions a forward without drafts; a forward after the verifier "
        f"idled (idle: extra ms) {cold or 'not measured'}"
    )


# -- the bench -------------------------------------------------------------------------------


def capacity_bench(
    pair: Any, cache_dir: Path, results_dir: Path, machine: Any, *, quick: bool
) -> None:
    max_new = 32 if quick else 64
    per_client = 2 if quick else PROMPTS_PER_CLIENT
    repeats = 1 if quick else REPEATS
    prompts = held_out_prompts(pair.tokenizer, count=CLIENTS * per_client, tokens=32)
    work = [prompts[i::CLIENTS] for i in range(CLIENTS)]
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    sources = {"draft": pair.draft_source, "preset": pair.preset, "cache_dir": str(cache_dir)}
    clients, sink = Clients(sources), Sink()
    figures: dict[str, Any] = {
        "max_new_tokens": max_new,
    }
    try:
        cfg = pair.compose(cache_dir)
        cfg.spec.serve_stats = True  # the batch counts below (STATS), off by default
        with experiment.serving(EXPERIMENT, cfg, out=sys.stderr) as (local, group):
            address = (local.spec.verifier.host, local.spec.verifier.port)
            verifier = psutil.Process(group.process("verifier").pid)
            clients.run("spec", address, [w[:1] for w in work], 8, verifier)  # warm-up
            for delay in DELAYS_MS:
                link = LinkEmulatorProcess(address, delay_ms=delay) if delay else nullcontext()
                with link as emulator:
                    where = emulator.address if emulator else address
                    figures[str(delay)] = at_delay(
                        clients,
                        where,
                        work,
                        max_new,
                        verifier,
                        repeats,
                        delay,
                        target=pair.target,
                        sink=sink,
                        prompts=prompts,
                        probe=address,
                    )
    finally:
        clients.close()
        sink.close()
    figures["load"] = {"before": load_before, "after": os.getloadavg()}
    write_results(results_dir / RESULTS_NAME, {"figures": figures}, machine=machine)
    arms = {
        "default": "pipelined, decodes alone when it has no draft",
        "waits": "pipelined, waits for drafts",
        "rounds": "DRAFT rounds",
        "held": f"DRAFT rounds, sessions held up to {HOLD_MS:g} ms for a batch",
    }
    for delay, label in [(d, policy) for d in DELAYS_MS for policy in arms]:
        f = figures[str(delay)] if label == "default" else figures[str(delay)][label]
        p = f["predicted"]
        policy = arms[label]
        print(
            f"[verifier {policy}] {delay} ms one-way, {CLIENTS} clients: speculative "
            f"{f['spec_tokens_per_cpu_s']:.1f} tokens per verifier CPU-second "
            f"({f['spec_per_client_tokens_per_s']:.1f} tokens/s "
            f"a client), the target alone batching {CLIENTS} "
            f"{f['target_tokens_per_cpu_s']:.1f} ({f['target_per_client_tokens_per_s']:.1f} a "
            f"client): {f['capacity_ratio']:.2f}x (runs: "
            + "/".join(f"{r:.2f}" for r in f["ratios"])
            + f"); predicted {f['predicted_ratio']:.2f}x (speculative "
            f"{p['spec_tokens_per_cpu_s']:.1f}, {p['spec_per_client_tokens_per_s']:.1f} a "
            f"client; alone {p['target_tokens_per_cpu_s']:.1f}, "
            f"{p['target_per_client_tokens_per_s']:.1f} a client); one client alone: "
            f"speculative {f['single']['spec_tokens_per_cpu_s']:.1f}, target "
            f"{f['single']['target_tokens_per_cpu_s']:.1f} tokens per CPU-second; measured / "
            f"predicted: speculative {f['spec_measured_over_predicted']:.2f}, target alone "
            f"{f['target_measured_over_predicted']:.2f}; same text {f['same']}; load "
            f"{f['load'][0]:.2f}"
        )
    for delay in DELAYS_MS:
        f = figures[str(delay)]
        for label, batches, share in (
            ("speculative", f["batches"], f["accounted"]),
            ("verifier waits", f["waits"]["batches"], f["waits"]["accounted"]),
            ("rounds", f["rounds"]["batches"], f["rounds"]["accounted"]),
            ("rounds held", f["held"]["batches"], f["held"]["accounted"]),
            ("target alone", f["target_batches"], f["target_accounted"]),
        ):
            said = ""
            if share:
                said = f"; the loop's and frames' costs of these forwards: {share['share']:.2f}"
            print(f"[batches] {delay} ms one-way, {label}: {describe_batches(batches)}{said}")
    f = figures["50"]["held"]
    print(
        "the last line: the drafters in DRAFT rounds (spec.pipeline=false), each session held "
        f"up to {HOLD_MS:g} ms for the others (spec.batch_hold_ms)"
    )
    print(
        f"verifier capacity at 50 ms, {CLIENTS} drafters / target alone batching {CLIENTS}: "
        f"{f['capacity_ratio']:.2f} (measured / predicted: {f['measured_over_predicted']:.2f})"
    )


def at_delay(
    clients: Clients, address: tuple[str, int], work: list[list[list[int]]], max_new: int,
    verifier: psutil.Process, repeats: int, delay: int, *, target: Any,
    prompts: list[list[int]], sink: Sink, probe: tuple[str, int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Both arms at one delay, alternated, and the model's prediction of each from the shared
    loop's costs (measured here before and after the runs) and one client alone of each kind
    (its frames); the default speculative arm's figures at the top, the waiting verifier's
    under `waits`, DRAFT rounds' under `rounds`, the held rounds' under `held`."""
    print(f"== capacity at {delay} ms one-way", file=sys.stderr)
    loop_before = loop_points(target, prompts, sink)
    cold = [cold_points(target, prompts)]
    one = [[p for w in work for p in w]]  # single-session costs: one client, all the prompts
    # (one session alone is never held: the held arm's is the rounds')
    alone = {
        kind: clients.run(kind, address, one, max_new, verifier)
        for kind, (_, _, hold_ms) in POLICIES.items()
        if not hold_ms
    }
    alone["spec, rounds held"] = alone["spec, rounds"]
    alone["target"] = clients.run("target", address, one, max_new, verifier)
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in alone}
    for _ in range(repeats):
        for kind in ("target", *POLICIES):
            runs[kind].append(clients.run(kind, address, work, max_new, verifier, probe))
        base = runs["target"][-1]["tokens_per_cpu_s"]
        each = [f"{kind} {runs[kind][-1]['tokens_per_cpu_s'] / base:.2f}x" for kind in POLICIES]
        print(f"  run: {', '.join(each)} the target alone (load {os.getloadavg()[0]:.2f})",
              file=sys.stderr)  # fmt: skip
        for kind in ("target", *POLICIES):
            print(f"    {kind}: {describe_batches(runs[kind][-1]['batches'])}", file=sys.stderr)
    loop_after = loop_points(target, prompts, sink)
    cold.append(cold_points(target, prompts))
    loop = fit_loop(loop_before, loop_after, cold=cold)
    print(f"  the shared loop: {describe_loop(loop)}", file=sys.stderr)
    t1 = alone["target"]["clients"][0]
    target_frames = FrameCosts.measured(
        cpu_s=alone["target"]["verifier_cpu_s"],
        forwards=t1["forwards"],
        loop=loop,
        wall_s=alone["target"]["wall_s"],
        opened_s=len(t1["outputs"]) * t1["prefill_ms"] / 1e3,  # priced apart (its OPENs)
    )
    figures: dict[str, Any] = {}
    for kind, (pipeline, decode_alone, hold_ms) in POLICIES.items():
        s1 = alone[kind]["clients"][0]
        spec_frames = FrameCosts.measured(
            cpu_s=alone[kind]["verifier_cpu_s"],
            forwards=s1["forwards"],
            loop=loop,
            wall_s=alone[kind]["wall_s"],
            # the held rounds' simulation prices each generation's prefill apart
            opened_s=len(s1["plan"]) * s1["prefill_ms"] / 1e3 if hold_ms else 0.0,
        )
        one_way_s = max(s1["rtt_s"] / 2, delay / 1e3)
        common = {
            "sessions": CLIENTS,
            "alpha": s1["acceptance"],
            "draft_s": s1["draft_s"],
            "one_way_s": one_way_s,
            "loop": loop,
            "frames": spec_frames,
            "max_window": SpecConfig().max_gamma,
            "max_new_tokens": max_new,
            "open_s": s1["prefill_ms"] / 1e3,
        }
        if pipeline:
            spec_predicted = predict_speculative(
                **common, alone=decode_alone, alpha_after_wrong=s1["acceptance_after_wrong"]
            )
        else:
            windows = [f - 1 for f in s1["forwards"]]  # its rounds' drafted tokens
            dealt = iter(s1["plan"])  # its generations, dealt back out as `work` was
            plans = [[next(dealt) for _ in prompts] for prompts in work]
            spec_predicted = predict_rounds(
                **common,
                hold_s=hold_ms / 1e3,
                windows=windows,
                plans=plans,
                draft_open_s=s1["draft_open_s"],
            )
        target_predicted = predict_target_alone(
            sessions=CLIENTS, loop=loop, frames=target_frames, one_way_s=one_way_s,
            max_new_tokens=max_new, open_s=t1["prefill_ms"] / 1e3,
        )  # fmt: skip
        spec_runs, target_runs = runs[kind], runs["target"]
        ratios = [
            s["tokens_per_cpu_s"] / t["tokens_per_cpu_s"]
            for s, t in zip(spec_runs, target_runs, strict=True)
        ]
        median = statistics.median(ratios)
        predicted_ratio = spec_predicted.tokens_per_cpu_s / target_predicted.tokens_per_cpu_s
        pick = min(range(repeats), key=lambda i: abs(ratios[i] - median))  # the median run
        spec, target = spec_runs[pick], target_runs[pick]
        figures[kind] = {
            "capacity_ratio": median,
            "ratios": ratios,
            "predicted_ratio": predicted_ratio,
            "measured_over_predicted": median / predicted_ratio,
            "spec_tokens_per_cpu_s": spec["tokens_per_cpu_s"],
            "target_tokens_per_cpu_s": target["tokens_per_cpu_s"],
            "spec_per_client_tokens_per_s": spec["per_client_tokens_per_s"],
            "target_per_client_tokens_per_s": target["per_client_tokens_per_s"],
            "per_client_ratio": spec["per_client_tokens_per_s"] / target["per_client_tokens_per_s"],
            "acceptance": statistics.mean(c["acceptance"] for c in spec["clients"]),
            "window": statistics.mean(c["window"] for c in spec["clients"]),
            "alone_share": statistics.mean(c["alone_share"] for c in spec["clients"]),
            "same": all(
                s["outputs"] == t["outputs"]
                for run_s, run_t in zip(spec_runs, target_runs, strict=True)
                for s, t in zip(run_s["clients"], run_t["clients"], strict=True)
            ),
            "predicted": {
                "spec_tokens_per_cpu_s": spec_predicted.tokens_per_cpu_s,
                "spec_per_client_tokens_per_s": spec_predicted.per_client_tokens_per_s,
                "target_tokens_per_cpu_s": target_predicted.tokens_per_cpu_s,
                "target_per_client_tokens_per_s": target_predicted.per_client_tokens_per_s,
                "window": spec_predicted.window,
                "tokens_per_forward": spec_predicted.tokens_per_forward,
                "rows_per_forward": spec_predicted.rows_per_forward,
                "drafted_per_forward": spec_predicted.drafted_per_forward,
                "target_rows_per_forward": target_predicted.rows_per_forward,
                "frame_ms_per_forward": {
                    "spec": spec_frames.per_forward_s * 1e3,
                    "target": target_frames.per_forward_s * 1e3,
                },
            },
            "single": {
                "spec_tokens_per_cpu_s": alone[kind]["tokens_per_cpu_s"],
                "target_tokens_per_cpu_s": alone["target"]["tokens_per_cpu_s"],
                "spec_per_client_tokens_per_s": alone[kind]["per_client_tokens_per_s"],
                "target_per_client_tokens_per_s": alone["target"]["per_client_tokens_per_s"],
                "acceptance": s1["acceptance"],
                "draft_ms": s1["draft_s"] * 1e3,
                "rtt_ms": s1["rtt_s"] * 1e3,
            },
            "spec_measured_over_predicted": spec["tokens_per_cpu_s"]
            / spec_predicted.tokens_per_cpu_s,
            "target_measured_over_predicted": target["tokens_per_cpu_s"]
            / target_predicted.tokens_per_cpu_s,
            "load": os.getloadavg(),
            "batches": spec["batches"],
            "target_batches": target["batches"],
            "accounted": accounted(spec, loop, spec_frames),
            "target_accounted": accounted(target, loop, target_frames),
            "runs": [{k: v for k, v in run.items() if k != "clients"} for run in spec_runs],
        }
    result = figures["spec"]
    result["waits"] = figures["spec, verifier waits"]
    result["rounds"] = figures["spec, rounds"]
    result["held"] = figures["spec, rounds held"]
    result["loop"] = {
        "base_ms": loop.base_s * 1e3,
        "per_session_ms": loop.per_session_s * 1e3,
        "per_drafted_ms": loop.per_drafted_s * 1e3,
        "rows_per_forward": loop.rows_per_forward,
        "grid_ms": {"before": loop_before[1], "after": loop_after[1]},
        "cold_ms": {str(g): e * 1e3 for g, e in loop.cold},
    }
    result["target_runs"] = [
        {k: v for k, v in run.items() if k != "clients"} for run in runs["target"]
    ]
    return result
