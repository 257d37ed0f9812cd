"""LoRA on a causal LM with PEFT: building the model, its data, and one client's local training."""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lab.config import LoRASettings, ModelConfig
from lab.corpus import Document, client_shards, load_finetune_corpus, shuffled, token_blocks
from lab.losses import next_token_loss
from lab.models import load_model

log = logging.getLogger(__name__)

MAX_BLOCK_TOKENS = 128


def peft_model(
    base: ModelConfig,
    lora: LoRASettings,
    *,
    cache_dir: Path,
    device: torch.device | None = None,
    seed: int = 0,
) -> Any:
    """The base model (4-bit where configured and supported) wrapped with LoRA adapters."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = load_model(base, cache_dir=cache_dir, device=device, for_training=True)
    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(seed)  # every party builds the same initial adapter
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # PEFT (0.21.2, the newest) reads `model.is_gradient_checkpointing`, which transformers 5
        # deprecated for `is_activation_checkpointing`: PEFT's call, and its check is right.
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        return get_peft_model(model, config)


_EMBEDDINGS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
"""Per model: whether PEFT's `save_embedding_layers="auto"` puts the embedding layers in its
state dict (`saves_embeddings`)."""
Links = list[tuple[dict, str, Any]]
"""A table, a name in it, and what it held there: a module's `__dict__` and its `_modules` or
`_parameters` table, or that table and a child or parameter."""
_ADAPTER_PARAMETERS: weakref.WeakKeyDictionary[Any, tuple[dict[str, torch.nn.Parameter], Links]] = (
    weakref.WeakKeyDictionary()
)
"""Per model: the parameters its adapter's state dict holds, by key, and the links from the
model down to each (`peft_state`)."""


def saves_embeddings(model: Any) -> bool:
    """What PEFT's `save_embedding_layers="auto"` decides for `model`, decided once: "auto"
    reads the base model's config from disk at every call, to see whether the vocabulary was
    resized since, and nothing here resizes it (a few ms a call, several calls a round)."""
    from peft import get_peft_model_state_dict

    saved = _EMBEDDINGS.get(model)
    if saved is None:
        auto = get_peft_model_state_dict(model)
        saved = set(auto) != set(get_peft_model_state_dict(model, save_embedding_layers=False))
        _EMBEDDINGS[model] = saved
    return saved


def peft_state(model: Any) -> dict[str, torch.Tensor]:
    """PEFT's state dict of `model`'s adapter (the model's own tensors: no copy made), as
    `get_peft_model_state_dict` gives it by default. Which parameters those are is worked out
    once per model (PEFT walks every module for its key prefixes at each call, ~2.5 ms on the
    debug model, several calls a round): each call gives them afresh, detached."""
    held = _held_parameters(model)
    if not held:  # some entry is not a parameter as it stands: PEFT's own answer, each time
        return _pefts_state(model)
    return {name: parameter.detach() for name, parameter in held.items()}


def _held_parameters(model: Any) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters by state dict key, found again if any link from the model
    down to one has changed since (a layer or parameter replaced: an adapter added, a load
    with `assign=True`); the links checked each call, one dict lookup each."""
    found = _ADAPTER_PARAMETERS.get(model)
    if found is None or not all(held.get(name) is obj for held, name, obj in found[1]):
        found = _ADAPTER_PARAMETERS[model] = _adapter_parameters(model)
    return found[0]


def _pefts_state(model: Any) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, save_embedding_layers=saves_embeddings(model))


