"""spec_decoding's config schema (`conf/spec_decoding.yaml`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lab.config import Endpoint, LabConfig, ModelConfig, check_fields_positive
from lab.serving import ServeConfig

MAX_GAMMA = 32
"""Most tokens one draft may hold (the verifier refuses more)."""
MAX_BRANCH_DEPTH = 16
"""Most tokens one branch may hold, its root included (the verifier refuses more)."""
MAX_BRANCH_WIDTH = 4
"""Most branches at one drafted position (the verifier refuses more)."""
MAX_BATCH_HOLD_MS = 1000
"""The longest `spec.batch_hold_ms` a session may ask for (the verifier refuses more)."""


@dataclass
class SpecConfig:
    verifier: Endpoint = field(default_factory=lambda: Endpoint(port=29520))
    """Where the verifier (the target model) listens and drafters dial (TCP). Its host defaults
    to cluster.master.host (conf/spec_decoding.yaml), so a cluster file names the serving host
    once; a local run picks a free port."""
    gamma: str = "auto"
    """Draft length: a number of tokens, or `auto` (the expected-speedup model picks it)."""
    max_gamma: int = 32
    """Largest draft length (or window) `auto` may choose."""
    pipeline: bool = True
    """Keep drafting while the verifier checks (tokens stream; gamma = how many may await its
    word). False: the classic rounds, where the drafter waits for each verdict."""
    decode_alone: bool = True
    """Pipelined: the verifier decodes by itself whenever no drafted token has reached it for
    its next position (after a rejection, while the drafter has not heard of it), so a slow
    link never leaves the target idle; drafts that arrive for positions it has decoded are
    compared with its tokens. False: it waits for the drafter (as good or better for a draft
    that costs a third of its target or more on a near link: docs/spec_decoding.md)."""
    branch_depth: int = 0
    """Pipelined: after each drafted token, the drafter drafts branches rooted at its
    next-best tokens there, this many tokens each (0: no branches); where the verifier's token
    is a branch's root, it checks on along that branch without waiting a round trip for the
    drafter. With `gamma=auto`, the most: the pipeline model picks the depth (0 where branches
    do not pay). Off by default: on the 2-core bench machine they did not pay
    (docs/spec_decoding.md)."""
    branch_width: int = 1
    """Pipelined: branches at each drafted position (its 2nd, 3rd, ... likeliest tokens)."""
    branch_flatness: float = 0.75
    """Pipelined, with branches: branch a drafted token only where the draft is unsure of it,
    its next-best token at least this likely next to it (p2 / p1, the exponent of their
    logits' gap; sampling: of log q + the position's noise). 0: every drafted token. On the
    bench pair, p2 / p1 >= 0.75 marks 38% of the positions and holds 63% of the wrong guesses
    (`python bench/spec_decoding_bench.py --costs`)."""
    temperature: float = 0.0
    """0: greedy (output identical to the target's own greedy decoding); > 0: sampling."""
    top_p: float = 1.0
    draft_top_k: int = 0
    """Sampling: the drafter drafts only from its k likeliest tokens (0: every token within
    top_p). Output stays distributed as the target's (the drafter samples from exactly the q it
    sends); fewer q entries travel per drafted token, at some cost in acceptance."""
    max_new_tokens: int = 64
    num_prompts: int = 4
    """Prompts taken from the held-out stdlib corpus (the start of validation files)."""
    prompt_tokens: int = 32
    baseline: bool = True
    """Also time target-only generation on the verifier, on the same prompts, in the same run."""
    seed: int = 0
    serve_stats: bool = False
    """The verifier answers STATS: its batcher's counts over every session (forwards, rows,
    drafted tokens, waits). For benches: from their changes a peer with the secret could follow
    other sessions' activity, so off unless asked."""
    max_batch: int = 8
    """The verifier: most sessions (drafters) one target forward serves. Their forwards that are
    ready at the same moment run as one padded batch, each with its own KV cache and positions
    (1: every forward serves one session)."""
    batch_cache_tokens: int = 0
    """The verifier: most KV-cache positions one batched forward may hold, padding included:
    rows x (the longest past + the longest new). A batch takes a session only while it fits, so
    a long session runs in a smaller batch or alone instead of padding every row to its length
    (the oldest waiting forward always runs: none starves). 0: auto, `max_batch` rows of
    min(session cap, 2048) (the verifier logs what that is in MiB for its target)."""
    batch_hold_ms: float = 0.0
    """The drafter's sessions consent to be held this long (ms) at the verifier for other
    sessions to share their forwards (spec_decoding/batching.py): each client's latency traded
    for the target host's capacity, worth it where drafters in DRAFT rounds across a link reach
    the verifier one at a time (docs/spec_decoding.md). 0: never held; a session that asks for
    none is never held for another's."""
    serve_sessions: int = 4
    """`role=serve`: generations the endpoint runs at once, each its own session on the
    verifier (which batches their forwards, up to `max_batch`); more requests queue."""

    def __post_init__(self) -> None:
        self.verifier.check("spec.verifier")
        if self.gamma != "auto":
            try:
                value = int(self.gamma)
            except ValueError:
                raise ValueError(
                    f"spec.gamma={self.gamma!r} must be `auto` or a number of tokens"
                ) from None
            if not 1 <= value <= MAX_GAMMA:
                raise ValueError(f"spec.gamma={value} must be in 1..{MAX_GAMMA}")
        if not 1 <= self.max_gamma <= MAX_GAMMA:
            raise ValueError(f"spec.max_gamma={self.max_gamma} must be in 1..{MAX_GAMMA}")
        if self.temperature < 0:
            raise ValueError(f"spec.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"spec.top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.branch_depth <= MAX_BRANCH_DEPTH:
            raise ValueError(
                f"spec.branch_depth={self.branch_depth} must be in 0..{MAX_BRANCH_DEPTH} (0: off)"
            )
        if not 1 <= self.branch_width <= MAX_BRANCH_WIDTH:
            raise ValueError(
                f"spec.branch_width={self.branch_width} must be in 1..{MAX_BRANCH_WIDTH}"
            )
        if not 0 <= self.branch_flatness <= 1:  # (False for NaN)
            raise ValueError(
                f"spec.branch_flatness={self.branch_flatness} must be in 0..1 (0: every token)"
            )
        if self.batch_cache_tokens < 0:
            raise ValueError(
                f"spec.batch_cache_tokens={self.batch_cache_tokens} must be >= 0 (0: auto)"
            )
        if not 0 <= self.batch_hold_ms <= MAX_BATCH_HOLD_MS:  # (False for NaN)
            raise ValueError(
                f"spec.batch_hold_ms={self.batch_hold_ms} must be in 0..{MAX_BATCH_HOLD_MS} "
                "(0: never held)"
            )
        if self.draft_top_k < 0:
            raise ValueError(f"spec.draft_top_k={self.draft_top_k} must be >= 0 (0: off)")
        check_fields_positive(
            "spec",
            self,
            ("max_new_tokens", "num_prompts", "prompt_tokens", "max_batch", "serve_sessions"),
        )

    @property
    def fixed_gamma(self) -> int | None:
        return None if self.gamma == "auto" else int(self.gamma)


@dataclass
class SpecDecodingRunConfig(LabConfig):
    """Schema of `conf/spec_decoding.yaml`."""

    target: ModelConfig = field(default_factory=ModelConfig)
    draft: ModelConfig = field(
        default_factory=lambda: ModelConfig(name="tiny_draft", pretrained="lab:tiny_draft")
    )
    spec: SpecConfig = field(default_factory=SpecConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    """`role=serve` (on the drafter's host): the OpenAI-compatible endpoint (docs/serving.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unread = {
            name: value
            for name, value in asdict(self.model).items()
            if value != getattr(ModelConfig(), name)
        }
        if unread:  # `model` comes from the shared base config; this experiment has two
            key, value = next(iter(unread.items()))
            raise ValueError(
                f"spec_decoding reads target.* and draft.*, not model.*: model.{key}={value!r} "
                f"would be ignored; set target.{key} (the verifier's model) or draft.{key} "
                "(the drafter's) instead"
            )
