"""Unsplit greedy decode per token, three ways side by side, against the memory floor (issue 58).

On one random-init Llama (`--shape 1b`: TinyLlama-1.1B's shape; `8b`: Llama-3-8B's; `tiny`: a
toy for a CPU), batch 1, a prompt of 32 random ids and 128 new tokens, greedy:

  (a) Hugging Face `generate`, eager (its dynamic cache, SDPA);
  (b) the lab's static-cache decoder (lab/static_decode.py), eager;
  (c) the same decoder with each decode step replayed from one `torch.cuda.CUDAGraph`;
  (d) the same, the step first through `torch.compile` (inductor, `--compile-mode`, fullgraph,
      static shapes) and the compiled kernels captured in the graph (compile seconds apart;
      `--no-compile` leaves (d) out). Without a GPU (d) runs compiled, eagerly.

Per-token time excludes the prompt: for (a) it is (time of `generate` for N new tokens - time for
1) / (N - 1), for (b) and (c) the decode loop after the first token, the device synchronised at
both ends; each the best of `--repeats` timed runs after a warm-up (and, for (c), the capture,
reported apart). Beside each row the floor: bytes read per token (every weight at the run's
dtype + the KV cache at the decode's mean position) / the card's bandwidth, measured as a
device-to-device copy of 2 GB, counting bytes read plus bytes written (4 GB) over its time.
Greedy agreement: (b) vs (c) and each vs (a), identical or the first position where they part;
with `--shape 1b` also a float32 model, fewer tokens, where (b) and (c) must be identical, and
last (if time is left) (d) against (b) in float32 too.

Imports torch, transformers and lab's hydra-free modules only (the GPU image lacks hydra).
Writes bench/results/decode_graph_bench_<shape>.json after each part (a killed run keeps what
finished) and prints the best graph variant / HF `generate` eager per token last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lab.device import skip_cudnn_attention
from lab.static_decode import StaticDecoder

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256},  # noqa: E501
    "1b": {"hidden": 2048, "layers": 22, "intermediate": 5632, "heads": 32, "kv_heads": 4, "vocab": 32000},  # noqa: E501
    "8b": {"hidden": 4096, "layers": 32, "intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256},  # noqa: E501
}  # fmt: skip
"""TinyLlama-1.1B (TinyLlama/TinyLlama-1.1B-Chat-v1.0) and Llama-3-8B's configs, random-init."""
COPY_BYTES = 2 * 10**9
D_GRAPH = "(d) static cache, compiled + CUDA graph"
D_EAGER = "(d) static cache, compiled (no graph)"