def _adapter_parameters(model: Any) -> tuple[dict[str, torch.nn.Parameter], Links]:
    """PEFT's state dict keys -> the model's parameters they are, whole (same storage, offset,
    shape and strides), and the links from the model down to them; empty unless every entry
    is one with storage of its own (a tensor with no data, zero-size or on the meta device,
    has no address to tell it from another of its shape)."""
    parameters = {
        (p.untyped_storage().data_ptr(), p.storage_offset(), p.shape, p.stride()): (path, p)
        for path, p in model.named_parameters()
    }
    held: dict[str, torch.nn.Parameter] = {}
    links: dict[tuple[int, str], tuple[dict, str, Any]] = {}
    taken: set[int] = set()
    for name, tensor in _pefts_state(model).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        found = parameters.get((*key, tensor.shape, tensor.stride()))
        if found is None or not key[0] or id(found[1]) in taken:
            return {}, []  # (two keys on one parameter, tied: PEFT's own order of loads)
        path, held[name] = found
        taken.add(id(found[1]))
        module, (*parents, leaf) = model, path.split(".")
        for step, table in [*((s, "_modules") for s in parents), (leaf, "_parameters")]:
            held_in = module.__dict__[table]  # the module's table itself, then its entry
            links[id(module), table] = (module.__dict__, table, held_in)
            links[id(held_in), step] = (held_in, step, held_in[step])
            module = held_in[step]
    return held, list(links.values())


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors (PEFT state dict keys), detached copies on CPU."""
    return {k: v.detach().to("cpu").clone() for k, v in peft_state(model).items()}


ADAPTER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""What an adapter tensor from a peer may be: the precisions a load casts from (float8 and the
packed float4 kinds are floating too, but a load into the model's dtype refuses them)."""


def check_adapter_state(model: Any, state: Any) -> None:
    """ValueError, in one line, unless `state` is a non-empty subset of this model's adapter
    tensors (FFA-LoRA's B alone is one), each of its shape and of an ADAPTER_DTYPES precision (a
    load casts it to the model's: a party on another device may hold another precision).
    What a peer sends is checked so before PEFT loads it (PEFT's RuntimeError would end the
    process)."""
    own = peft_state(model)  # the model's own tensors: no copy made
    if not isinstance(state, dict) or not state or not set(state) <= set(own):
        names = set(state) if isinstance(state, dict) else set()
        raise ValueError(
            f"adapter tensors do not match this model's LoRA layout: {sorted(names ^ set(own))[:4]}"
        )
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in ADAPTER_DTYPES:
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(
                f"adapter tensor {name} is {kind}, not one of {[str(d) for d in ADAPTER_DTYPES]}"
            )
        if tensor.shape != own[name].shape:
            raise ValueError(
                f"adapter tensor {name} has shape {list(tensor.shape)[:8]}; this model's is "
                f"{list(own[name].shape)}"
            )


