"""`role=rank`: one rank of a tensor-parallel job, and what rank 0 measures and writes.

Every rank joins the group (tensor_parallel.group), loads its shards (tensor_parallel.shard)
and generates the prompts' batch together with the others, `tp.repeats` times after a warm-up.
Rank 0 alternates each generation with the unsplit model's on its own cores while the other
ranks wait at a barrier (the baseline: the same prompts, same settings), then writes the run's
records: tokens/s, ms a token, the ratio, bytes all-reduced a token, the collectives' share,
memory per rank, and whether greedy output matched the unsplit model's.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lab.device import resolve_dtype
from lab.models import load_tokenizer, resolve_source
from lab.tracking import Tracker
from tensor_parallel.config import TensorParallelRunConfig, parse_cpus
from tensor_parallel.decode import Generation, generate, left_padded, same_on_every_rank
from tensor_parallel.group import Group, tp_group
from tensor_parallel.shard import ShardedModel, load_sharded

log = logging.getLogger(__name__)

JOB = "tensor_parallel"


def pin_cores(text: str) -> list[int]:
    """Run this process on the cores `text` lists (none: all it may use); returns them."""
    if text and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, parse_cpus(text))
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def first_divergence(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[int, int] | None:
    """(row, position) of the first token where two (B, N) generations differ, or None."""
    differ = (ours != theirs).nonzero()
    if not len(differ):
        return None
    position = int(differ[:, 1].min())
    row = int(differ[differ[:, 1] == position][0, 0])
    return row, position


def top2_margin(logits: torch.Tensor) -> float:
    """The gap between the two largest logits of a (V,) row."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def _gen(
    model: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    settings: Any,
    seed: int,
    sync: Any,
    keep: bool = False,
    after_prefill: Any = lambda: None,
) -> Generation:
    tp = settings.tp
    return generate(
        model,
        *batch,
        max_new_tokens=tp.max_new_tokens,
        temperature=tp.temperature,
        top_p=tp.top_p,
        seed=seed,
        keep_logits=keep,
        sync=sync,
        after_prefill=after_prefill,
    )


def run_rank(settings: TensorParallelRunConfig) -> dict[str, float]:
    """This rank's part of the job; rank 0 returns the run's metrics (the others: {})."""
    tp = settings.tp
    cores = pin_cores(tp.cpus)
    logging.basicConfig(level=logging.INFO, format=f"[rank{tp.rank}] %(levelname)s: %(message)s")
    log.info("rank %d of %d on cores %s", tp.rank, tp.ranks, cores)
    folder = Path(resolve_source(settings.model, cache_dir=settings.paths.cache_path))
    with tp_group(
        settings.cluster, rank=tp.rank, ranks=tp.ranks, timeout_s=tp.join_timeout_s
    ) as group:
        return _measure(settings, group, folder, cores)


