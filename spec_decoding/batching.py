"""One target forward for several sessions: the verifier batching its drafters.

Each session keeps its own KV cache (`CachedDecoder`) and asks for forwards as before; the
sessions' threads meet here. Whoever asks while no forward runs leads: it takes every request
waiting (its own among them), runs them as one padded batch, hands each its logits and its
grown cache, and leads again while requests wait; the others sleep until theirs is done. No
request waits for company: a batch is what arrived while the last forward ran (continuous
batching), so one session alone runs exactly as it did without this.

The batch: past caches left-padded to the longest, new tokens right-padded to the longest, an
attention mask that hides both paddings and each row's own position ids, so every row sees
its own prefix only. Afterwards each row's cache is cut back out (its padding dropped): a
session that leaves takes its cache with it, one that joins brings its own.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

if TYPE_CHECKING:
    from spec_decoding.cache import CachedDecoder

log = logging.getLogger(__name__)

MAX_PADDING_SHARE = 0.5
"""A batch takes waiting requests, shortest first, while at most this share of its token slots
is padding (a 33-token check next to three 2-token ones would pay 4 x 33): the rest wait for
the next forward, the leader's own always in the first. (A prompt's prefill runs alone, in its
session's thread: `CachedDecoder.prefill`.)"""
GATHER_SHARE = 0.25
MAX_GATHER_S = 0.005
"""A leader with fewer requests than its last forward served waits for the others at most this
share of that forward's time (and at most this long): they are usually a moment behind, doing
their sessions' bookkeeping, and without the wait one of them started a forward alone each
time while the rest queued behind it (batches of 1 and 3 in turn for 4 sessions)."""


@dataclass
class _Request:
    decoder: CachedDecoder
    feed: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


@dataclass
class BatchStats:
    """What the batcher did, for tests, the bench and /health."""

    forwards: int = 0
    rows: int = 0
    """Session-forwards served (a forward of 3 sessions counts 3)."""
    tokens: int = 0
    """Tokens fed, padding excluded."""
    most_rows: int = 0
    failed_rows: int = 0
    """Rows whose forward failed alone (their session ends; the others' went on)."""


