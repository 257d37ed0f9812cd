"""The driver's view of a split model: RRefs to its stages, `forward` and `generate`.

Each call runs the stages in order, the driver relaying activations (CPU tensors) from one to
the next. In generation (`split_engine.generation.decode`) every stage keeps a KV cache per
request: the prompt is sent once (prefill), then only the newest token's hidden state travels
per step.
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef

from lab.config import ModelConfig
from split_engine.config import SplitConfig
from split_engine.generation import Generation, Sampling, positions_from_mask
from split_engine.layout import StageCosts, balance_boundaries, stage_ranges
from split_engine.liveness import PeerWatch, wait_watching
from split_engine.memory_probes import free_memory_bytes
from split_engine.stage import Stage, describe_model
from split_engine.workers import StageLostError, stage_alive, stage_name

log = logging.getLogger(__name__)


def choose_boundaries(split: SplitConfig, costs: StageCosts, *, timeout_s: float) -> list[int]:
    """`split.boundaries` when given, else a balance by parameter count or by free memory."""
    if split.boundaries:
        return list(split.boundaries)
    if split.balance == "memory":
        capacities = [
            rpc.rpc_sync(stage_name(rank), free_memory_bytes, timeout=timeout_s)
            for rank in range(1, split.num_stages + 1)
        ]
        log.info("free memory per stage host (GiB): %s", [round(c / 2**30, 1) for c in capacities])
    else:
        capacities = [1.0] * split.num_stages
    return balance_boundaries(costs, capacities=capacities)


def remote_reason(exc: Exception) -> str | None:
    """What a stage's own code raised, from the RPC error that carried it back (the last
    `SomeError: reason` line of the remote traceback), or None where the call never reached
    the stage's code (a lost connection, a timeout: torch's messages name no error type)."""
    said = [
        line.strip()
        for line in str(exc).splitlines()
        if re.match(r"^\s*\w+(Error|Exception): ", line)
        and "On WorkerInfo(" not in line  # torch's wrapper around the remote error
    ]
    return said[-1][:500] if said else None


def wait_all(
    futures: list[torch.futures.Future], *, watch: PeerWatch | None = None
) -> tuple[list[Any], tuple[int, Exception] | None]:
    """Every future's result in order, each waited for even after one fails (a call left
    running on a stage would overlap that stage's next one); with the first transport failure
    (a RuntimeError: a call timed out, a peer gone) and its index, or None. A stage's refusal
    (the remote exception re-raised as its own type, a ValueError say) is raised, the first
    in stage order, once every call has ended. With `watch` (the driver's over its stages),
    the peers are checked every liveness.WATCH_S while the calls run (PeerGoneError, or
    RoleFailedError for a local stage process), and the first transport failure returns at
    once, with no results: the calls left running end with the run."""
    if watch is not None:
        wait_watching(futures, watch)
        for index, future in enumerate(futures):
            if future.done():
                try:
                    future.wait()
                except RuntimeError as exc:
                    watch.settle()  # where it can, it names the peer and how it ended
                    return [], (index, exc)
                except Exception:  # a refusal: raised below, once every call has ended
                    pass
    results: list[Any] = []
    first: tuple[int, Exception] | None = None
    for index, future in enumerate(futures):
        try:
            results.append(future.wait())
        except Exception as exc:
            first = first or (index, exc)
    if first is not None and not isinstance(first[1], RuntimeError):
        raise first[1]
    return results, first


class ShardedModel:
    """A causal LM whose layers live in stage processes; the driver holds only RRefs."""

    def __init__(
        self, stages: list[RRef], *, ranges: list[tuple[int, int]], timeout_s: float
    ) -> None:
        self.stages = stages
        self.ranges = ranges
        self.timeout_s = timeout_s
        self._requests = itertools.count()

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        split: SplitConfig,
        *,
        training: bool = False,
        mixed_precision: str = "none",
        lora: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> ShardedModel:
        """Decide the cut, then have every stage load its own layers (in parallel)."""
        fields = asdict(model)
        timeout = split.rpc_timeout_s
        info = rpc.rpc_sync(stage_name(1), describe_model, args=(fields,), timeout=timeout)
        costs = StageCosts(info["embeddings"], info["per_layer"], info["head"], info["num_layers"])
        ranges = stage_ranges(choose_boundaries(split, costs, timeout_s=timeout), costs.num_layers)
        log.info(
            "%s cut into %d stages: layers %s (params %s)",
            model.name,
            len(ranges),
            [f"{a}-{b - 1}" for a, b in ranges],
            [costs.stage(a, b) for a, b in ranges],
        )
        stages = [
            rpc.remote(
                stage_name(rank),
                Stage,
                args=(fields,),
                kwargs={
                    "start": start,
                    "end": end,
                    "wire_dtype": split.wire_dtype,
                    "training": training,
                    "mixed_precision": mixed_precision,
                    "lora": lora,
                    "seed": seed,
                },
                timeout=timeout,
            )
            for rank, (start, end) in enumerate(ranges, start=1)
        ]
        sharded = cls(stages, ranges=ranges, timeout_s=timeout)
        sharded.call_all("held_layers")  # waits for every stage to have loaded
        for index in range(len(stages) - 1):
            sharded.call(index, "link", stages[index + 1], timeout)
        return sharded

    # ------------------------------------------------------------------ plumbing

    def _lost(self, index: int, exc: Exception, *, call: str = "the call") -> StageLostError:
        """The error for a failed call into stage `index`, naming the stage that is gone (with
        chained calls the failure may lie further down the pipeline: each stage is probed);
        where every stage still answers, the stage's own reason (a refused call: the last
        `...Error: ` line of the remote traceback, the deepest stage's in a chain)."""
        reason = str(exc).splitlines()[0][:300]
        for probe in range(len(self.stages)):
            try:
                rpc.rpc_sync(stage_name(probe + 1), stage_alive, timeout=min(5.0, self.timeout_s))
            except RuntimeError:
                start, end = self.ranges[probe]
                lost = StageLostError(
                    f"{stage_name(probe + 1)} (layers {start}-{end - 1}) failed or stopped "
                    f"answering within split.rpc_timeout_s={self.timeout_s:g}: it no longer "
                    f"answers ({reason})"
                )
                lost.peer = stage_name(probe + 1)  # the driver does not wait to release it
                return lost
        start, end = self.ranges[index]
        said = remote_reason(exc)
        if said is not None:
            return StageLostError(
                f"{stage_name(index + 1)} (layers {start}-{end - 1}) refused {call}: {said}"
            )
        return StageLostError(
            f"{stage_name(index + 1)} (layers {start}-{end - 1}) failed or stopped answering "
            f"within split.rpc_timeout_s={self.timeout_s:g}: {reason}"
        )

    def call(self, index: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """`stage.method(*args, **kwargs)` on stage `index` (0-based), synchronously."""
        try:
            return getattr(self.stages[index].rpc_sync(timeout=self.timeout_s), method)(
                *args, **kwargs
            )
        except RuntimeError as exc:
            raise self._lost(index, exc) from None

    def call_async(
        self, index: int, method: str, *args: Any, **kwargs: Any
    ) -> torch.futures.Future:
        return getattr(self.stages[index].rpc_async(timeout=self.timeout_s), method)(
            *args, **kwargs
        )

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every stage at once; results in stage order. Where one fails, the
        others are waited for before the first failure is raised: a call left running on a
        stage (a model still being built) would overlap that stage's next one."""
        futures = [self.call_async(i, method, *args, **kwargs) for i in range(len(self.stages))]
        results, failed = wait_all(futures)
        if failed is not None:
            raise self._lost(*failed) from None
        return results

    def run_stages(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        *,
        request: int | None = None,
        labels: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Through every stage in order, each handing its output straight to the next (one
        message per hop, none relayed by the driver); returns the last stage's output."""
        return self.call(
            0,
            "forward",
            x,
            attention_mask,
            position_ids,
            request=request,
            labels=labels,
            last_only=last_only,
            chain=True,
        )

    def bytes_between_stages(self, stats: list[dict[str, float]] | None = None) -> int:
        """Activation bytes the stages have sent to the next stage so far (from `stats()`,
        fetched here unless the caller has them already)."""
        return int(sum(s["bytes_sent"] for s in (stats or self.stats())[:-1]))

    # ------------------------------------------------------------------ model API

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (B, T, V) for the whole sequence, as the unsplit model computes them."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.run_stages(input_ids, attention_mask, positions_from_mask(attention_mask))

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
        kv_cache: bool = True,
    ) -> Generation:
        """`generation.decode` across the stages, its loop run by the first stage (one call
        from here per generation; per token, one hop down the chain and back, tokens picked
        on the last stage). Step times are measured where the loop runs."""
        request = next(self._requests)
        # the whole generation is one call: up to rpc_timeout_s for each token (each hop
        # between stages has its own rpc_timeout_s, and a stage that dies ends it at once)
        timeout = self.timeout_s * (1 + max_new_tokens)
        try:
            reply = (
                self.stages[0]
                .rpc_sync(timeout=timeout)
                .decode(
                    input_ids,
                    attention_mask,
                    request=request,
                    sampling=sampling.as_dict(),
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id,
                    kv_cache=kv_cache,
                )
            )
        except RuntimeError as exc:
            raise self._lost(0, exc) from None
        return Generation.from_dict(reply)

    def stats(self) -> list[dict[str, float]]:
        return self.call_all("stats")


class DriverChain:
    """The split model as `generation.decode` sees it from the driver: per token one call into
    the first stage, which hands on down the chain; the last stage picks. One hop more per token
    than `ShardedModel.generate` (whose loop runs in the first stage), for a driver that sees
    each token as it comes and can stop between tokens (an HTTP client streaming, or leaving).
    """

    def __init__(self, sharded: ShardedModel) -> None:
        self.sharded = sharded

    def new_request(self, sampling: Sampling, *, kv_cache: bool) -> int:
        request = next(self.sharded._requests)
        self.sharded.call(0, "open_request", request, sampling.as_dict(), kv_cache)
        return request

    def next_token(
        self,
        feed: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        request: int,
    ) -> torch.Tensor:
        return self.sharded.call(
            0, "forward", feed, attention_mask, position_ids, request=request, chain=True,
            pick=True,
        )  # fmt: skip

    def end_request(self, request: int) -> None:
        self.sharded.call(0, "end_request", request, chain=True)
