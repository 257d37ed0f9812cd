"""4-bit loading: every shape is probed, failing ones stay full precision, nothing crashes.

Every machine runs both the 4-bit path and the fallback, whatever its CPU: the fallback is
forced by making the probe fail. Only a machine where bitsandbytes cannot be imported skips.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lab.quantization as quant
from lab.config import ModelConfig
from lab.models import count_4bit_layers, load_model
from lab.pretrain import TinyModelSpec, build_llama

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes cannot be imported here")

CPU = torch.device("cpu")
IDS = torch.arange(1, 25).reshape(2, 12)  # (B, T)


def _saved_llama(folder: Path, tokenizer_source: Path, spec: TinyModelSpec):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    model = build_llama(spec, vocab_size=len(tokenizer), context_length=64, tokenizer=tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.eval()


@pytest.fixture
def wide_llama(tiny_models: Path, tmp_path: Path):
    """64-wide projections (head dim 32), whose every shape the 4-bit path runs here."""
    spec = TinyModelSpec(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=128)
    folder = tmp_path / "wide"
    return _saved_llama(folder, tiny_models / "tiny_target", spec), folder


@pytest.fixture
def narrow_llama(tiny_models: Path, tmp_path: Path):
    """32-wide projections: the shapes that crashed bitsandbytes' AVX-512-bf16 CPU path."""
    spec = TinyModelSpec(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64)
    folder = tmp_path / "narrow"
    return _saved_llama(folder, tiny_models / "tiny_target", spec), folder


def _load(folder: Path, lab_cache: Path, *, for_training: bool):
    cfg = ModelConfig(name="probe", pretrained=str(folder), dtype="float32", quantization="4bit")
    return load_model(cfg, cache_dir=lab_cache, device=CPU, for_training=for_training)


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


def _loss_and_embedding_grad(model) -> tuple[torch.Tensor, torch.Tensor]:
    """One training forward + backward; the gradient reaching the input embedding (float)."""
    embedding = model.get_input_embeddings().weight
    embedding.requires_grad_(True)
    embedding.grad = None
    logits = model(input_ids=IDS).logits[:, :-1]  # (B, T-1, V)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), IDS[:, 1:].reshape(-1))
    loss.backward()
    assert embedding.grad is not None
    return logits.detach(), embedding.grad.detach().clone()


