"""Each rank's share of a Hugging Face causal LM, loaded from its safetensors slice by slice.

The split follows the model's own `base_model_tp_plan` (transformers writes one for Llama,
Qwen2, Mistral, ...): `colwise` linears (q/k/v, gate/up) keep a block of output rows, so a
rank holds whole attention heads (and whole KV heads: its KV cache is its heads' alone) and a
block of the MLP's width; `rowwise` linears (o_proj, down_proj) keep the matching block of input
columns, and their partial sums meet in one all-reduce each: two a layer. Embeddings, norms and
the LM head stay whole on every rank.

Two engines hold the shards:
- `dtensor`: torch's tensor-parallel engine (`parallelize_module` with ColwiseParallel /
  RowwiseParallel on a device mesh): each weight a DTensor, the all-reduce issued by DTensor.
- `local`: the same shards as plain tensors in smaller nn.Linear, and `dist.all_reduce` after
  each rowwise linear (a forward hook): no DTensor dispatch on the decode path.
Both compute the same sums in the same order; bench/tensor_parallel_bench.py times both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from lab.cli import ConfigError

Engine = Literal["dtensor", "local"]
ENGINES = ("dtensor", "local")
STYLES = ("colwise", "rowwise")
WEIGHTS_FILE = "model.safetensors"


def tp_plan(config: Any) -> dict[str, str]:
    """The model's base_model_tp_plan (module pattern -> style); ConfigError in one line when it
    has none or uses a style this engine does not shard."""
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ConfigError(
            f"model type {config.model_type!r} has no base_model_tp_plan in its transformers "
            "config: tensor_parallel shards models that declare one (Llama, Qwen2, Mistral, ...)"
        )
    odd = sorted({s for s in plan.values() if s not in STYLES})
    if odd:
        raise ConfigError(
            f"model type {config.model_type!r}'s tp plan uses {odd}: tensor_parallel shards "
            f"{' and '.join(STYLES)} linears only"
        )
    return plan


def check_divisible(config: Any, ranks: int) -> None:
    """ConfigError in one line unless heads, KV heads and the MLP width divide by `ranks`."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None)
        or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{name}={value}" for name, value in sizes.items() if value % ranks]
    if bad:
        raise ConfigError(
            f"tp.ranks={ranks} does not divide {', '.join(bad)} of {config.model_type!r}: each "
            "rank holds whole heads and an equal share of the MLP (choose a rank count that "
            "divides them)"
        )


