"""Speculative decoding vs target-only vs HF assisted generation, on two pairs.

Run: `python bench/spec_decoding_bench.py [--quick]`; `--capacity`: one verifier serving four
drafters against the target alone serving four clients (bench/spec_capacity.py).

The realistic pair (`lab.pretrain` preset `bench`, built once and cached, about 13 minutes on 2
cores) has a target whose forward step costs about ten times its draft's, as real pairs do;
the tiny pair (the lab's default models) costs a third to a half, mostly per-call overhead.
For each pair the bench measures c, the draft's forward step over the target's (one thread
each, KV cache, one token), on this machine. On the same held-out prompts, in one run:
  1. target-only with Hugging Face `generate`, in this process, with one thread and with two
     (ours uses two processes on two cores: ours is judged against the faster);
  2. Hugging Face assisted generation (`generate(assistant_model=draft)`), one and two threads;
  3. ours: the verifier in its own process, the drafter here, over loopback, in rounds and
     pipelined, `gamma=auto`, with the speedup the cost model predicts (from the run's own
     measurements, against the one-thread target the verifier runs);
  4. realistic pair: pipelined at 0, 2, 10 and 50 ms one-way (the link emulator in its own
     process): the headline, three runs on 16 held-out prompts, each alternated with
     target-only (one and two threads, and the target alone served over the same link, as a
     user at the drafter's host would get it without a draft) and with `auto` plus branches
     (depth <= 4, chosen by the model; only tokens the draft is unsure of, `branch_flatness`),
     with each prompt's own speedup; then, on the first 4
     prompts, fixed windows next to `auto`, a verifier that waits, and rounds;
  5. realistic pair, sampling (temperature 0.8, top-p 0.95): target-only sampling vs ours, with
     the bytes each drafted token's q costs against a dense q row;
  6. the q bytes per drafted token of a 32k-vocabulary random-init draft at the same settings,
     dense and with `draft_top_k=64` (bytes do not depend on training).
Greedy methods must produce the same tokens (checked). Every process uses one thread unless a
row says two. Prints a table, writes bench/results/spec_decoding_bench.json, and ends with our
loopback speedup over target-only on the realistic pair.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from lab import experiment, registry
from lab.config import CONF_DIR, ModelConfig, default_cache_dir
from lab.corpus import held_out_prompts
from lab.machine import announce_machine, write_results
from lab.models import load_model, load_tokenizer
from lab.sampling import probs_from_logits
from netproto import Connection, LinkEmulatorProcess
from spec_decoding.cache import CachedDecoder
from spec_decoding.config import SpecConfig
from spec_decoding.draft_q import encode_q, quantize
from spec_decoding.drafter import Drafter
from spec_decoding.gamma import GammaController, PipelineModel, fit_verify_costs
from spec_decoding.run import EXPERIMENT, summarize

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "spec_decoding_bench.json"
RUN_DIR = ROOT / "outputs" / "bench" / "spec_decoding"
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
VOCAB_32K = 32_000
TOP_K = 64
REPEATS = 3
"""Runs of the per-delay headline, each alternated with target-only."""
HEADLINE_PROMPTS = 16
"""Held-out prompts of the per-delay headline (the other rows run on the first 4): one
prompt's speedup ranged 0.7-3.0x at 10 ms (acceptance 0.3-0.98), so 4 prompts left the
headline at the mercy of which four."""


@contextmanager
def threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def step_ms(model: Any, prompt: list[int], *, steps: int = 24, drafted: int = 0) -> float:
    """Median ms of one decode step (KV cache) as both sides run it: the next token, and with
    `drafted` that many drafted tokens checked in the same forward, its tokens read back (on a
    GPU, without that read only the kernel launches would be timed). The drafts are dropped
    after each step, as on a rejection."""
    decoder = CachedDecoder(model, prompt)
    decoder.prefill()
    times = []
    for token in prompt[:steps]:  # any tokens: the cost does not depend on which
        started = time.perf_counter()
        decoder.extend(prompt[1 : 1 + drafted]).argmax(dim=-1).tolist()
        times.append(time.perf_counter() - started)
        decoder.commit([token])
    return statistics.median(times[2:]) * 1e3


def hf_generate(
    model: Any,
    prompts: list[list[int]],
    max_new: int,
    tokenizer: Any,
    *,
    sample: bool = False,
    **kwargs: Any,
) -> tuple[list[list[int]], float, list[dict[str, Any]]]:
    """Outputs and total seconds of Hugging Face `generate` on each prompt, and each prompt's
    tokens and seconds (a baseline `summarize` takes)."""
    outputs, seconds, each = [], 0.0, []
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=model.device)
        mode = {"do_sample": True, **SAMPLING} if sample else {"do_sample": False}
        torch.manual_seed(index)
        started = time.perf_counter()
        with torch.inference_mode():  # as our decoding runs: like for like
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                **mode,
                **kwargs,
            )
        elapsed = time.perf_counter() - started
        seconds += elapsed
        outputs.append(out[0, len(prompt) :].tolist())
        each.append({"tokens": outputs[-1], "seconds": elapsed})
    return outputs, seconds, each


def ours(
    address: tuple[str, int],
    draft: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_new: int,
    gamma: int | None,
    *,
    pipeline: bool,
    baselines: list[dict[str, Any]] | None = None,
    sample: bool = False,
    decode_alone: bool = True,
    branch_depth: int | None = None,
) -> dict[str, Any]:
    with Connection.connect(*address, read_timeout_s=120) as conn:
        drafter = Drafter(
            draft,
            tokenizer,
            conn,
            gamma=GammaController(fixed=gamma, max_gamma=SpecConfig().max_gamma),
            pipeline=pipeline,
            decode_alone=decode_alone,
            branch_depth=SpecConfig().branch_depth if branch_depth is None else branch_depth,
            branch_width=SpecConfig().branch_width,
            branch_flatness=SpecConfig().branch_flatness,
            temperature=SAMPLING["temperature"] if sample else 0.0,
            top_p=SAMPLING["top_p"] if sample else 1.0,
        )
        generations = [
            drafter.generate(prompt, max_new_tokens=max_new, seed=index)
            for index, prompt in enumerate(prompts)
        ]
    # the model's prediction is against the one-thread target alone, timed on these prompts
    metrics = summarize(generations, baselines or [], greedy=not sample)
    tokens = sum(len(g.tokens) for g in generations)
    seconds = sum(g.seconds for g in generations)
    accepted = sum(c.accepted for g in generations for c in g.checks) + sum(
        r.accepted for g in generations for r in g.rounds
    )
    row: dict[str, Any] = {
        "outputs": [g.tokens for g in generations],
        "seconds": seconds,
        "each_seconds": [g.seconds for g in generations],
        "acceptance": metrics["acceptance_rate"],
        "mean_gamma": metrics["mean_gamma"],
        "sent_bytes_per_drafted": metrics.get("sent_bytes_per_drafted"),
        "q_bytes_per_drafted": metrics.get("q_bytes_per_drafted", 0.0),
        "sent_bytes_per_token": sum(g.sent_bytes for g in generations) / max(1, tokens),
        # drafted tokens the verifier took per round trip of the link (the run's median)
        "accepted_per_rtt": accepted / (seconds / max(metrics["rtt_ms"] / 1e3, 1e-9)),
        "alone_share": metrics.get("alone_share", 0.0),
        "branch_share": metrics.get("branch_share", 0.0),
        "branch_root_hit": metrics.get("branch_root_hit", 0.0),
        "flat_share": metrics.get("flat_share", 0.0),
        "wrong_flat_share": metrics.get("wrong_flat_share", 0.0),
    }
    if baselines:
        row["predicted_speedup"] = metrics["predicted_speedup"]
        row["measured_over_predicted"] = metrics["measured_over_predicted"]
    if pipeline:
        row["costs"] = {
            key: metrics[key]
            for key in (
                "draft_ms_per_token",
                "verify_base_ms",
                "verify_per_token_ms",
                "verify_per_doubling_ms",
                "rtt_ms",
            )
        }
    return row


def remote_target_only(
    address: tuple[str, int], draft: Any, tokenizer: Any, prompts: list[list[int]], max_new: int
) -> float:
    """Seconds of the target alone as a user at the drafter's host gets it without a draft:
    the verifier's `generate` (BASELINE), timed here, so the prompt's way there and the
    tokens' way back are in it."""
    with Connection.connect(*address, read_timeout_s=120) as conn:
        client = Drafter(draft, tokenizer, conn, gamma=GammaController(fixed=1, max_gamma=1))
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            client.baseline(prompt, max_new_tokens=max_new, seed=index)
        return time.perf_counter() - started


