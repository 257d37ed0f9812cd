"""Split inference and training: what the cut costs and what pipelining buys, in one run.

Same random-init Llama models (the lab tokenizer), same prompts, on this machine:

1. per-token decode latency, 2-stage split over loopback vs the unsplit model (same driver
   process, same decode loop, same prompts) - target: split at most 1.3x;
2. split with a KV cache in every stage vs recomputing the prefix every step, per-token latency
   when the sequence reaches 256 tokens - target: the cache at least 5x faster (the mean over
   the whole generation, 32 to 256 tokens, is printed too);
3. peak memory (RSS) of each stage process vs one process running the unsplit model, on a model
   whose weights dominate memory - target: each stage at most 0.65x;
4. training throughput with 4 pipelined micro-batches vs none, each stage process on one thread
   as if it were its own machine - target: at least 1.3x.

Prints a table, writes bench/results/split_bench.json, and ends with the split/unsplit
per-token latency ratio. `--quick` shrinks every part.

`--profile` instead says where a split token's time goes (`profile`, below); with `--shape 1b`
on a GPU, that is the 1.1B split's 7.3x on the H100 looked into.
"""

from __future__ import annotations

import argparse
import itertools
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from lab.config import ModelConfig, default_cache_dir
from lab.machine import announce_machine, write_results
from lab.models import load_model
from lab.tracking import METRICS_FILE, read_records

RESULTS = Path(__file__).resolve().parent / "results" / "split_bench.json"
RUNS = Path("outputs/bench/split")
CACHE = default_cache_dir()


SHAPE_1B = {
    "hidden": 2048,
    "layers": 22,
    "intermediate": 5632,
    "heads": 32,
    "kv_heads": 4,
    "vocab": 32000,
}
"""TinyLlama-1.1B's config (hub id TinyLlama/TinyLlama-1.1B-Chat-v1.0), built random-init:
`--shape 1b`, for a GPU (make gpu-check)."""


def random_llama(
    folder: Path,
    *,
    hidden: int,
    layers: int,
    context: int,
    tokenizer_from: Path,
    intermediate: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    vocab: int | None = None,
) -> Path:
    """A random-init Llama saved as an HF folder (built once per shape, then reused)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "model.safetensors").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(
        vocab_size=max(vocab or 0, len(tokenizer)),
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=layers,
        num_attention_heads=heads or max(1, hidden // 64),
        num_key_value_heads=kv_heads or heads or max(1, hidden // 64),
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(
        f"built {folder.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params",
        file=sys.stderr,
    )
    return folder


def run_module(module: str, name: str, overrides: list[str]) -> dict[str, float]:
    """`python -m <module> <overrides>`, as a user runs it: a driver process of its own per run
    (torch keeps one RRef context per process, spent at its first RPC shutdown: a driver that
    joined a second world in the same process could no longer delete its RRefs, and every
    stage would report them leaked). Returns the run's summary metrics."""
    run_dir = (RUNS / name).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", module, f"hydra.run.dir={run_dir}", "tracking.wandb=false",
         "tracking.console=false", f"paths.cache_dir={CACHE}", *overrides],
        check=True,
    )  # fmt: skip
    print(f"{name}: {time.perf_counter() - started:.0f}s", file=sys.stderr)
    summaries = [r for r in read_records(run_dir / METRICS_FILE) if r.get("kind") == "summary"]
    return {k: v for k, v in summaries[-1].items() if k != "kind"}


