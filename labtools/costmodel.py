"""Predict before you buy: each module's headline figure on a link of D ms and B Mbit/s, from
one local run.

"Latency is compute time plus transmission time." A local run (every role on one machine's
loopback) measures the compute: its headline figure, and what each step sends. A link adds, per
step, its one-way delay once for every message the step waits for in turn (a count read from
the module's protocol, below), and each transfer's bytes over the link's rate. TCP adds one thing
a user feels: after an idle spell (longer than its retransmission timeout, 200 ms at least) a
connection starts again from a 10-segment window and doubles it every round trip, so a transfer
of n bytes waits extra round trips until the window covers n or the link's bandwidth-delay
product (`Link.slow_start_s`). Calibrated only on the local run; nothing is fitted to the link
grid it is judged on.

    python -m labtools.costmodel split_training outputs/run/... --delay-ms 10 --rate 100mbit

The per-module counts (sequential one-way crossings per step):
- split_inference (KV cache on, N stages): the driver asks stage 1 once per generation, and
  each token then goes stage 1 -> ... -> stage N and its answer back: 2 (N - 1) crossings, with
  the hidden state of the batch's new positions each way forward.
- split_training (2 stages): forward (driver -> stage 1, its output handed to stage 2 as an
  RRef, confirmed and fetched, the loss back: 5), distributed backward (4), the gradient norm (2,
  and 2 more on steps where it clips), DistributedOptimizer.step (2), and for a tied embedding
  the gradient sync (8): 13 to 23; the activations cross forward and their gradients backward
  (batch x block x hidden float32 each way).
- fed_learn (synchronous rounds): the coordinator sends each client its task and the global
  adapter (one crossing, the adapters out through its own link in turn), the client trains and
  answers (one crossing, each client on its own link): 2 crossings, each after an idle spell.
- spec_decoding: its own model (spec_decoding/gamma.py), given the link's round trip: rounds
  pay one round trip per round, pipelined pays the one-way delay on each verdict's way.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.tracking import METRICS_FILE, read_records

MSS = 1448
"""TCP payload per segment on a 1500-byte MTU (timestamps on)."""
INITIAL_WINDOW = 10 * MSS
MIN_RTO_S = 0.2


@dataclass(frozen=True)
class Link:
    one_way_s: float
    rate_bps: float | None
    """Bits per second; None: as fast as the machine."""

    @property
    def rtt_s(self) -> float:
        return 2 * self.one_way_s

    def serialize_s(self, nbytes: float) -> float:
        return 0.0 if self.rate_bps is None else nbytes * 8 / self.rate_bps

    def slow_start_s(self, nbytes: float) -> float:
        """The round trips a connection starting from the initial window waits before its
        window covers `nbytes` (or the bandwidth-delay product, past which the rate limits)."""
        if nbytes <= INITIAL_WINDOW:
            return 0.0
        covered = nbytes
        if self.rate_bps is not None:
            covered = min(nbytes, self.rate_bps / 8 * self.rtt_s)
        rounds = math.ceil(math.log2(max(covered, 1.0) / INITIAL_WINDOW + 1)) - 1
        return max(0, rounds) * self.rtt_s

    @property
    def rto_s(self) -> float:
        """Linux's retransmission timeout on a quiet path: the round trip plus 200 ms. A
        connection idle for longer restarts from a small window (tcp_slow_start_after_idle)."""
        return self.rtt_s + MIN_RTO_S


def parse_rate(rate: str | None) -> float | None:
    """A tc rate (`10mbit`, `1gbit`, `500kbit`, `none`) in bits per second."""
    if rate is None or rate == "none":
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            value = float(rate[: -len(unit)])
            if not math.isfinite(value) or value <= 0:
                break
            return value * scale
    raise ValueError(f"not a rate: {rate!r} (e.g. 10mbit, 1gbit, none)")


# --------------------------------------------------------------------------- reading a run


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no {METRICS_FILE} in {run_dir}")
    return read_records(path)


def _summary(run_dir: Path) -> dict[str, Any]:
    rows = [r for r in _records(run_dir) if r.get("kind") == "summary"]
    if not rows:
        raise ValueError(f"no summary in {run_dir / METRICS_FILE}: did the run finish?")
    return rows[-1]


def _steps(run_dir: Path, key: str) -> list[dict[str, Any]]:
    return [r for r in _records(run_dir) if r.get("kind") == "metrics" and key in r]


def _speedup(run_dir: Path) -> float:
    return float(_summary(run_dir)["speedup"])


def _token_ms(run_dir: Path) -> float:
    return float(_summary(run_dir)["token_ms_p50"])


def _step_ms(run_dir: Path) -> float:
    """The median training step, the first (warm-up) left out."""
    steps = [float(r["step_s"]) for r in _steps(run_dir, "step_s")][1:]
    if not steps:
        raise ValueError(f"no training steps after the first in {run_dir}")
    return 1e3 * statistics.median(steps)


def _round_s(run_dir: Path) -> float:
    rounds = [float(r["round_s"]) for r in _steps(run_dir, "round_s")]
    if not rounds:
        raise ValueError(f"no rounds in {run_dir}")
    return statistics.mean(rounds)


HEADLINES: dict[str, tuple[Callable[[Path], float], str]] = {
    "speedup": (_speedup, "speedup over the target alone (x)"),
    "token_ms": (_token_ms, "per-token latency (ms, median)"),
    "step_ms": (_step_ms, "training step (ms, median)"),
    "round_s": (_round_s, "round time (s, mean)"),
}


def headline(kind: str, run_dir: Path) -> float:
    if kind not in HEADLINES:
        raise ValueError(f"unknown headline {kind!r}; known: {sorted(HEADLINES)}")
    return HEADLINES[kind][0](Path(run_dir))


# --------------------------------------------------------------------------- predicting


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The resolved config of a run (Hydra's `.hydra/config.yaml`, beside it or above it)."""
    from omegaconf import OmegaConf

    for folder in (run_dir, run_dir.parent):
        path = folder / ".hydra" / "config.yaml"
        if path.is_file():
            config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            assert isinstance(config, dict)
            return {str(k): v for k, v in config.items()}
    raise ValueError(f"no .hydra/config.yaml at {run_dir} or above it")


