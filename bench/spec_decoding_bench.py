"""Speculative decoding vs target-only vs HF assisted generation.

Run: `python bench/spec_decoding_bench.py [--quick]`.

One run, the same held-out prompts and the same tiny_target / tiny_draft pair (greedy, so every
method must produce the same tokens, which is checked):
  1. target-only greedy with Hugging Face `generate`, in this process;
  2. Hugging Face assisted generation (`generate(assistant_model=draft)`), in this process;
  3. ours: the verifier in its own process, the drafter here, over loopback, both in rounds
     (draft, then wait for the verdict) and pipelined (keep drafting while the verifier checks,
     the default), each with `gamma=auto`; with the speedup our cost model predicts for each;
  4. ours pipelined through the link emulator at 2, 10 and 50 ms one-way delay, fixed windows
     vs `auto`, and rounds with `auto` next to them.
Every process uses one thread, as if each were its own small machine. Prints a table, writes
bench/results/spec_decoding_bench.json, and ends with our loopback speedup over target-only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from lab import experiment
from lab.config import CONF_DIR, ModelConfig, default_cache_dir
from lab.corpus import held_out_prompts
from lab.machine import announce_machine, write_results
from lab.models import load_model, load_tokenizer
from netproto import Connection, LinkEmulatorProcess
from spec_decoding.config import SpecConfig  # also registers the schema `compose` needs
from spec_decoding.drafter import Drafter
from spec_decoding.gamma import GammaController
from spec_decoding.run import EXPERIMENT, summarize

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "spec_decoding_bench.json"
RUN_DIR = ROOT / "outputs" / "bench" / "spec_decoding"


def hf_generate(
    model: Any, prompts: list[list[int]], max_new: int, tokenizer: Any, **kwargs: Any
) -> tuple[list[list[int]], list[float]]:
    outputs, seconds = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        started = time.perf_counter()
        with torch.inference_mode():  # as our decoding runs: like for like
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                **kwargs,
            )
        seconds.append(time.perf_counter() - started)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs, seconds


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
) -> dict[str, Any]:
    with Connection.connect(*address, read_timeout_s=120) as conn:
        drafter = Drafter(
            draft,
            tokenizer,
            conn,
            gamma=GammaController(fixed=gamma, max_gamma=SpecConfig().max_gamma),
            pipeline=pipeline,
        )
        generations = [
            drafter.generate(prompt, max_new_tokens=max_new, seed=index)
            for index, prompt in enumerate(prompts)
        ]
    metrics = summarize(generations, baselines or [], greedy=True)
    row = {
        "outputs": [g.tokens for g in generations],
        "seconds": sum(g.seconds for g in generations),
        "acceptance": metrics["acceptance_rate"],
        "mean_gamma": metrics["mean_gamma"],
    }
    if baselines:
        row["predicted_speedup"] = metrics["predicted_speedup"]
        row["measured_over_predicted"] = metrics["measured_over_predicted"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and delays")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument(
        "--target",
        default="lab:tiny_target",
        help="hub id, local folder or lab: model (default: lab:tiny_target)",
    )
    parser.add_argument("--draft", default="lab:tiny_draft", help="same, for the draft model")
    args = parser.parse_args()
    machine = announce_machine()
    torch.set_num_threads(1)
    num_prompts, max_new = (2, 32) if args.quick else (4, 64)
    delays = (10,) if args.quick else (2, 10, 50)
    gammas = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32)

    target_cfg = ModelConfig(name="target", pretrained=args.target)
    draft_cfg = ModelConfig(name="draft", pretrained=args.draft)
    target = load_model(target_cfg, cache_dir=args.cache_dir)  # CUDA, MPS or CPU: detected
    draft = load_model(draft_cfg, cache_dir=args.cache_dir)
    tokenizer = load_tokenizer(draft_cfg, cache_dir=args.cache_dir)
    prompts = held_out_prompts(tokenizer, count=num_prompts, tokens=32)

    hf_generate(target, prompts[:1], 8, tokenizer)  # warm-up
    reference, target_s = hf_generate(target, prompts, max_new, tokenizer)
    assisted, assisted_s = hf_generate(target, prompts, max_new, tokenizer, assistant_model=draft)
    baselines = [
        {"tokens": out, "seconds": sec} for out, sec in zip(reference, target_s, strict=True)
    ]
    tokens = sum(len(o) for o in reference)
    rows: dict[str, dict[str, Any]] = {
        "target-only (HF generate)": {"tokens_per_s": tokens / sum(target_s)},
        "HF assisted generation": {
            "tokens_per_s": tokens / sum(assisted_s),
            "same_tokens": assisted == reference,
        },
    }
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="spec_decoding",
            overrides=[
                "num_threads=1",
                f"target.pretrained={args.target}",
                f"draft.pretrained={args.draft}",
                f"paths.cache_dir={args.cache_dir}",
                f"paths.run_dir={RUN_DIR}",
                "tracking.wandb=false",
            ],
        )

    def record(label: str, result: dict[str, Any]) -> None:
        rows[label] = {
            "tokens_per_s": tokens / result.pop("seconds"),
            "same_tokens": result.pop("outputs") == reference,
            **result,
        }
        print(f"{label}: {rows[label]['tokens_per_s']:.1f} tokens/s", file=sys.stderr)

    # the verifier started as `python -m spec_decoding` starts it, its log on stderr
    with experiment.serving(EXPERIMENT, cfg, out=sys.stderr) as (local, _):
        address = (local.cluster.verifier.host, local.cluster.verifier.port)
        for pipeline in (False, True):  # warm-up
            ours(address, draft, tokenizer, prompts[:1], 8, None, pipeline=pipeline)
        for pipeline, mode in ((False, "rounds"), (True, "pipelined")):
            record(
                f"ours, loopback, {mode}, auto",
                ours(
                    address,
                    draft,
                    tokenizer,
                    prompts,
                    max_new,
                    None,
                    pipeline=pipeline,
                    baselines=baselines,
                ),
            )
        for delay in delays:
            with LinkEmulatorProcess(address, delay_ms=delay) as link:
                run = (link.address, draft, tokenizer, prompts, max_new)
                for gamma in (*gammas, None):
                    name = "auto" if gamma is None else gamma
                    record(
                        f"ours, {delay} ms, pipelined, gamma={name}",
                        ours(*run, gamma, pipeline=True),
                    )
                record(f"ours, {delay} ms, rounds, gamma=auto", ours(*run, None, pipeline=False))

    base = rows["target-only (HF generate)"]["tokens_per_s"]
    print(f"{'method':<40}{'tokens/s':>10}{'vs target':>11}{'accept':>8}{'gamma':>7}  same")
    nan = float("nan")
    for label, row in rows.items():
        row["speedup"] = row["tokens_per_s"] / base
        print(
            f"{label:<40}{row['tokens_per_s']:>10.1f}{row['speedup']:>10.2f}x"
            f"{row.get('acceptance', nan):>8.2f}{row.get('mean_gamma', nan):>7.2f}"
            f"  {row.get('same_tokens', True)}"
        )
    for mode in ("rounds", "pipelined"):
        row = rows[f"ours, loopback, {mode}, auto"]
        print(
            f"{mode}: measured / predicted speedup {row['measured_over_predicted']:.2f} "
            f"(predicted {row['predicted_speedup']:.2f}x)"
        )
    auto_vs_best = {}
    for delay in delays:
        fixed = [rows[f"ours, {delay} ms, pipelined, gamma={g}"]["tokens_per_s"] for g in gammas]
        auto = rows[f"ours, {delay} ms, pipelined, gamma=auto"]["tokens_per_s"]
        auto_vs_best[delay] = auto / max(fixed)
        rounds = rows[f"ours, {delay} ms, rounds, gamma=auto"]["tokens_per_s"]
        print(
            f"{delay} ms: auto / best fixed window {auto_vs_best[delay]:.2f}; "
            f"pipelined / rounds {auto / rounds:.2f}"
        )
    headline = rows["ours, loopback, pipelined, auto"]
    ours_speedup = headline["speedup"]
    vs_assisted = headline["tokens_per_s"] / rows["HF assisted generation"]["tokens_per_s"]
    print(f"ours / HF assisted generation (loopback): {vs_assisted:.2f}x")
    write_results(
        RESULTS,
        {
            "rows": rows,
            "auto_vs_best_fixed": auto_vs_best,
            "prompts": num_prompts,
            "max_new_tokens": max_new,
        },
        machine=machine,
    )
    print(f"our speedup over target-only (loopback): {ours_speedup:.2f}x")


if __name__ == "__main__":
    main()
