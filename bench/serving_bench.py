"""Serving under load: the split model with several requests in flight, against the unsplit
model served by transformers' continuous batching, all behind the lab's OpenAI-compatible
endpoint and driven by the official `openai` client.

Rows (one run, same model, same prompts, same clients):
- `pipelined`: the split, 2 stages, `split.micro_batches=2` (stage 1 computes one micro-batch
  while stage 2 computes the other);
- `one in flight`: the same split, `split.micro_batches=1` (every active request in one
  micro-batch: batching only);
- `unsplit CB`: the whole model in one process, transformers' continuous batching
  (`init_continuous_batching`: a maintained engine) behind the same endpoint.

Hosts own their cores: "host 1" (the serve role / driver and stage 1; the unsplit server) and
"host 2" (stage 2) each get their own core by `taskset`, the assignment `--cores-per-host`
makes (labtools.hosts.network.host_cpus), over loopback (no namespaces: the hop is loopback's);
every process runs torch on one thread. The clients are threads of this process and run on both
hosts' cores: they have no core of their own (a 2-core machine has none to spare), so they share
the cores with the hosts, and the output says so.

The cost model takes only single-request inputs, nothing fitted to the serving cells:
- each stage's and the whole model's decode step for micro-batches of 1-8 rows, timed here on
  one core with the same layer builder the stages use;
- each row's per-request serving work on host 1 per token: the CPU time of the serving
  process's event loop (HTTP, server-sent events) and of its requests' worker threads
  (detokenizing), read from its `/health` before and after the row's 1-client run. It is paid
  once per request per token on host 1's core, so it grows with the clients;
- each row's per-step rest (hops, relaying, scheduling): the 1-client run's inter-token time
  less the compute and less that serving work; paid once per step on the token's way round;
- the clients' own CPU per token (this process's, in the 1-client run), charged to the two
  cores the hosts and the clients share.
It predicts each row's throughput at every client count, prints measured / predicted for every
cell and for each row at 4 clients (not only the ratio of ratios, where errors of the same sign
cancel), and says the regime (memory-bound: a batch of 4 costs about what one row costs;
compute-bound: it costs about 4x).

Prints a table and the ratios last; writes bench/results/serving_bench.json. Not in `make test`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from lab.config import default_cache_dir  # noqa: E402
from lab.launch import free_port  # noqa: E402
from lab.machine import announce_machine, write_results  # noqa: E402
from labtools.hosts.network import host_cpus  # noqa: E402

RESULTS = REPO / "bench" / "results" / "serving_bench.json"
RUNS = REPO / "outputs" / "bench" / "serving"
SECRET = "serving-bench-secret"
SHAPE_NAME = "serve-512x8"
SHAPE = {"hidden": 512, "layers": 8, "heads": 8, "intermediate": 1376}
"""The named random-init shape: a Llama of 8 layers of width 512 with the lab's tokenizer (4
layers a stage)."""
PROMPTS = [
    "def parse(text):\n    ",
    "import os\nimport sys\n\nclass Path",
    "for i in range(10):\n    total +=",
    "while True:\n    line = stream.",
    "class Tree:\n    def __init__(self",
    "x = {'a': 1, 'b':",
    "with open(path) as handle:\n    ",
    "try:\n    value = int(",
]


def build_model(folder: Path) -> Path:
    from transformers import AutoTokenizer

    from lab.pretrain import TinyModelSpec, build_llama, ensure_tiny_models, load_preset

    if (folder / "model.safetensors").is_file():
        return folder
    tiny = ensure_tiny_models(load_preset("debug"), default_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(tiny / "tiny_target")
    torch.manual_seed(0)
    spec = TinyModelSpec(
        num_layers=SHAPE["layers"],
        hidden_size=SHAPE["hidden"],
        num_heads=SHAPE["heads"],
        intermediate_size=SHAPE["intermediate"],
    )
    model = build_llama(spec, vocab_size=len(tokenizer), context_length=512, tokenizer=tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------- the cost model's inputs


def step_ms(folder: Path, start: int, end: int, *, context: int, sizes: range) -> dict[int, float]:
    """Median ms of one decode step of layers [start, end) for micro-batches of each size, a
    cache of `context` tokens a row, on this process's one core (the stages' own builder)."""
    from transformers import AutoConfig, DynamicCache

    from split_engine.layout import build_stage_model

    model, _, config = build_stage_model(
        str(folder),
        start=start,
        end=end,
        dtype=torch.float32,
        device=torch.device("cpu"),
        revision=None,
        offline=True,
        trust_remote_code=False,
    )
    AutoConfig  # noqa: B018 - imported for the stage builder's lazy imports
    decoder = getattr(model, "model", model)
    last = end == config.num_hidden_layers
    head = getattr(model, "lm_head", None)
    out: dict[int, float] = {}
    with torch.no_grad():
        for size in sizes:
            cache = DynamicCache()
            kw = (
                {"input_ids": torch.randint(0, 100, (size, context))}
                if start == 0
                else {"inputs_embeds": torch.randn(size, context, config.hidden_size)}
            )
            decoder(**kw, use_cache=True, past_key_values=cache)
            times = []
            for _ in range(12):
                kw = (
                    {"input_ids": torch.randint(0, 100, (size, 1))}
                    if start == 0
                    else {"inputs_embeds": torch.randn(size, 1, config.hidden_size)}
                )
                began = time.perf_counter()
                hidden = decoder(**kw, use_cache=True, past_key_values=cache).last_hidden_state
                if last and head is not None:
                    head(hidden[:, -1:]).argmax(-1)
                times.append(time.perf_counter() - began)
                cache.crop(-1)  # back to `context` tokens
            out[size] = statistics.median(times[2:]) * 1e3
    return out


def period_ms(row: str, clients: int, inputs: dict[str, Any]) -> float:
    """The time between two tokens of one request with `clients` in flight. A micro-batch of
    k requests goes round in its stages' compute, plus the row's per-step rest (hops,
    relaying) once, plus its k requests' serving work on host 1's core (it lands there while
    stage 1 computes the next step); pipelined, two micro-batches share the cycle and neither
    host's core can do more than its part of both (host 1: both stage-1 steps and every
    request's serving work). The clients' CPU shares the two cores with the hosts."""
    s1, s2, full = inputs["stage1_ms"], inputs["stage2_ms"], inputs["full_ms"]
    hop, serve, client = (inputs[key][row] for key in ("hop_ms", "serve_ms", "client_ms"))
    if row == "unsplit CB":
        host1, host2 = full[clients] + clients * serve, 0.0
        period = host1 + hop
    elif row == "one in flight" or clients == 1:
        host1, host2 = s1[clients] + clients * serve, s2[clients]
        period = host1 + host2 + hop
    else:
        size = -(-clients // 2)  # two micro-batches, as equal as the scheduler makes them
        host1, host2 = 2 * s1[size] + clients * serve, 2 * s2[size]
        period = max(host1, host2, s1[size] + s2[size] + hop + size * serve)
    return max(period, (host1 + host2 + clients * client) / 2)  # two cores, clients on them


def predict(row: str, clients: int, inputs: dict[str, Any], *, max_tokens: int) -> float:
    """Tokens/s over all clients: each request waits its first token (the 1-client time to
    first token, and a step in flight to join when others run), then a period per token."""
    period = period_ms(row, clients, inputs)
    first = inputs["ttft_ms"][row] + (period if clients > 1 else 0.0)
    return clients * max_tokens / (first + (max_tokens - 1) * period) * 1e3


def regime(full: dict[int, float]) -> str:
    growth = full[4] / full[1]
    kind = "memory-bound" if growth < 1.6 else "compute-bound" if growth > 3 else "in between"
    return f"{kind} (a step of 4 rows costs {growth:.2f}x one row's)"


# ---------------------------------------------------------------------- the servers


class TransformersCB:
    """`lab.serving.Engine` over transformers' continuous batching (the unsplit baseline)."""

    def __init__(self, folder: Path, *, max_concurrent: int) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        config = GenerationConfig(
            do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=1024
        )
        batching = ContinuousBatchingConfig(
            num_blocks=64,
            page_size=64,
            max_batch_tokens=512,
            max_requests_per_batch=max_concurrent,
            use_cuda_graph=False,
        )
        self.manager = model.init_continuous_batching(
            generation_config=config, continuous_batching_config=batching
        )
        self.manager.start()
        self.max_concurrent = max_concurrent
        self.slots_key = f"--max-concurrent {max_concurrent}"
        self.context_tokens: int | None = 512
        self.ids = iter(range(1 << 62))

    def generate(self, prompt: list[int], params: Any, on_tokens: Any) -> list[int]:
        request = f"r{next(self.ids)}"
        self.manager.add_request(
            prompt, request_id=request, streaming=True, max_new_tokens=params.max_new_tokens
        )
        tokens: list[int] = []
        try:
            for output in self.manager.request_id_iter(request):
                tokens = list(output.generated_tokens)
                if tokens:
                    on_tokens(tokens)
        except BaseException:
            self.manager.cancel_request(request)
            raise
        return tokens

    def health(self) -> dict[str, Any]:
        return {}


