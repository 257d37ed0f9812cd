"""Greedy decoding of a Hugging Face Llama on a static KV cache, each decode step one CUDA graph
where a GPU is (issue 58, item 1, the unsplit loop).

On a GPU the lab's eager loop (`split_engine.generation.decode`) measures Python and kernel
launches, not the card: a 1.1B decode step launches hundreds of small kernels. Here every buffer
a step touches has a fixed shape and address (the cache, a slot-validity mask, the fed token,
its position, the step counter, the output row), so the whole step — forward, argmax, end-of-
sequence bookkeeping, and the writes that feed the next step — is recorded once with
`torch.cuda.CUDAGraph` and replayed per token with no host sync. Nothing reads a tensor the graph
allocated, so there is no "overwritten by a subsequent run" (what `generate` + static cache +
`reduce-overhead` hit), and the graph is captured directly, not through torch.compile's
per-thread cudagraph trees. The weights are the model's own modules (embedding, norms, q/k/v/o,
MLP, rotary, head); only attention over the static cache is written here.

`graphs="off"` (the CPU path, and the GPU baseline) runs the very same step eagerly on the same
cache, so graph replay and eager agree exactly in float32. Greedy only; the prefill runs eagerly.
Split stages and speculative decoding do not use this yet.

`compile=True` hands the decode step (forward, argmax, bookkeeping; one shape) to
`torch.compile(fullgraph=True, dynamic=False)` with inductor's "default" mode (or
"max-autotune-no-cudagraphs"), never "reduce-overhead": the graph here is our own
`torch.cuda.CUDAGraph`, which records the compiled kernels, so fewer and fused kernels are what a
replay launches (a plain replay is launch-bound: ~20 small kernels a layer). The compiled step runs
`WARMUP_STEPS` times before capture, so compiling and autotuning happen outside it; its seconds are
reported apart (`compile_s`). The prefill stays eager (another shape).

Grouped-query attention reads the cache as it is, without `repeat_interleave` of the whole cache
per step: the query heads that share a KV head become that head's rows (B, nkv, G*T, d), with the
mask repeated to match. Not `scaled_dot_product_attention(enable_gqa=True)`: with a mask, neither
flash (no mask) nor memory-efficient attention (no grouped heads, sdp_utils.cpp) admits it, so it
lands on the math backend, which repeats K and V itself; the grouping here keeps the
memory-efficient kernel and is the same arithmetic per row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

GraphMode = Literal["auto", "on", "off"]
GRAPH_MODES: tuple[str, ...] = ("auto", "on", "off")
COMPILE_MODES: tuple[str, ...] = ("default", "max-autotune-no-cudagraphs")
"""Inductor modes that launch kernels only, so our own CUDA graph can record them."""
SUPPORTED_MODEL_TYPES = ("llama",)
WARMUP_STEPS = 3
"""Eager steps on a side stream before capture (cuBLAS handles, allocator), as torch's docs ask."""
SLOT_ALIGN = 16
"""Cache slots are allocated in multiples of this, so memory-efficient attention's mask needs no
padding; slots past `max_len` are never valid."""
EOS_CHECK_EVERY = 16
"""With an end-of-sequence id, the host asks whether every row has ended once per this many steps
(each ask is a sync)."""