def test_model_whose_shapes_all_run_trains_evaluates_and_trains_again_in_4bit(
    wide_llama, lab_cache: Path
) -> None:
    """QLoRA clients train, evaluate, then train again every round: gradients must keep
    reaching the lowest layer after an eval pass (bitsandbytes' CPU repacking broke this)."""
    original, folder = wide_llama
    quantized = _load(folder, lab_cache, for_training=True)
    assert count_4bit_layers(quantized) == 7 * original.config.num_hidden_layers
    assert quantized.training

    original.train()
    expected_logits, expected_grad = _loss_and_embedding_grad(original)
    logits, first_grad = _loss_and_embedding_grad(quantized)  # train
    assert _correlation(logits, expected_logits) > 0.9
    assert _correlation(first_grad, expected_grad) > 0.8

    quantized.eval()  # eval, as a client's evaluation runs it
    with torch.no_grad():
        eval_logits = quantized(input_ids=IDS).logits
    assert _correlation(eval_logits, original(input_ids=IDS).logits) > 0.9

    quantized.train()  # and train again: the same weights give the same gradient
    _, second_grad = _loss_and_embedding_grad(quantized)
    torch.testing.assert_close(second_grad, first_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("for_training", [False, True], ids=["inference", "training"])
def test_model_with_32_wide_projections_loads_and_predicts(
    narrow_llama, lab_cache: Path, for_training: bool
) -> None:
    original, folder = narrow_llama
    quantized = _load(folder, lab_cache, for_training=for_training)
    quantized.eval()
    with torch.no_grad():
        for _ in range(2):  # the first eval forward is where bitsandbytes may repack weights
            logits = quantized(input_ids=IDS).logits
            assert _correlation(logits, original(input_ids=IDS).logits) > 0.9
    # Every projection in 4-bit: where bitsandbytes' CPU repacking fails on these widths (an
    # AVX-512-bf16 CPU), those layers run the plain 4-bit path instead of full precision.
    assert count_4bit_layers(quantized) == 7 * original.config.num_hidden_layers


def test_layers_whose_shape_fails_the_probe_stay_in_full_precision(
    wide_llama, lab_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gate_proj and up_proj (64 -> 128) are made to fail: they load as plain nn.Linear, every
    other projection in 4-bit, and the model still predicts; the log line says which."""
    original, folder = wide_llama
    real_probe = quant.probe_shape

    def probe(shape: quant.LinearShape, **kwargs) -> str | None:
        if shape.out_features == 128:
            return "eval: AssertionError: N must be divisible by block_n"
        return real_probe(shape, **kwargs)

    monkeypatch.setattr(quant, "probe_shape", probe)
    quantized = _load(folder, lab_cache, for_training=False)
    for name, module in quantized.named_modules():
        if name.endswith(("gate_proj", "up_proj")):
            assert type(module) is torch.nn.Linear, name
        elif name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")):
            assert isinstance(module, bnb.nn.Linear4bit), name
    assert count_4bit_layers(quantized) == 5 * original.config.num_hidden_layers
    assert type(quantized.lm_head) is torch.nn.Linear  # transformers' own skips still hold
    with torch.no_grad():
        logits = quantized(input_ids=IDS).logits
    assert _correlation(logits, original(input_ids=IDS).logits) > 0.9

    plan = quant.plan_4bit(
        quantized.config, device=CPU, compute_dtype=torch.float32, for_training=False
    )
    assert "64->128: eval: AssertionError" in plan.describe()
    assert plan.describe().startswith("10 of 14 linear layers in 4-bit, 4 kept in full precision")


@pytest.mark.parametrize("cause", ["probe", "import"])
def test_when_nothing_runs_in_4bit_one_warning_and_full_precision(
    wide_llama, lab_cache: Path, monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    original, folder = wide_llama
    if cause == "probe":
        monkeypatch.setattr(quant, "probe_shape", lambda shape, **kw: "train: RuntimeError: x")
        reason = r"no linear layer of this model runs in 4-bit on cpu \(128->64: train: "
    else:
        monkeypatch.setattr(quant, "bnb_importable", lambda: (False, "bitsandbytes is broken"))
        reason = "bitsandbytes is broken"
    with pytest.warns(RuntimeWarning) as caught:
        quantized = _load(folder, lab_cache, for_training=True)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert messages[0].startswith("model.quantization=4bit was asked for but ")
    assert "; loading the model in full precision instead" in messages[0]
    import re

    assert re.search(reason, messages[0]), messages[0]
    assert count_4bit_layers(quantized) == 0
    with torch.no_grad():
        torch.testing.assert_close(
            quantized(input_ids=IDS).logits, original(input_ids=IDS).logits, rtol=0, atol=0
        )


_REAL_FORWARD = bnb.nn.Linear4bit.forward


@pytest.mark.parametrize(
    ("broken_forward", "for_training", "why"),
    [
        (
            lambda self, x: torch.zeros(*x.shape[:-1], self.out_features),
            False,
            "eval, 3 rows: relative error 1",
        ),
        (  # what bitsandbytes' repacked CPU weights do after an eval pass, on any machine
            lambda self, x: _REAL_FORWARD(self, x).detach(),
            True,
            "train, 3 rows: no gradient reaches the layer's input",
        ),
    ],
    ids=["garbage", "drops_the_gradient"],
)
def test_probe_refuses_a_broken_kernel(
    monkeypatch: pytest.MonkeyPatch, broken_forward, for_training: bool, why: str
) -> None:
    monkeypatch.setattr(bnb.nn.Linear4bit, "forward", broken_forward)
    got = quant.probe_shape.__wrapped__(
        quant.LinearShape(64, 64, False),
        device="cpu",
        compute_dtype=torch.float32,
        for_training=for_training,
    )
    assert got == why


@pytest.mark.parametrize("preset", ["default", "debug"])
def test_every_shape_of_the_lab_models_runs_in_4bit_for_training_and_inference(
    preset: str,
) -> None:
    """tiny_target and tiny_draft, as each preset builds them: all their layers quantize."""
    from types import SimpleNamespace

    from lab.pretrain import load_preset

    settings = load_preset(preset)
    special = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    for spec in (settings.target, settings.draft):
        with torch.device("meta"):
            model = build_llama(
                spec,
                vocab_size=settings.vocab_size,
                context_length=settings.context_length,
                tokenizer=special,
            )
        linears, _ = quant.quantizable_linears(model.config)
        assert len(linears) == 7 * spec.num_layers
        for for_training in (True, False):
            plan = quant.plan_4bit(
                model.config, device=CPU, compute_dtype=torch.float32, for_training=for_training
            )
            assert not plan.failures, (spec, for_training, plan.failures)


def test_gpt2_conv1d_layers_quantize_and_a_saved_4bit_model_loads_as_saved(
    tiny_models: Path, tmp_path: Path, lab_cache: Path
) -> None:
    """GPT-2 keeps its projections in Conv1D (weight stored in x out), which transformers
    quantizes too; a model saved after 4-bit loading keeps its own quantization settings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=2,
        vocab_size=320,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    original = GPT2LMHeadModel(config).eval()
    original.save_pretrained(tmp_path / "gpt2")
    linears, _ = quant.quantizable_linears(config)
    assert {str(s) for s in linears.values()} == {
        "64->192+bias",
        "64->64+bias",
        "64->256+bias",
        "256->64+bias",
    }
    quantized = _load(tmp_path / "gpt2", lab_cache, for_training=False)
    assert count_4bit_layers(quantized) == 4 * config.n_layer
    with torch.no_grad():
        logits = quantized(input_ids=IDS).logits
    assert _correlation(logits, original(input_ids=IDS).logits) > 0.9

    quantized.save_pretrained(tmp_path / "gpt2_4bit")
    reloaded = _load(tmp_path / "gpt2_4bit", lab_cache, for_training=False)
    assert count_4bit_layers(reloaded) == 4 * config.n_layer
    with torch.no_grad():
        # the same NF4 weights; the CPU kernel may compute them in bf16 on one side
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, logits, rtol=0, atol=1e-2)
