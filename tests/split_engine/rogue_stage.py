"""A rogue rank without the shared secret, for tests: `python -m tests.split_engine.rogue_stage
PORT OUT STORE_SECRET`.

It joins a split world as stage2 with no secret. The rendezvous store (the lab's, behind the
secret) would refuse it, so it is given the store's secret alone, as if the store had let it in:
what follows tests the RPC guard on its own, the layer behind the store. When the
driver starts its handshake with it (after stage1 has proved the secret and been accepted), it
first tries to make stage1 and the driver do things, records what each attempt got in OUT (JSON),
then answers the handshake as a stage without the secret would. The driver then stops the run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any


def attack(out: Path, honest_prove) -> None:
    import torch.distributed.rpc as rpc

    from split_engine import handshake, memory_probes, stage, workers

    attempts = {
        "release stage1": ("stage1", workers.release_stage, ()),
        "read stage1's free memory": ("stage1", memory_probes.free_memory_bytes, ()),
        "describe a model on stage1": ("stage1", stage.describe_model, ({},)),
        "handshake again with stage1": ("stage1", honest_prove, (b"n" * 32,)),
        "send stage1 a proof": ("stage1", handshake.stage_accept_driver, (b"p" * 32, b"w" * 32)),
        "release the driver's peer": ("driver", workers.release_stage, ()),
    }
    outcome = {}
    for what, (to, func, args) in attempts.items():
        try:
            value = rpc.rpc_sync(to, func, args=args, timeout=20)
            outcome[what] = f"served: {value!r}"
        except Exception as exc:
            outcome[what] = "refused" if "refused" in str(exc) else f"failed: {exc}"
    out.write_text(json.dumps(outcome, indent=1))


def admit_to_store(store_secret: bytes) -> None:
    """From now on this process meets a world with the store's secret for the store's handshake
    alone, and no secret for anything after (what a rank the store let in would be)."""
    from split_engine import handshake, workers

    meet = workers._store_on_master_host

    def meet_with_the_stores_secret(
        url: str, timeout: timedelta = timedelta(seconds=300), **kwargs: Any
    ) -> Iterator[tuple[Any, int, int]]:
        handshake._auth.secret = store_secret  # the store's handshake only
        rendezvous = meet(url, timeout, **kwargs)
        joined = next(rendezvous)
        handshake._auth.secret = None  # and no secret for anything after
        yield joined

    workers._store_on_master_host = meet_with_the_stores_secret


def main(port: int, out: Path, store_secret: bytes) -> None:
    from lab.config import Endpoint
    from split_engine import handshake, workers
    from split_engine.config import SplitConfig

    honest_prove = handshake.stage_prove

    def prove_after_attacking(driver_nonce: bytes) -> tuple[bytes, bytes]:
        handshake.stage_prove = honest_prove  # pickled by name when we call it on stage1
        attack(out, honest_prove)
        return honest_prove(driver_nonce)

    handshake.stage_prove = prove_after_attacking  # what the driver's handshake call runs here
    admit_to_store(store_secret)
    world = workers.World(
        2, Endpoint("127.0.0.1", port), SplitConfig(num_stages=2, rpc_timeout_s=20)
    )
    with workers.joined(world, secret=None):
        workers.serve_until_released(ping_s=1.0, timeout_s=20)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].encode())