def _hidden_size(config: dict[str, Any]) -> int:
    """The model's hidden size: a lab preset's, or the `config.json` of its local folder."""
    import json

    from lab.pretrain import load_preset

    model = config["model"]
    if str(model.get("pretrained", "")).startswith("lab:") and model.get("lab_preset"):
        preset = load_preset(str(model["lab_preset"]))
        which = str(model["pretrained"]).removeprefix("lab:").removeprefix("tiny_")
        return int(getattr(preset, which).hidden_size)
    path = Path(str(model["pretrained"])) / "config.json"
    if path.is_file():
        return int(json.loads(path.read_text())["hidden_size"])
    raise ValueError(f"cannot tell the hidden size of {model.get('pretrained')!r}")


def predict_token_ms(run_dir: Path, link: Link) -> float:
    """split_inference, KV cache on: the local token plus 2 (N - 1) crossings, the new
    positions' hidden state at the link's rate each way forward."""
    summary, config = _summary(run_dir), _run_config(run_dir)
    stages = int(config["split"]["num_stages"])
    if not config["generate"].get("kv_cache", True):
        raise ValueError("the model covers split_inference with generate.kv_cache=true")
    hops = stages - 1
    hidden = float(summary["bytes_between_stages_per_token"])  # the forward crossings' bytes
    per_hop = link.serialize_s(hidden / hops)
    return float(summary["token_ms_p50"]) + 1e3 * (2 * hops * link.one_way_s + hops * per_hop)


SPLIT_TRAINING_CROSSINGS = 13
"""Per step with 2 stages: forward 5 (driver -> stage 1; stage 1's output, an RRef the driver
hands stage 2, confirmed with its owner and fetched; the loss back), backward 4, the gradient
norm 2 and DistributedOptimizer.step 2."""
CLIP_CROSSINGS = 2
"""On steps where the norm exceeds split.grad_clip: the scaling, on both stages."""
TIE_CROSSINGS = 8
"""A tied embedding / head: stage 1 fetches stage 2's gradient and hands back the sum, two
nested RPCs through an RRef the driver passed (each with its owner's confirmation)."""


