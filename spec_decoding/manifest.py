"""What the lab's tools need from spec_decoding (lab.registry): its sweep, plots, headline and
its cost model on a link (gamma.py's models of a run, given the link's round trip), its roles
across hosts and its curves, its quick settings.

Registered by entry point (pyproject.toml); imports no model code.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lab.benchfigures import figure, machine, text
from lab.linkmodel import Link, run_config, run_summary
from lab.plots import pyplot, save, step_rows
from lab.records import METRICS_FILE, read_records, same_outputs
from lab.registry import Headline, Manifest, Metric, Scenario, Variant, Workload
from spec_decoding.gamma import (
    FIRST_GAMMA,
    PIPELINE_PRIOR,
    CostModel,
    PipelineModel,
    expected_tokens,
    simulate_pipeline,
)

NAME = "spec_decoding"
DEBUG = ["target.lab_preset=debug", "draft.lab_preset=debug"]
SHORT = ["spec.num_prompts=2", "spec.max_new_tokens=16"]


def plots(run_dir: Path) -> list[Path]:
    """Acceptance rate and speedup over the target alone, per prompt."""
    prompts = step_rows(read_records(run_dir / METRICS_FILE), "acceptance_rate")
    if not prompts:
        return []
    plt = pyplot()
    fig, (acc_ax, speed_ax) = plt.subplots(1, 2, figsize=(9, 3.5))
    numbers = [r["step"] + 1 for r in prompts]
    acc_ax.bar(numbers, [r["acceptance_rate"] for r in prompts])
    acc_ax.set_ylim(0, 1)
    acc_ax.set_ylabel("drafted tokens accepted (fraction)")
    acc_ax.set_title("acceptance")
    if all("speedup" in r for r in prompts):
        speed_ax.bar(numbers, [r["speedup"] for r in prompts], label="measured")
        speed_ax.plot(numbers, [r["predicted_speedup"] for r in prompts], "k_", markersize=20,
                      mew=2, label="predicted by the cost model")  # fmt: skip
        speed_ax.axhline(1.0, color="grey", lw=1)
        speed_ax.legend(fontsize=8)
    speed_ax.set_ylabel("tokens/s over the target alone (x)")
    speed_ax.set_title("speedup")
    for ax in (acc_ax, speed_ax):
        ax.set_xlabel("prompt")
        ax.set_xticks(numbers)
        ax.grid(alpha=0.3, axis="y")
    return [save(fig, plt, run_dir / "spec_prompts.png")]


def _rounds_seconds(model: Any, *, tokens: int, prompts: int, max_gamma: int) -> float:
    """Seconds of DRAFT rounds for `prompts` generations of `tokens` each, in expectation: the
    first round drafts FIRST_GAMMA, then the model's best length, cut to what a generation still
    needs (on short generations and long round trips the cut, not the best, sets the rounds)."""
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
    if model.alone:  # the event-by-event simulation, one generation from its opening
        runs = [
            simulate_pipeline(model, window, alone=True, tokens=tokens, seed=s) for s in range(4)
        ]
        return prompts * tokens / statistics.mean(runs)
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
    """spec_decoding/gamma.py's model of the run's mode, given the local run's
    acceptance rate and costs and the link's round trip (its own loopback one added). Rounds:
    each generation's rounds as `gamma=auto` would draft them there (`_rounds_seconds`).
    Pipelined: each generation's epochs at the window it would choose (`_pipelined_seconds`).
    Compute costs are scaled to the local run's measured time (what the model leaves out,
    measured once, locally); each generation's opening adds a round trip."""
    s, config = run_summary(run_dir), run_config(run_dir)
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
            after_wrong = s.get("acceptance_after_wrong")
            model = PipelineModel(
                alpha, c * draft + link.serialize_s(drafted_bytes),
                c * float(s["verify_base_ms"]) / 1e3, c * float(s["verify_per_token_ms"]) / 1e3,
                rtt / 2, alone=spec.get("decode_alone", True),
                verify_per_doubling_s=c * float(s.get("verify_per_doubling_ms", 0.0)) / 1e3,
                alpha_after_wrong=None if after_wrong is None else float(after_wrong),
            )  # fmt: skip
            # until its first generation is over, `auto` allows PIPELINE_PRIOR drafted tokens
            # in flight: the run's first epoch stalls if that is too few for the round trip
            ramp = max(0.0, rtt + model._verify_s(1) - PIPELINE_PRIOR * model.draft_s)
            ramp = 0.0 if model.alone else ramp  # the verifier decodes from the start
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


def speedup(run_dir: Path) -> float:
    return float(run_summary(run_dir)["speedup"])


