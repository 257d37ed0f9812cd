"""bitsandbytes 4-bit (NF4) loading that never crashes: each of the model's own shapes is probed.

bitsandbytes picks its kernels by device, CPU features and weight shape, and the same release
that runs a 64x64 layer can fail on a 32-wide or 344-wide one (its AVX-512-bf16 CPU path
repacks weights in blocks of 32 rows and 64 columns). So before a model loads in 4-bit, every
distinct shape of the linear layers transformers would quantize is built as a real
`Linear4bit`, set up exactly as the loaded model's will be, and run through the phases the
model will go through: train (forward and backward), eval, train again for a model that trains;
eval twice for one that only infers. Layers whose shape fails stay in full precision
(`llm_int8_skip_modules`); when none passes, the whole model loads in full precision with one
warning that says why.

The CPU repacking is switched off in models that train: after an eval forward it sends every
call, training ones too, through a kernel without autograd, so the layers below a LoRA adapter
would silently stop receiving gradients. Inference-only models keep it (it is bitsandbytes'
fast bf16 path) on the shapes where the probe saw it work, and switch it off on the shapes
where only the plain 4-bit path works. On CUDA, bitsandbytes also picks kernels by the number
of rows, so the probe runs several batch sizes there.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

QUANT_TYPE = "nf4"
DOUBLE_QUANT = True
"""How the lab quantizes: the probe builds its layers exactly as the BitsAndBytesConfig asks."""

PROBE_ROWS = {"cuda": (1, 3, 64, 2048)}
"""Rows (tokens) each probe phase runs per device type: CUDA kernels change with the count
(<= 4 rows, up to 1536, above); elsewhere 3 rows cover the one path."""

MAX_RELATIVE_ERROR = 0.5
"""A probe's output (and input gradient) may differ from full precision by at most this share
of its norm: NF4 errs by about 0.1 on random weights; garbage, zeros or NaN fail."""


@dataclass(frozen=True)
class LinearShape:
    in_features: int
    out_features: int
    bias: bool

    def __str__(self) -> str:
        return f"{self.in_features}->{self.out_features}{'+bias' if self.bias else ''}"


@dataclass(frozen=True)
class Plan4bit:
    """Which linear layers of one model load as 4-bit on this device, and why the others don't."""

    quantize: tuple[str, ...]
    """Module names that load as bitsandbytes Linear4bit."""
    keep: tuple[str, ...]
    """Module names transformers would quantize but whose shape failed the probe here."""
    failures: dict[str, str]
    """Failed shape (`in->out`) -> what went wrong."""
    no_repack: tuple[str, ...] = ()
    """Module names that run in 4-bit only with bitsandbytes' CPU repacking off."""
    default_skips: tuple[str, ...] = ()
    """What transformers leaves unquantized by itself (the LM head, ...)."""

    @property
    def skip_modules(self) -> list[str] | None:
        """`llm_int8_skip_modules`: None keeps transformers' defaults; naming any replaces them."""
        return [*self.default_skips, *self.keep] if self.keep else None

    @property
    def usable(self) -> bool:
        return bool(self.quantize)

    def describe(self) -> str:
        plain = f" ({len(self.no_repack)} without CPU repacking)" if self.no_repack else ""
        if not self.failures:
            return f"all {len(self.quantize)} linear layers in 4-bit{plain}"
        shapes = "; ".join(f"{shape}: {why}" for shape, why in self.failures.items())
        return (
            f"{len(self.quantize)} of {len(self.quantize) + len(self.keep)} linear layers in "
            f"4-bit{plain}, {len(self.keep)} kept in full precision (shapes that failed here: "
            f"{shapes})"
        )