def predict_step_ms(run_dir: Path, link: Link) -> float:
    """split_training: the local step plus its sequential crossings (13; 2 more where the
    gradient is clipped, 8 more for a tied embedding) and the activations forward and their
    gradients backward at the link's rate. The counts were read from the code and checked once
    with each phase of a step timed at 20 ms one way, a delay outside the judged grid."""
    config = _run_config(run_dir)
    split = config["split"]
    if int(split["num_stages"]) != 2 or int(split.get("grad_accum_steps", 1)) != 1:
        raise ValueError("the model covers split_training with 2 stages and no accumulation")
    steps = _steps(run_dir, "step_s")[1:]
    clip = float(split.get("grad_clip", 0.0) or 0.0)
    clipped = (
        sum(float(s.get("grad_norm", 0.0)) > clip for s in steps) / len(steps)
        if clip > 0 and steps
        else 0.0
    )
    # the sync runs on every step, tied or not (an untied model's returns early, after its
    # round trips: skipping it drifted cross-host losses by 1.4e-4, so it stays for now)
    crossings = SPLIT_TRAINING_CROSSINGS + CLIP_CROSSINGS * clipped + TIE_CROSSINGS
    activations = int(split["batch_size"]) * int(split["block_size"]) * _hidden_size(config) * 4
    return _step_ms(run_dir) + 1e3 * (
        crossings * link.one_way_s + 2 * link.serialize_s(activations)
    )


def predict_round_s(run_dir: Path, link: Link) -> float:
    """fed_learn, synchronous: each local round plus the global adapters out through the
    coordinator's link (every client's, one after the other) and a client's update back through
    its own. Each connection starts its transfer from the initial window in the first round
    (a new connection) and in any round after an idle spell longer than the link's RTO (a
    round's training: the local round's time); otherwise its window is still open."""
    rounds = _steps(run_dir, "round_s")
    if not rounds:
        raise ValueError(f"no rounds in {run_dir}")
    seconds = []
    for index, r in enumerate(rounds):
        clients = max(1.0, float(r["clients"]))
        down, up = float(r["bytes_down"]), float(r["bytes_up"]) / clients
        local = float(r["round_s"])
        cold = index == 0 or local > link.rto_s
        wait = link.slow_start_s(down / clients) + link.slow_start_s(up) if cold else 0.0
        seconds.append(
            local + 2 * link.one_way_s + link.serialize_s(down) + link.serialize_s(up) + wait
        )
    return statistics.mean(seconds)


FIRST_GAMMA = 4
"""What `gamma=auto` drafts before it has measured anything (spec_decoding.gamma)."""


def _rounds_seconds(model: Any, *, tokens: int, prompts: int, max_gamma: int) -> float:
    """Seconds of DRAFT rounds for `prompts` generations of `tokens` each, in expectation: the
    first round drafts FIRST_GAMMA, then the model's best length, cut to what a generation still
    needs (on short generations and long round trips the cut, not the best, sets the rounds)."""
    from spec_decoding.gamma import expected_tokens

    best = model.best_gamma(max_gamma)
    seconds, first = 0.0, True
    for _ in range(prompts):
        done = 0.0
        while done < tokens - 1e-9:
            gamma = min(FIRST_GAMMA if first else best, max(0, math.ceil(tokens - done) - 1))
            first = False
            seconds += model.round_seconds(gamma)
            done += expected_tokens(model.alpha, gamma)
    return seconds


def _pipelined_seconds(model: Any, *, tokens: int, prompts: int, max_gamma: int) -> float:
    """Seconds of `prompts` pipelined generations of `tokens` each, in expectation, at the window
    `gamma=auto` would choose: each is a run of epochs (gamma.PipelineModel: from a correction
    to the next wrong guess), cut short where the generation ends: a short generation over a
    long link pays each epoch's round trip without the steady state's overlap. A generation's
    first epoch starts as the drafter opens it, one way earlier than after a correction; it
    ends when the drafter hears the last verdict, one way after the verifier knows it."""
    window = model.best_window(max_gamma)
    detect = model.detection_times(window)
    alpha, horizon = model.alpha, len(detect)
    remaining = [0.0] * (tokens + 1)  # expected seconds to produce r more tokens from an epoch
    for r in range(1, tokens + 1):
        total = 0.0
        for j in range(1, min(r, horizon) + 1):  # the first wrong guess is the j-th drafted
            total += alpha ** (j - 1) * (1 - alpha) * (detect[j - 1] + remaining[r - j])
        if r <= horizon:
            total += alpha**r * detect[r - 1]
        else:
            total += alpha**horizon * (detect[-1] + remaining[r - horizon])
        remaining[r] = total
    return prompts * remaining[tokens]  # - one way at the start, + one way at the end


