"""Two orderings of torch RPC that split training depends on, checked in plain processes.

`python -m tests.split_engine.rpc_ordering` prints one JSON line:

- `changed_after_send_seen`: TensorPipe sends a CPU tensor's memory when it goes out, after
  `rpc_async` has returned, so a change made in place right after the call reaches the peer
  (20 tries of a 16 MB tensor filled with ones after it was handed to `rpc_async` as zeros: how
  many the receiver saw changed). Split training's pipeline pushes a copy of every tensor it
  goes on changing (the tied gradient, summed and clipped in place after it was sent): without
  the copy, the two ends of a tied matrix took different updates from step 2 on.
- `shared_context_whole`: distributed autograd with two micro-batches in one context, across
  two hops (driver -> last stage -> first stage), a backward that sleeps on the last stage
  while the second micro-batch's gradient message is served: is the first stage's gradient,
  read right after `dist_autograd.backward` returns, whole? (The early answer torch's engine
  gives a second message for a context whose backward is running was the suspect of the
  cross-host drift split training had on distributed autograd; this is the check that did not
  reproduce it.)

Nothing of the lab is imported: this is torch's behaviour, plain RPC, no guard.
"""

from __future__ import annotations

import json
import os
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

WEIGHT: torch.Tensor | None = None
_calls = 0
_lock = threading.Lock()


def total(tensor: torch.Tensor) -> float:
    return float(tensor.sum())


class Sleepy(torch.autograd.Function):
    """Identity whose backward sleeps 0.2 s the first time it runs and 1 s after."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        global _calls
        with _lock:
            _calls += 1
            call = _calls
        time.sleep(0.2 if call == 1 else 1.0)
        return grad


def first_forward(x: torch.Tensor) -> torch.Tensor:
    global WEIGHT
    if WEIGHT is None:
        WEIGHT = torch.ones(4, 4, requires_grad=True)
    return x @ WEIGHT


def last_forward(x: torch.Tensor) -> torch.Tensor:
    hidden = rpc.rpc_sync("w1", first_forward, args=(x,))  # an autograd edge back to w1
    return Sleepy.apply(hidden).sum()


def first_gradient(context_id: int) -> torch.Tensor:
    grads = dist_autograd.get_gradients(context_id)
    return grads[WEIGHT].clone() if WEIGHT in grads else torch.zeros(4, 4)


def _drive() -> dict[str, object]:
    seen = []
    for _ in range(20):
        tensor = torch.zeros(4_000_000)
        future = rpc.rpc_async("w1", total, args=(tensor,))
        tensor.fill_(1.0)
        seen.append(future.wait())
    micro = [torch.full((1, 4), float(i + 1)) for i in range(4)]
    whole = torch.stack([x.t() @ torch.ones(1, 4) for x in micro]).sum(0)  # d sum(xW)/dW
    with dist_autograd.context() as context_id:
        losses = [rpc.rpc_async("w2", last_forward, args=(x,)) for x in micro]
        dist_autograd.backward(context_id, [torch.stack([f.wait() for f in losses]).sum()])
        shared = rpc.rpc_sync("w1", first_gradient, args=(context_id,))
    return {
        "changed_after_send_seen": sum(value > 0 for value in seen),
        "of": len(seen),
        "shared_context_whole": bool(torch.equal(shared, whole)),
    }


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 0:
        print(json.dumps(_drive()), flush=True)
    rpc.shutdown()


def main() -> None:
    from socket import socket

    with socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_worker, args=(port,), nprocs=3, join=True)


if __name__ == "__main__":
    main()
