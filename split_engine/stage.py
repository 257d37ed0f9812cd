"""One stage of a split model, living in its own process and called over RPC.

The driver creates it with `rpc.remote(stage_name, Stage, ...)` and then calls its methods
through the RRef. Tensors cross the RPC boundary on CPU (no device maps to set up between
hosts) and move to the stage's device on arrival. Calls into one stage are serialised by a lock:
a stage computes one thing at a time, as one machine would, and pipelined micro-batches overlap
*across* stages.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.rpc import RRef

from lab.config import ModelConfig, PathsConfig
from lab.device import detect_device, resolve_dtype, supports_bf16
from lab.losses import next_token_loss
from lab.models import hub_offline, resolve_source
from split_engine.batching import stage_step
from split_engine.generation import Sampling, TokenPicker, decode
from split_engine.handshake import require_driver
from split_engine.layout import build_stage_model, full_model_name, stage_costs
from split_engine.memory_probes import peak_memory
from split_engine.rpc_guard import never_sent

log = logging.getLogger(__name__)

COMPUTE_SAMPLES = 4096
"""Forward times a stage keeps for `stats()` (the most recent)."""

MODEL_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja")
"""A model folder's config and tokenizer files (what an export copies besides the weights)."""


@dataclass
class StageHost:
    """What a stage process knows about its own machine (set by `role=stage` at start)."""

    cache_dir: Path
    device: torch.device


_host: StageHost | None = None


def set_stage_host(host: StageHost) -> None:
    global _host
    _host = host


def stage_host() -> StageHost:
    if _host is None:  # a driver-only process, or a test building a stage in-process
        return StageHost(cache_dir=PathsConfig().cache_path, device=detect_device())
    return _host


def _model_config(fields: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**fields)


_BUILDING = threading.Lock()
"""One model built at a time in a stage process: accelerate's `init_empty_weights` patches
`nn.Module.register_parameter` for the whole process (two overlapping builds can leave it
patched for good, and every later model is made of meta tensors), and transformers' lazy imports
are not safe from two threads at once (`cannot import name 'AutoConfig'`). A driver whose build
failed on one stage while another was still building used to start its next build beside it."""


def describe_model(model_fields: dict[str, Any]) -> dict[str, int]:
    """Layer count and parameter costs of the model, read from its config on the stage's host.

    The driver asks stage 1 for this, so the driver itself needs no copy of the model.
    """
    require_driver()
    with _BUILDING:
        return _describe_model(model_fields)


def _describe_model(model_fields: dict[str, Any]) -> dict[str, int]:
    from transformers import AutoConfig

    cfg = _model_config(model_fields)
    source = resolve_source(cfg, cache_dir=stage_host().cache_dir)
    config = AutoConfig.from_pretrained(
        source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
    )
    costs = stage_costs(config)
    return {
        "num_layers": costs.num_layers,
        "embeddings": costs.embeddings,
        "per_layer": costs.per_layer,
        "head": costs.head,
        "vocab_size": int(config.vocab_size),
    }


