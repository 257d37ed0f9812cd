"""Build the lab's offline models: `python -m lab.pretrain [pretrain=debug] [pretrain.*=...]`.

Trains, on the stdlib corpus, a byte-level BPE tokenizer and two Llama-architecture models that
share it: `tiny_target` (several layers) and `tiny_draft` (one or two layers, distilled from the
target so that their greedy choices agree often, which speculative decoding needs). Both are
saved as ordinary Hugging Face model folders, so every module loads them exactly as it would
load Llama-3 from the hub.

Layout: `$LAB_CACHE/tiny_models/<preset>-<hash of the preset's settings>/{tiny_target,tiny_draft}`,
each folder with config.json, model.safetensors, tokenizer files and `lab_pretrain.json` (the
settings, step count and validation loss that produced it). A changed setting gets a new folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from lab import atomic
from lab.config import CONF_DIR, LabConfig, check_fields_positive, register_schema, to_settings
from lab.corpus import load_corpus, token_blocks
from lab.losses import device_of, evaluate, next_token_loss
from lab.waiting import EVERY_S, FIRST_S, Wait, speaking

log = logging.getLogger(__name__)

TINY_MODELS = ("tiny_target", "tiny_draft")
META_FILE = "lab_pretrain.json"

RANDOM_MODELS = {"random_long": 4096}
"""Untrained models of the preset's target shape and tokenizer, with a long position limit (the
value): for measuring cost over context lengths the trained models cannot reach (run_matrix).
Their text is noise; their cost per token is that of a trained model of the same shape."""


@dataclass
class TinyModelSpec:
    """Shape of one tiny Llama model."""

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    intermediate_size: int = 344

    def __post_init__(self) -> None:
        check_fields_positive(
            "pretrain.*", self, ("num_layers", "hidden_size", "num_heads", "intermediate_size")
        )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )


@dataclass
class PretrainConfig:
    """How the tiny models are built (`conf/pretrain/<preset>.yaml`)."""

    preset: str = "default"
    """Name of the preset (`conf/pretrain/<preset>.yaml` holds what differs from these
    defaults, which are the `default` preset: about 3-4 minutes on 2 CPU cores)."""
    seed: int = 0
    vocab_size: int = 1024
    context_length: int = 128
    """Training block length and the models' max_position_embeddings."""
    train_chars: int = 3_000_000
    """Corpus budget (characters of stdlib source) for tokenizer and model training."""
    val_fraction: float = 0.05
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 30
    target_steps: int = 900
    draft_steps: int = 1200
    """The draft learns only from the target's distributions (distill_alpha 0): on held-out
    blocks it then picks the target's next token far more often than after 300 steps of half
    text, half target, and speculative decoding's speed rests on that agreement."""
    distill_alpha: float = 0.0
    """Draft loss = alpha * cross-entropy on the text + (1 - alpha) * KL to the target."""
    distill_temperature: float = 1.0
    eval_blocks: int = 64
    num_threads: int = 0
    """torch intra-op threads while training; 0 keeps torch's default (all cores). Pin it to
    get bit-identical weights from a rebuild on the same machine."""
    target: TinyModelSpec = field(default_factory=TinyModelSpec)
    """tiny_target: 4 Llama layers, 1.05M parameters."""
    draft: TinyModelSpec = field(
        default_factory=lambda: TinyModelSpec(
            num_layers=1, hidden_size=64, num_heads=2, intermediate_size=172
        )
    )
    """tiny_draft: 1 layer, 0.18M parameters, distilled from the target."""

    def __post_init__(self) -> None:
        check_fields_positive(
            "pretrain",
            self,
            (
                "vocab_size",
                "context_length",
                "train_chars",
                "batch_size",
                "lr",
                "target_steps",
                "draft_steps",
                "eval_blocks",
            ),
        )
        if not 0.0 <= self.distill_alpha <= 1.0:
            raise ValueError(f"pretrain.distill_alpha={self.distill_alpha} must be in [0, 1]")
        if self.vocab_size < 300:
            raise ValueError(
                f"pretrain.vocab_size={self.vocab_size} must be >= 300 "
                "(256 byte symbols + special tokens + merges)"
            )

    def fingerprint(self) -> str:
        """Short hash of every setting that changes the result (not the thread count)."""
        settings = asdict(self)
        settings.pop("num_threads")
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


@dataclass
class PretrainRunConfig(LabConfig):
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)


