"""Where a decoder-only model is cut, and how one stage of it is built with only its weights.

A stage is an ordinary Hugging Face causal LM whose config has fewer layers: the first stage
keeps the embeddings, the last keeps the final norm and the LM head, and the others get neither.
Its forward is the model's own (`decoder(inputs_embeds=...)`), so masks, rotary positions and
the KV cache work exactly as in the unsplit model. Weights come straight from the checkpoint's
safetensors files, one tensor at a time, and only those of the stage's own layers.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Attribute names of one architecture family."""

    decoder: str
    """The CausalLM's attribute holding the decoder stack (`model`, `transformer`)."""
    embeddings: tuple[str, ...]
    """Decoder attributes that only the first stage keeps."""
    layers: str
    final_norm: str
    head: str = "lm_head"
    position_embedding: str | None = None
    """A learned position table the decoder adds to `inputs_embeds` (GPT-2's `wpe`): stages
    after the first replace it by zeros, as their input already has the positions in it."""


LLAMA = Layout(decoder="model", embeddings=("embed_tokens",), layers="layers", final_norm="norm")
GPT2 = Layout(
    decoder="transformer",
    embeddings=("wte", "wpe"),
    layers="h",
    final_norm="ln_f",
    position_embedding="wpe",
)
LAYOUTS: dict[str, Layout] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "olmo": LLAMA,
    "gpt2": GPT2,
}
"""model_type -> layout. Families whose decoder rescales `inputs_embeds` (Gemma) cannot be cut
this way and are refused."""


def layout_of(config: Any) -> Layout:
    layout = LAYOUTS.get(config.model_type)
    if layout is None:
        raise ValueError(
            f"split stages support model types {sorted(LAYOUTS)}, not {config.model_type!r}"
        )
    return layout


# ---------------------------------------------------------------------------- where to cut


@dataclass(frozen=True)
class StageCosts:
    """Parameter counts of the pieces a cut distributes."""

    embeddings: int
    per_layer: int
    head: int
    """Final norm and LM head (a tied head is a copy on the last stage: it counts)."""
    num_layers: int

    def stage(self, start: int, end: int) -> int:
        first, last = start == 0, end == self.num_layers
        return (end - start) * self.per_layer + first * self.embeddings + last * self.head


def stage_costs(config: Any) -> StageCosts:
    """Parameter counts from a one-layer model built without memory (meta tensors)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    one = copy.deepcopy(config)
    _set_num_layers(one, 1)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(one)
    layout = layout_of(config)
    decoder = getattr(model, layout.decoder)
    embeddings = sum(
        p.numel() for name in layout.embeddings for p in getattr(decoder, name).parameters()
    )
    per_layer = sum(p.numel() for p in getattr(decoder, layout.layers)[0].parameters())
    head = sum(p.numel() for p in getattr(decoder, layout.final_norm).parameters())
    head += getattr(model, layout.head).weight.numel()
    return StageCosts(embeddings, per_layer, head, config.num_hidden_layers)


def balance_boundaries(costs: StageCosts, *, capacities: list[float]) -> list[int]:
    """Cut points minimising the largest cost/capacity over stages (exact, by dynamic programming).

    Every stage gets at least one layer. Equal capacities balance parameter counts.
    """
    num_stages, num_layers = len(capacities), costs.num_layers
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} stages need at least as many layers; the model has {num_layers}"
        )
    if any(c <= 0 for c in capacities):
        raise ValueError(f"stage capacities must be positive, got {capacities}")
    inf = float("inf")
    # best[k][j]: the smallest worst ratio placing layers [0, j) on stages [0, k).
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, num_layers - (num_stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                ratio = max(best[k - 1][i], costs.stage(i, j) / capacities[k - 1])
                if ratio < best[k][j]:
                    best[k][j], cut[k][j] = ratio, i
    boundaries, j = [], num_layers
    for k in range(num_stages, 1, -1):
        j = cut[k][j]
        boundaries.append(j)
    return boundaries[::-1]


def stage_ranges(boundaries: list[int], num_layers: int) -> list[tuple[int, int]]:
    """[(start, end), ...] per stage from cut points, checked against the model."""
    edges = [0, *boundaries, num_layers]
    for a, b in itertools.pairwise(edges):
        if b <= a:
            raise ValueError(
                f"split.boundaries={boundaries} do not cut a {num_layers}-layer model into "
                f"non-empty stages (each boundary must be in 1..{num_layers - 1}, increasing)"
            )
    return list(itertools.pairwise(edges))


# ---------------------------------------------------------------------------- building a stage


class ZeroPositions(nn.Module):
    """Stands in for a learned position table in stages after the first (adds nothing)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.register_buffer("like", torch.zeros(0, dtype=dtype), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        like: torch.Tensor = self.like  # type: ignore[assignment]
        return like.new_zeros(*position_ids.shape, self.hidden_size)  # (B, T, H)


def _set_num_layers(config: Any, num_layers: int, *, start: int = 0) -> None:
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(config, name):
            setattr(config, name, num_layers)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):  # per-layer attention kinds (sliding / full)
        config.layer_types = layer_types[start : start + num_layers]


