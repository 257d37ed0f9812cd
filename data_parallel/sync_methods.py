"""The `dp.sync` methods, registered by name (as fed_learn.strategy's strategies are).

A method says which engines it runs under (`engines`), whether every worker trains its own
replica apart and the replicas meet every dp.inner_steps (`apart`: DiLoCo, data_parallel.steps),
how the run's summary names it (`label`), and, under DDP, which communication hook carries the
gradient buckets (`attach`: data_parallel.engine's plain SUM, or data_parallel.sync's). `auto`
is a method too: it measures the link and picks another before anything is wrapped
(data_parallel.autosync). A new method is a subclass here; nothing else string-matches
`dp.sync`.
"""

from __future__ import annotations

from typing import Any, ClassVar


class SyncMethod:
    name: ClassVar[str]
    registry: ClassVar[dict[str, type[SyncMethod]]] = {}
    engines: ClassVar[tuple[str, ...]] = ("ddp",)
    """The dp.engine values it runs under (DDP's communication hooks: ddp only)."""
    apart: ClassVar[bool] = False
    """Every worker trains its own replica; they meet every dp.inner_steps (DiLoCo)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a family's base (TorchHook) names no method
            SyncMethod.registry[cls.name] = cls

    @classmethod
    def label(cls, dp: Any) -> str:
        """What the run's summary calls it, with its settings (`dp`: the DPConfig)."""
        return cls.name

    @classmethod
    def attach(cls, ddp: Any, *, dp: Any, timer: Any, names: dict[int, str]) -> Any:
        """Register its communication hook on `ddp` (DistributedDataParallel); returns the
        hook's state that goes into checkpoints (top-k's residuals, PowerSGD's), or None.
        `names`: each parameter's name by id."""
        raise NotImplementedError(f"dp.sync={cls.name} has no DDP communication hook")


def sync_method(name: str) -> type[SyncMethod]:
    """The method `dp.sync=name` names; ValueError naming every registered one."""
    if name not in SyncMethod.registry:
        raise ValueError(f"dp.sync={name!r}: choose one of {sorted(SyncMethod.registry)}")
    return SyncMethod.registry[name]


class Summed(SyncMethod):
    """Each bucket all-reduced with SUM in fp32 (DDP's own all-reduce, timed); FSDP2's
    reduce-scatter under dp.engine=fsdp."""

    name = "ddp"
    engines = ("ddp", "fsdp")

    @classmethod
    def label(cls, dp: Any) -> str:
        return f"ddp ({dp.engine})"

    @classmethod
    def attach(cls, ddp: Any, *, dp: Any, timer: Any, names: dict[int, str]) -> Any:
        from data_parallel.engine import summed_allreduce_hook

        ddp.register_comm_hook(timer, summed_allreduce_hook)
        return None


class Nothing(SyncMethod):
    """Nothing crosses: the bench's baseline (not data-parallel training)."""

    name = "none"

    @classmethod
    def attach(cls, ddp: Any, *, dp: Any, timer: Any, names: dict[int, str]) -> Any:
        from data_parallel.engine import noop_hook

        ddp.register_comm_hook(timer, noop_hook)
        return None


class TorchHook(SyncMethod):
    """torch's fp16/bf16 compress hook, timed (data_parallel.sync.dtype_hook)."""

    @classmethod
    def attach(cls, ddp: Any, *, dp: Any, timer: Any, names: dict[int, str]) -> Any:
        from data_parallel import sync

        state = sync.dtype_hook(cls.name, timer)
        ddp.register_comm_hook(state, sync.timed_torch_hook)
        return state


class Fp16(TorchHook):
    name = "fp16"


class Bf16(TorchHook):
    name = "bf16"


class PowerSGD(SyncMethod):
    """torch's PowerSGD hook, its state kept per parameter (data_parallel.sync.powersgd_hook)."""

    name = "powersgd"

    @classmethod
    def attach(cls, ddp: Any, *, dp: Any, timer: Any, names: dict[int, str]) -> Any:
        from data_parallel import sync

        state = sync.powersgd_hook(dp, timer, names)
        ddp.register_comm_hook(state, sync.timed_torch_hook)
        return state

    @classmethod
    def label(cls, dp: Any) -> str:
        return f"powersgd (rank {dp.powersgd_rank})"


class TopK(SyncMethod):
    """The largest entries of each bucket, with error feedback (data_parallel.sync.TopK)."""

    name = "topk"

    @classmethod
    def label(cls, dp: Any) -> str:
        return f"topk ({dp.topk_fraction:g})"

    @classmethod
    def attach(cls, ddp: Any, *, dp: Any, timer: Any, names: dict[int, str]) -> Any:
        from data_parallel import sync

        state = sync.TopK(dp.topk_fraction, timer, names)
        ddp.register_comm_hook(state, sync.topk_hook)
        return state


class DiLoCo(SyncMethod):
    """Each worker steps apart; the pseudo-gradients meet every dp.inner_steps
    (data_parallel.diloco, data_parallel.steps)."""

    name = "diloco"
    apart = True

    @classmethod
    def label(cls, dp: Any) -> str:
        fragments = f", {dp.fragments} fragments" if dp.fragments > 1 else ""
        return f"diloco (H={dp.inner_steps}{fragments})"


class Auto(SyncMethod):
    """Measure the link and a step, take the method predicted to reach DDP's loss first
    (data_parallel.autosync); resolved before the model is wrapped."""

    name = "auto"