register_schema("pretrain_schema", PretrainRunConfig)


@contextlib.contextmanager
def without_hf_progress_bars() -> Iterator[None]:
    """transformers' own progress bars off for the block (loading or writing a small model)."""
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def load_preset(name: str) -> PretrainConfig:
    """The pretraining settings of `conf/pretrain/<name>.yaml`, validated."""
    path = CONF_DIR / "pretrain" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(
            f"model.lab_preset={name!r} is not a pretrain preset; choose one of {known}"
        )
    merged = OmegaConf.merge(OmegaConf.structured(PretrainConfig), OmegaConf.load(path))
    return to_settings(merged, PretrainConfig)


def models_dir(cfg: PretrainConfig, cache_dir: Path) -> Path:
    return Path(cache_dir) / "tiny_models" / f"{cfg.preset}-{cfg.fingerprint()}"


def is_built(folder: Path) -> bool:
    return all((folder / name / META_FILE).is_file() for name in TINY_MODELS)


def ensure_tiny_models(cfg: PretrainConfig, cache_dir: Path) -> Path:
    """The folder holding tiny_target and tiny_draft for `cfg`, training them if missing.

    Safe when several processes ask at once (the local launcher starts roles together): one
    trains under a file lock, the others wait and then load. Written to a temporary folder and
    renamed into place, so a crash never leaves a half-written model behind.
    """
    folder = models_dir(cfg, cache_dir)
    if is_built(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    progress = BuildProgress(folder.parent / f".{folder.name}{PROGRESS_SUFFIX}")
    waiting = Wait(
        "another process's build of the lab's tiny models",
        where=str(folder),
        key=f"model.lab_preset={cfg.preset}",
        progress=progress.read,
    )
    with _file_lock(folder.parent / f".{folder.name}.lock", waiting=waiting):
        if is_built(folder):  # built by another process while we waited
            return folder
        log.info("training the lab's tiny models into %s", folder)
        try:
            with atomic.staged_dir(folder) as staging:
                _build(cfg, staging, progress=progress)
        finally:
            progress.clear()
    return folder


PROGRESS_SUFFIX = ".progress"
"""Beside a build's lock: the builder's progress (JSON), which the processes waiting show."""


class BuildProgress:
    """How far a tiny-model build has come, in a small file beside its lock: the builder
    writes it (at most once a second), a process waiting on the lock reads it into its line."""

    def __init__(self, path: Path, *, clock=time.time) -> None:
        self.path, self.clock = path, clock
        self._written = -math.inf

    def update(self, phase: str, done: int, total: int, *, started: float, then: str = "") -> None:
        """`phase` (tiny_target) at step `done` of `total`, begun at `started` (clock time);
        `then`: what follows it."""
        now = self.clock()
        if now - self._written < 1.0 and done < total:
            return
        self._written = now
        left = (now - started) / done * (total - done) if done else None
        record = {"pid": os.getpid(), "phase": phase, "done": done, "total": total,
                  "left_s": left, "then": then, "time": now}  # fmt: skip
        with contextlib.suppress(OSError):  # progress is a courtesy: never fails the build
            atomic.write_text(self.path, json.dumps(record))

    def read(self) -> str:
        """The builder's progress in words ("" when it has written none)."""
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return ""
        text = f"pid {record['pid']} is at {record['phase']}"
        if record.get("total"):
            text += f" step {record['done']} of {record['total']}"
        if record.get("left_s") is not None:
            text += f", about {_duration(record['left_s'])} left of it"
        if record.get("then"):
            text += f", then {record['then']}"
        quiet = self.clock() - float(record.get("time", self.clock()))
        if quiet > 60:
            text += f" (its last word {_duration(quiet)} ago)"
        return text

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min {seconds % 60:02d} s"


def ensure_random_model(name: str, cfg: PretrainConfig, cache_dir: Path) -> Path:
    """The folder of random-init model `name` (see RANDOM_MODELS), built once beside the
    preset's tiny models (whose tokenizer it shares; they are built first if missing)."""
    if name not in RANDOM_MODELS:
        raise ValueError(f"no random-init lab model {name!r}; choose one of {list(RANDOM_MODELS)}")
    tiny = ensure_tiny_models(cfg, cache_dir)
    folder = tiny / name
    if (folder / META_FILE).is_file():
        return folder
    with _file_lock(tiny.parent / f".{tiny.name}-{name}.lock"):
        if (folder / META_FILE).is_file():
            return folder
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny / "tiny_target")
        torch.manual_seed(cfg.seed)
        model = build_llama(
            cfg.target,
            vocab_size=len(tokenizer),
            context_length=RANDOM_MODELS[name],
            tokenizer=tokenizer,
        )
        with atomic.staged_dir(folder) as staging, without_hf_progress_bars():
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            meta = {"name": name, "pretrain": asdict(cfg), "random_init": True}
            (staging / META_FILE).write_text(json.dumps(meta, indent=2))
    return folder