def module_styles(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Every linear's full name (`model.layers.0.self_attn.q_proj`) -> its style."""
    import fnmatch

    base = model.base_model_prefix
    names = {name for name, _ in model.named_modules()}
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        for name in names:
            if fnmatch.fnmatchcase(name, f"{base}.{pattern}"):
                styles[name] = style
    return styles


@dataclass
class Collectives:
    """What the local engine's all-reduces cost: counted and timed on this rank."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.count, self.nbytes, self.seconds = 0, 0, 0.0


@dataclass
class ShardedModel:
    """One rank's model and what a caller measures of it."""

    model: nn.Module
    engine: str
    rank: int
    ranks: int
    collectives: Collectives = field(default_factory=Collectives)
    param_bytes: int = 0
    """This rank's weights (its shards and the whole embeddings, norms and head)."""


def _shard_slice(full_shape: tuple[int, ...], dim: int, rank: int, ranks: int) -> slice:
    size = full_shape[dim] // ranks
    return slice(rank * size, (rank + 1) * size)


def _read(handle: Any, key: str, style: str | None, rank: int, ranks: int) -> torch.Tensor:
    """`key`'s tensor from the open safetensors file: whole, or this rank's rows (colwise
    weight and bias) or columns (rowwise weight) only, read as a slice."""
    if style is None:
        return handle.get_tensor(key)
    part = handle.get_slice(key)
    shape = tuple(part.get_shape())
    if style == "colwise":  # (out, in) rows, or a bias (out,)
        return part[_shard_slice(shape, 0, rank, ranks)]
    if len(shape) == 1:  # a rowwise bias: whole (the local engine keeps rank 0's only)
        return part[:]
    return part[:, _shard_slice(shape, 1, rank, ranks)]


def _style_of(key: str, styles: dict[str, str]) -> str | None:
    module = key.rsplit(".", 1)[0]
    return styles.get(module)


def build_empty(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The model of `folder`'s config with no storage (meta tensors), in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def _rebuild_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inverse frequencies) are computed at construction, not
    saved: rebuild the modules that hold them on `device`."""
    for name, module in list(model.named_modules()):
        if name.endswith("rotary_emb"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            with torch.device(device):
                fresh = type(module)(config=model.config)
            setattr(parent, name.rsplit(".", 1)[-1], fresh)


def load_sharded(
    folder: Path,
    *,
    rank: int,
    ranks: int,
    engine: str,
    dtype: torch.dtype,
    device: torch.device,
    mesh: Any = None,
    group: Any = None,
    progress: Callable[[str], None] = lambda line: None,
) -> ShardedModel:
    """This rank's share of the model saved in `folder` (config.json + model.safetensors): only
    its slices are read from the file. `mesh`: the 1-D device mesh (dtensor engine)."""
    from safetensors import safe_open

    started = time.monotonic()
    model = build_empty(folder, dtype)
    plan = tp_plan(model.config)
    check_divisible(model.config, ranks)
    styles = module_styles(model, plan)
    if engine == "dtensor":
        _parallelize(model, styles, mesh)
    else:
        _narrow_linears(model, styles, ranks)
    model.to_empty(device=device)
    _rebuild_buffers(model, device)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} holds no .safetensors weights to load shards from")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    if key not in params:
                        continue
                    value = _read(handle, key, _style_of(key, styles), rank, ranks)
                    target = params[key]
                    local = target.to_local() if hasattr(target, "to_local") else target
                    if tuple(local.shape) != tuple(value.shape):
                        raise ValueError(f"{key}: shard {tuple(value.shape)} for {local.shape}")
                    local.copy_(value.to(local.dtype))
                    loaded.add(key)
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()  # type: ignore[operator]
            loaded |= {k for k in params if k.endswith("lm_head.weight")}
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{folder}: no weights for {missing[:3]}")
    model.eval()
    sharded = ShardedModel(model, engine, rank, ranks)
    if engine == "local":
        _hook_all_reduces(model, styles, sharded.collectives, rank=rank, group=group)
    sharded.param_bytes = sum(_local_bytes(p) for p in {id(p): p for p in params.values()}.values())
    progress(f"rank {rank}: loaded its shards in {time.monotonic() - started:.1f}s")
    return sharded


def _local_bytes(param: torch.Tensor) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


def _parallelize(model: nn.Module, styles: dict[str, str], mesh: Any) -> None:
    """torch's engine: each planned linear becomes ColwiseParallel / RowwiseParallel on `mesh`."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {name: kinds[style]() for name, style in styles.items()})


def _narrow_linears(model: nn.Module, styles: dict[str, str], ranks: int) -> None:
    """The local engine: each planned linear replaced by one of its shard's shape."""
    for name, style in styles.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear), name
        out_f, in_f = linear.out_features, linear.in_features
        if style == "colwise":
            out_f //= ranks
        else:
            in_f //= ranks
        with torch.device("meta"):
            narrow = nn.Linear(in_f, out_f, bias=linear.bias is not None, dtype=linear.weight.dtype)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, narrow)


def _hook_all_reduces(
    model: nn.Module, styles: dict[str, str], counter: Collectives, *, rank: int, group: Any
) -> None:
    """After each rowwise linear, the partial sums of every rank added (dist.all_reduce); a
    rowwise bias counts once (rank 0's)."""

    def reduce(module: nn.Linear, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        dist.all_reduce(output, group=group)
        counter.seconds += time.perf_counter() - started
        counter.count += 1
        counter.nbytes += output.numel() * output.element_size()
        return output

    for name, style in styles.items():
        if style == "rowwise":
            linear = model.get_submodule(name)
            if linear.bias is not None and rank != 0:
                with torch.no_grad():
                    linear.bias.zero_()  # type: ignore[operator]  # the sum holds rank 0's bias once
            linear.register_forward_hook(reduce)


def save_config_note(folder: Path, note: dict[str, Any]) -> None:
    """A random-init shape's folder says what it is (its config and seed)."""
    (folder / "lab_shape.json").write_text(json.dumps(note, indent=2))