def verify_ms(model: Any, prompt: list[int], sizes: tuple[int, ...]) -> dict[int, float]:
    """Median ms of one verifying forward over k drafted tokens, for each k in `sizes`: a GPU
    checks a handful almost for the price of one."""
    return {k: step_ms(model, prompt, steps=12, drafted=k) for k in sizes}


FLATNESS = (0.5, 0.62, 0.75, 0.8, 0.9)
"""`--costs`: thresholds of p2 / p1 at which the draft's unsureness is reported."""


@torch.inference_mode()
def greedy_agreement(
    target: Any, draft: Any, prompts: list[list[int]], max_new: int
) -> tuple[float, dict[str, Any]]:
    """Share of positions of the target's greedy continuations where the draft's argmax (on the
    same prefix) is the target's token: the greedy acceptance rate of a perfect pipeline. And
    where the draft is unsure (`spec.branch_flatness`): the share of positions whose p1 is
    below 0.5, and for each p2 / p1 threshold the share of positions at or above it, the share
    of the wrong guesses among those, and of the wrong guesses whose 2nd-best was right."""
    right_all, ratio_all, p1_all, second_all = [], [], [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=target.device)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                              do_sample=False, pad_token_id=0)  # fmt: skip
        logits = draft(out.to(draft.device)).logits[0, len(prompt) - 1 : -1].float()
        top = logits.softmax(-1).topk(2)
        truth = out[0, len(prompt) :].to(logits.device)
        right_all.append(top.indices[:, 0] == truth)
        second_all.append(top.indices[:, 1] == truth)
        ratio_all.append(top.values[:, 1] / top.values[:, 0])
        p1_all.append(top.values[:, 0])
    right, second = torch.cat(right_all), torch.cat(second_all)
    ratio, p1 = torch.cat(ratio_all), torch.cat(p1_all)
    wrong = ~right
    flat = {
        str(at): {
            "positions": float((ratio >= at).float().mean()),
            "wrong": float(((ratio >= at) & wrong).sum() / wrong.sum().clamp(min=1)),
            "second_right": float(((ratio >= at) & second).sum() / wrong.sum().clamp(min=1)),
        }
        for at in FLATNESS
    }
    calibration = {"p1_below_half": float((p1 < 0.5).float().mean()), "flatness": flat}
    return float(right.float().mean()), calibration


