"""Model loading: same logits after a save/load round trip, lab models, clear errors, 4-bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lab.config import ModelConfig
from lab.models import ModelUnavailableError, load_model, load_tokenizer
from lab.pretrain import build_llama


@pytest.fixture
def saved_random_model(tiny_models: Path, tmp_path: Path):
    """A random-init tiny Llama saved as an ordinary HF folder, with the lab's tokenizer."""
    from transformers import AutoTokenizer

    from lab.pretrain import TinyModelSpec

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "tiny_target")
    model = build_llama(
        TinyModelSpec(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64),
        vocab_size=len(tokenizer),
        context_length=64,
        tokenizer=tokenizer,
    ).eval()
    folder = tmp_path / "random_llama"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, folder


def test_saved_model_reloads_through_the_loader_with_identical_logits(
    saved_random_model, lab_cache: Path
) -> None:
    original, folder = saved_random_model
    cfg = ModelConfig(name="random", pretrained=str(folder), dtype="float32")
    loaded = load_model(cfg, cache_dir=lab_cache, device=torch.device("cpu"))
    tokenizer = load_tokenizer(cfg, cache_dir=lab_cache)
    ids = tokenizer("def f(x):\n    return x + 1\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=0
        )
    assert not loaded.training


def test_lab_model_loads_by_name_and_shares_the_tokenizer(
    tiny_models: Path, lab_cache: Path
) -> None:
    target_cfg = ModelConfig(name="tiny_target", pretrained="lab:tiny_target", lab_preset="debug")
    draft_cfg = ModelConfig(name="tiny_draft", pretrained="lab:tiny_draft", lab_preset="debug")
    target = load_model(target_cfg, cache_dir=lab_cache, device=torch.device("cpu"))
    draft = load_model(draft_cfg, cache_dir=lab_cache, device=torch.device("cpu"))
    assert target.config.num_hidden_layers > draft.config.num_hidden_layers
    assert (
        load_tokenizer(target_cfg, cache_dir=lab_cache).get_vocab()
        == load_tokenizer(draft_cfg, cache_dir=lab_cache).get_vocab()
    )


def test_uncached_hub_model_offline_fails_with_one_clear_sentence(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lab_cache: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))
    cfg = ModelConfig(name="llama3_8b", pretrained="meta-llama/Meta-Llama-3-8B")
    with pytest.raises(ModelUnavailableError) as info:
        load_tokenizer(cfg, cache_dir=lab_cache)
    message = str(info.value)
    assert "'meta-llama/Meta-Llama-3-8B' is not in the local Hugging Face cache" in message
    assert "model.pretrained=/path/to/a/local/copy" in message
    assert "\n" not in message


def test_an_unreachable_hub_is_said_at_once_not_after_a_minute_of_retries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lab_cache: Path
) -> None:
    """Hub access on, but the hub cannot be reached (here: HF_ENDPOINT at a loopback port
    nobody listens on, so no address beyond this machine is dialled): one sentence naming the
    endpoint and the local-folder way out, from the probe before any download is tried (the
    hub client's own retries took 77 s to fail)."""
    import socket

    import huggingface_hub.constants

    with socket.socket() as closed:  # a port that was free a moment ago: refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    cfg = ModelConfig(name="llama3_8b", pretrained="meta-llama/Meta-Llama-3-8B")
    with pytest.raises(ModelUnavailableError) as info:
        load_tokenizer(cfg, cache_dir=lab_cache)
    message = str(info.value)
    assert f"the hub cannot be reached from here (127.0.0.1:{port}: Connection refused)" in message
    assert "model.pretrained=/path/to/a/local/copy" in message and "\n" not in message


@pytest.mark.parametrize("source", ["/nonexistent/model_folder", "./no/such/dir", "lab:tiny_giant"])
def test_bad_source_is_a_clear_error(source: str, lab_cache: Path) -> None:
    with pytest.raises(ModelUnavailableError, match=r"model\.pretrained="):
        load_model(ModelConfig(pretrained=source), cache_dir=lab_cache, device=torch.device("cpu"))


def test_unknown_lab_preset_names_the_choices(lab_cache: Path) -> None:
    with pytest.raises(
        ValueError, match=r"model.lab_preset='huge' .* \['bench', 'debug', 'default'\]"
    ):
        load_model(ModelConfig(lab_preset="huge"), cache_dir=lab_cache)