def predict_speedup(run_dir: Path, link: Link) -> float:
    """spec_decoding: spec_decoding/gamma.py's model of the run's mode, given the local run's
    acceptance rate and costs and the link's round trip (its own loopback one added). Rounds:
    each generation's rounds as `gamma=auto` would draft them there (`_rounds_seconds`).
    Pipelined: each generation's epochs at the window it would choose (`_pipelined_seconds`).
    Compute costs are scaled to the local run's measured time (what the model leaves out,
    measured once, locally); each generation's opening adds a round trip."""
    from spec_decoding.gamma import CostModel, PipelineModel

    s, config = _summary(run_dir), _run_config(run_dir)
    spec = config["spec"]
    alpha = min(max(float(s["acceptance_rate"]), 0.0), 0.999)
    draft = float(s["draft_ms_per_token"]) / 1e3
    drafted_bytes = float(s.get("sent_bytes_per_drafted", 0.0))
    max_gamma = int(spec["max_gamma"])
    prompts = int(spec["num_prompts"])
    tokens = float(s["new_tokens"])

    def seconds(rtt: float, c: float) -> float:
        """The model's seconds for the run's tokens at round trip `rtt`, compute costs x c."""
        if spec.get("pipeline", True):
            model = PipelineModel(
                alpha, c * draft + link.serialize_s(drafted_bytes),
                c * float(s["verify_base_ms"]) / 1e3, c * float(s["verify_per_token_ms"]) / 1e3,
                rtt / 2,
            )  # fmt: skip
            # before its first verdict, `auto` allows FIRST_GAMMA drafted tokens in flight: the
            # run's first epoch stalls until that verdict is back
            ramp = max(0.0, rtt + model._verify_s(1) - FIRST_GAMMA * model.draft_s)
            return ramp + _pipelined_seconds(
                model, tokens=round(tokens / prompts), prompts=prompts, max_gamma=max_gamma
            )
        rounds = CostModel(alpha, c * draft, c * float(s["verify_ms_per_round"]) / 1e3, 0.0, rtt)
        return _rounds_seconds(
            rounds, tokens=round(tokens / prompts), prompts=prompts, max_gamma=max_gamma
        )

    # What the model leaves out of compute (Python between steps, messages' handling) shows as
    # the local run taking longer than modelled: the compute costs are scaled until the model
    # gives the local run's measured time; the link's time is not scaled.
    local_rtt = float(s["rtt_ms"]) / 1e3
    measured = tokens / float(s["tokens_per_s"])
    low, high = 0.05, 20.0
    for _ in range(40):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if seconds(local_rtt, middle) < measured else (low, middle)
    remote = seconds(local_rtt + link.rtt_s, low) + prompts * link.rtt_s
    return tokens / remote / float(s["target_tokens_per_s"])


PREDICTORS: dict[str, Callable[[Path, Link], float]] = {
    "speedup": predict_speedup,
    "token_ms": predict_token_ms,
    "step_ms": predict_step_ms,
    "round_s": predict_round_s,
}
MODULE_HEADLINE = {
    "spec_decoding": "speedup",
    "split_inference": "token_ms",
    "split_training": "step_ms",
    "fed_learn": "round_s",
}


def predict(kind: str, run_dir: Path, *, delay_ms: float, rate: str | None) -> float:
    """Headline `kind` of the run at `run_dir` (a local run) on a link of `delay_ms` one way
    and `rate` (a tc rate or None)."""
    if not math.isfinite(delay_ms) or not 0.0 <= delay_ms <= 10_000.0:
        raise ValueError(f"delay_ms must be within 0..10000, got {delay_ms}")
    return PREDICTORS[kind](Path(run_dir), Link(delay_ms / 1e3, parse_rate(rate)))


WITHIN = (0.85, 1.15)