def costs_only(pairs: dict[str, Pair], num_prompts: int, max_new: int) -> dict[str, Any]:
    """`--costs`: each pair's c, verify cost per drafted-token count, greedy acceptance, the
    target alone (HF `generate`), and what the pipeline model predicts from those on loopback:
    the figures a GPU run needs before any speculative run (make gpu-check)."""
    figures: dict[str, Any] = {}
    for name, pair in pairs.items():
        prompts = held_out_prompts(pair.tokenizer, count=num_prompts, tokens=32)
        fig: dict[str, Any] = pair.measure_c(prompts[0])
        sizes = (0, 1, 2, 4, 8, 16, 32)  # drafted tokens: a forward over one more
        fig["verify_ms"] = verify_ms(pair.target, prompts[0], sizes)
        base, per_token, per_doubling = fit_verify_costs(
            (k + 1, ms / 1e3) for k, ms in fig["verify_ms"].items()
        )
        wide = held_out_prompts(pair.tokenizer, count=HEADLINE_PROMPTS, tokens=32)
        fig["acceptance_greedy"], fig["unsure"] = greedy_agreement(
            pair.target, pair.draft, wide, max_new
        )
        hf_generate(pair.target, prompts[:1], 8, pair.tokenizer)  # warm-up
        reference, seconds, _ = hf_generate(pair.target, prompts, max_new, pair.tokenizer)
        fig["target_only_tokens_per_s"] = sum(len(o) for o in reference) / seconds
        model = PipelineModel(
            alpha=fig["acceptance_greedy"],
            draft_s=fig["draft_step_ms"] / 1e3,
            verify_base_s=base,
            verify_per_token_s=per_token,
            verify_per_doubling_s=per_doubling,
            one_way_s=50e-6,
            alone=True,
        )
        window = model.best_window(SpecConfig().max_gamma)
        fig["predicted_speedup"] = model.tokens_per_second(window) * fig["target_step_ms"] / 1e3
        fig["predicted_window"] = window
        print(
            f"{name} pair: target step {fig['target_step_ms']:.2f} ms, draft "
            f"{fig['draft_step_ms']:.2f} ms: c = {fig['c']:.3f}; verify "
            + ", ".join(f"{k}: {ms:.2f}" for k, ms in fig["verify_ms"].items())
            + f" ms; greedy acceptance {fig['acceptance_greedy']:.2f}; target alone "
            f"{fig['target_only_tokens_per_s']:.1f} tokens/s (HF generate); the pipeline model "
            f"predicts {fig['predicted_speedup']:.2f}x its step rate on loopback (window {window})"
        )
        unsure = fig["unsure"]
        print(
            f"{name} pair, where the draft is unsure: p1 < 0.5 at "
            f"{unsure['p1_below_half']:.2f} of positions; "
            + "; ".join(
                f"p2/p1 >= {at}: {f['positions']:.2f} of positions, {f['wrong']:.2f} of the "
                f"wrong guesses ({f['second_right']:.2f} with the 2nd-best right)"
                for at, f in unsure["flatness"].items()
            )
        )
        figures[name] = fig
    return figures


