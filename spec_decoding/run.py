"""`python -m spec_decoding`: roles, metrics, and the local (loopback) set-up."""

from __future__ import annotations

import logging
import math
import signal
import statistics
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig

from lab import experiment
from lab.cli import ConfigError
from lab.cluster import connect_when_ready, emulated_link, serve
from lab.corpus import held_out_prompts
from lab.experiment import Experiment, LocalPlan, Process
from lab.models import load_model, load_tokenizer, resolve_source
from lab.tracking import Tracker
from netproto import ConnectionClosed, NetTimeout
from spec_decoding.config import SpecDecodingRunConfig
from spec_decoding.drafter import CheckStats, Generation, VerifierLostError, drafter_for
from spec_decoding.gamma import (
    PipelineModel,
    expected_tokens,
    fit_verify_costs,
)
from spec_decoding.verifier import Verifier

log = logging.getLogger(__name__)

READY_LINE = "verifier ready"
"""What the verifier prints once it serves (local runs start drafting after it)."""


def serve_verifier(settings: SpecDecodingRunConfig) -> None:
    """`role=verifier`: serve the target model until SIGTERM or SIGINT."""
    cache_dir = settings.paths.cache_path
    model = load_model(settings.target, cache_dir=cache_dir, key="target")
    if model.dtype in (torch.bfloat16, torch.float16):
        log.warning(
            "the target runs in %s: a forward over several drafted tokens rounds differently "
            "from one token at a time, so greedy output can part from the target's own where two "
            "tokens nearly tie (on an H200, bf16, the bench pair: 3 of 4 prompts identical; "
            "float32: 4 of 4). target.dtype=float32 keeps it token for token.",
            model.dtype,
        )
    tokenizer = load_tokenizer(settings.target, cache_dir=cache_dir, key="target")
    verifier = Verifier(
        model,
        tokenizer,
        max_batch=settings.spec.max_batch,
        batch_cache_tokens=settings.spec.batch_cache_tokens,
        serve_stats=settings.spec.serve_stats,
    )
    server = serve(verifier.handle, settings.cluster, settings.spec.verifier, name="verifier")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        host, port = server.address
        print(f"{READY_LINE} on {host}:{port} serving {settings.target.name}", flush=True)
        stop.wait()
    finally:
        server.stop()


def summarize(
    generations: list[Generation], baselines: list[dict[str, Any]], *, greedy: bool
) -> dict[str, float]:
    """Headline metrics of a run: measured speedup next to what the model of it predicts."""
    new_tokens = sum(len(g.tokens) for g in generations)
    seconds = sum(g.seconds for g in generations)
    if any(g.checks for g in generations):
        metrics, predicted_rate = _pipelined_metrics(generations)
    else:
        metrics, predicted_rate = _round_metrics(generations)
    metrics.update({"tokens_per_s": new_tokens / seconds, "new_tokens": float(new_tokens)})
    drafted = sum(g.drafted or sum(r.drafted for r in g.rounds) for g in generations)
    if drafted:  # what each drafted token cost on the wire
        metrics["sent_bytes_per_drafted"] = sum(g.sent_bytes for g in generations) / drafted
        if any(g.q_bytes for g in generations):
            metrics["q_bytes_per_drafted"] = sum(g.q_bytes for g in generations) / drafted
    if baselines:
        target_tokens = sum(len(b["tokens"]) for b in baselines)
        target_rate = target_tokens / sum(b["seconds"] for b in baselines)
        predicted_speedup = predicted_rate / target_rate
        metrics.update(
            {
                "target_tokens_per_s": target_rate,
                "speedup": metrics["tokens_per_s"] / target_rate,
                "predicted_speedup": predicted_speedup,
                "measured_over_predicted": metrics["tokens_per_s"]
                / target_rate
                / predicted_speedup,
            }
        )
        if greedy:
            metrics["greedy_match"] = statistics.mean(
                float(g.tokens == b["tokens"]) for g, b in zip(generations, baselines, strict=True)
            )
    return metrics