def report(out: Path, names: Sequence[str], *, log: Any = None) -> int:
    """`labtools.hosts curves`' results next to what each variant's local run predicts: a table per
    variant, `<out>/<variant>/report/results.{jsonl,csv}` and heatmaps (measured, predicted,
    measured/predicted) over delay x rate. Returns 0 when every cell is within WITHIN."""
    from labtools import heatmaps, matrix
    from labtools.hosts import curve_variants

    log = log or sys.stdout
    variants = curve_variants()
    inside = total = 0
    for name in names:
        folder = out / name
        records = matrix.Results(folder).records()
        done = folder / "calibration" / "done"
        if not records or not done.is_file():
            print(f"{name}: no results under {folder}", file=log)
            continue
        kind = variants[name].headline
        calibrations = [Path(line) for line in done.read_text().split()]
        latest = {r["cell"]: r for r in records}
        rows = []
        for record in latest.values():
            settings = record["settings"]
            metrics = dict(record.get("metrics", {}))
            if record["status"] == "ok":
                delay, rate = float(settings["delay_ms"]), str(settings["rate"])
                # from each local run, the middle prediction
                predicted = statistics.median(
                    predict(kind, c, delay_ms=delay, rate=rate) for c in calibrations
                )
                metrics.update(predicted=predicted,
                               measured_over_predicted=metrics["measured"] / predicted)  # fmt: skip
            rows.append({**record, "metrics": metrics})
        report_dir = folder / "report"
        if (report_dir / matrix.RESULTS_JSONL).is_file():
            (report_dir / matrix.RESULTS_JSONL).unlink()
        results = matrix.Results(report_dir)
        for row in rows:
            results.append(matrix.clean_json(row))
        delays = sorted({float(r["settings"]["delay_ms"]) for r in rows})
        rates = sorted({str(r["settings"]["rate"]) for r in rows},
                       key=lambda r: -(parse_rate(r) or math.inf))  # fmt: skip
        for row in rows:
            row["settings"] = {"delay": f"{float(row['settings']['delay_ms']):g} ms",
                               "rate": str(row["settings"]["rate"])}  # fmt: skip
        label, unit = HEADLINES[kind][1].rsplit(" (", 1)
        unit = unit.rstrip(")")
        heatmaps.draw(
            rows,
            [
                matrix.Metric("measured", f"{label}, measured across hosts", unit),
                matrix.Metric("predicted", f"{label}, predicted from the local run", unit),
                matrix.Metric(
                    "measured_over_predicted", "measured / predicted", "ratio", ratio=True
                ),
            ],
            grid={"delay": [f"{d:g} ms" for d in delays], "rate": rates},
            axes={"delay": "one-way", "rate": "tc tbf"},
            out_dir=report_dir / "heatmaps",
            title=f"{name} across three network namespaces (labtools.hosts curves)",
        )
        local = statistics.median(headline(kind, c) for c in calibrations)
        print(f"\n{name}: {HEADLINES[kind][1]}; local run {local:.4g}; "
              "measured / predicted per cell", file=log)  # fmt: skip
        print(f"{'delay':>8} " + " ".join(f"{r:>22}" for r in rates), file=log)
        by_cell = {(r["settings"]["delay"], r["settings"]["rate"]): r for r in rows}
        for delay in delays:
            cells = []
            for rate in rates:
                row = by_cell.get((f"{delay:g} ms", rate), {"status": "not run"})
                m = row.get("metrics", {})
                if "predicted" not in m:
                    cells.append(f"{row['status']:>22}")
                    continue
                ratio = m["measured_over_predicted"]
                total += 1
                inside += WITHIN[0] <= ratio <= WITHIN[1]
                cells.append(f"{m['measured']:>7.4g} /{m['predicted']:>7.4g} ={ratio:>5.2f}")
            print(f"{delay:>5g} ms " + " ".join(cells), file=log)
    print(f"\ncells with measured / predicted within {WITHIN[0]}-{WITHIN[1]}: {inside} of {total}",
          file=log)  # fmt: skip
    return 0 if total and inside == total else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labtools.costmodel", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("module", choices=sorted(MODULE_HEADLINE))
    parser.add_argument("run_dir", type=Path, help="a local run of it (its metrics.jsonl)")
    parser.add_argument("--delay-ms", type=float, nargs="+", default=[0.0, 2.0, 10.0, 50.0])
    parser.add_argument("--rate", nargs="+", default=["1gbit", "100mbit", "10mbit"])
    args = parser.parse_args(argv)
    kind = MODULE_HEADLINE[args.module]
    try:
        local = headline(kind, args.run_dir)
        rows = [
            (d, r, predict(kind, args.run_dir, delay_ms=d, rate=r))
            for d in args.delay_ms
            for r in args.rate
        ]
    except (ValueError, KeyError) as exc:
        print(f"labtools.costmodel: {exc}", file=sys.stderr)
        return 2
    print(f"{args.module}, {HEADLINES[kind][1]}: {local:.4g} in the local run {args.run_dir}")
    print(f"{'one-way delay':>14} {'rate':>8} {'predicted':>10}")
    for delay, rate, value in rows:
        print(f"{delay:>11g} ms {rate:>8} {value:>10.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