def acceptance_needed(costs: dict[str, float], target_rate: float, speedup: float) -> float | None:
    """The least acceptance rate at which the pipeline model, fed this run's measured costs,
    predicts `speedup` over `target_rate` (None: not below 0.995)."""
    for step in range(100, 200):
        alpha = step / 200
        model = PipelineModel(
            alpha=alpha,
            draft_s=costs["draft_ms_per_token"] / 1e3,
            verify_base_s=costs["verify_base_ms"] / 1e3,
            verify_per_token_s=costs["verify_per_token_ms"] / 1e3,
            verify_per_doubling_s=costs["verify_per_doubling_ms"] / 1e3,
            one_way_s=costs["rtt_ms"] / 2e3,
            alone=True,
        )
        if (
            model.tokens_per_second(model.best_window(SpecConfig().max_gamma))
            >= speedup * target_rate
        ):
            return alpha
    return None


class Pair:
    """One target/draft pair: its models, c, and the rows measured with it."""

    def __init__(self, label: str, target: str, draft: str, preset: str, cache_dir: Path) -> None:
        self.label = label
        self.preset = preset
        self.target_source, self.draft_source = target, draft
        target_cfg = ModelConfig(name="target", pretrained=target, lab_preset=preset)
        draft_cfg = ModelConfig(name="draft", pretrained=draft, lab_preset=preset)
        self.target = load_model(target_cfg, cache_dir=cache_dir)  # CUDA, MPS or CPU: detected
        self.draft = load_model(draft_cfg, cache_dir=cache_dir)
        self.tokenizer = load_tokenizer(draft_cfg, cache_dir=cache_dir)
        self.params = {
            name: sum(p.numel() for p in model.parameters())
            for name, model in (("target", self.target), ("draft", self.draft))
        }
        self.rows: dict[str, dict[str, Any]] = {}

    def measure_c(self, prompt: list[int]) -> dict[str, float]:
        target_ms, draft_ms = step_ms(self.target, prompt), step_ms(self.draft, prompt)
        return {"target_step_ms": target_ms, "draft_step_ms": draft_ms, "c": draft_ms / target_ms}

    def compose(self, cache_dir: Path) -> Any:
        registry.manifest("spec_decoding").load_schema()  # what `compose` composes over
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(
                config_name="spec_decoding",
                overrides=[
                    "num_threads=1",
                    f"target.pretrained={self.target_source}",
                    f"target.lab_preset={self.preset}",
                    f"draft.pretrained={self.draft_source}",
                    f"draft.lab_preset={self.preset}",
                    f"paths.cache_dir={cache_dir}",
                    f"paths.run_dir={RUN_DIR}",
                    "tracking.wandb=false",
                ],
            )