def serve_unsplit(args: argparse.Namespace) -> None:
    """`--serve-unsplit`: this process serves the whole model (transformers' CB)."""
    import logging

    from lab.openai_http import serve
    from lab.serving import ServeConfig

    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    engine = TransformersCB(Path(args.model), max_concurrent=8)
    from transformers import AutoTokenizer

    serve(
        engine,
        AutoTokenizer.from_pretrained(args.model),
        model_id="bench",
        config=ServeConfig(port=args.port, max_tokens_limit=1024),
        secret=SECRET.encode(),
    )


def _pinned(cpus: tuple[int, ...], argv: list[str]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus)), *argv] if cpus else argv


def start_servers(
    row: str, folder: Path, cpus: list[tuple[int, ...]], log_dir: Path
) -> tuple[list[subprocess.Popen], int]:
    """The row's processes, each on its host's core; returns them and the HTTP port."""
    port = free_port("127.0.0.1")
    env = {**os.environ, "LAB_SECRET": SECRET, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log_dir.mkdir(parents=True, exist_ok=True)
    if row == "unsplit CB":
        argv = [
            sys.executable,
            __file__,
            "--serve-unsplit",
            "--model",
            str(folder),
            "--port",
            str(port),
        ]
        plan = [("unsplit", cpus[0], argv)]
    else:
        master = free_port("127.0.0.1")
        common = [
            f"cluster.master.port={master}",
            f"model.pretrained={folder}",
            "model.name=bench",
            "num_threads=1",
            "tracking.wandb=false",
            "tracking.console=false",
            "split.num_stages=2",
        ]
        micro = 2 if row == "pipelined" else 1
        plan = []
        for name, host, extra in (
            ("stage1", cpus[0], ["role=stage", "split.rank=1"]),
            ("stage2", cpus[1], ["role=stage", "split.rank=2"]),
            (
                "serve",
                cpus[0],
                [
                    "role=serve",
                    f"serve.port={port}",
                    "serve.model_id=bench",
                    f"split.micro_batches={micro}",
                    "split.max_concurrent=8",
                    "serve.max_tokens_limit=1024",
                ],
            ),
        ):
            run_dir = log_dir / name
            plan.append(
                (
                    name,
                    host,
                    [
                        sys.executable,
                        "-m",
                        "split_inference",
                        *extra,
                        *common,
                        f"paths.run_dir={run_dir}",
                        f"hydra.run.dir={run_dir}",
                    ],
                )
            )
    procs = []
    for name, host, argv in plan:
        with (log_dir / f"{name}.log").open("w") as out:
            procs.append(
                subprocess.Popen(
                    _pinned(host, argv),
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + 600
    said = time.monotonic()
    while not (log_dir / plan[-1][0]).with_suffix(".log").read_text().count("serving "):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            stop(procs)
            raise SystemExit(f"{row}: a server did not start: see {log_dir}")
        if time.monotonic() - said > 30:
            said = time.monotonic()
            print(f"  waiting for {row}'s servers to say 'serving' ({log_dir})", flush=True)
        time.sleep(0.5)
    return procs, port


def stop(procs: list[subprocess.Popen]) -> None:
    import signal

    for proc in reversed(procs):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------------- the clients


def serving_cpu_s(port: int) -> dict[str, float]:
    """The server's CPU seconds so far (its `/health`): event loop, request threads, process."""
    import json
    import urllib.request

    ask = urllib.request.Request(
        f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {SECRET}"}
    )
    with urllib.request.urlopen(ask, timeout=60) as answer:
        return {k: float(v) for k, v in json.load(answer)["cpu_s"].items()}


def load(port: int, clients: int, *, requests: int, max_tokens: int) -> dict[str, float]:
    """`clients` threads, each streaming `requests` completions one after another (and this
    process's CPU per token meanwhile: the clients' own work)."""
    import openai

    gaps: list[float] = []
    firsts: list[float] = []
    tokens = [0]
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(index: int) -> None:
        api = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=SECRET, max_retries=0, timeout=600
        )
        start.wait()
        for number in range(requests):
            prompt = PROMPTS[(index + number * clients) % len(PROMPTS)]
            began = time.perf_counter()
            times = []
            for chunk in api.completions.create(
                model="bench", prompt=prompt, stream=True, max_tokens=max_tokens, temperature=0
            ):
                if chunk.choices and chunk.choices[0].text:
                    times.append(time.perf_counter())
            with lock:
                if times:
                    firsts.append(times[0] - began)
                    gaps.extend(b - a for a, b in itertools.pairwise(times))
                tokens[0] += max_tokens

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    began, cpu = time.perf_counter(), time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    client_cpu_s = time.process_time() - cpu
    q = statistics.quantiles(gaps, n=20) if len(gaps) > 1 else gaps * 19
    return {
        "tokens_per_s": tokens[0] / wall,
        "ttft_ms_p50": statistics.median(firsts) * 1e3,
        "token_ms_p50": statistics.median(gaps) * 1e3,
        "token_ms_p95": q[18] * 1e3,
        "client_cpu_ms_per_token": client_cpu_s * 1e3 / max(tokens[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens")
    parser.add_argument("--clients", default="1,2,4,8", help="client counts, comma-separated")
    parser.add_argument("--serve-unsplit", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_unsplit:
        serve_unsplit(args)
        return
    try:
        counts = sorted({int(c) for c in args.clients.split(",")})
    except ValueError:
        print(f"--clients {args.clients}: comma-separated integers, e.g. 1,2,4,8", file=sys.stderr)
        raise SystemExit(2) from None
    if not counts or counts[0] < 1 or counts[-1] > 8 or 1 not in counts or 4 not in counts:
        print("--clients: counts within 1..8, with 1 and 4 among them", file=sys.stderr)
        raise SystemExit(2)
    machine = announce_machine()
    cpus = host_cpus(2, 1)
    print(f"cores: host 1 {cpus[0]}, host 2 {cpus[1]} (taskset); load {os.getloadavg()}")
    max_tokens, requests = (16, 1) if args.quick else (32, 2)
    folder = build_model(RUNS / "model")
    os.sched_setaffinity(0, set(cpus[0]))  # the single-request inputs, on host 1's core
    torch.set_num_threads(1)
    context = 12 + max_tokens // 2
    inputs: dict[str, Any] = {
        "stage1_ms": step_ms(folder, 0, SHAPE["layers"] // 2, context=context, sizes=range(1, 9)),
        "stage2_ms": step_ms(
            folder, SHAPE["layers"] // 2, SHAPE["layers"], context=context, sizes=range(1, 9)
        ),
        "full_ms": step_ms(folder, 0, SHAPE["layers"], context=context, sizes=range(1, 9)),
        "overhead_ms": {},
        "serve_ms": {},
        "serve_process_ms": {},
        "client_ms": {},
        "hop_ms": {},
        "ttft_ms": {},
    }
    os.sched_setaffinity(0, set().union(*cpus))
    print(
        f"stage step ms by rows: {[round(v, 2) for v in inputs['stage1_ms'].values()]} and "
        f"{[round(v, 2) for v in inputs['stage2_ms'].values()]}; the whole model "
        f"{[round(v, 2) for v in inputs['full_ms'].values()]}; {regime(inputs['full_ms'])}"
    )
    print(
        "clients: threads of this process (the openai client), on both hosts' cores: no core "
        "of their own on this box, they share the cores with the hosts"
    )
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for row in ("pipelined", "one in flight", "unsplit CB"):
        procs, port = start_servers(row, folder, cpus, RUNS / row.replace(" ", "_"))
        try:
            load(port, 1, requests=1, max_tokens=4)  # warm: first calls pay for lazy set-up
            rows[row] = {}
            for clients in counts:
                before = serving_cpu_s(port)
                rows[row][clients] = load(port, clients, requests=requests, max_tokens=max_tokens)
                rows[row][clients]["load_1min"] = os.getloadavg()[0]
                if clients == 1:  # the single-request inputs: serving work, the clients' own
                    after, served = serving_cpu_s(port), requests * max_tokens
                    work = sum(after[k] - before[k] for k in ("event_loop", "requests"))
                    inputs["serve_ms"][row] = work * 1e3 / served
                    inputs["serve_process_ms"][row] = (
                        (after["process"] - before["process"]) * 1e3 / served
                    )
                    inputs["client_ms"][row] = rows[row][1]["client_cpu_ms_per_token"]
                print(
                    f"  {row:<14} {clients} clients: "
                    f"{rows[row][clients]['tokens_per_s']:.1f} tokens/s",
                    flush=True,
                )
        finally:
            stop(procs)
        compute = (
            inputs["full_ms"][1]
            if row == "unsplit CB"
            else inputs["stage1_ms"][1] + inputs["stage2_ms"][1]
        )
        inputs["overhead_ms"][row] = max(0.0, rows[row][1]["token_ms_p50"] - compute)
        inputs["hop_ms"][row] = max(0.0, inputs["overhead_ms"][row] - inputs["serve_ms"][row])
        inputs["ttft_ms"][row] = rows[row][1]["ttft_ms_p50"]
    print(
        f"\n{'row':<15}{'clients':>8}{'tok/s':>9}{'pred':>9}{'meas/pred':>10}"
        f"{'ttft p50':>10}{'tok p50':>9}{'tok p95':>9}{'load':>6}"
    )
    for row, cells in rows.items():
        for clients, cell in cells.items():
            cell["predicted_tokens_per_s"] = predict(row, clients, inputs, max_tokens=max_tokens)
            cell["measured_over_predicted"] = cell["tokens_per_s"] / cell["predicted_tokens_per_s"]
            print(
                f"{row:<15}{clients:>8}{cell['tokens_per_s']:>9.1f}"
                f"{cell['predicted_tokens_per_s']:>9.1f}"
                f"{cell['measured_over_predicted']:>10.2f}"
                f"{cell['ttft_ms_p50']:>10.0f}{cell['token_ms_p50']:>9.1f}"
                f"{cell['token_ms_p95']:>9.1f}{cell['load_1min']:>6.1f}"
            )
    pipelined, single, base = (rows[r][4] for r in ("pipelined", "one in flight", "unsplit CB"))
    x = pipelined["tokens_per_s"] / single["tokens_per_s"]
    vs_measured = pipelined["tokens_per_s"] / base["tokens_per_s"]
    vs_predicted = pipelined["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
    y = vs_measured / vs_predicted
    per_row = {row: rows[row][4]["measured_over_predicted"] for row in rows}

    def ms(key: str) -> str:
        return ", ".join(f"{row} {value:.1f}" for row, value in inputs[key].items())

    print(
        f"regime: {regime(inputs['full_ms'])}; per token, from each row's 1-client run (ms): "
        f"outside the model {ms('overhead_ms')}; of it, serving work on host 1 (event loop and "
        f"request threads' CPU, paid per request) {ms('serve_ms')}, the per-step rest "
        f"{ms('hop_ms')}; the serving process's whole CPU {ms('serve_process_ms')}; the "
        f"clients' CPU (on the hosts' two cores) {ms('client_ms')}"
    )
    print(
        "per row at 4 clients, measured / predicted: "
        + ", ".join(f"{row} {ratio:.2f}" for row, ratio in per_row.items())
    )
    print(
        f"targets: pipelined / one in flight >= 1.4 ({x:.2f}); vs unsplit, measured / "
        f"predicted within 0.85-1.15 ({y:.2f}: {vs_measured:.2f} measured, "
        f"{vs_predicted:.2f} predicted)"
    )
    write_results(
        RESULTS,
        {
            "shape": {"name": SHAPE_NAME, **SHAPE},
            "quick": args.quick,
            "max_tokens": max_tokens,
            "requests_per_client": requests,
            "cores": [list(c) for c in cpus],
            "clients_on": "threads of the bench process, on both hosts' cores (none of their own)",
            "inputs": inputs,
            "rows": rows,
            "measured_over_predicted_at_4": per_row,
            "pipelined_vs_one": x,
            "vs_unsplit_measured": vs_measured,
            "vs_unsplit_predicted": vs_predicted,
            "vs_unsplit_measured_over_predicted": y,
        },
        machine=machine,
    )
    print(
        f"4 clients, 2 hosts x 1 core: pipelined / one in flight: {x:.2f}; "
        f"vs unsplit batched, measured / predicted: {y:.2f}"
    )


if __name__ == "__main__":
    main()
