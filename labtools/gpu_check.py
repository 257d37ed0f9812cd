"""`python -m labtools.gpu_check` (`make gpu-check`): the CUDA paths, where a GPU is.

With a CUDA GPU: the `cuda` tests (every module end to end on the GPU), then each bench on it:
netproto, split (a 1B Llama shape with random-init weights), speculative decoding (the trained
bench pair: a random-init pair accepts almost nothing), federated LoRA. Each bench prints the
machine (the GPU named) first and stores its results under bench/results/. Without one it says
so, and why, and exits 0: there is nothing to check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = (
    ("cuda tests", ["-m", "pytest", "-m", "cuda", "-q", "-rs"]),
    ("netproto bench", ["bench/netproto_bench.py"]),
    ("split bench, 1B Llama shape", ["bench/split_bench.py", "--shape", "1b"]),
    ("speculative decoding bench", ["bench/spec_decoding_bench.py"]),
    ("federated LoRA bench", ["bench/fed_learn_bench.py"]),
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


def main() -> int:
    name = gpu()
    if name is None:
        return 0
    print(f"gpu-check on {name}", flush=True)
    failed = []
    for label, args in STEPS:
        print(f"== {label}: python {' '.join(args)}", flush=True)
        if subprocess.run([sys.executable, *args], cwd=ROOT, check=False).returncode:
            failed.append(label)
    print(
        f"gpu-check: {len(STEPS) - len(failed)} of {len(STEPS)} steps ok"
        + (f" (failed: {', '.join(failed)})" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