def load_adapter_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Load `state` (checked: `check_adapter_state`) into `model`'s adapter, in place, as
    PEFT's `set_peft_model_state_dict` does (a copy into each parameter, cast to its dtype and
    device); a subset (FFA-LoRA's B) leaves the rest as held."""
    from peft import set_peft_model_state_dict

    check_adapter_state(model, state)
    held = _held_parameters(model)
    if not held:
        set_peft_model_state_dict(model, state)
        return
    with torch.no_grad():
        for name, tensor in state.items():
            parameter = held[name]
            if tensor.shape != parameter.shape:  # refused as PEFT's load refuses it: no broadcast
                raise RuntimeError(
                    f"size mismatch for {name}: {tuple(tensor.shape)} into {tuple(parameter.shape)}"
                )
            parameter.copy_(tensor)


def block_size(model: Any) -> int:
    return min(MAX_BLOCK_TOKENS, int(model.config.max_position_embeddings))


def client_data(
    tokenizer: Any,
    *,
    index: int,
    num_clients: int,
    seed: int,
    block: int,
    max_examples: int,
    data_dir: str = "",
    data_glob: str = "**/*",
    partition: str = "package",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) blocks of this client's own data (90/10 split).

    With `data_dir`, the text files under it (the client's private data; `data_glob` picks
    them). Without, the lab's stand-in: client `index`'s share of the stdlib test suite, whole
    test packages at a time (`lab.corpus.load_finetune_corpus`), text the lab's base models
    were not pretrained on.
    """
    if data_dir:
        texts = [d.text for d in shuffled(folder_documents(data_dir, pattern=data_glob), seed=seed)]
    elif partition == "file_type":  # heterogeneous clients: a file type each
        from fed_learn.partition import CHARS_PER_BLOCK_TOKEN, file_type_shard

        if not 0 <= index < num_clients:
            raise ValueError(f"client_index={index} must be in 0..{num_clients - 1}")
        budget = max_examples * block * CHARS_PER_BLOCK_TOKEN
        texts = file_type_shard(index, num_clients, seed=seed, max_chars=budget)
    else:
        if not 0 <= index < num_clients:
            raise ValueError(f"client_index={index} must be in 0..{num_clients - 1}")
        shard = client_shards(load_finetune_corpus().train, num_clients, seed=seed)[index]
        texts = [d.text for d in shuffled(shard, seed=seed + index)]
    blocks = token_blocks(texts, tokenizer, block_size=block, max_blocks=max_examples)
    if len(blocks) < 2:
        raise ValueError(
            f"{len(blocks)} block of {block} tokens is too little data to train and validate on"
        )
    num_val = max(1, len(blocks) // 10)
    return blocks[num_val:], blocks[:num_val]


MAX_DOCUMENT_BYTES = 50 * 2**20


def folder_documents(folder: str, *, pattern: str = "**/*") -> list[Document]:
    """The text files under `folder` matching `pattern`, in path order; binary files (a NUL
    byte in their first 8 KiB) and files over 50 MiB are skipped."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"fed.data_dir={folder}: no such folder")
    docs = []
    for path in sorted(root.glob(pattern)):
        if not path.is_file() or path.stat().st_size > MAX_DOCUMENT_BYTES:
            continue
        raw = path.read_bytes()
        if b"\0" in raw[:8192]:
            continue
        rel = path.relative_to(root).as_posix()
        docs.append(
            Document(path=rel, package=rel.split("/")[0], text=raw.decode(errors="replace"))
        )
    if not docs:
        raise FileNotFoundError(f"no text files match fed.data_glob={pattern!r} under {root}")
    return docs


def validation_blocks(tokenizer: Any, *, block: int, count: int) -> torch.Tensor:
    """Held-out text of the clients' domain that no client holds (files kept out of every
    shard), for the coordinator's evaluation: `count` blocks evenly spaced over all of it, so
    that every held-out file has its say, not only the first few."""
    docs = load_finetune_corpus().validation
    blocks = token_blocks([d.text for d in docs], tokenizer, block_size=block)
    picks = torch.linspace(0, len(blocks) - 1, min(count, len(blocks))).round().long()
    return blocks[picks]


def train_local(
    model: Any,
    blocks: torch.Tensor,
    *,
    epochs: int,
    max_steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    prox_mu: float = 0.0,
    freeze_a: bool = False,
    on_step: Callable[[int, int], None] | None = None,
) -> float:
    """Local LoRA training; returns the mean training loss.

    `prox_mu` > 0 adds FedProx's (mu / 2) * ||w - w_global||^2 over the adapter weights;
    `freeze_a` trains only the B matrices (FFA-LoRA); `on_step(done, total)` after each step.
    """
    params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    for name, param in params.items():
        param.requires_grad_(not (freeze_a and "lora_A" in name))
    trainable = [p for p in params.values() if p.requires_grad]
    anchors = {n: p.detach().clone() for n, p in params.items()} if prox_mu > 0 else {}
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    steps_per_epoch = math.ceil(len(blocks) / batch_size)
    total = epochs * steps_per_epoch if max_steps <= 0 else min(max_steps, epochs * steps_per_epoch)
    model.train()
    losses = []
    for step in range(total):
        if step % steps_per_epoch == 0:
            order = torch.randperm(len(blocks), generator=generator)
        start = (step % steps_per_epoch) * batch_size
        batch = blocks[order[start : start + batch_size]].to(device)  # (B, T)
        loss = next_token_loss(model(input_ids=batch).logits, batch)  # logits (B, T, V)
        losses.append(loss.item())
        if anchors:
            loss = loss + prox_mu / 2 * sum(
                ((params[n] - a) ** 2).sum() for n, a in anchors.items()
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(step + 1, total)
    model.eval()
    return sum(losses) / len(losses)