def _round_metrics(generations: list[Generation]) -> tuple[dict[str, float], float]:
    """DRAFT rounds, and the tokens/s the rounds model predicts from their measured costs."""
    rounds = [r for g in generations for r in g.rounds]
    drafted = sum(r.drafted for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    trials = sum(r.accepted + (r.accepted < r.drafted) for r in rounds)
    alpha = min(accepted / trials, 0.999) if trials else 0.0
    draft_s = sum(r.draft_s for r in rounds) / max(drafted, 1)
    # The cost model of `gamma.py`, fed with this run's measured rate and costs.
    predicted_tokens = sum(expected_tokens(alpha, r.drafted) for r in rounds)
    predicted_seconds = sum(
        r.drafted * draft_s + r.verify_s + max(0.0, r.round_s - r.draft_s - r.verify_s)
        for r in rounds
    )
    metrics = {
        # of the drafted tokens the verifier checked (none after a rejected one), those it took
        "acceptance_rate": accepted / trials if trials else 0.0,
        "mean_accepted_per_round": accepted / len(rounds),
        "mean_gamma": drafted / len(rounds),
        "rtt_ms": statistics.median(max(0.0, r.round_s - r.draft_s - r.verify_s) for r in rounds)
        * 1e3,
        "draft_ms_per_token": draft_s * 1e3,
        "verify_ms_per_round": statistics.mean(r.verify_s for r in rounds) * 1e3,
        "rounds": float(len(rounds)),
        "drafted_per_token": drafted / max(1, sum(len(g.tokens) for g in generations)),
    }
    return metrics, predicted_tokens / predicted_seconds


def _pipelined_metrics(generations: list[Generation]) -> tuple[dict[str, float], float]:
    """Pipelined: a 'round' is one verifier step (one PROGRESS); gamma is the window."""
    checks = [c for g in generations for c in g.checks]
    accepted = sum(c.accepted for c in checks)
    checked = accepted + sum(c.rejected for c in checks)
    drafted = sum(g.drafted for g in generations)
    draft_s = sum(g.draft_s for g in generations) / max(drafted, 1)
    forwards = [(c.fed, c.verify_s) for c in checks if c.fed]
    forwards += [c.forward_before for c in checks if c.forward_before is not None]
    base, slope, doubling = fit_verify_costs(forwards)
    rtts = [c.rtt_s for c in checks if c.rtt_s is not None]
    opens = [g.open_rtt_s for g in generations if g.open_rtt_s is not None]
    rtt_s = statistics.median(rtts or opens or [0.0])
    window = round(statistics.median(c.window for c in checks))
    roots = [c.root_hit for c in checks if c.root_hit is not None]
    after_wrong = _after_wrong(checks)
    # branches gated by flatness: which drafted tokens were branched, which wrong ones were
    rooted = [g for g in generations if g.roots]
    flat = sum(g.flat for g in rooted) / max(1, sum(g.drafted for g in rooted))
    wrong = sum(c.rejected for g in rooted for c in g.checks)
    cover = sum(c.root_hit is not None for g in rooted for c in g.checks) / max(1, wrong)
    gated = bool(rooted) and flat < 1
    model = PipelineModel(
        alpha=min(accepted / checked, 0.999) if checked else 0.0,
        alpha_after_wrong=after_wrong,
        draft_s=draft_s,
        verify_base_s=base,
        verify_per_token_s=slope,
        verify_per_doubling_s=doubling,
        one_way_s=rtt_s / 2,
        alone=any(g.decode_alone for g in generations),
        branch_depth=max(g.branch_depth for g in generations),
        branch_hit=(sum(roots) + 1) / (len(roots) + 2),
        branch_share=flat if gated else 1.0,
        branch_cover=cover if gated else 1.0,
    )
    # the model's steady rate for the tokens, plus each session's set-up and end: the prompt's
    # way to the verifier and its time on OPEN (or the drafter's own prefill, the longer), and
    # the last token's way back
    tokens = sum(len(g.tokens) for g in generations)
    rate = model.tokens_per_second(window)
    ends = sum(max(g.open_s, rtt_s / 2 + g.prefill_ms / 1e3) + rtt_s / 2 for g in generations)
    predicted_s = (tokens / rate if rate > 0 else math.nan) + ends
    metrics = {
        "acceptance_rate": accepted / checked if checked else 0.0,
        "mean_accepted_per_round": accepted / len(checks),
        "mean_gamma": statistics.mean(c.window for c in checks),
        "rtt_ms": rtt_s * 1e3,
        "draft_ms_per_token": draft_s * 1e3,
        "verify_ms_per_round": statistics.mean(c.verify_s for c in checks) * 1e3,
        "rounds": float(len(checks)),
        "forward_share": len(forwards) / len(checks),
        "alone_share": sum(g.alone for g in generations) / max(1, tokens),
        "branch_share": sum(g.branch_tokens for g in generations) / max(1, tokens),
        "branches_per_token": sum(g.branches for g in generations) / max(1, tokens),
        "branch_root_hit": sum(roots) / len(roots) if roots else 0.0,
        # of our drafted tokens, those unsure enough to branch; of the wrong ones, those
        "flat_share": flat if rooted else 0.0,
        "wrong_flat_share": cover if rooted else 0.0,
        "drafted_per_token": drafted / max(1, tokens),
        # the pipeline model's costs, as fitted here (a forward of n tokens: base + n *
        # per_token + log2(n) * per_doubling)
        "verify_base_ms": base * 1e3,
        "verify_per_token_ms": slope * 1e3,
        "verify_per_doubling_ms": doubling * 1e3,
    }
    if after_wrong is not None:
        metrics["acceptance_after_wrong"] = after_wrong
    return metrics, tokens / predicted_s


def _after_wrong(checks: list[CheckStats]) -> float | None:
    """Of the guesses checked right after a wrong one (in each generation's order), the share
    that were right; None without such guesses."""
    after, right, last_right = 0, 0, True
    for check in checks:
        trials = check.accepted + int(check.rejected)
        if trials and not last_right:
            after, right = after + 1, right + int(check.accepted > 0)
        if trials:
            last_right = not check.rejected
    return min(right / after, 0.999) if after else None


def run_drafter(
    settings: SpecDecodingRunConfig,
    address: tuple[str, int],
    *,
    wait_s: float | None = None,
    check: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """`role=drafter`: generate on the configured prompts against the verifier at `address`."""
    spec = settings.spec
    cache_dir = settings.paths.cache_path
    model = load_model(settings.draft, cache_dir=cache_dir, key="draft")
    tokenizer = load_tokenizer(settings.draft, cache_dir=cache_dir, key="draft")
    prompts = held_out_prompts(tokenizer, count=spec.num_prompts, tokens=spec.prompt_tokens)
    with (
        Tracker.from_settings(settings, job="spec_decoding") as tracker,
        emulated_link(settings.cluster, address) as dial,
    ):
        try:  # the verifier may still be loading its model
            conn = connect_when_ready(
                settings.cluster,
                dial,
                check=check,
                wait_s=settings.cluster.connect_timeout_s if wait_s is None else wait_s,
                what="the verifier",
                where=f"{address[0]}:{address[1]}",
                key=f"cluster.connect_timeout_s={settings.cluster.connect_timeout_s:g}"
                if wait_s is None
                else "",
            )
        except (ConnectionClosed, NetTimeout) as exc:
            raise VerifierLostError(
                f"no verifier answering at {address[0]}:{address[1]} ({exc})"
            ) from None
        try:
            drafter = drafter_for(
                model, tokenizer, conn, spec, temperature=spec.temperature, top_p=spec.top_p
            )
            generations, baselines = [], []
            for index, prompt in enumerate(prompts):
                if spec.baseline:
                    baselines.append(
                        drafter.baseline(
                            prompt, max_new_tokens=spec.max_new_tokens, seed=spec.seed + index
                        )
                    )
                generation = drafter.generate(
                    prompt, max_new_tokens=spec.max_new_tokens, seed=spec.seed + index
                )
                generations.append(generation)
                tracker.log(
                    summarize([generation], baselines[-1:], greedy=spec.temperature == 0),
                    step=index,
                )
                log.info(
                    "prompt %d/%d: %d tokens in %.2fs",
                    index + 1,
                    len(prompts),
                    len(generation.tokens),
                    generation.seconds,
                )
            if generations:
                log.info("sample output: %r", tokenizer.decode(generations[0].tokens))
            tracker.outputs(
                {"prompt": index, "tokens": list(g.tokens), "text": tokenizer.decode(g.tokens)}
                for index, g in enumerate(generations)
            )
        except VerifierLostError:
            check()  # a verifier process that died says why
            raise
        finally:
            conn.close()
        metrics = summarize(generations, baselines, greedy=spec.temperature == 0)
        tracker.summary(metrics)
        return metrics


def drafter_role(settings: SpecDecodingRunConfig) -> dict[str, float]:
    verifier = settings.spec.verifier
    if verifier.port == 0:
        raise ConfigError("role=drafter needs spec.verifier.port: the verifier's, not 0")
    return run_drafter(settings, (verifier.host, verifier.port))


def verifier_role(settings: SpecDecodingRunConfig) -> dict[str, float]:
    serve_verifier(settings)
    return {}


def serve_role(settings: SpecDecodingRunConfig) -> dict[str, float]:
    from spec_decoding.serve import serve_role as serving  # the HTTP stack, for this role only

    return serving(settings)


def prepare(settings: SpecDecodingRunConfig) -> None:
    """Build the models here once (the lab's tiny pair, or a hub fetch) before the roles load;
    a draft that is not there is refused before the verifier starts."""
    cache_dir = settings.paths.cache_path
    resolve_source(settings.draft, cache_dir=cache_dir, key="draft")
    load_model(replace(settings.target, quantization="none"), cache_dir=cache_dir, key="target")


def local_plan(settings: SpecDecodingRunConfig) -> LocalPlan:
    """The verifier as its own process; this process drafts once it serves."""
    verifier = settings.spec.verifier
    return LocalPlan(
        processes=[Process("verifier", ("role=verifier",), service=True, ready=READY_LINE)],
        main=lambda local, check: run_drafter(local, (verifier.host, verifier.port), check=check),
    )


EXPERIMENT = Experiment(
    name="spec_decoding",
    roles={"verifier": verifier_role, "drafter": drafter_role, "serve": serve_role},
    plan=local_plan,
    servers=("verifier",),
    prepare=prepare,
)


def run(cfg: DictConfig | SpecDecodingRunConfig) -> dict[str, float]:
    return experiment.run(EXPERIMENT, cfg)