class BatchedTarget:
    """The target model shared by every session of a verifier; forwards batched across them."""

    def __init__(self, model: Any, *, max_batch: int = 8, pad_token_id: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be at least 1")
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.pad_token_id = pad_token_id or 0  # any id: its rows' outputs are dropped
        self.stats = BatchStats()
        self._queue: list[_Request] = []
        self._leading = False
        self._last_rows = 0
        self.sessions = 0
        """Sessions open on the verifier (it counts them): a leader waits for no more."""
        self._last_forward_s = 0.0
        self._cond = threading.Condition()

    def run(self, decoder: CachedDecoder, feed: list[int]) -> torch.Tensor:
        """Feed `feed` after `decoder`'s cache; (len(feed), V) float logits. The decoder's
        cache has grown by `feed` when this returns. Blocks while other sessions' forwards
        run; raises what its own forward raised, never another's."""
        request = _Request(decoder, list(feed))
        with self._cond:
            self._queue.append(request)
            self._cond.notify_all()  # a leader gathering a batch counts it
            while not request.done.is_set():
                if self._leading:
                    self._cond.wait()
                    continue
                self._leading = True
                self._gather()
                batch = self._take(request)
                self._cond.release()
                try:
                    self._serve(batch)
                finally:
                    self._cond.acquire()
                    self._leading = False
                    self._cond.notify_all()
        if request.error is not None:
            raise request.error
        assert request.logits is not None
        return request.logits

    def _gather(self) -> None:
        """(The lock held, leading.) Wait a moment for the last forward's other sessions."""
        expected = min(self._last_rows, self.sessions, self.max_batch)
        deadline = time.monotonic() + min(GATHER_SHARE * self._last_forward_s, MAX_GATHER_S)
        while len(self._queue) < expected:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)

    def _take(self, own: _Request) -> list[_Request]:
        """The next batch (the lock held): `own` first if still waiting, then the shortest
        waiting, within `max_batch` and `MAX_PADDING_SHARE`."""
        waiting = sorted(self._queue, key=lambda r: (r is not own, len(r.feed)))
        batch = [waiting[0]]
        for request in waiting[1:]:
            if len(batch) == self.max_batch:
                break
            rows = [*batch, request]
            longest = max(len(r.feed) for r in rows)
            real = sum(len(r.feed) for r in rows)
            if (longest * len(rows) - real) > MAX_PADDING_SHARE * longest * len(rows):
                continue
            batch.append(request)
        for request in batch:
            self._queue.remove(request)
        return batch

    def _serve(self, batch: list[_Request]) -> None:
        """Run one batch; a batch that fails is run again row by row, so a row that fails
        alone fails only its own session."""
        started = time.perf_counter()
        try:
            outputs = self.forward([(r.decoder, r.feed) for r in batch])
            self._last_rows, self._last_forward_s = len(batch), time.perf_counter() - started
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error = exc
                self.stats.failed_rows += 1
                batch[0].done.set()
                return
            log.warning("a batched forward of %d sessions failed: each runs alone", len(batch))
            for request in batch:
                self._serve([request])
            return
        for request, logits in zip(batch, outputs, strict=True):
            request.logits = logits
            request.done.set()

    @torch.inference_mode()
    def forward(self, jobs: list[tuple[CachedDecoder, list[int]]]) -> list[torch.Tensor]:
        """One forward over `jobs` (decoder, tokens to feed after its cache): each decoder's
        cache grown by its tokens, and its (len(feed), V) float logits."""
        if len(jobs) == 1:  # alone: exactly the unbatched forward
            decoder, feed = jobs[0]
            input_ids = torch.tensor([feed], dtype=torch.long, device=self.device)  # (1, T)
            out = self.model(input_ids=input_ids, past_key_values=decoder.cache, use_cache=True)
            decoder.cache = out.past_key_values
            self._count([len(feed)])
            return [out.logits[0].float()]
        past = [len(d.cached) for d, _ in jobs]
        fed = [len(f) for _, f in jobs]
        longest_past, longest_feed = max(past), max(fed)
        width = longest_past + longest_feed
        input_ids = torch.full((len(jobs), longest_feed), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(jobs), width, dtype=torch.long)  # (B, past + new)
        positions = torch.zeros(len(jobs), longest_feed, dtype=torch.long)  # (B, new)
        for row, ((_, feed), length) in enumerate(zip(jobs, past, strict=True)):
            input_ids[row, : len(feed)] = torch.tensor(feed)
            mask[row, longest_past - length : longest_past + len(feed)] = 1
            positions[row] = torch.arange(length, length + longest_feed)
        cache = _padded_cache([d.cache for d, _ in jobs], past, longest_past)
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits.float()  # (B, new, V)
        rows = [  # every row's cache built before any session takes its own: a failure here
            _row_cache(out.past_key_values, row, longest_past - length, longest_past + len(feed))
            for row, ((_, feed), length) in enumerate(zip(jobs, past, strict=True))
        ]  # (out of memory) leaves every cache as it was, and the rows rerun alone
        for (decoder, _), own in zip(jobs, rows, strict=True):
            decoder.cache = own
        self._count(fed)
        return [logits[row, : len(feed)] for row, (_, feed) in enumerate(jobs)]

    def _count(self, fed: list[int]) -> None:
        stats = self.stats
        stats.forwards += 1
        stats.rows += len(fed)
        stats.tokens += sum(fed)
        stats.most_rows = max(stats.most_rows, len(fed))


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """A DynamicCache's (keys, values) per layer, each (1, heads, length, head_dim); None
    while it holds nothing."""
    layers = getattr(cache, "layers", None) or []
    pairs = [(layer.keys, layer.values) for layer in layers if layer.keys is not None]
    if not pairs or pairs[0][0].numel() == 0:
        return None
    return pairs


def _padded_cache(caches: list[Any], past: list[int], longest: int) -> DynamicCache:
    """The sessions' caches as one, each row left-padded with zeros to `longest` tokens."""
    per_session = [_layers(c) for c in caches]
    template = next((p for p in per_session if p is not None), None)
    batched = DynamicCache()
    if template is None or longest == 0:
        return batched
    for index, (keys, values) in enumerate(template):
        heads, dim = keys.shape[1], keys.shape[-1]
        shape = (len(caches), heads, longest, dim)  # (B, heads, past, head_dim)
        all_keys = keys.new_zeros(shape)
        all_values = values.new_zeros((len(caches), values.shape[1], longest, values.shape[-1]))
        for row, (layers, length) in enumerate(zip(per_session, past, strict=True)):
            if layers is None or length == 0:
                continue
            all_keys[row, :, longest - length :] = layers[index][0][0]
            all_values[row, :, longest - length :] = layers[index][1][0]
        batched.update(all_keys, all_values, index)
    return batched


def _row_cache(cache: Any, row: int, start: int, end: int) -> DynamicCache:
    """Row `row` of a batched cache, positions start..end (its padding cut), as its own."""
    own = DynamicCache()
    for index, layer in enumerate(cache.layers):
        keys = layer.keys[row : row + 1, :, start:end].clone()  # (1, heads, length, head_dim)
        values = layer.values[row : row + 1, :, start:end].clone()
        own.update(keys, values, index)
    return own