@dataclass
class StaticGeneration:
    tokens: torch.Tensor
    """(B, new) generated ids on the CPU; rows that ended are padded with pad_token_id."""
    prefill_s: float
    """The prompt's forward and the first token."""
    decode_s: float
    """The steps after the first token, the device synchronised at both ends."""
    capture_s: float
    """Warm-up and graph capture, paid once per decoder (0 when eager or captured before);
    with `compile=True` the compiling is not in it but in `compile_s`."""
    graphs: bool
    compile_s: float = 0.0
    """The compiled step's first run (tracing, inductor, autotuning), paid once per decoder."""
    compiled: bool = False

    @property
    def per_token_ms(self) -> float:
        """Milliseconds per token after the first."""
        return 1000 * self.decode_s / max(1, self.tokens.shape[1] - 1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def positions_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows, as Hugging Face `generate` computes them."""
    positions = attention_mask.long().cumsum(-1) - 1  # (B, T)
    return positions.masked_fill(attention_mask == 0, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StaticDecoder:
    """A Llama causal LM's greedy decoder with a KV cache of `max_len` slots for `batch_size` rows.

    `graphs`: "on" captures the decode step in a CUDA graph (a CUDA model only), "off" runs it
    eagerly, "auto" is "on" exactly where the model is on CUDA. `compile`: the decode step
    through `torch.compile` (inductor, `compile_mode`), captured in the graph where graphs are on.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_len: int,
        batch_size: int = 1,
        graphs: GraphMode = "auto",
        compile: bool = False,
        compile_mode: str = "default",
    ) -> None:
        config = model.config
        if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"StaticDecoder supports model_type {SUPPORTED_MODEL_TYPES}, "
                f"not {getattr(config, 'model_type', None)!r}"
            )
        if graphs not in GRAPH_MODES:
            raise ValueError(f"graphs={graphs!r}: pick one of {GRAPH_MODES}")
        if not (isinstance(max_len, int) and max_len >= 2):
            raise ValueError(f"max_len={max_len!r} must be an int >= 2")
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode={compile_mode!r}: pick one of {COMPILE_MODES}")
        device = next(model.parameters()).device
        if graphs == "on" and device.type != "cuda":
            raise ValueError(f"graphs='on' needs the model on a CUDA device, it is on {device}")
        self.model = model
        self.device = device
        self.graphs = graphs == "on" or (graphs == "auto" and device.type == "cuda")
        self.max_len = max_len
        self.batch_size = batch_size
        attn = model.model.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.num_kv_heads: int = config.num_key_value_heads
        self.kv_groups: int = config.num_attention_heads // config.num_key_value_heads
        dtype = next(model.parameters()).dtype
        num_slots = -(-max_len // SLOT_ALIGN) * SLOT_ALIGN
        cache_shape = (batch_size, self.num_kv_heads, num_slots, self.head_dim)
        on = {"device": device}
        # Zeros, not empty: a masked slot still meets V in the attention kernel (0 * NaN = NaN).
        self.k_cache = [torch.zeros(cache_shape, dtype=dtype, **on) for _ in model.model.layers]
        self.v_cache = [torch.zeros(cache_shape, dtype=dtype, **on) for _ in model.model.layers]
        self.valid = torch.zeros(batch_size, num_slots, dtype=torch.bool, **on)  # (B, S)
        self.slots = torch.arange(num_slots, **on)  # (S,)
        self.input_ids = torch.zeros(batch_size, 1, dtype=torch.long, **on)  # (B, 1)
        self.position_ids = torch.zeros(batch_size, 1, dtype=torch.long, **on)  # (B, 1)
        self.cache_position = torch.zeros(1, dtype=torch.long, **on)  # (1,): the slot written
        self.step = torch.zeros(1, dtype=torch.long, **on)  # (1,): the output column written
        self.out_tokens = torch.zeros(batch_size, max_len, dtype=torch.long, **on)  # (B, L)
        self.unfinished = torch.ones(batch_size, dtype=torch.bool, **on)  # (B,)
        self.eos_id = torch.full((1,), -1, dtype=torch.long, **on)  # -1: no end-of-sequence id
        self.pad_id = torch.zeros(1, dtype=torch.long, **on)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compiled = bool(compile)
        self.compile_mode = compile_mode
        self._decode_step = (
            torch.compile(self._step, fullgraph=True, dynamic=False, mode=compile_mode)
            if compile
            else self._step
        )
        self._warm = False  # the compiled step has run (compiled) at least once
        self._compile_s = 0.0

    # -- the model, over the static cache --------------------------------------------------

    def _attention(
        self,
        attn: Any,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache_position: torch.Tensor,
        layer: int,
    ) -> torch.Tensor:
        batch, length, _ = h.shape
        q = attn.q_proj(h).view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, d)
        k = attn.k_proj(h).view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, d)
        v = attn.v_proj(h).view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, d)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.k_cache[layer].index_copy_(2, cache_position, k)
        self.v_cache[layer].index_copy_(2, cache_position, v)
        # Query head h = j * G + g reads KV head j: group them as KV head j's G*T rows.
        groups, nkv = self.kv_groups, self.num_kv_heads
        q = q.reshape(batch, nkv, groups * length, self.head_dim)  # (B, nkv, G*T, d)
        slots = mask.shape[-1]
        mask = mask[:, :, None].expand(batch, 1, groups, length, slots)
        mask = mask.reshape(batch, 1, groups * length, slots)  # (B, 1, G*T, S)
        out = F.scaled_dot_product_attention(
            q, self.k_cache[layer], self.v_cache[layer], attn_mask=mask, scale=attn.scaling
        )  # (B, nkv, G*T, d)
        out = out.reshape(batch, nkv * groups, length, self.head_dim)  # (B, nh, T, d)
        out = out.transpose(1, 2).reshape(batch, length, -1)  # (B, T, nh * d)
        return attn.o_proj(out)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, cache_position: torch.Tensor
    ) -> torch.Tensor:
        """(B, T) ids at (B, T) positions written to slots (T,) -> (B, V) last-position logits."""
        body = self.model.model
        x = body.embed_tokens(ids)  # (B, T, H)
        cos, sin = body.rotary_emb(x, positions)  # (B, T, d) each
        # A query sees the valid slots up to its own: (B, 1, T, S)
        mask = (
            self.valid[:, None, :] & (self.slots[None, None, :] <= cache_position[None, :, None])
        )[:, None]
        for i, layer in enumerate(body.layers):
            h = layer.input_layernorm(x)
            x = x + self._attention(layer.self_attn, h, cos, sin, mask, cache_position, i)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = body.norm(x[:, -1:])  # (B, 1, H): only the last position is read
        return self.model.lm_head(x)[:, -1]  # (B, V)

    def _emit(self, logits: torch.Tensor) -> None:
        """Pick, record and feed the next token; all in place, so the graph can hold it."""
        token = logits.argmax(dim=-1)  # (B,)
        token = torch.where(self.unfinished, token, self.pad_id)
        self.unfinished &= token != self.eos_id
        self.out_tokens.index_copy_(1, self.step, token[:, None])
        self.input_ids.copy_(token[:, None])
        self.step.add_(1)

    def _step(self) -> None:
        """One decode step from the static buffers to the static buffers."""
        self.valid.index_fill_(1, self.cache_position, True)
        self._emit(self._forward(self.input_ids, self.position_ids, self.cache_position))
        self.position_ids.add_(1)
        self.cache_position.add_(1)

    # -- capture and the loop ------------------------------------------------------------------

    def _reset(self) -> None:
        for cache in (*self.k_cache, *self.v_cache):
            cache.zero_()
        self.valid.zero_()
        self.out_tokens.zero_()
        self.unfinished.fill_(True)
        for counter in (self.input_ids, self.position_ids, self.cache_position, self.step):
            counter.zero_()

    def warm_up(self) -> float:
        """Compile the step (run it once, then `WARMUP_STEPS - 1` more: autotuned kernels pick
        their configs); seconds of that first run (0 if not compiled or done)."""
        if not self.compiled or self._warm:
            return 0.0
        self._reset()
        with torch.no_grad():
            started = time.perf_counter()
            self._decode_step()
            _sync(self.device)
            compile_s = time.perf_counter() - started
            for _ in range(WARMUP_STEPS - 1):
                self._decode_step()
        _sync(self.device)
        self._warm = True
        return compile_s

    def capture(self) -> float:
        """Warm up and capture the decode step once; seconds spent (0 if done or eager). A
        compiled step is compiled first, on the same side stream, and those seconds are not
        counted here (`warm_up`'s)."""
        if not self.graphs or self.graph is not None:
            return 0.0
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._compile_s = self.warm_up()
        started = time.perf_counter()
        self._reset()
        with torch.no_grad():
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self._decode_step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._decode_step()
        _sync(self.device)
        self.graph = graph
        return time.perf_counter() - started

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
    ) -> StaticGeneration:
        """Greedy continuation of left-padded prompts (B, T), as `generate` / the lab's loop."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(
                f"input_ids must be (batch, prompt_len >= 1), got {tuple(input_ids.shape)}"
            )
        batch, prompt_len = input_ids.shape
        if batch != self.batch_size:
            raise ValueError(
                f"a batch of {batch} rows; this decoder's cache holds {self.batch_size}"
            )
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
        if prompt_len + max_new_tokens > self.max_len:
            raise ValueError(
                f"a prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} needs "
                f"{prompt_len + max_new_tokens} cache slots; "
                f"this decoder has max_len={self.max_len}"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError("attention_mask must have input_ids' shape")
        self._compile_s = 0.0
        capture_s = self.capture()  # with graphs, compiles first (in `_compile_s`, not here)
        compile_s = self._compile_s if self.graphs else self.warm_up()
        self._reset()
        self.eos_id.fill_(-1 if eos_token_id is None else eos_token_id)
        self.pad_id.fill_(pad_token_id)
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        _sync(self.device)
        started = time.perf_counter()
        self.valid[:, :prompt_len] = mask.bool()
        positions = positions_of(mask)  # (B, T)
        self._emit(self._forward(ids, positions, self.slots[:prompt_len]))
        self.position_ids.copy_(positions[:, -1:] + 1)
        self.cache_position.fill_(prompt_len)
        _sync(self.device)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        steps = 1
        while steps < max_new_tokens:
            ask = eos_token_id is not None and steps % EOS_CHECK_EVERY == 0
            if ask and not bool(self.unfinished.any()):
                break
            if self.graph is not None:
                self.graph.replay()
            else:
                self._decode_step()
            steps += 1
        _sync(self.device)
        decode_s = time.perf_counter() - started
        tokens = self.out_tokens[:, :steps].cpu()  # (B, steps)
        if eos_token_id is not None:
            ended = tokens == eos_token_id  # (B, steps)
            if bool(ended.any(dim=1).all()):  # the lab's loop stops after the last row's end
                tokens = tokens[:, : int(ended.int().argmax(dim=1).max()) + 1]
        return StaticGeneration(
            tokens, prefill_s, decode_s, capture_s, self.graph is not None, compile_s, self.compiled
        )
