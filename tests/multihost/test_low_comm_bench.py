"""bench/low_comm_bench.py --quick across three namespace hosts: every method runs at both link
settings, auto says what it picked, and the bench ends on its one line (minutes: `slow`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# `slow` only, not `multihost`: it is the bench's evidence run (about 5 minutes), kept out of
# `make test-multihost`'s budget; `make test-slow` runs it where namespaces can be made
pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_bench_measures_every_method_on_both_links_and_ends_on_its_line(
    lab_cache: Path, tiny_models: Path
) -> None:
    from labtools.hosts import unavailable

    why = unavailable()
    if why:
        pytest.skip(f"needs network namespaces: {why}")
    done = subprocess.run(
        [sys.executable, "bench/low_comm_bench.py", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False,
        env={**os.environ, "LAB_CACHE": str(lab_cache)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"time to DDP's final validation loss at 10 Mbit/s, DDP / DiLoCo: "
                        r"(\d+\.\d|not reached)", lines[-1]), lines[-1]  # fmt: skip
    assert len(re.findall(r"dp\.sync=auto chose \S+:", done.stdout)) == 2
    results = json.loads((ROOT / "outputs/bench/low_comm/quick.json").read_text())
    for link in ("1gbit", "10mbit"):
        rows = results["tables"][link]["rows"]
        assert set(rows) == {"ddp", "powersgd", "topk", "diloco:5", "diloco:10"}
        assert rows["ddp"]["bytes_per_worker"] > rows["diloco:10"]["bytes_per_worker"] * 3
    # DDP's losses do not depend on the link: its short run at 10 Mbit/s is the 1 Gbit/s run's
    assert results["tables"]["10mbit"]["rows"]["ddp"]["ddp_losses_vs_fast_link"] <= 1e-6