@contextlib.contextmanager
def _file_lock(path: Path, *, waiting: Wait | None = None) -> Iterator[None]:
    """Hold `path`'s lock for the block; while another process holds it, `waiting` speaks."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with speaking(waiting) if waiting else contextlib.nullcontext():
                fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def train_tokenizer(texts: list[str], *, vocab_size: int):
    """A byte-level BPE tokenizer (any text encodes; no unknown tokens) as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1_000_000,
    )


def build_llama(spec: TinyModelSpec, *, vocab_size: int, context_length: int, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=context_length,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def _lr_at(step: int, *, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )


def train_lm(
    model,
    blocks: torch.Tensor,
    *,
    cfg: PretrainConfig,
    steps: int,
    description: str,
    teacher=None,
    progress: BuildProgress | None = None,
    then: str = "",
    clock=time.monotonic,
) -> float:
    """Train `model` on random blocks; distil from `teacher` when given. Returns the last loss.

    Shows a bar with the time left; a line with it too, within seconds and every 30 s (the bar
    shows nothing where the output is not a terminal: a log, a role's pipe); and writes it to
    `progress` for the processes waiting on this build."""
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    model.train()
    loss_value = float("nan")
    started, wall_started = clock(), time.time()
    next_line = started + FIRST_S
    with _progress() as bar:
        task = bar.add_task(description, total=steps, loss=float("nan"))
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, total=steps, warmup=cfg.warmup_steps, peak=cfg.lr)
            batch = blocks[torch.randint(len(blocks), (cfg.batch_size,), generator=generator)]
            full_logits = model(input_ids=batch).logits  # (B, T, V)
            loss = next_token_loss(full_logits, batch)
            logits, targets = full_logits[:, :-1], batch[:, 1:]  # (B, T-1, V), (B, T-1)
            if teacher is not None:
                with torch.no_grad():
                    teacher_logits = teacher(input_ids=batch).logits[:, :-1]  # (B, T-1, V)
                temp = cfg.distill_temperature
                kl = F.kl_div(
                    F.log_softmax(logits / temp, dim=-1),
                    F.log_softmax(teacher_logits / temp, dim=-1),
                    log_target=True,
                    reduction="batchmean",
                ) / targets.size(1)
                loss = cfg.distill_alpha * loss + (1 - cfg.distill_alpha) * kl * temp**2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss_value = loss.item()
            bar.update(task, advance=1, loss=loss_value)
            if progress is not None:
                progress.update(description, step + 1, steps, started=wall_started, then=then)
            now = clock()
            if now >= next_line or step + 1 == steps:
                next_line = now + EVERY_S
                left = (now - started) / (step + 1) * (steps - step - 1)
                log.info("%s: step %d of %d, loss %.4f, %s so far, about %s left%s", description,
                         step + 1, steps, loss_value, _duration(now - started), _duration(left),
                         f" (then {then})" if then and step + 1 < steps else "")  # fmt: skip
    model.eval()
    return loss_value


@torch.no_grad()
def greedy_agreement(draft, target, blocks: torch.Tensor, *, batch_size: int = 16) -> float:
    """Share of positions where draft and target pick the same next token (greedy)."""
    device = device_of(target)
    same, count = 0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size].to(device)
        same += (
            (draft(input_ids=batch).logits.argmax(-1) == target(input_ids=batch).logits.argmax(-1))
            .sum()
            .item()
        )
        count += batch.numel()
    return same / count


