"""`python -m split_inference`: roles, metrics, and the local (loopback) set-up."""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig

from lab import experiment
from lab.corpus import held_out_prompts
from lab.launch import ServiceGroup
from lab.memory import peak_memory
from lab.models import load_model, load_tokenizer
from lab.tracking import Tracker
from split_engine.generation import Generation, Sampling, StepModel, UnsplitModel, decode
from split_engine.roles import driving, split_experiment
from split_engine.sharded import ShardedModel
from split_inference.config import SplitInferenceRunConfig
from split_inference.load import client_counts, serve_load

log = logging.getLogger(__name__)


def batches(
    prompts: list[list[int]], *, batch_size: int, pad_token_id: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Left-padded (ids, mask) batches; row j of a batch is shortened by j*T/(2B) tokens so that
    padding, masks and per-row positions are exercised."""
    out = []
    for begin in range(0, len(prompts), batch_size):
        rows = prompts[begin : begin + batch_size]
        full = len(rows[0])
        rows = [row[: full - j * full // (2 * batch_size)] for j, row in enumerate(rows)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, row in enumerate(rows):
            ids[j, width - len(row) :] = torch.tensor(row)
            mask[j, width - len(row) :] = 1
        out.append((ids, mask))
    return out


def warm_up(model: StepModel | ShardedModel, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A short untimed generation: first calls pay for lazy initialisation, on both sides."""
    ids, mask = batch
    if isinstance(model, ShardedModel):
        model.generate(ids[:1], mask[:1], max_new_tokens=3)
    else:
        decode(model, ids[:1], mask[:1], max_new_tokens=3)


LAST_STEPS = 8
"""`token_ms_last` is the median over each generation's last this-many steps (the longest
sequences: where recomputing the prefix costs most)."""


def latency_metrics(generations: list[Generation], prefix: str = "") -> dict[str, float]:
    steps = [s for g in generations for s in g.step_s]
    last = [s for g in generations for s in g.step_s[-LAST_STEPS:]]
    tokens = sum(g.tokens.numel() for g in generations)
    seconds = sum(g.prefill_s + sum(g.step_s) for g in generations)
    q = statistics.quantiles(steps, n=20) if len(steps) >= 2 else steps * 19
    return {
        f"{prefix}prefill_ms": statistics.mean(g.prefill_s for g in generations) * 1e3,
        f"{prefix}token_ms_p50": statistics.median(steps) * 1e3 if steps else 0.0,
        f"{prefix}token_ms_p95": q[18] * 1e3 if steps else 0.0,
        f"{prefix}token_ms_last": statistics.median(last) * 1e3 if last else 0.0,
        f"{prefix}tokens_per_s": tokens / seconds,
    }


def _texts(generation: Generation, tokenizer: Any, pad: int | None) -> list[tuple[list[int], str]]:
    """Each row's new ids (up to its padding: a row that stopped early is padded) and text."""
    rows = []
    for row in generation.tokens.tolist():
        while row and pad is not None and row[-1] == pad:
            row.pop()
        rows.append((row, tokenizer.decode(row)))
    return rows


def run_driver(
    settings: SplitInferenceRunConfig,
    *,
    stages: ServiceGroup | None = None,
) -> dict[str, float]:
    """`role=driver`: cut the model across the stages, generate, measure."""
    split, gen = settings.split, settings.generate
    cache_dir = settings.paths.cache_path
    tokenizer = load_tokenizer(settings.model, cache_dir=cache_dir)
    prompts = held_out_prompts(tokenizer, count=gen.num_prompts, tokens=gen.prompt_tokens)
    pad = tokenizer.pad_token_id
    work = batches(prompts, batch_size=gen.batch_size, pad_token_id=pad)
    options = {
        "max_new_tokens": gen.max_new_tokens,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": pad,
        "kv_cache": gen.kv_cache,
    }

    def sampling(index: int) -> Sampling:  # the same draws, split or not
        return Sampling(gen.temperature, gen.top_p, seed=gen.seed + index)

    with Tracker.from_settings(settings, job="split_inference") as tracker:
        with driving(settings, split, stages=stages):
            sharded = ShardedModel.build(settings.model, split)
            warm_up(sharded, work[0])
            sharded.call_all("reset_traffic")  # bytes and forward times of the timed runs only
            split_runs = []
            for index, (ids, mask) in enumerate(work):
                split_runs.append(sharded.generate(ids, mask, sampling=sampling(index), **options))
                tracker.log(latency_metrics(split_runs[-1:]), step=index)
            tracker.outputs(
                {"prompt": index * gen.batch_size + row, "tokens": ids, "text": text}
                for index, generation in enumerate(split_runs)
                for row, (ids, text) in enumerate(_texts(generation, tokenizer, pad))
            )
            stage_stats = sharded.stats()
            traffic = sharded.bytes_between_stages(stage_stats)
            served: dict[str, float] = {}
            for step, clients in enumerate(client_counts(gen.clients) if gen.clients else []):
                served = serve_load(sharded, prompts, clients=clients, in_flight=split.in_flight,
                                    max_new_tokens=gen.max_new_tokens)  # fmt: skip
                tracker.log(served, step=len(work) + step)
        metrics = latency_metrics(split_runs)
        metrics.update(served)  # at generate.clients (the last count)
        new_tokens = sum(g.tokens.numel() for g in split_runs)
        metrics["bytes_between_stages_per_token"] = traffic / new_tokens
        # where a token's time goes: each stage's own forward, and the rest (the hops between
        # processes, serialisation, the decode loop itself)
        metrics["outside_stages_ms_p50"] = metrics["token_ms_p50"] - sum(
            stats["compute_ms_p50"] for stats in stage_stats
        )
        for rank, stats in enumerate(stage_stats, start=1):
            metrics[f"stage{rank}_compute_ms_p50"] = stats["compute_ms_p50"]
            metrics[f"stage{rank}_peak_rss_mib"] = stats["peak_rss_mib"]
            metrics[f"stage{rank}_params_m"] = stats["params"] / 1e6
            if "cuda_max_allocated_mib" in stats:
                metrics[f"stage{rank}_cuda_max_allocated_mib"] = stats["cuda_max_allocated_mib"]
        if gen.baseline:  # after the stages have left: the unsplit model has the machine alone
            if stages is not None:
                stages.wait_exited(30.0)
            # like for like: the stages hold full-precision weights whatever model.quantization
            full = replace(settings.model, quantization="none")
            with peak_memory() as unsplit_memory:
                unsplit = UnsplitModel(load_model(full, cache_dir=cache_dir))
                warm_up(unsplit, work[0])
                base_runs = []
                for index, (ids, mask) in enumerate(work):
                    base_runs.append(
                        decode(unsplit, ids, mask, sampling=sampling(index), **options)
                    )
                    tracker.log(latency_metrics(base_runs[-1:], prefix="unsplit_"), step=index)
            metrics.update(latency_metrics(base_runs, prefix="unsplit_"))
            # the driver's whole RSS while it held the unsplit model, like a stage's peak RSS
            metrics["unsplit_peak_rss_mib"] = unsplit_memory.rss_mib
            if unsplit_memory.cuda_max_allocated_mib is not None:
                metrics["unsplit_cuda_max_allocated_mib"] = unsplit_memory.cuda_max_allocated_mib
            metrics["memory_ratio"] = (
                max(metrics[f"stage{rank}_peak_rss_mib"] for rank in range(1, split.num_stages + 1))
                / metrics["unsplit_peak_rss_mib"]
            )
            metrics["latency_ratio"] = metrics["token_ms_p50"] / metrics["unsplit_token_ms_p50"]
            if gen.temperature == 0:
                metrics["greedy_match"] = statistics.mean(
                    float(torch.equal(a.tokens, b.tokens))
                    for a, b in zip(split_runs, base_runs, strict=True)
                )
        log.info(
            "sample output: %r", tokenizer.decode(split_runs[0].tokens[0], skip_special_tokens=True)
        )
        tracker.summary(metrics)
        return metrics


def serve_role(settings: SplitInferenceRunConfig) -> dict[str, float]:
    from split_inference.serve import serve_role as serving  # the HTTP stack, for this role only

    return serving(settings)


EXPERIMENT = split_experiment("split_inference", run_driver, roles={"serve": serve_role})


def run(cfg: DictConfig | SplitInferenceRunConfig) -> dict[str, float]:
    return experiment.run(EXPERIMENT, cfg)