def bench_pair(
    pair: Pair,
    prompts: list[list[int]],
    max_new: int,
    *,
    headline_prompts: list[list[int]],
    cache_dir: Path,
    delays: tuple[int, ...],
    gammas: tuple[int, ...],
    sampling: bool,
) -> dict[str, Any]:
    """Every row of one pair; returns its headline figures."""
    model, draft, tokenizer, rows = pair.target, pair.draft, pair.tokenizer, pair.rows
    print(f"== {pair.label}: measuring c", file=sys.stderr)
    costs = pair.measure_c(prompts[0])
    hf_generate(model, prompts[:1], 8, tokenizer)  # warm-up
    reference, target_1, baselines = hf_generate(model, prompts, max_new, tokenizer)
    with threads(2):
        same_2, target_2, _ = hf_generate(model, prompts, max_new, tokenizer)
    assisted, assisted_1, _ = hf_generate(model, prompts, max_new, tokenizer, assistant_model=draft)
    with threads(2):
        _, assisted_2, _ = hf_generate(model, prompts, max_new, tokenizer, assistant_model=draft)
    tokens = sum(len(o) for o in reference)
    if delays:  # the per-delay headline's prompts: a larger set (one prompt's speedup moves a lot)
        headline_reference, _, _ = hf_generate(model, headline_prompts, max_new, tokenizer)
        headline_tokens = sum(len(o) for o in headline_reference)
    rows["target-only, 1 thread"] = {"tokens_per_s": tokens / target_1}
    rows["target-only, 2 threads"] = {
        "tokens_per_s": tokens / target_2,
        "same": same_2 == reference,
    }
    rows["HF assisted, 1 thread"] = {
        "tokens_per_s": tokens / assisted_1,
        "same": assisted == reference,
    }
    rows["HF assisted, 2 threads"] = {"tokens_per_s": tokens / assisted_2}

    def record(
        label: str, result: dict[str, Any], reference_tokens: list[list[int]] | None
    ) -> None:
        outputs = result.pop("outputs")
        result.pop("each_seconds", None)
        generated = sum(len(o) for o in outputs)
        rows[label] = {"tokens_per_s": generated / result.pop("seconds"), **result}
        if reference_tokens is not None:
            rows[label]["same"] = outputs == reference_tokens
        print(
            f"{pair.label} / {label}: {rows[label]['tokens_per_s']:.1f} tokens/s", file=sys.stderr
        )

    cfg = pair.compose(cache_dir)
    # the verifier started as `python -m spec_decoding` starts it, its log on stderr
    with experiment.serving(EXPERIMENT, cfg, out=sys.stderr) as (local, _):
        address = (local.spec.verifier.host, local.spec.verifier.port)
        for pipeline in (False, True):  # warm-up
            ours(address, draft, tokenizer, prompts[:1], 8, None, pipeline=pipeline)
        for pipeline, mode in ((False, "rounds"), (True, "pipelined")):
            result = ours(
                address, draft, tokenizer, prompts, max_new, None,
                pipeline=pipeline, baselines=baselines,
            )  # fmt: skip
            record(f"ours, {mode}, auto", result, reference)
        for delay in delays:
            emulator = LinkEmulatorProcess(address, delay_ms=delay) if delay else nullcontext()
            with emulator as link:
                where = link.address if link else address
                run = (where, draft, tokenizer, prompts, max_new)
                wide = (where, draft, tokenizer, headline_prompts, max_new)
                # the headline: three runs on the larger prompt set, each alternated with
                # target-only (both thread counts, and served remotely over this link) and
                # with the same settings plus branches (`auto` picks their depth, <= 4)
                ratios, branched, remote, per_prompt = [], [], [], []
                for repeat in range(REPEATS):
                    _, alone_1, each_1 = hf_generate(model, headline_prompts, max_new, tokenizer)
                    with threads(2):
                        _, alone_2, _ = hf_generate(model, headline_prompts, max_new, tokenizer)
                    remote_s = remote_target_only(*wide)
                    label = f"ours, {delay} ms, pipelined, gamma=auto" + (
                        f" (run {repeat + 1})" if repeat else ""
                    )
                    result = ours(*wide, None, pipeline=True, baselines=each_1)
                    each = result.pop("each_seconds")
                    record(label, result, headline_reference)
                    seconds = headline_tokens / rows[label]["tokens_per_s"]
                    ratios.append(min(alone_1, alone_2) / seconds)
                    remote.append(remote_s / seconds)
                    per_prompt.append([b["seconds"] / s for b, s in zip(each_1, each, strict=True)])
                    label = f"ours, {delay} ms, branches" + (
                        f" (run {repeat + 1})" if repeat else ""
                    )
                    result = ours(*wide, None, pipeline=True, baselines=each_1, branch_depth=4)
                    record(label, result, headline_reference)
                    seconds = headline_tokens / rows[label]["tokens_per_s"]
                    branched.append(min(alone_1, alone_2) / seconds)
                auto_row = rows[f"ours, {delay} ms, pipelined, gamma=auto"]
                auto_row["speedup_median"] = statistics.median(ratios)
                auto_row["speedups"] = ratios
                auto_row["vs_remote_target"] = statistics.median(remote)
                # each prompt's median over the runs, against its one-thread target-only
                each_prompt = sorted(statistics.median(r) for r in zip(*per_prompt, strict=True))
                auto_row["per_prompt"] = each_prompt
                rows[f"ours, {delay} ms, branches"]["speedup_median"] = statistics.median(branched)
                for gamma in gammas:
                    label = f"ours, {delay} ms, pipelined, gamma={gamma}"
                    record(label, ours(*run, gamma, pipeline=True), reference)
                record(
                    f"ours, {delay} ms, pipelined, verifier waits, auto",
                    ours(*run, None, pipeline=True, decode_alone=False),
                    reference,
                )
                record(
                    f"ours, {delay} ms, rounds, auto", ours(*run, None, pipeline=False), reference
                )
        if sampling:
            outs_1, sample_1, sampled = hf_generate(model, prompts, max_new, tokenizer, sample=True)
            with threads(2):
                outs_2, sample_2, _ = hf_generate(model, prompts, max_new, tokenizer, sample=True)
            # sampled texts may end early (EOS): each row counts its own tokens
            rows["sampling: target-only, 1 thread"] = {
                "tokens_per_s": sum(map(len, outs_1)) / sample_1
            }
            rows["sampling: target-only, 2 threads"] = {
                "tokens_per_s": sum(map(len, outs_2)) / sample_2
            }
            result = ours(
                address, draft, tokenizer, prompts, max_new, None,
                pipeline=True, baselines=sampled, sample=True,
            )  # fmt: skip
            record("sampling: ours, pipelined, auto", result, None)
            with LinkEmulatorProcess(address, delay_ms=10) as link:
                result = ours(
                    link.address, draft, tokenizer, prompts, max_new, None,
                    pipeline=True, baselines=sampled, sample=True,
                )  # fmt: skip
            record("sampling: ours, 10 ms, pipelined, auto", result, None)

    target_best = max(rows[f"target-only, {n}"]["tokens_per_s"] for n in ("1 thread", "2 threads"))
    assisted_best = max(
        rows[f"HF assisted, {n}"]["tokens_per_s"] for n in ("1 thread", "2 threads")
    )
    headline = rows["ours, pipelined, auto"]
    target_rate = rows["target-only, 1 thread"]["tokens_per_s"]  # what the verifier runs
    figures: dict[str, Any] = {
        "acceptance_needed_for_2x": acceptance_needed(headline["costs"], target_rate, 2.0),
        "acceptance_needed_for_1.5x": acceptance_needed(headline["costs"], target_rate, 1.5),
        **costs,
        "params": pair.params,
        "acceptance": headline["acceptance"],
        "speedup_vs_target_best": headline["tokens_per_s"] / target_best,
        "speedup_vs_target_1_thread": headline["tokens_per_s"]
        / rows["target-only, 1 thread"]["tokens_per_s"],
        "speedup_vs_assisted_best": headline["tokens_per_s"] / assisted_best,
        "measured_over_predicted": {
            mode: rows[f"ours, {mode}, auto"]["measured_over_predicted"]
            for mode in ("rounds", "pipelined")
        },
        "predicted_speedup": {
            mode: rows[f"ours, {mode}, auto"]["predicted_speedup"]
            for mode in ("rounds", "pipelined")
        },
    }
    auto_vs_best, pipelined_vs_rounds, per_delay = {}, {}, {}
    for delay in delays:
        row = rows[f"ours, {delay} ms, pipelined, gamma=auto"]
        per_delay[delay] = {
            "speedup_vs_target_best": row["speedup_median"],
            "speedups": row["speedups"],
            "vs_remote_target": row["vs_remote_target"],
            "per_prompt": row["per_prompt"],
            "acceptance": row["acceptance"],
            "accepted_per_rtt": row["accepted_per_rtt"],
            "sent_bytes_per_token": row["sent_bytes_per_token"],
            "alone_share": row["alone_share"],
            "branches_speedup": rows[f"ours, {delay} ms, branches"]["speedup_median"],
            "branch_share": rows[f"ours, {delay} ms, branches"]["branch_share"],
            "branch_root_hit": rows[f"ours, {delay} ms, branches"]["branch_root_hit"],
            "flat_share": rows[f"ours, {delay} ms, branches"]["flat_share"],
            "wrong_flat_share": rows[f"ours, {delay} ms, branches"]["wrong_flat_share"],
            "measured_over_predicted": row.get("measured_over_predicted"),
            "vs_waiting": row["tokens_per_s"]
            / rows[f"ours, {delay} ms, pipelined, verifier waits, auto"]["tokens_per_s"],
        }
        fixed = [rows[f"ours, {delay} ms, pipelined, gamma={g}"]["tokens_per_s"] for g in gammas]
        auto = rows[f"ours, {delay} ms, pipelined, gamma=auto"]["tokens_per_s"]
        auto_vs_best[delay] = auto / max(fixed)
        pipelined_vs_rounds[delay] = auto / rows[f"ours, {delay} ms, rounds, auto"]["tokens_per_s"]
    figures["per_delay"] = per_delay
    figures["auto_vs_best_fixed"] = auto_vs_best
    figures["pipelined_vs_rounds"] = pipelined_vs_rounds
    if sampling:
        ours_sampled = rows["sampling: ours, pipelined, auto"]
        sample_best = max(
            rows[f"sampling: target-only, {n}"]["tokens_per_s"] for n in ("1 thread", "2 threads")
        )
        vocab = int(model.get_input_embeddings().num_embeddings)
        figures["sampling"] = {
            "speedup_vs_target_best": ours_sampled["tokens_per_s"] / sample_best,
            "speedup_at_10ms_vs_target_best": rows["sampling: ours, 10 ms, pipelined, auto"][
                "tokens_per_s"
            ]
            / sample_best,
            "acceptance": ours_sampled["acceptance"],
            "q_bytes_per_drafted": ours_sampled["q_bytes_per_drafted"],
            "dense_q_row_bytes": 4 * vocab,
            "q_bytes_vs_dense": (ours_sampled["q_bytes_per_drafted"] or 0.0) / (4 * vocab),
            "sent_bytes_per_drafted": ours_sampled["sent_bytes_per_drafted"],
        }
    return figures