def _measure(settings: Any, group: Group, folder: Path, cores: list[int]) -> dict[str, float]:
    tp = settings.tp
    dtype = resolve_dtype(settings.model.dtype, group.device)
    seed = torch.tensor([settings.seed])
    dist.broadcast(seed, src=0)  # rank 0's seed, for every rank's sampler
    sharded = load_sharded(
        folder,
        rank=group.rank,
        ranks=group.ranks,
        engine=tp.engine,
        dtype=dtype,
        device=group.device,
        mesh=group.mesh,
        progress=log.info,
    )
    tokenizer = load_tokenizer(settings.model, cache_dir=settings.paths.cache_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = left_padded([tokenizer(p)["input_ids"] for p in tp.prompts], pad)
    unsplit = _unsplit(folder, dtype, group) if group.rank == 0 and tp.baseline else None
    ours, theirs = [], []
    sync = group.sync
    for repeat in range(tp.repeats + 1):  # the first: warm-up
        sharded.collectives.reset()
        started = time.perf_counter()
        generation = _gen(
            sharded.model,
            batch,
            settings,
            int(seed),
            sync,
            keep=True,
            after_prefill=sharded.collectives.reset,
        )  # decode steps' alone
        wall = time.perf_counter() - started
        if repeat:
            ours.append(
                (
                    generation,
                    wall,
                    sharded.collectives.seconds,
                    sharded.collectives.count,
                    sharded.collectives.nbytes,
                )
            )
        if tp.baseline:
            if unsplit is not None:
                theirs.append(_gen(unsplit, batch, settings, int(seed), sync, keep=True))
            dist.barrier()  # the other ranks idle while rank 0 runs the unsplit model
    same_ranks = same_on_every_rank(ours[-1][0].tokens)
    bytes_per_rank = torch.tensor([sharded.param_bytes], dtype=torch.float64)
    gathered = [torch.zeros_like(bytes_per_rank) for _ in range(group.ranks)]
    dist.all_gather(gathered, bytes_per_rank)
    if group.rank != 0:
        return {}
    metrics = _metrics(settings, sharded, ours, theirs[1:] if theirs else [], unsplit)
    metrics |= {
        "same_tokens_on_every_rank": float(same_ranks),
        "weights_mib_per_rank": max(float(g) for g in gathered) / 2**20,
        "peak_rss_mib_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cores_per_rank": float(len(cores)),
    }
    if group.device.type == "cuda":
        metrics["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(group.device) / 2**20
    metrics["batch"] = float(len(tp.prompts))
    with Tracker.from_settings(settings, job=JOB) as tracker:
        tracker.outputs(
            {"prompt": prompt, "tokens": tokens.tolist()}
            for prompt, tokens in zip(tp.prompts, ours[-1][0].tokens, strict=True)
        )
        tracker.summary(metrics)
    return metrics


def _unsplit(folder: Path, dtype: torch.dtype, group: Group) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(group.device)  # type: ignore[arg-type]
    return model.eval()


def _metrics(
    settings: Any, sharded: ShardedModel, ours: list, theirs: list[Generation], unsplit: Any
) -> dict[str, float]:
    """The run's figures from the measured generations (warm-up left out)."""
    tp = settings.tp
    batch = len(tp.prompts)
    steps = [s for g, *_ in ours for s in g.token_s]
    pooled = Generation(ours[-1][0].tokens, steps, 0.0)
    decode_steps = sum(len(g.token_s) for g, *_ in ours)  # the collectives counted after prefill
    comm_s = sum(c for _, _, c, _, _ in ours)
    count = sum(n for *_, n, _ in ours)
    nbytes = sum(b for *_, b in ours)
    busy_s = sum(sum(g.token_s) for g, *_ in ours)
    metrics = {
        "ranks": float(tp.ranks),
        "token_ms": pooled.median_ms,
        "token_ms_p95": pooled.ms(0.95),
        "tokens_per_s": 1e3 * batch / pooled.median_ms,
        "allreduces_per_token": count / decode_steps,
        "allreduce_bytes_per_token": nbytes / decode_steps / batch,  # per prompt's token
    }
    if sharded.engine == "local":
        metrics["collective_share"] = comm_s / busy_s
        # a step in its two parts (means): in the all-reduces, and the compute between them
        metrics["collective_ms_per_token"] = 1e3 * comm_s / decode_steps
        metrics["compute_ms_per_token"] = 1e3 * (busy_s - comm_s) / decode_steps
        # this thread's CPU in a step (its compute; a wait costs none): compute that takes longer
        # than its CPU waited for a core
        cpu_s = sum(sum(g.token_cpu_s) for g, *_ in ours)
        metrics["compute_cpu_ms_per_token"] = 1e3 * cpu_s / decode_steps
    if theirs:
        base = Generation(theirs[-1].tokens, [s for g in theirs for s in g.token_s], 0.0)
        metrics |= {
            "unsplit_token_ms": base.median_ms,
            "unsplit_tokens_per_s": 1e3 * batch / base.median_ms,
            "speedup": base.median_ms / pooled.median_ms,
            "unsplit_weights_mib": sum(p.numel() * p.element_size() for p in unsplit.parameters())
            / 2**20,
        }
        if tp.temperature == 0:
            metrics |= _exactness(ours[-1][0], theirs[-1])
    return metrics


def _exactness(ours: Generation, theirs: Generation) -> dict[str, float]:
    """Greedy output against the unsplit model's: same, or where it first differs with the
    unsplit model's top-2 margin there (a near tie that rounding may break)."""
    where = first_divergence(ours.tokens, theirs.tokens)
    upto = len(ours.step_logits) if where is None else where[1] + 1  # the same context so far
    worst = max(
        float((a - b).abs().max())
        for a, b in zip(ours.step_logits[:upto], theirs.step_logits[:upto], strict=True)
    )
    out = {"same_greedy_tokens": float(where is None), "max_logit_diff": worst}
    if where is not None:
        row, position = where
        out |= {
            "diverged_at": float(position),
            "unsplit_top2_margin": top2_margin(theirs.step_logits[position][row]),
        }
    return out