def describe_machine(device: torch.device) -> dict[str, Any]:
    import transformers

    machine: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        machine["gpu"] = props.name
        machine["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return machine


def build_llama(shape: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A random-init Llama of `shape`, made on `device` (seeded), cast to `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,  # no end: every run makes exactly the tokens asked for
        pad_token_id=None,
    )
    torch.manual_seed(0)
    try:
        with device:  # weights made where they run: an 8B in float32 on a CPU takes minutes
            model = LlamaForCausalLM(config)
    except Exception as exc:  # a transformers that refuses: built on the CPU
        print(f"built on the CPU, then moved ({type(exc).__name__}: {exc})", flush=True)
        model = LlamaForCausalLM(config).to(device)  # type: ignore[arg-type]
    return model.to(dtype).eval()  # type: ignore[arg-type]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, *, num_bytes: int, repeats: int = 10) -> dict[str, float]:
    """Bytes read + bytes written by a device-to-device copy of `num_bytes`, per second (median)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - started)
    median_s = sorted(times)[len(times) // 2]
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy_bytes": num_bytes, "copy_s": median_s, "bytes_per_s": 2 * num_bytes / median_s}


def bytes_per_token(model: Any, *, position: float) -> dict[str, float]:
    """What one decode step must read: every weight, and the KV cache up to `position`."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = config.hidden_size // config.num_attention_heads
    elem = next(model.parameters()).element_size()
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * position * elem
    return {"weight_bytes": weights, "kv_bytes": kv, "bytes": weights + kv}


@torch.no_grad()
def hf_generate(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    sync(ids.device)
    started = time.perf_counter()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
    )
    sync(ids.device)
    return time.perf_counter() - started, out[:, ids.shape[1] :].cpu()


def time_hf(model: Any, ids: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, Any]:
    hf_generate(model, ids, 8)  # warm-up
    one = min(hf_generate(model, ids, 1)[0] for _ in range(repeats))
    runs = [hf_generate(model, ids, new_tokens) for _ in range(repeats)]
    full = min(s for s, _ in runs)
    tokens = runs[0][1]
    assert tokens.shape[1] == new_tokens, tokens.shape
    return {
        "ms_per_token": 1000 * (full - one) / (new_tokens - 1),
        "prefill_ms": 1000 * one,
        "tokens": tokens,
    }


def time_static(
    model: Any,
    ids: torch.Tensor,
    new_tokens: int,
    repeats: int,
    *,
    graphs: bool,
    compile: bool = False,
    compile_mode: str = "default",
) -> dict[str, Any]:
    decoder = StaticDecoder(
        model,
        max_len=ids.shape[1] + new_tokens,
        graphs="on" if graphs else "off",
        compile=compile,
        compile_mode=compile_mode,
    )
    first = decoder.generate(ids, max_new_tokens=new_tokens)  # warm-up (and capture)
    runs = [decoder.generate(ids, max_new_tokens=new_tokens) for _ in range(repeats)]
    best = min(runs, key=lambda r: r.decode_s)
    for run in runs:
        assert torch.equal(run.tokens, first.tokens), "a replay differed from the first run"
    return {
        "ms_per_token": best.per_token_ms,
        "prefill_ms": 1000 * best.prefill_s,
        "capture_ms": 1000 * first.capture_s,
        **({"compile_s": first.compile_s} if compile else {}),
        "tokens": first.tokens,
    }


def agreement(a: torch.Tensor, b: torch.Tensor) -> str:
    """'identical', or where two greedy sequences first part."""
    if a.shape == b.shape and torch.equal(a, b):
        return "identical"
    length = min(a.shape[1], b.shape[1])
    parted = (a[:, :length] != b[:, :length]).any(dim=0).nonzero()
    first = int(parted[0]) if len(parted) else length
    return f"differ from new token {first} of {max(a.shape[1], b.shape[1])}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--float32-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="the JSON (bench/results/...)")
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out (d), the compiled step"
    )
    parser.add_argument(
        "--compile-mode",
        choices=("default", "max-autotune-no-cudagraphs"),
        default="default",
        help="inductor's mode for (d)",
    )
    parser.add_argument(
        "--no-float32-compiled",
        action="store_true",
        help="skip the float32 check of (d) against (b) (1b / tiny only; a second compile)",
    )
    args = parser.parse_args(argv)
    out = args.out or RESULTS / f"decode_graph_bench_{args.shape}.json"
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    skip_cudnn_attention()  # as the lab's processes do on a GPU: flash / memory-efficient SDPA
    results: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": describe_machine(device),
        "shape": args.shape,
        "dims": SHAPES[args.shape],
        "dtype": str(dtype).removeprefix("torch."),
        "batch": 1,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "compile": None if args.no_compile else args.compile_mode,
        "errors": {},
    }
    print("machine: " + ", ".join(f"{k} {v}" for k, v in results["machine"].items()), flush=True)

    def part(name: str, work: Callable[[], None]) -> None:
        started = time.perf_counter()
        try:
            work()
        except Exception as exc:  # one part failing leaves the others' figures
            traceback.print_exc()
            results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"-- {name}: FAILED: {results['errors'][name][:300]}", flush=True)
        finally:
            results.setdefault("part_s", {})[name] = round(time.perf_counter() - started, 1)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2, default=str))

    state: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape]["vocab"]
    ids = torch.randint(0, vocab, (1, args.prompt_tokens), generator=gen).to(device)

    def bandwidth() -> None:
        num_bytes = COPY_BYTES if cuda else COPY_BYTES // 20
        results["bandwidth"] = copy_bandwidth(device, num_bytes=num_bytes)
        bw = results["bandwidth"]
        print(
            f"copy test: {num_bytes / 1e9:.2f} GB copied device to device, (read + written) "
            f"{2 * num_bytes / 1e9:.2f} GB / {bw['copy_s'] * 1e3:.3f} ms (median of 10) = "
            f"{bw['bytes_per_s'] / 1e12:.3f} TB/s",
            flush=True,
        )

    def float32_identity() -> None:
        model = build_llama(args.shape, device, torch.float32)
        n = args.float32_new_tokens
        eager = time_static(model, ids, n, 1, graphs=False)["tokens"]
        hf = time_hf(model, ids, n, 1)["tokens"]
        check = {"new_tokens": n, "static_eager_vs_hf": agreement(eager, hf)}
        if cuda:
            graph = time_static(model, ids, n, 1, graphs=True)["tokens"]
            check["graph_vs_static_eager"] = agreement(graph, eager)
        results["float32"] = check
        state["float32_eager"] = eager
        print(
            f"float32, {n} new tokens: " + ", ".join(f"{k} {v}" for k, v in check.items()),
            flush=True,
        )
        del model
        if cuda:
            torch.cuda.empty_cache()

    def float32_compiled_identity() -> None:
        n, eager = args.float32_new_tokens, state["float32_eager"]
        model = build_llama(args.shape, device, torch.float32)
        compiled = time_static(
            model, ids, n, 1, graphs=cuda, compile=True, compile_mode=args.compile_mode
        )
        label = "compiled_graph_vs_static_eager" if cuda else "compiled_vs_static_eager"
        results["float32"][label] = agreement(compiled["tokens"], eager)
        results["float32"]["compiled_compile_s"] = compiled["compile_s"]
        print(
            f"float32, {n} new tokens: {label} {results['float32'][label]} "
            f"(compiled in {compiled['compile_s']:.1f}s)",
            flush=True,
        )
        del model
        if cuda:
            torch.cuda.empty_cache()

    def build() -> None:
        started = time.perf_counter()
        state["model"] = build_llama(args.shape, device, dtype)
        sync(device)
        results["build_s"] = round(time.perf_counter() - started, 1)
        position = args.prompt_tokens + args.new_tokens / 2
        results["bytes_per_token"] = bytes_per_token(state["model"], position=position)
        b = results["bytes_per_token"]
        print(
            f"model built in {results['build_s']}s: weights {b['weight_bytes'] / 1e9:.3f} GB, "
            f"KV cache at the mean position {position:.0f} {b['kv_bytes'] / 1e6:.2f} MB",
            flush=True,
        )

    rows: dict[str, dict[str, Any]] = {}

    def row(name: str, timing: Callable[[], dict[str, Any]]) -> Callable[[], None]:
        def work() -> None:
            rows[name] = timing()
            shown = {k: v for k, v in rows[name].items() if k != "tokens"}
            results.setdefault("rows", {})[name] = shown
            print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in shown.items()), flush=True)

        return work

    def table() -> None:
        floor_ms = None
        if "bandwidth" in results and "bytes_per_token" in results:
            floor_ms = (
                1000 * results["bytes_per_token"]["bytes"] / results["bandwidth"]["bytes_per_s"]
            )
            results["floor_ms_per_token"] = floor_ms
        hf = rows.get("(a) HF generate eager")
        print(
            f"\n{'decode, ' + args.shape + ' ' + results['dtype']:<40} {'ms/token':>9} "
            f"{'floor ms':>9} {'x floor':>8} {'vs (a)':>7}"
        )
        for name, r in rows.items():
            ms = r["ms_per_token"]
            vs_floor = f"{ms / floor_ms:8.1f}" if floor_ms else f"{'-':>8}"
            vs_hf = f"{ms / hf['ms_per_token']:7.3f}" if hf else f"{'-':>7}"
            floor = f"{floor_ms:9.3f}" if floor_ms else f"{'-':>9}"
            print(f"{name:<40} {ms:9.3f} {floor} {vs_floor} {vs_hf}")
        names = list(rows)
        agree = {
            f"{x} vs {y}": agreement(rows[x]["tokens"], rows[y]["tokens"])
            for i, x in enumerate(names)
            for y in names[i + 1 :]
        }
        results["greedy_agreement"] = agree
        for pair, verdict in agree.items():
            print(f"greedy {results['dtype']}: {pair}: {verdict}")

    part("bandwidth", bandwidth)
    if args.shape in ("1b", "tiny"):
        part("float32 identity", float32_identity)
    part("build", build)
    if "model" in state:
        model, n, r = state["model"], args.new_tokens, args.repeats
        part(
            "(a) HF generate eager", row("(a) HF generate eager", lambda: time_hf(model, ids, n, r))
        )
        part(
            "(b) static cache eager",
            row("(b) static cache eager", lambda: time_static(model, ids, n, r, graphs=False)),
        )
        if cuda:
            part(
                "(c) static cache, CUDA graph",
                row(
                    "(c) static cache, CUDA graph",
                    lambda: time_static(model, ids, n, r, graphs=True),
                ),
            )
        else:
            print("(c) static cache, CUDA graph: skipped, no CUDA device", flush=True)
        if not args.no_compile:
            name = D_GRAPH if cuda else D_EAGER
            part(
                name,
                row(
                    name,
                    lambda: time_static(
                        model, ids, n, r, graphs=cuda, compile=True, compile_mode=args.compile_mode
                    ),
                ),
            )
    part("table", table)
    state.pop("model", None)
    model = None  # the rows' closures hold it too: free the bf16 model before the float32 one
    if cuda:
        torch.cuda.empty_cache()
    if not args.no_compile and not args.no_float32_compiled and "float32_eager" in state:
        part("float32 compiled identity", float32_compiled_identity)
    a = rows.get("(a) HF generate eager")
    graphs = {k: rows[k] for k in ("(c) static cache, CUDA graph", D_GRAPH) if k in rows}
    if graphs:
        best = min(graphs, key=lambda k: graphs[k]["ms_per_token"])
        label = f"best graph variant {best}"
    else:
        best = D_EAGER if D_EAGER in rows else "(b) static cache eager"
        label = f"{best}, no GPU"
    last = rows.get(best)
    if a and last:
        ratio = last["ms_per_token"] / a["ms_per_token"]
        results["headline"] = {"ratio": ratio, "of": f"{label} / HF generate eager"}
        out.write_text(json.dumps(results, indent=2, default=str))
        print(
            f"{label} / HF generate eager per token, {args.shape} "
            f"{results['machine'].get('gpu', 'cpu')}: {ratio:.3f}x "
            f"({last['ms_per_token']:.3f} vs {a['ms_per_token']:.3f} ms)",
            flush=True,
        )
    else:
        print(f"no ratio: parts failed: {sorted(results['errors'])}", flush=True)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