def _build(
    cfg: PretrainConfig, out_dir: Path, *, progress: BuildProgress | None = None
) -> dict[str, Any]:
    threads_before = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        torch.manual_seed(cfg.seed)
        started = time.perf_counter()
        if progress is not None:
            progress.update("the tokenizer", 0, 0, started=time.time(),
                            then=f"tiny_target ({cfg.target_steps} steps)")  # fmt: skip
        corpus = load_corpus(val_fraction=cfg.val_fraction, max_train_chars=cfg.train_chars)
        train_texts = [doc.text for doc in corpus.train]
        tokenizer = train_tokenizer(train_texts, vocab_size=cfg.vocab_size)
        train_blocks = token_blocks(train_texts, tokenizer, block_size=cfg.context_length)
        val_blocks = token_blocks(
            [doc.text for doc in corpus.validation],
            tokenizer,
            block_size=cfg.context_length,
            max_blocks=cfg.eval_blocks,
        )
        log.info(
            "corpus: %s; %d train blocks, %d validation blocks of %d tokens",
            corpus.source,
            len(train_blocks),
            len(val_blocks),
            cfg.context_length,
        )
        common = {
            "vocab_size": len(tokenizer),
            "context_length": cfg.context_length,
            "tokenizer": tokenizer,
        }
        target = build_llama(cfg.target, **common)
        train_lm(target, train_blocks, cfg=cfg, steps=cfg.target_steps, description="tiny_target",
                 progress=progress, then=f"tiny_draft ({cfg.draft_steps} steps)")  # fmt: skip
        draft = build_llama(cfg.draft, **common)
        train_lm(
            draft,
            train_blocks,
            cfg=cfg,
            steps=cfg.draft_steps,
            description="tiny_draft",
            teacher=target,
            progress=progress,
        )
        metrics = {
            "target_val_loss": evaluate(target, val_blocks),
            "draft_val_loss": evaluate(draft, val_blocks),
            "draft_target_agreement": greedy_agreement(draft, target, val_blocks),
            "target_params": sum(p.numel() for p in target.parameters()),
            "draft_params": sum(p.numel() for p in draft.parameters()),
            "train_tokens": train_blocks.numel(),
            "build_seconds": time.perf_counter() - started,
        }
        for name, model in (("tiny_target", target), ("tiny_draft", draft)):
            folder = out_dir / name
            with without_hf_progress_bars():  # a blink for a tiny model
                model.save_pretrained(folder)  # config.json + model.safetensors
                tokenizer.save_pretrained(folder)
            meta = {
                "name": name,
                "pretrain": asdict(cfg),
                "metrics": metrics,
                "val_loss": metrics[f"{name.removeprefix('tiny_')}_val_loss"],
                "corpus": corpus.source,
                "torch": torch.__version__,
            }
            (folder / META_FILE).write_text(json.dumps(meta, indent=2))
        return metrics
    finally:
        torch.set_num_threads(threads_before)


def read_build_metrics(folder: Path) -> dict[str, float]:
    meta = json.loads((folder / "tiny_target" / META_FILE).read_text())
    return {k: float(v) for k, v in meta["metrics"].items()}


def run(cfg: DictConfig | PretrainRunConfig) -> dict[str, float]:
    """Build (or find) the tiny models for `cfg.pretrain`; returns their headline metrics."""
    from lab.tables import print_wide
    from lab.tracking import Tracker

    settings = to_settings(cfg, PretrainRunConfig)
    with Tracker.from_settings(settings, job="pretrain") as tracker:
        folder = ensure_tiny_models(settings.pretrain, settings.paths.cache_path)
        metrics = read_build_metrics(folder)
        tracker.summary(metrics)
        log.info("tiny models ready in %s", folder)
        if settings.tracking.console:
            print_wide(models_table(folder, metrics))
        print(f"tiny_target: {folder / 'tiny_target'}\ntiny_draft:  {folder / 'tiny_draft'}")
        return metrics


def models_table(folder: Path, metrics: dict[str, float]) -> Table:
    """The README's table of the tiny pair: layers, parameters, validation loss; and how often
    the draft picks the target's greedy token."""
    table = Table(title=f"tiny models ({folder.name})", title_justify="left")
    for column in ("model", "layers", "parameters", "validation loss (nats/token)"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name in TINY_MODELS:
        layers = json.loads((folder / name / "config.json").read_text())["num_hidden_layers"]
        short = name.removeprefix("tiny_")
        table.add_row(
            name,
            str(layers),
            f"{metrics[f'{short}_params'] / 1e6:.2f} M",
            f"{metrics[f'{short}_val_loss']:.3f}",
        )
    table.caption = (
        f"the draft picks the target's greedy token at "
        f"{metrics['draft_target_agreement']:.1%} of validation positions; "
        f"built in {metrics['build_seconds']:.0f} s"
    )
    return table


@hydra.main(version_base="1.3", config_path="../conf", config_name="pretrain")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
