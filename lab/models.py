"""Load any Hugging Face causal LM and its tokenizer: by hub id, local folder or `lab:` name.

The lab's tiny models go through the very same `from_pretrained` path as Llama-3 does; the
only difference is where the folder comes from (`lab:tiny_target` is built on first use).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from pathlib import Path

import torch

from lab.cli import UserError
from lab.config import ModelConfig
from lab.device import detect_device, resolve_dtype
from lab.pretrain import (
    RANDOM_MODELS,
    TINY_MODELS,
    ensure_random_model,
    ensure_tiny_models,
    load_preset,
    without_hf_progress_bars,
)
from lab.quantization import configure_4bit_model, quantization_config

log = logging.getLogger(__name__)

LAB_PREFIX = "lab:"


class ModelUnavailableError(UserError, ValueError):
    """The configured model cannot be found (not cached offline, missing folder, bad name)."""


def hub_offline() -> bool:
    """Whether Hugging Face hub access is switched off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


HUB_PROBE_TIMEOUT_S = 5.0


def hub_unreachable() -> str:
    """Why the Hugging Face hub (its endpoint, HF_ENDPOINT) cannot be reached: "" when a TCP
    connection to it opens within HUB_PROBE_TIMEOUT_S."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    endpoint = urlsplit(constants.ENDPOINT)
    host = endpoint.hostname or ""
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or type(exc).__name__}"
    return ""


_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
"""`name` or `org/name`: anything else is meant as a filesystem path."""


def resolve_source(cfg: ModelConfig, *, cache_dir: Path, key: str = "model") -> str:
    """A local folder or hub id `from_pretrained` can take; builds `lab:` models if missing.

    `key`: the config section `cfg` came from (`model`, `target`, `draft`), named in errors.
    """
    source = cfg.pretrained
    if source.startswith(LAB_PREFIX):
        name = source.removeprefix(LAB_PREFIX)
        if name in RANDOM_MODELS:
            return str(ensure_random_model(name, load_preset(cfg.lab_preset), cache_dir))
        if name not in TINY_MODELS:
            known = [LAB_PREFIX + n for n in (*TINY_MODELS, *RANDOM_MODELS)]
            raise ModelUnavailableError(f"{key}.pretrained={source!r}: the lab builds {known}")
        folder = ensure_tiny_models(load_preset(cfg.lab_preset), cache_dir)
        return str(folder / name)
    local = Path(source).expanduser()
    if local.is_dir():
        return str(local)
    if not _HUB_ID.match(source):
        raise ModelUnavailableError(f"{key}.pretrained={source!r} is not an existing folder")
    return source


QUIET_LOAD_BYTES = 256 * 2**20
"""A local checkpoint smaller than this loads without transformers' progress bars (a blink
each, and five of them in a local run's log); larger ones, and hub downloads, keep theirs."""


def _progress_bars_for(source: str) -> contextlib.AbstractContextManager[None]:
    folder = Path(source)
    small = folder.is_dir() and (
        sum(f.stat().st_size for f in folder.glob("*.safetensors")) < QUIET_LOAD_BYTES
    )
    return without_hf_progress_bars() if small else contextlib.nullcontext()


def _from_pretrained(loader, source: str, cfg: ModelConfig, *, key: str = "model", **kwargs):
    """Call `loader.from_pretrained`, turning 'not here, and no way to get it' into one sentence."""
    common = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code, **kwargs}
    if Path(source).is_dir():
        with _progress_bars_for(source):
            return loader.from_pretrained(source, **common)
    try:
        return loader.from_pretrained(source, local_files_only=True, **common)
    except OSError:
        if hub_offline():
            raise ModelUnavailableError(
                f"Model {source!r} is not in the local Hugging Face cache and hub access is off "
                f"(HF_HUB_OFFLINE); download it on a connected machine (`hf download {source}`) "
                f"or set {key}.pretrained=/path/to/a/local/copy."
            ) from None
    unreachable = hub_unreachable()
    if unreachable:  # said now, not after the hub client's minute of retries
        raise ModelUnavailableError(
            f"Model {source!r} is not in the local Hugging Face cache and the hub cannot be "
            f"reached from here ({unreachable}); set {key}.pretrained=/path/to/a/local/copy "
            f"(on a connected machine: `hf download {source}`), or use lab:tiny_target"
        )
    try:
        return loader.from_pretrained(source, **common)
    except OSError as exc:
        raise ModelUnavailableError(
            f"Model {source!r} is not in the local Hugging Face cache and could not be "
            f"downloaded ({str(exc).splitlines()[0][:160]}); check the name and your network, or "
            f"set {key}.pretrained=/path/to/a/local/copy."
        ) from exc


def load_tokenizer(cfg: ModelConfig, *, cache_dir: Path, key: str = "model"):
    from transformers import AutoTokenizer

    source = resolve_source(cfg, cache_dir=cache_dir, key=key)
    tokenizer = _from_pretrained(AutoTokenizer, source, cfg, key=key)
    if tokenizer.pad_token is None:  # Llama ships none; batching with padding needs one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    cfg: ModelConfig,
    *,
    cache_dir: Path,
    device: torch.device | None = None,
    for_training: bool = False,
    key: str = "model",
):
    """The model of `cfg` on `device` (detected when None), in its configured dtype.

    `model.quantization=4bit` loads NF4 weights through bitsandbytes for every linear layer
    whose shape runs correctly here (probed: see `lab.quantization`), the others in full
    precision; where no layer does, it warns once and loads full precision.
    `for_training=True` leaves the model in train mode; inference models come back in eval mode.
    `key`: the config section `cfg` came from, named in errors (`target.pretrained=...`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    device = device or detect_device()
    dtype = resolve_dtype(cfg.dtype, device)
    source = resolve_source(cfg, cache_dir=cache_dir, key=key)
    kwargs: dict = {"dtype": dtype}
    precision, plan = "", None
    if cfg.quantization == "4bit":
        hf_config = _from_pretrained(AutoConfig, source, cfg, key=key)
        if getattr(hf_config, "quantization_config", None):  # saved quantized: load as saved
            precision = "a checkpoint quantized when saved (its own quantization config)"
            kwargs["device_map"] = {"": device}
        else:
            bnb_config, plan, precision = quantization_config(
                hf_config,
                device=device,
                compute_dtype=dtype,
                for_training=for_training,
                trust_remote_code=cfg.trust_remote_code,
            )
            if bnb_config is not None:
                kwargs["quantization_config"] = bnb_config
                kwargs["device_map"] = {"": device}
    model = _from_pretrained(AutoModelForCausalLM, source, cfg, key=key, **kwargs)
    if plan is not None:
        configure_4bit_model(model, for_training=for_training, plan=plan)
    elif "device_map" not in kwargs:
        model.to(device)
    model.train(for_training)
    log.info(
        "loaded %s (%s) on %s as %s%s",
        cfg.name,
        source,
        device,
        dtype,
        f", {precision}" if precision else "",
    )
    return model


def count_4bit_layers(model: torch.nn.Module) -> int:
    """How many of `model`'s layers hold bitsandbytes 4-bit weights (0 in full precision)."""
    bnb = sys.modules.get("bitsandbytes")  # not imported: nothing can be 4-bit
    if bnb is None:
        return 0
    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