def checkpoint_files(
    source: str, *, revision: str | None, offline: bool
) -> tuple[Path, dict[str, Path]]:
    """The model's folder and, per tensor name, the safetensors file holding it.

    `source` is a local folder or a hub id; from the hub only the shards listed in the index
    are fetched (all of them for now: which ones a stage needs is decided by the caller).
    """
    folder = Path(source).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(
            snapshot_download(
                source,
                revision=revision,
                allow_patterns=["*.json", "*.safetensors"],
                local_files_only=offline,
            )
        )
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return folder, {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(
            f"{folder} has no model.safetensors(.index.json): split stages read only "
            f"safetensors checkpoints (convert .bin weights with `save_pretrained`)"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return folder, {name: single for name in f.keys()}  # noqa: SIM118 - not a dict


def full_model_name(name: str, *, layout: Layout, start: int) -> str:
    """The whole model's name for a stage's tensor (its layer indices shifted by `start`)."""
    parts = name.split(".")
    if parts[:2] == [layout.decoder, layout.layers]:
        parts[2] = str(int(parts[2]) + start)
    return ".".join(parts)


def _checkpoint_name(
    name: str, *, layout: Layout, start: int, files: dict[str, Path], config: Any
) -> str:
    """The checkpoint's tensor name for a stage parameter (layer indices shifted by `start`)."""
    parts = name.split(".")
    full = full_model_name(name, layout=layout, start=start)
    candidates = [full, full.removeprefix(layout.decoder + ".")]
    if parts[0] == layout.head and getattr(config, "tie_word_embeddings", False):
        embed = f"{layout.decoder}.{layout.embeddings[0]}.weight"
        candidates += [embed, embed.removeprefix(layout.decoder + ".")]
    for candidate in candidates:
        if candidate in files:
            return candidate
    raise ValueError(f"the checkpoint has no tensor for {full!r} (tried {candidates})")


def build_stage_model(
    source: str,
    *,
    start: int,
    end: int,
    dtype: torch.dtype,
    device: torch.device,
    revision: str | None = None,
    offline: bool = False,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, Layout, Any]:
    """Layers [start, end) of the model at `source`, plus embeddings / head where they belong.

    Returns (stage CausalLM, its layout, the full model's config). Only this stage's tensors are
    read from disk; nothing of the others is ever allocated.
    """
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, files = checkpoint_files(source, revision=revision, offline=offline)
    full_config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    layout = layout_of(full_config)
    num_layers = full_config.num_hidden_layers
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"stage layers [{start}, {end}) are not inside a {num_layers}-layer model")
    config = copy.deepcopy(full_config)
    _set_num_layers(config, end - start, start=start)
    config.tie_word_embeddings = False  # a stage has at most one end of a tied pair
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are real
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    decoder = getattr(model, layout.decoder)
    if start > 0:
        for name in layout.embeddings:
            setattr(decoder, name, None)
        if layout.position_embedding:
            setattr(decoder, layout.position_embedding, ZeroPositions(config.hidden_size, dtype))
    if end < num_layers:
        setattr(decoder, layout.final_norm, nn.Identity())
        setattr(model, layout.head, nn.Identity())
    wanted = {
        name: _checkpoint_name(name, layout=layout, start=start, files=files, config=full_config)
        for name in model.state_dict()
    }
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, key in wanted.items():
        by_file.setdefault(files[key], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                tensors[name] = f.get_tensor(wanted[name]).to(device=device, dtype=dtype)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.to(device)  # buffers; parameters are there already, in `dtype`
    model.eval()
    return model, layout, full_config