CURVE = [*DEBUG, "spec.num_prompts=2", "spec.max_new_tokens=32", "num_threads=1"]


AT_DELAY = "figures > realistic > per_delay"

REALISTIC = "python -m spec_decoding target.lab_preset=bench draft.lab_preset=bench"
"""The realistic pair (its draft 0.06 of its target a step; built once: docs/tiny_models.md)."""


def verdict(summary: Mapping[str, Any]) -> list[str]:
    """Speculative decoding's answer: faster or slower than the target alone, and why."""
    speedup, ours = float(summary["speedup"]), float(summary["tokens_per_s"])
    target, accepted = float(summary["target_tokens_per_s"]), summary.get("acceptance_rate")
    lines = [
        f"speculative decoding ran at {ours:.1f} tokens/s, the target alone at {target:.1f} on "
        f"the same prompts: {speedup:.2f}x, "
        + ("faster than the target alone." if speedup >= 1 else "slower than the target alone.")
    ]
    why = []
    if "draft_ms_per_token" in summary and target > 0:  # a draft step over a target step
        why.append(f"a draft step cost {float(summary['draft_ms_per_token']) * target / 1e3:.2f} "
                   "of a target step")  # fmt: skip
    if accepted is not None:
        why.append(f"{float(accepted):.2f} of the drafted tokens were accepted")
    realistic = text(
        lambda: (
            f"the realistic pair (a draft step {bench('figures > realistic > c'):.3f} of "
            f"its target's) ran {bench(f'{AT_DELAY} > 0 > speedup_vs_target_best'):.2f}x on "
            f"loopback in `python bench/spec_decoding_bench.py`"
        )
    )
    lines.append(
        (f"Why: {' and '.join(why)}. " if why else "")
        + "Speculation pays when the draft is cheap next to its target and agrees with it "
        f"often; the lab's tiny pair (its draft a third of its target) is for trying the parts, "
        f"not for speed: {realistic}."
    )
    lines.append(f"For the realistic case: {REALISTIC}")
    return lines


def bench(keys: str) -> float:
    """A figure of bench/results/spec_decoding_bench.json (lab.benchfigures)."""
    return figure("spec_decoding_bench", keys)


MANIFEST = Manifest(
    name=NAME,
    schema="spec_decoding.config:SpecDecodingRunConfig",
    endpoints=("spec.verifier",),
    renamed={"cluster.verifier": "spec.verifier"},
    unread={"model": "its two models are target.* and draft.* (e.g. target.pretrained=...)"},
    serving=("verifier",),
    summary="a small draft model proposes tokens, a large target verifies them over TCP",
    headline=Headline(
        "speedup",
        "speedup over the target alone (x)",
        speedup,
        predict_speedup,
        means="speculative decoding's tokens/s over the target model decoding alone on the "
        "same prompts, both measured in this run: above 1x speculation pays",
        verdict=verdict,
        benchmark=lambda: (
            f"{bench(f'{AT_DELAY} > 0 > speedup_vs_target_best'):.2f}x on loopback and "
            f"{bench(f'{AT_DELAY} > 10 > speedup_vs_target_best'):.2f}x "
            f"at 10 ms one-way with the realistic pair, whose draft costs "
            f"{bench('figures > realistic > c'):.3f} of its target a step; the tiny pair's draft "
            f"costs {bench('figures > tiny > c'):.3f}, too much to gain much "
            f"(`python bench/spec_decoding_bench.py`, {machine('spec_decoding_bench')})"
        ),
    ),
    workload=Workload(
        (
            Metric("tokens_per_s", "speculative: throughput", "tokens/s"),
            Metric("target_tokens_per_s", "target alone: throughput", "tokens/s"),
            Metric("acceptance_rate", "acceptance rate", "fraction"),
            Metric("speedup", "speedup over target alone", "x", ratio=True),
        ),
        repeat=lambda cell, repeats: [f"spec.num_prompts={repeats}"],
        baseline="target_tokens_per_s",
        baseline_free=("spec.gamma", "spec.max_gamma", "spec.pipeline", "draft.", "cluster."),
    ),
    quick=(*DEBUG, *SHORT),
    plots=plots,
    scenario=Scenario(
        NAME,
        "spec.verifier",
        [
            ("desktop", "verifier", ["role=verifier"]),
            ("laptop", "drafter", ["role=drafter"]),
        ],
        [*DEBUG, *SHORT, "num_threads=1"],
        same_outputs,
        result_role="drafter",
        port=29520,
    ),
    variants=(
        Variant("spec_rounds", NAME, [*CURVE, "spec.pipeline=false"]),
        Variant("spec_pipelined", NAME, CURVE),
    ),
)