def q_bytes_32k(prompts: list[list[int]], tokenizer: Any) -> dict[str, float]:
    """q bytes per drafted token of a random-init draft over a 32k vocabulary, as the drafter
    encodes them (its nucleus, and cut to the top 64), at the sampling settings above, beside
    a dense float32 row."""
    from lab.pretrain import TinyModelSpec, build_llama

    torch.manual_seed(0)
    spec = TinyModelSpec(num_layers=1, hidden_size=64, num_heads=2, intermediate_size=128)
    model = build_llama(spec, vocab_size=VOCAB_32K, context_length=256, tokenizer=tokenizer).eval()
    with torch.inference_mode():
        logits = torch.cat([model(input_ids=torch.tensor([p])).logits[0] for p in prompts])
    result: dict[str, float] = {"dense float32 row": 4.0 * VOCAB_32K}
    for label, top_k in (("nucleus", 0), (f"draft_top_k={TOP_K}", TOP_K)):
        q = probs_from_logits(logits, top_k=top_k, **SAMPLING)  # (tokens, V)
        sizes = [
            sum(t.numel() * t.element_size() for t in encode_q(quantize(row[None])).values())
            for row in q
        ]
        result[label] = statistics.mean(sizes)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, delays and windows")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument(
        "--preset", default="bench", help="lab.pretrain preset of the realistic pair"
    )
    parser.add_argument(
        "--target",
        default="lab:tiny_target",
        help="realistic pair's target: hub id, folder or lab:",
    )
    parser.add_argument("--draft", default="lab:tiny_draft", help="same, for its draft")
    parser.add_argument(
        "--costs",
        action="store_true",
        help="only c, verify costs, greedy acceptance and the model's prediction per pair",
    )
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="one verifier, 4 drafters vs the target alone batching 4 (bench/spec_capacity.py)",
    )
    args = parser.parse_args()
    machine = announce_machine()
    torch.set_num_threads(1)
    num_prompts, max_new = (2, 32) if args.quick else (4, 64)
    headline_count = 2 if args.quick else HEADLINE_PROMPTS
    delays = (0, 10) if args.quick else (0, 2, 10, 50)
    gammas = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32)

    print("loading (the realistic pair is built on first use: ~13 min)", file=sys.stderr)
    if args.capacity:
        from spec_capacity import capacity_bench  # (bench/, beside this script)

        realistic = Pair("realistic", args.target, args.draft, args.preset, args.cache_dir)
        capacity_bench(realistic, args.cache_dir, RESULTS.parent, machine, quick=args.quick)
        return
    pairs = {
        "realistic": Pair("realistic", args.target, args.draft, args.preset, args.cache_dir),
        "tiny": Pair("tiny", "lab:tiny_target", "lab:tiny_draft", "default", args.cache_dir),
    }
    if args.costs:
        write_results(
            RESULTS.with_name("spec_decoding_costs.json"),
            {"figures": costs_only(pairs, num_prompts, max_new), "max_new_tokens": max_new},
            machine=machine,
        )
        return
    figures: dict[str, Any] = {}
    for name, pair in pairs.items():
        prompts = held_out_prompts(pair.tokenizer, count=num_prompts, tokens=32)
        is_realistic = name == "realistic"
        figures[name] = bench_pair(
            pair,
            prompts,
            max_new,
            headline_prompts=held_out_prompts(pair.tokenizer, count=headline_count, tokens=32),
            cache_dir=args.cache_dir,
            delays=delays if is_realistic else (),
            gammas=gammas,
            sampling=is_realistic,
        )
    tokenizer = pairs["realistic"].tokenizer
    figures["q_bytes_32k_vocab"] = q_bytes_32k(
        held_out_prompts(tokenizer, count=num_prompts, tokens=32), tokenizer
    )

    nan = float("nan")
    for name, pair in pairs.items():
        fig = figures[name]
        print(
            f"\n{name} pair: target {pair.params['target'] / 1e6:.2f} M, draft "
            f"{pair.params['draft'] / 1e6:.2f} M parameters; step {fig['target_step_ms']:.2f} ms "
            f"vs {fig['draft_step_ms']:.2f} ms: c = {fig['c']:.3f}"
        )
        base = pair.rows["target-only, 1 thread"]["tokens_per_s"]
        print(f"{'method':<42}{'tokens/s':>10}{'vs 1 thread':>12}{'accept':>8}{'gamma':>7}  same")
        for label, row in pair.rows.items():
            row["vs_target_1_thread"] = row["tokens_per_s"] / base
            print(
                f"{label:<42}{row['tokens_per_s']:>10.1f}{row['vs_target_1_thread']:>11.2f}x"
                f"{row.get('acceptance', nan):>8.2f}{row.get('mean_gamma', nan):>7.2f}"
                f"  {row.get('same', '')}"
            )
        print(
            f"{name}: ours / faster target-only {fig['speedup_vs_target_best']:.2f}x, "
            f"/ faster HF assisted {fig['speedup_vs_assisted_best']:.2f}x; measured / predicted "
            + ", ".join(
                f"{mode} {fig['measured_over_predicted'][mode]:.2f} "
                f"(predicted {fig['predicted_speedup'][mode]:.2f}x)"
                for mode in ("rounds", "pipelined")
            )
        )
        needed = [fig[f"acceptance_needed_for_{x}"] for x in ("1.5x", "2x")]
        least = [f"{n}" if n is not None else "> 0.995" for n in needed]
        print(
            f"{name}: at this run's measured costs the pipeline model reaches 1.5x the "
            f"one-thread target from an acceptance of {least[0]}, 2x from {least[1]} (this "
            f"pair: {fig['acceptance']:.2f})"
        )
        for delay, ratio in fig["auto_vs_best_fixed"].items():
            print(
                f"{name}, {delay} ms: auto / best fixed window {ratio:.2f}; "
                f"pipelined / rounds {fig['pipelined_vs_rounds'][delay]:.2f}"
            )
        for delay, d in fig.get("per_delay", {}).items():
            predicted = d["measured_over_predicted"]
            print(
                f"{name}, {delay} ms one-way: speedup over the faster target-only "
                f"{d['speedup_vs_target_best']:.2f}x (median of {len(d['speedups'])}: "
                + "/".join(f"{x:.2f}" for x in d["speedups"])
                + f"), acceptance {d['acceptance']:.2f}, {d['accepted_per_rtt']:.1f} tokens "
                f"accepted per round trip, {d['sent_bytes_per_token']:.0f} bytes sent per token, "
                f"{d['alone_share']:.2f} of tokens decoded by the verifier alone; with "
                f"branches {d['branches_speedup']:.2f}x ({d['branch_share']:.2f} of tokens "
                f"along them; {d['flat_share']:.2f} of drafted tokens unsure enough to branch, "
                f"holding {d['wrong_flat_share']:.2f} of the wrong ones, whose roots were the "
                f"verifier's token at {d['branch_root_hit']:.2f}), "
                f"{d['vs_waiting']:.2f}x a verifier that waits; measured / predicted "
                f"{predicted if predicted is None else f'{predicted:.2f}'}; "
                f"{d['vs_remote_target']:.2f}x the target alone served over this link; per "
                f"prompt (median of the runs, against its one-thread target-only) "
                f"{d['per_prompt'][0]:.2f}x to {d['per_prompt'][-1]:.2f}x, median "
                f"{statistics.median(d['per_prompt']):.2f}x"
            )
        if "sampling" in fig:
            s = fig["sampling"]
            print(
                f"{name}, sampling (t={SAMPLING['temperature']}, top_p={SAMPLING['top_p']}): "
                f"ours / faster target-only {s['speedup_vs_target_best']:.2f}x, acceptance "
                f"{s['acceptance']:.2f} (loopback), "
                f"{s['speedup_at_10ms_vs_target_best']:.2f}x at 10 ms one-way; no q travels "
                f"pipelined ({s['sent_bytes_per_drafted']:.0f} bytes sent per drafted token)"
            )
    q32 = figures["q_bytes_32k_vocab"]
    print(
        "32k-vocabulary random-init draft, q bytes per drafted token: "
        + ", ".join(f"{label} {value:.0f}" for label, value in q32.items())
    )
    write_results(
        RESULTS,
        {
            "figures": figures,
            "rows": {name: pair.rows for name, pair in pairs.items()},
            "prompts": num_prompts,
            "headline_prompts": headline_count,
            "max_new_tokens": max_new,
        },
        machine=machine,
    )
    at_10 = figures["realistic"].get("per_delay", {}).get(10)
    if at_10 is not None:
        print(
            "speedup over target-only at 10 ms one-way (realistic pair): "
            f"{at_10['speedup_vs_target_best']:.2f}"
        )
    # loopback as the per-delay headline measures it (three runs, each alternated with
    # target-only, on the larger prompt set) where it ran; else the single loopback row
    at_0 = figures["realistic"].get("per_delay", {}).get(0)
    speedup = (at_0 or figures["realistic"])["speedup_vs_target_best"]
    print(f"our speedup over target-only (loopback, realistic pair): {speedup:.2f}x")


if __name__ == "__main__":
    main()
