"""`python -m labtools.gpu_check` (`make gpu-check`): the CUDA paths, where a GPU is, in parts.

With a CUDA GPU: the `cuda` tests (every module end to end on the GPU), then each bench on it:
netproto, where a split token's time goes and the split bench (a random-init TinyLlama-1.1B
shape), speculative decoding's costs and bench (the trained bench pair: a random-init pair
accepts almost nothing), federated LoRA. Each bench prints the machine (the GPU named) first and
stores its results under bench/results/.

It runs in parts and resumes: each check's outcome is written to `--state` as soon as it ends,
a later run skips the checks that passed (a failed one runs again; `--again` forgets all), and
`--budget-s` stops starting new checks once that many seconds have passed (each call runs at
least one), so a GPU lent for ten minutes at a time gets through the whole list over several
calls (a check that outlives its call is killed there and runs again next time). The summary
ends with one line per check: ok or failed with its last line of output and its time, or not
run yet. Without a
GPU it says so, and why, and exits 0: there is nothing to check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / "outputs" / "gpu_check" / "state.json"


@dataclass(frozen=True)
class Check:
    name: str
    args: tuple[str, ...]
    """`python <args>`, run from the repository root."""


CUDA_TESTS: tuple[str, ...] = ("-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider")
CUDA_TESTS += ("tests/lab/test_cuda.py",)
"""That file alone: collecting the whole suite would import every module's dependencies."""
CHECKS = (
    Check("cuda tests: device, netproto", (*CUDA_TESTS, "-k", "picks_the_gpu or netproto")),
    Check("cuda tests: speculative decoding", (*CUDA_TESTS, "-k", "speculative")),
    Check("cuda tests: split", (*CUDA_TESTS, "-k", "split")),
    Check("cuda tests: federated QLoRA", (*CUDA_TESTS, "-k", "federated")),
    Check("cuda tests: static decode", (*CUDA_TESTS[:-1], "tests/lab/test_static_decode.py")),
    Check(
        "decode on a static cache in a CUDA graph, 1B shape",
        ("bench/decode_graph_bench.py", "--shape", "1b"),
    ),
    Check(
        "decode on a static cache in a CUDA graph, 8B shape",
        ("bench/decode_graph_bench.py", "--shape", "8b"),
    ),
    Check("netproto bench", ("bench/netproto_bench.py",)),
    Check("split profile, 1B shape", ("bench/split_bench.py", "--shape", "1b", "--profile")),
    Check("split bench, 1B shape", ("bench/split_bench.py", "--shape", "1b")),
    Check("speculative decoding costs", ("bench/spec_decoding_bench.py", "--costs")),
    Check("speculative decoding bench", ("bench/spec_decoding_bench.py", "--quick")),
    Check("federated LoRA bench", ("bench/fed_learn_bench.py", "--quick")),
)


def gpu() -> str | None:
    """The first CUDA device's name, or None (and why, on stderr)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    why = (
        f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no device"
        if torch.version.cuda
        else f"torch {torch.__version__} is a CPU build"
    )
    print(f"gpu-check: no CUDA GPU here ({why}): nothing to check", file=sys.stderr)
    return None


def load_state(path: Path) -> dict[str, dict]:
    """Outcomes so far, by check name (an unreadable file counts as none, saying so)."""
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"gpu-check: {path} unreadable ({exc}): starting over", file=sys.stderr)
        return {}
    return state if isinstance(state, dict) else {}


def save_state(path: Path, state: dict[str, dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)  # a killed call leaves the previous state whole


def run_check(check: Check, log: Path) -> dict:
    """One check, its output shown and kept in `log`; its outcome."""
    started = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    last = ""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, *check.args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
            if line.strip():
                last = line.strip()
        code = proc.wait()
    return {
        "ok": code == 0,
        "code": code,
        "seconds": round(time.perf_counter() - started, 1),
        "last_line": last[-300:],
    }


def summary(state: dict[str, dict], gpu_name: str) -> list[str]:
    lines = [f"gpu-check on {gpu_name}: one line per check"]
    for check in CHECKS:
        outcome = state.get(check.name)
        if outcome is None:
            lines.append(f"  {check.name}: not run yet")
        else:
            verdict = "ok" if outcome.get("ok") else f"FAILED (exit {outcome.get('code')})"
            lines.append(
                f"  {check.name}: {verdict} in {outcome.get('seconds', 0):.0f}s: "
                f"{outcome.get('last_line', '')}"
            )
    done = sum(1 for c in CHECKS if c.name in state)
    passed = sum(1 for c in CHECKS if state.get(c.name, {}).get("ok"))
    left = len(CHECKS) - done
    lines.append(f"gpu-check: {passed} of {len(CHECKS)} checks ok, {left} not run yet")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--state", type=Path, default=STATE, help=f"outcomes so far ({STATE})")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="start no new check after this many seconds, one at least (0: run them all)",
    )
    parser.add_argument("--again", action="store_true", help="forget earlier outcomes, passes too")
    parser.add_argument(
        "--only", default="", help="run only the checks whose name contains this text"
    )
    args = parser.parse_args(argv)
    name = gpu()
    if name is None:
        return 0
    state = {} if args.again else load_state(args.state)
    started, ran = time.monotonic(), 0
    for check in CHECKS:
        if state.get(check.name, {}).get("ok") or args.only not in check.name:
            continue
        if ran and args.budget_s and time.monotonic() - started > args.budget_s:
            print(f"gpu-check: {args.budget_s:.0f}s spent: the rest next time", flush=True)
            break
        print(f"== {check.name}: python {' '.join(check.args)}", flush=True)
        log = args.state.parent / (re.sub(r"[^A-Za-z0-9]+", "_", check.name).strip("_") + ".log")
        state[check.name] = run_check(check, log)
        ran += 1
        save_state(args.state, state)
    lines = summary(state, name)
    print("\n".join(lines), flush=True)
    failed = [c.name for c in CHECKS if c.name in state and not state[c.name].get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