class Stage:
    """Layers [start, end) of a causal LM, with a KV cache per generation request."""

    def __init__(
        self,
        model_fields: dict[str, Any],
        *,
        start: int,
        end: int,
        wire_dtype: str = "auto",
        training: bool = False,
        mixed_precision: str = "none",
        lora: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        require_driver()
        with _BUILDING:
            self._build(
                model_fields,
                start=start,
                end=end,
                wire_dtype=wire_dtype,
                training=training,
                mixed_precision=mixed_precision,
                lora=lora,
                seed=seed,
            )

    def _build(
        self,
        model_fields: dict[str, Any],
        *,
        start: int,
        end: int,
        wire_dtype: str,
        training: bool,
        mixed_precision: str,
        lora: dict[str, Any] | None,
        seed: int,
    ) -> None:
        host = stage_host()
        cfg = _model_config(model_fields)
        source = resolve_source(cfg, cache_dir=host.cache_dir)
        self.device = host.device
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        started = time.perf_counter()
        self.source, self.revision = source, cfg.revision
        self.lora = lora is not None
        model, layout, full_config = build_stage_model(
            source,
            start=start,
            end=end,
            dtype=self.dtype,
            device=self.device,
            revision=cfg.revision,
            offline=hub_offline(),
            trust_remote_code=cfg.trust_remote_code,
        )
        self.start, self.end = start, end
        self.first = start == 0
        self.last = end == full_config.num_hidden_layers
        self.hidden_size = int(full_config.hidden_size)
        self.vocab_size = int(full_config.vocab_size)
        """The width of the hidden states that cross the cut."""
        self.tied = bool(getattr(full_config, "tie_word_embeddings", False))
        """The model ties its input embedding and LM head: the first stage holds the matrix,
        the last a copy; training keeps the two equal (split_training.pipeline)."""
        self.wire_dtype = self.dtype if wire_dtype == "auto" else getattr(torch, wire_dtype)
        self.autocast = mixed_precision == "bf16" and supports_bf16(self.device)
        if mixed_precision == "bf16" and not self.autocast:
            log.warning("%s has no bf16 support: training in %s", self.device, self.dtype)
        if lora is not None and self.tied:
            _refuse_adapting_a_tied_matrix(lora, layout)
        if lora is not None:
            from peft import LoraConfig, inject_adapter_in_model

            torch.manual_seed(seed + start)  # adapters start the same for any cut of this stage
            model = inject_adapter_in_model(LoraConfig(**lora), model)
            for name, param in model.named_parameters():
                param.requires_grad_("lora_" in name)
        self.model = model.train(training)
        self.training = training
        self.layout = layout
        self.decoder = getattr(model, layout.decoder)
        self.head = getattr(model, layout.head)
        if self.tied and self.first and self.last:  # one stage holds both ends: one matrix
            self.head.weight = getattr(self.decoder, layout.embeddings[0]).weight
        self.caches: dict[int, Any] = {}
        self.masks: dict[int, torch.Tensor] = {}
        """Each KV-cached request's attention mask so far (B, T_total): a call brings only the
        columns of its own tokens, so what crosses a cut per token does not grow with the
        context."""
        self.pickers: dict[int, TokenPicker] = {}
        """The last stage picks each request's next tokens (`open_request`)."""
        self.next: RRef | None = None
        self.next_timeout_s = 60.0
        self.lock = threading.Lock()
        self.bytes_received = 0
        self.bytes_sent = 0
        self.compute_s: collections.deque[float] = collections.deque(maxlen=COMPUTE_SAMPLES)
        """Seconds of each recent `forward` inside this stage (its layers, the copy to the CPU
        included: on a GPU that is where the stage waits for its kernels), without the hops."""
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=COMPUTE_SAMPLES)
        """Requests in each recent `step` (a micro-batch of several requests in flight)."""
        log.info(
            "stage layers [%d, %d) of %s on %s as %s (%.1f M params, %.1fs)%s",
            start,
            end,
            cfg.name,
            self.device,
            self.dtype,
            sum(p.numel() for p in model.parameters()) / 1e6,
            time.perf_counter() - started,
            " with LoRA adapters" if lora else "",
        )

    # ------------------------------------------------------------------ compute

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        *,
        request: int | None = None,
        labels: torch.Tensor | None = None,
        last_only: bool = False,
        chain: bool = False,
        pick: bool = False,
    ) -> torch.Tensor:
        """Run this stage on token ids (first stage) or hidden states (the others).

        Returns hidden states in the wire dtype (B, T, H), or on the last stage logits (B, T, V)
        (B, 1, V with `last_only`), with `labels` the summed token loss (a scalar), or with
        `pick` the next token of each row (B,), picked by the request's picker. A request
        opened with a KV cache (`open_request`) keeps its keys and values for its next call.
        With `chain`, the output goes on to the next stage (see `link`)
        and what comes back is the last stage's: activations travel stage to stage, not
        through the driver.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"a stage's input is a tensor, got {type(x).__name__}")
        self.bytes_received += x.numel() * x.element_size()
        cache = self.caches.get(request) if request is not None else None
        # inference and evaluation: no graph and no dropout (training runs `train_forward`)
        with self.lock, torch.no_grad(), self._autocast(), self._eval_mode():
            started = time.perf_counter()
            whole: torch.Tensor | None = attention_mask
            if cache is not None and attention_mask is not None:
                attention_mask, whole = self._extend_mask(request, cache, attention_mask, x)
            result = self._compute(
                x,
                whole,
                position_ids,
                cache=cache,
                request=request,
                labels=labels,
                last_only=last_only,
                pick=pick,
            )
            self.compute_s.append(time.perf_counter() - started)
        self.bytes_sent += result.numel() * result.element_size()
        if chain and self.next is not None:  # outside the lock: this stage is free again
            return self.next.rpc_sync(timeout=self.next_timeout_s).forward(
                result,
                attention_mask,
                position_ids,
                request=request,
                labels=labels,
                last_only=last_only,
                chain=True,
                pick=pick,
            )
        return result

    def step(
        self, x: torch.Tensor, requests: list[int], opening: list[dict[str, Any] | None]
    ) -> torch.Tensor:
        """One micro-batch of several requests, each with its own KV-cache slot
        (`split_engine.batching.stage_step`)."""
        if not isinstance(requests, list) or not all(type(r) is int for r in requests):
            raise TypeError("a step's requests are a list of ints")
        return stage_step(self, x, requests, opening)

    def _extend_mask(
        self, request: int | None, cache: Any, attention_mask: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A KV-cached call's mask: the columns of this call's own tokens (what goes on to the
        next stage) and the request's whole mask so far (what the layers attend with)."""
        assert request is not None
        new = attention_mask[:, -x.shape[1] :]  # (B, T_new)
        held = self.masks.get(request)
        cached = cache.get_seq_length()
        rows, tokens = x.shape[0], x.shape[1]
        if (
            attention_mask.dim() != 2
            or tuple(new.shape) != (rows, tokens)
            or (held is None and cached)
            or (held is not None and tuple(held.shape) != (rows, cached))
        ):
            raise ValueError(
                f"request {request}: a mask of {tuple(attention_mask.shape)} for {rows} rows of "
                f"{tokens} new tokens after {cached} cached ones"
            )
        whole = new if held is None else torch.cat([held, new.to(held.dtype)], dim=1)
        self.masks[request] = whole
        return new, whole

    def _compute(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        *,
        cache: Any = None,
        request: int | None = None,
        labels: torch.Tensor | None = None,
        last_only: bool = False,
        pick: bool = False,
    ) -> torch.Tensor:
        """This stage's layers on `x` (the caller holds the lock and sets grad and autocast)."""
        inputs: dict[str, Any] = {
            "attention_mask": None if attention_mask is None else attention_mask.to(self.device),
            "position_ids": position_ids.to(self.device),
            "use_cache": cache is not None,
            "past_key_values": cache,
        }
        if self.first:
            inputs["input_ids"] = x.to(self.device)
        else:
            inputs["inputs_embeds"] = x.to(self.device, self.dtype)  # (B, T, H)
        out = self.decoder(**inputs)
        if cache is not None:
            self.caches[request] = out.past_key_values  # type: ignore[index]
        hidden = out.last_hidden_state  # (B, T, H)
        if not self.last:
            return hidden.to(self.wire_dtype).cpu()
        if last_only or pick:
            hidden = hidden[:, -1:]  # (B, 1, H)
        logits = self.head(hidden)  # (B, T, V)
        if pick:
            return self.pickers[request](logits[:, -1]).cpu()  # type: ignore[index]
        if labels is None:
            return logits.float().cpu()
        return self._loss(logits, labels)

    def train_forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None
    ) -> torch.Tensor:
        """A training forward inside this process, its graph kept for a local backward: hidden
        states in the wire dtype (B, T, H), or on the last stage the summed token loss. `x` may
        be a leaf that requires grad (the previous stage's output): its `.grad` is what goes
        back across the cut."""
        if not self.training:
            raise ValueError("this stage was built for inference (training=False)")
        with self.lock, torch.enable_grad(), self._autocast():
            return self._compute(x, None, position_ids, labels=labels)

    def open_request(self, request: int, sampling: dict[str, Any], kv_cache: bool) -> None:
        """Get ready for a generation request on this stage and every later one: its KV cache
        (with `kv_cache`), and on the last stage its token picker."""
        from transformers import DynamicCache

        picker = TokenPicker(Sampling.from_dict(sampling))
        with self.lock:
            self.masks.pop(request, None)
            if kv_cache:
                self.caches[request] = DynamicCache()
            if self.last:
                self.pickers[request] = picker
        if self.next is not None:
            self.next.rpc_sync(timeout=self.next_timeout_s).open_request(
                request, sampling, kv_cache
            )

    def decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        request: int,
        sampling: dict[str, Any],
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int,
        kv_cache: bool,
    ) -> dict[str, Any]:
        """A whole generation, run from the first stage: the decode loop lives here and the last
        stage picks each token, so a token costs one call down the chain and its answer (no
        driver in between, no logits on the wire). Returns `Generation.as_dict()`."""
        if not self.first:
            raise ValueError("decode runs on the first stage, which holds the embeddings")
        generation = decode(
            _Chain(self, request),
            input_ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            sampling=Sampling.from_dict(sampling),
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            kv_cache=kv_cache,
        )
        return generation.as_dict()

    def link(self, next_stage: RRef, timeout_s: float) -> None:
        """Where `forward(..., chain=True)` sends this stage's output."""
        self.next, self.next_timeout_s = next_stage, timeout_s

    @staticmethod
    def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed next-token cross-entropy (the driver divides by the batch's token count)."""
        return next_token_loss(logits, labels, reduction="sum").cpu()

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """The model in eval mode for this call (dropout off), then back as it was: a training
        stage also answers evaluations. The caller holds the lock, which `train_forward` takes
        too, so no training forward sees the switch. An inference stage is built in eval mode:
        its per-token calls walk no modules here."""
        if not self.model.training:
            yield
            return
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def end_request(self, request: int, *, chain: bool = False) -> None:
        """Free a finished request's KV cache and picker (with `chain`, on every later stage
        too; a later stage that is gone took its state along)."""
        with self.lock:
            self.caches.pop(request, None)
            self.masks.pop(request, None)
            self.pickers.pop(request, None)
        if chain and self.next is not None:
            with contextlib.suppress(RuntimeError):
                self.next.rpc_sync(timeout=self.next_timeout_s).end_request(request, chain=True)

    # ------------------------------------------------------------------ introspection

    def held_layers(self) -> list[int]:
        """Global indices of the decoder layers whose weights this process holds."""
        layers = getattr(self.decoder, self.layout.layers)
        return list(range(self.start, self.start + len(layers)))

    def parameter_names(self) -> list[str]:
        return [name for name, _ in self.model.named_parameters()]

    def stats(self) -> dict[str, float]:
        """Memory, CPU time and traffic of this stage's process, and the median time of its
        recent forwards (`compute_ms_p50`: the stage's own share of a token)."""
        stats = peak_memory()
        stats.update(
            bytes_received=float(self.bytes_received),
            bytes_sent=float(self.bytes_sent),
            compute_ms_p50=statistics.median(self.compute_s) * 1e3 if self.compute_s else 0.0,
            params=float(sum(p.numel() for p in self.model.parameters())),
            open_requests=float(len(self.caches) + len(self.pickers) + len(self.masks)),
            mean_batch=statistics.mean(self.batch_sizes) if self.batch_sizes else 0.0,
        )
        return stats

    def reset_traffic(self) -> None:
        """Start counting bytes and forward times afresh (after a warm-up)."""
        self.bytes_received = self.bytes_sent = 0
        self.compute_s.clear()
        self.batch_sizes.clear()

    # ------------------------------------------------------------------ tied embeddings

    def _tied_ends(self) -> list[torch.nn.Parameter]:
        """The ends of a tied embedding / LM-head matrix this stage holds and trains."""
        if not self.tied:
            return []
        ends = []
        if self.first:
            ends.append(getattr(self.decoder, self.layout.embeddings[0]).weight)
        if self.last and not self.first:
            ends.append(self.head.weight)
        return [p for p in ends if p.requires_grad]

    def _tied_copy(self) -> torch.nn.Parameter | None:
        """The last stage's copy of a tied matrix (None where this stage holds no copy)."""
        ends = self._tied_ends()
        return ends[0] if ends and self.last and not self.first else None

    def tied_weight(self) -> torch.Tensor | None:
        """This stage's copy of a tied matrix, on CPU (None if it holds none)."""
        ends = self._tied_ends()
        return ends[0].detach().cpu() if ends else None

    def set_tied_weight(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            for param in self._tied_ends():
                param.copy_(weight)

    def export_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of this stage under the whole model's names (CPU), for writing the
        whole fine-tuned model as one Hugging Face folder; a tied head's copy left out."""
        if self.lora:
            raise ValueError(
                "a split.lora=true run trains adapters: its checkpoints hold them; exporting a "
                "whole model from a LoRA run is not supported"
            )
        copy = self._tied_copy()
        return {
            full_model_name(name, layout=self.layout, start=self.start): p.detach().cpu()
            for name, p in self.model.named_parameters()
            if p is not copy
        }

    def model_files(self) -> dict[str, bytes]:
        """The model's config and tokenizer files (not its weights), for an export; from the
        local Hugging Face cache (or the hub) when the model was named by hub id."""
        folder = Path(self.source)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(
                snapshot_download(
                    self.source,
                    revision=self.revision,
                    allow_patterns=[f"*{suffix}" for suffix in MODEL_FILE_SUFFIXES],
                    local_files_only=hub_offline(),
                )
            )
        return {
            path.name: path.read_bytes()
            for path in sorted(folder.iterdir())
            if path.is_file()
            and path.suffix in MODEL_FILE_SUFFIXES
            and not path.name.endswith(".index.json")
        }

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores of this stage: its trained tensors, a tied LM head's copy
        left out (the first stage stores the matrix once)."""
        copy = self._tied_copy()
        return {
            name: p.detach().cpu().contiguous()
            for name, p in self.model.named_parameters()
            if p.requires_grad and p is not copy
        }

    def load_trainable_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore `trainable_state`; a tied copy is restored by the driver afterwards."""
        copy = self._tied_copy()
        params = dict(self.model.named_parameters())
        expected = {name for name, p in params.items() if p.requires_grad and p is not copy}
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise ValueError(
                f"checkpoint does not match stage layers [{self.start}, {self.end}): "
                f"missing {missing[:3]}, unexpected {extra[:3]}"
            )
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)


never_sent(Stage)  # a peer may call its methods, never fetch the model itself


def _refuse_adapting_a_tied_matrix(lora: dict[str, Any], layout: Any) -> None:
    """LoRA on a tied embedding or LM head would put two different adapters on one matrix."""
    ends = {layout.head, *layout.embeddings[:1]}
    targets = lora.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    adapted = sorted(t for t in targets if t.split(".")[-1] in ends)
    if adapted:
        raise ValueError(
            f"lora.target_modules={adapted} adapts a tied embedding / LM head; across stages "
            "each end would get an adapter of its own and the tie would break: leave them out "
            "(LoRA trains the other layers; the tied matrix stays frozen)"
        )


class _Chain:
    """The split model as `decode` sees it from inside the first stage: one request, whose
    tokens come back from the end of the chain already picked."""

    def __init__(self, stage: Stage, request: int) -> None:
        self.stage = stage
        self.request = request

    def new_request(self, sampling: Sampling, *, kv_cache: bool) -> int:
        self.stage.open_request(self.request, sampling.as_dict(), kv_cache)
        return self.request

    def next_token(
        self,
        feed: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        request: int,
    ) -> torch.Tensor:
        return self.stage.forward(
            feed, attention_mask, position_ids, request=request, chain=True, pick=True
        )

    def end_request(self, request: int) -> None:
        self.stage.end_request(request, chain=True)