class _NoHubKernelAdvice(logging.Filter):
    """On AVX-512-bf16 CPUs bitsandbytes tries the `kernels` package (code fetched from the
    hub at run time, which the lab never does), warns, and uses its own native kernel. The
    warning's advice to install it would send a user to the hub: say what happens instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "gemm_4bit_forward from kernels-community" not in record.getMessage():
            return True
        log.debug("bitsandbytes uses its own CPU 4-bit kernel (no hub `kernels` package)")
        return False


# Installed on import, not only before our own first import of bitsandbytes: PEFT imports it
# too, whenever it is installed, in runs that never asked for 4-bit.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoHubKernelAdvice())


def bnb_importable() -> tuple[bool, str]:
    """Whether bitsandbytes imports here (its native library can be missing or broken)."""
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # ImportError, or a broken native library
        return False, f"bitsandbytes cannot be imported ({type(exc).__name__}: {exc})"
    return True, f"bitsandbytes {bnb.__version__}"


def configure_4bit_layer(layer: torch.nn.Module, *, repack: bool) -> None:
    """Set a Linear4bit up as the lab runs it: bitsandbytes' CPU weight repacking off unless
    `repack` (it is on by default on AVX-512-bf16 CPUs)."""
    if not repack and hasattr(layer, "support_avx512bf16_for_cpu"):
        setattr(layer, "support_avx512bf16_for_cpu", False)  # noqa: B010 (an untyped attribute)


def configure_4bit_model(model: torch.nn.Module, *, for_training: bool, plan: Plan4bit) -> None:
    """`configure_4bit_layer` on every Linear4bit of a model loaded by `plan`: repacking off
    in a model that trains, and on the layers whose shape runs only without it."""
    import bitsandbytes as bnb

    no_repack = set(plan.no_repack)
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            configure_4bit_layer(module, repack=not for_training and name not in no_repack)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().float().cpu(), expected.detach().float().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - expected).norm() / expected.norm().clamp_min(1e-12))


@functools.cache
def probe_shape(
    shape: LinearShape,
    *,
    device: str,
    compute_dtype: torch.dtype,
    for_training: bool,
    repack: bool = False,
) -> str | None:
    """None if a Linear4bit of `shape` runs correctly on `device` through the model's phases,
    else what went wrong (one line). Cached per process: a shape is probed once."""
    import bitsandbytes as bnb

    phases = ("train", "eval", "train") if for_training else ("eval", "eval")
    phase = "quantize"
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(0)
        reference = torch.nn.Linear(shape.in_features, shape.out_features, bias=shape.bias)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                layer = bnb.nn.Linear4bit(
                    shape.in_features,
                    shape.out_features,
                    bias=shape.bias,
                    quant_type=QUANT_TYPE,
                    compress_statistics=DOUBLE_QUANT,
                    compute_dtype=compute_dtype,
                )
                layer.load_state_dict(reference.state_dict())
                layer = layer.to(device)  # quantizes
                reference = reference.to(device)  # full precision, where the probe computes
                configure_4bit_layer(layer, repack=repack)
                for phase in phases:
                    layer.train(phase == "train")
                    for rows in PROBE_ROWS.get(device, (3,)):
                        why = _probe_phase(layer, reference, phase, rows=rows, device=device)
                        if why is not None:
                            return f"{phase}, {rows} rows: {why}"
        except Exception as exc:
            first_line = (str(exc).splitlines() or [""])[0][:120]
            return f"{phase}: {type(exc).__name__}: {first_line}"
    return None


def _probe_phase(
    layer: torch.nn.Module, reference: torch.nn.Linear, phase: str, *, rows: int, device: str
) -> str | None:
    x = torch.randn(rows, reference.in_features).to(device)
    if phase == "eval":
        with torch.no_grad():
            error = _relative_error(layer(x), reference(x))
    else:
        probe_in = x.clone().requires_grad_(True)
        out = layer(probe_in)
        if out.grad_fn is not None:
            out.float().square().sum().backward()
        if probe_in.grad is None:
            return "no gradient reaches the layer's input"
        ref_in = x.clone().requires_grad_(True)
        reference(ref_in).square().sum().backward()
        assert ref_in.grad is not None
        error = max(_relative_error(out, reference(x)), _relative_error(probe_in.grad, ref_in.grad))
    return None if error <= MAX_RELATIVE_ERROR else f"relative error {error:.3g}"


def quantizable_linears(
    config: Any, *, trust_remote_code: bool = False
) -> tuple[dict[str, LinearShape], list[str]]:
    """The linear layers transformers' bitsandbytes integration would quantize in a model of
    `config` (its own test: exactly nn.Linear, or GPT-2's Conv1D), and its own skip list
    (output embeddings, tied weights, the last module, fp32 modules), which a
    BitsAndBytesConfig that names any skip must repeat. Read off a meta-device copy of the
    model, so nothing is allocated."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    skip = HfQuantizer.get_modules_to_not_convert(skeleton, None, skeleton._keep_in_fp32_modules)
    linears = {}
    for name, module in skeleton.named_modules():
        if not should_convert_module(name, skip):
            continue
        if isinstance(module, Conv1D):  # weight stored (in, out)
            in_features, out_features = module.weight.shape
        elif type(module) is torch.nn.Linear:
            in_features, out_features = module.in_features, module.out_features
        else:
            continue
        linears[name] = LinearShape(int(in_features), int(out_features), module.bias is not None)
    return linears, skip


def plan_4bit(
    config: Any,
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    for_training: bool,
    trust_remote_code: bool = False,
) -> Plan4bit:
    """Probe every distinct linear shape of a model of `config` and sort its layers: 4-bit
    (with or without CPU repacking, for an inference model) or full precision."""
    linears, default_skips = quantizable_linears(config, trust_remote_code=trust_remote_code)
    failures: dict[str, str] = {}
    plain_only: set[LinearShape] = set()
    probe = functools.partial(
        probe_shape, device=device.type, compute_dtype=compute_dtype, for_training=for_training
    )
    for shape in sorted(set(linears.values()), key=str):
        why = probe(shape, repack=not for_training)  # bitsandbytes' own choice, for inference
        if why is None:
            continue
        if not for_training and probe(shape, repack=False) is None:
            plain_only.add(shape)  # runs in 4-bit on the plain path
        else:
            failures[str(shape)] = why
    return Plan4bit(
        quantize=tuple(n for n, shape in linears.items() if str(shape) not in failures),
        keep=tuple(n for n, shape in linears.items() if str(shape) in failures),
        failures=failures,
        no_repack=tuple(n for n, shape in linears.items() if shape in plain_only),
        default_skips=tuple(default_skips),
    )


def quantization_config(
    config: Any,
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    for_training: bool,
    trust_remote_code: bool = False,
) -> tuple[Any | None, Plan4bit | None, str]:
    """A BitsAndBytesConfig that quantizes only the layers that work here and the plan it
    follows, or (None, None) with one RuntimeWarning saying why when nothing does; plus a line
    for the log."""
    from transformers import BitsAndBytesConfig

    ok, why = bnb_importable()
    plan = None
    if ok:
        try:
            plan = plan_4bit(
                config,
                device=device,
                compute_dtype=compute_dtype,
                for_training=for_training,
                trust_remote_code=trust_remote_code,
            )
        except Exception as exc:  # the model's skeleton could not be built or read
            why = f"its layers could not be probed ({type(exc).__name__}: {exc})"
        else:
            if not plan.usable:
                shapes = "; ".join(f"{s}: {w}" for s, w in plan.failures.items())
                why = f"no linear layer of this model runs in 4-bit on {device.type} ({shapes})"
                if not plan.failures:
                    why = "this model has no linear layer bitsandbytes would quantize"
    if plan is None or not plan.usable:
        warnings.warn(
            f"model.quantization=4bit was asked for but {why}; loading the model in full "
            "precision instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None, None, "full precision (4-bit unavailable here)"
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=QUANT_TYPE,
        bnb_4bit_use_double_quant=DOUBLE_QUANT,
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=plan.skip_modules,
    )
    return bnb_config, plan, plan.describe()