def unsplit_peak_rss_mib(folder: Path, new_tokens: int) -> float:
    """Peak RSS of a fresh process that loads the whole model and generates (the baseline)."""
    out = subprocess.run(
        [sys.executable, __file__, "--unsplit-peak", str(folder), "--tokens", str(new_tokens)],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _unsplit_peak_main(folder: Path, new_tokens: int) -> None:
    from split_engine.generation import UnsplitModel, decode

    model = load_model(ModelConfig(name="unsplit", pretrained=str(folder)), cache_dir=CACHE)
    ids = torch.randint(3, model.config.vocab_size, (1, 32))
    decode(UnsplitModel(model), ids, torch.ones_like(ids), max_new_tokens=new_tokens)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


class InProcessChain:
    """The stages of a split model chained in this process, no RPC between them: what the cut
    itself costs (each stage's own mask, cache and copy to the CPU), without a process boundary.
    Same `StepModel` interface as the split and unsplit models, for `decode`."""

    def __init__(self, folder: Path, boundaries: list[int], num_layers: int) -> None:
        from split_engine import handshake
        from split_engine.stage import Stage

        # a stage refuses work before a driver proved itself over RPC; here this process is
        # the driver and both stages, so the proof is given (this process serves no one)
        handshake._auth.driver_proved = True
        fields = {"name": "profiled", "pretrained": str(folder)}
        edges = [0, *boundaries, num_layers]
        self.stages = [Stage(fields, start=a, end=b) for a, b in itertools.pairwise(edges)]
        self._next = 0

    def new_request(self, sampling: Any, *, kv_cache: bool) -> int:
        self._next += 1
        for stage in self.stages:
            stage.open_request(self._next, sampling.as_dict(), kv_cache)
        return self._next

    def next_token(
        self, feed: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *,
        request: int,
    ) -> torch.Tensor:  # fmt: skip
        x = feed
        for stage in self.stages[:-1]:
            x = stage.forward(x, attention_mask, position_ids, request=request)
        return self.stages[-1].forward(x, attention_mask, position_ids, request=request, pick=True)

    def end_request(self, request: int) -> None:
        for stage in self.stages:
            stage.end_request(request)


def _per_token_ms(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    """Median ms of a decode step after the prefill (KV cache), and the tokens."""
    from split_engine.generation import decode

    decode(model, ids, torch.ones_like(ids), max_new_tokens=4)  # warm-up
    generation = decode(model, ids, torch.ones_like(ids), max_new_tokens=new_tokens)
    return sorted(generation.step_s)[len(generation.step_s) // 2] * 1e3, generation.tokens


def _operator_table(model: Any, ids: torch.Tensor, tokens: int, out: Path, label: str) -> str:
    """torch.profiler over a short generation: the top operators by self time (CUDA where
    there is one), as a table, also written to `out`; a Chrome trace beside it."""
    from torch.profiler import ProfilerActivity, profile

    from split_engine.generation import decode

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        decode(model, ids, torch.ones_like(ids), max_new_tokens=tokens)
    table = prof.key_averages().table(
        sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=15
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ops_{label}.txt").write_text(table)
    prof.export_chrome_trace(str(out / f"trace_{label}.json"))
    return table


def profile(folder: Path, *, tokens: int, out: Path) -> dict[str, float]:
    """Where a split token's time goes, three ways side by side on the same model and prompt:
    the unsplit model in this process; the same two stages chained in this process (the cut
    without RPC); the split run (`python -m split_inference`, two stage processes over RPC on
    loopback), with each stage's own forward time and the rest. Then torch.profiler's top
    operators of the unsplit and the chained decode."""
    from transformers import AutoConfig

    from split_engine.generation import UnsplitModel

    num_layers = AutoConfig.from_pretrained(folder).num_hidden_layers
    ids = torch.randint(3, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
    split = run_module(
        "split_inference",
        "profile",
        [f"model.pretrained={folder}", "generate.num_prompts=2", "generate.batch_size=1",
         f"generate.max_new_tokens={tokens}"],
    )  # fmt: skip
    unsplit = UnsplitModel(
        load_model(ModelConfig(name="unsplit", pretrained=str(folder)), cache_dir=CACHE)
    )
    unsplit_ms, unsplit_tokens = _per_token_ms(unsplit, ids, tokens)
    unsplit_ops = _operator_table(unsplit, ids, 8, out, "unsplit")
    del unsplit
    chain = InProcessChain(folder, [num_layers // 2], num_layers)
    chain_ms, chain_tokens = _per_token_ms(chain, ids, tokens)
    compute = [statistics.median(s.compute_s) * 1e3 for s in chain.stages]
    threaded: list[float] = []  # RPC runs a call in one of its worker threads: the same there
    worker = threading.Thread(target=lambda: threaded.append(_per_token_ms(chain, ids, tokens)[0]))
    worker.start()
    worker.join()
    chain_ops = _operator_table(chain, ids, 8, out, "chained")
    figures = {
        "unsplit_token_ms": unsplit_ms,
        "chained_token_ms": chain_ms,
        "chained_stage1_ms": compute[0],
        "chained_stage2_ms": compute[1],
        "chained_same_tokens": float(torch.equal(chain_tokens, unsplit_tokens)),
        "chained_in_a_thread_token_ms": threaded[0],
        "split_token_ms": split["token_ms_p50"],
        "split_unsplit_token_ms": split["unsplit_token_ms_p50"],
        "split_stage1_ms": split["stage1_compute_ms_p50"],
        "split_stage2_ms": split["stage2_compute_ms_p50"],
        "split_outside_stages_ms": split["outside_stages_ms_p50"],
    }
    print("== torch.profiler, unsplit, 8 tokens\n" + unsplit_ops)
    print("== torch.profiler, two stages chained in process, 8 tokens\n" + chain_ops)
    print(f"{'per decode token (median)':<52}{'ms':>8}{'vs unsplit':>12}")
    for label, ms in (
        ("unsplit, this process", unsplit_ms),
        ("two stages chained in this process, no RPC", chain_ms),
        ("  of which stage 1's forward", compute[0]),
        ("  of which stage 2's forward", compute[1]),
        ("the same, run from another thread", threaded[0]),
        ("split over RPC (python -m split_inference)", split["token_ms_p50"]),
        ("  of which stage 1's forward", split["stage1_compute_ms_p50"]),
        ("  of which stage 2's forward", split["stage2_compute_ms_p50"]),
        ("  outside the stages' forwards (hops, loop)", split["outside_stages_ms_p50"]),
        ("  unsplit, in the split run's driver", split["unsplit_token_ms_p50"]),
    ):
        print(f"{label:<52}{ms:>8.2f}{ms / unsplit_ms:>11.2f}x")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer tokens")
    parser.add_argument(
        "--shape",
        choices=("default", "1b"),
        default="default",
        help="1b: every part on a random-init TinyLlama-1.1B shape (for a GPU: make gpu-check)",
    )
    parser.add_argument("--models", type=Path, default=CACHE / "bench_models")
    parser.add_argument("--results", type=Path, default=None,
                        help=f"where the JSON results go (default: {RESULTS})")  # fmt: skip
    parser.add_argument(
        "--profile",
        action="store_true",
        help="only where a split token's time goes (unsplit, chained in process, over RPC)",
    )
    parser.add_argument("--unsplit-peak", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.unsplit_peak:
        _unsplit_peak_main(args.unsplit_peak, args.tokens)
        return
    machine = announce_machine()

    from lab.models import resolve_source

    tokenizer_from = Path(resolve_source(ModelConfig(), cache_dir=CACHE))
    medium = random_llama(
        args.models / ("llama-256x4" if args.quick else "llama-512x8"),
        hidden=256 if args.quick else 512,
        layers=4 if args.quick else 8,
        context=512,
        tokenizer_from=tokenizer_from,
    )
    big = random_llama(
        args.models / ("llama-512x8" if args.quick else "llama-1024x24"),
        hidden=512 if args.quick else 1024,
        layers=8 if args.quick else 24,
        context=512,
        tokenizer_from=tokenizer_from,
    )
    if args.shape == "1b":
        medium = big = random_llama(
            args.models / "llama-1b-tinyllama-shape",
            context=2048,
            tokenizer_from=tokenizer_from,
            **SHAPE_1B,
        )
    if args.profile:
        figures = profile(
            medium, tokens=16 if args.quick else 64, out=RUNS.resolve() / "profile_ops"
        )
        write_results(
            args.results or RESULTS.with_name(f"split_profile_{args.shape}.json"),
            {"figures": figures, "quick": args.quick, "shape": args.shape},
            machine=machine,
        )
        print(
            "split over RPC / unsplit per token: "
            f"{figures['split_token_ms'] / figures['unsplit_token_ms']:.2f}x; chained in process "
            f"/ unsplit: {figures['chained_token_ms'] / figures['unsplit_token_ms']:.2f}x"
        )
        return
    rows: dict[str, dict[str, Any]] = {}

    # 1. Per-token latency, split vs unsplit, in one run (the driver times both).
    latency = run_module(
        "split_inference",
        "latency",
        [
            f"model.pretrained={medium}",
            "generate.num_prompts=4",
            "generate.batch_size=1",
            f"generate.max_new_tokens={16 if args.quick else 64}",
        ],
    )
    rows["decode latency"] = {
        "ours": latency["token_ms_p50"],
        "baseline": latency["unsplit_token_ms_p50"],
        "unit": "ms/token (p50)",
        "ratio": latency["latency_ratio"],
        "target": "<= 1.3",
        "same_tokens": latency["greedy_match"] == 1.0,
    }

    # 1b. The fenced default's channel (basic: tensors inline on TensorPipe's one connection,
    # no listener but its own) vs TensorPipe's own choice (auto: cma's direct copy between
    # processes of one machine, mpt_uv's 16 lane listeners a process), alternated.
    channel_ms: dict[str, list[float]] = {"basic": [], "auto": []}
    for repeat, channels in itertools.product(range(1 if args.quick else 2), ("basic", "auto")):
        measured = run_module(
            "split_inference",
            f"channels_{channels}_{repeat}",
            [
                f"model.pretrained={medium}",
                "generate.num_prompts=4",
                "generate.batch_size=1",
                "generate.baseline=false",
                f"generate.max_new_tokens={16 if args.quick else 64}",
                f"split.channels={channels}",
            ],
        )
        channel_ms[channels].append(measured["token_ms_p50"])
    rows["decode, channels basic (default) vs auto"] = {
        "ours": statistics.median(channel_ms["basic"]),
        "baseline": statistics.median(channel_ms["auto"]),
        "unit": "ms/token (p50, median of runs)",
        "ratio": statistics.median(channel_ms["basic"]) / statistics.median(channel_ms["auto"]),
        "target": "",
        "runs": channel_ms,
    }

    # 2. KV cache vs recomputing the prefix, up to 256 tokens of sequence.
    new = 64 if args.quick else 224
    cache_runs = {
        kv: run_module(
            "split_inference",
            f"kv_{kv}",
            [
                f"model.pretrained={medium}",
                "generate.num_prompts=1",
                "generate.batch_size=1",
                "generate.baseline=false",
                f"generate.max_new_tokens={new}",
                f"generate.kv_cache={str(kv).lower()}",
            ],
        )
        for kv in (True, False)
    }
    rows[f"KV cache vs recompute, at {32 + new} tokens"] = {
        "ours": cache_runs[True]["token_ms_last"],
        "baseline": cache_runs[False]["token_ms_last"],
        "unit": "ms/token (last 8 steps)",
        "ratio": cache_runs[False]["token_ms_last"] / cache_runs[True]["token_ms_last"],
        "target": ">= 5",
    }
    rows[f"KV cache vs recompute, 32 to {32 + new} tokens"] = {
        "ours": cache_runs[True]["tokens_per_s"],
        "baseline": cache_runs[False]["tokens_per_s"],
        "unit": "tokens/s (whole generation)",
        "ratio": cache_runs[True]["tokens_per_s"] / cache_runs[False]["tokens_per_s"],
        "target": "",
    }

    # 3. Peak memory per stage vs one unsplit process.
    memory = run_module(
        "split_inference",
        "memory",
        [
            f"model.pretrained={big}",
            "generate.num_prompts=1",
            "generate.batch_size=1",
            "generate.baseline=false",
            "generate.max_new_tokens=4",
        ],
    )
    unsplit_mib = unsplit_peak_rss_mib(big, 4)
    for rank in (1, 2):
        stage_mib = memory[f"stage{rank}_peak_rss_mib"]
        rows[f"peak RSS, stage {rank} / unsplit"] = {
            "ours": stage_mib,
            "baseline": unsplit_mib,
            "unit": "MiB",
            "ratio": stage_mib / unsplit_mib,
            "target": "<= 0.65",
        }

    # 4. Training throughput, 4 pipelined micro-batches vs 1, one thread per stage.
    training = {
        m: run_module(
            "split_training",
            f"train_m{m}",
            [
                f"model.pretrained={medium}",
                "num_threads=1",
                f"split.microbatches={m}",
                "split.batch_size=8",
                f"split.block_size={64 if args.quick else 128}",
                f"split.steps={3 if args.quick else 8}",
                "split.checkpoint_every=0",
                "split.max_train_blocks=256",
            ],
        )
        for m in (1, 4)
    }
    rows["training, m=4 vs m=1"] = {
        "ours": training[4]["tokens_per_s"],
        "baseline": training[1]["tokens_per_s"],
        "unit": "tokens/s",
        "ratio": training[4]["tokens_per_s"] / training[1]["tokens_per_s"],
        "target": ">= 1.3",
        "idle_share_m4": training[4]["idle_share"],
        "idle_share_gpipe_m4": training[4]["idle_share_gpipe"],
        "idle_share_m1": training[1]["idle_share"],
    }

    print(f"{'measure':<42}{'ours':>10}{'baseline':>10}{'ratio':>8}  {'target':<8} unit")
    for label, row in rows.items():
        print(
            f"{label:<42}{row['ours']:>10.1f}{row['baseline']:>10.1f}{row['ratio']:>8.2f}"
            f"  {row['target']:<8} {row['unit']}"
        )
    t4 = rows["training, m=4 vs m=1"]
    print(
        f"stage idle share with m=4: {t4['idle_share_m4']:.2f} measured vs "
        f"{t4['idle_share_gpipe_m4']:.2f} GPipe's (p-1)/(m+p-1); m=1: {t4['idle_share_m1']:.2f}"
    )
    default = RESULTS.with_name("split_bench_1b.json") if args.shape == "1b" else RESULTS
    write_results(
        args.results or default,
        {"rows": rows, "quick": args.quick, "shape": args.shape},
        machine=machine,
    )
    print(f"split/unsplit per-token latency: {rows['decode latency']['ratio']:.2f}x")


if __name__ == "__main__":
    main()
