"""The adapter's state as PEFT gives it by default, its embedding-layer check made once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import get_peft_model_state_dict

from fed_learn.lora import adapter_state, check_adapter_state, peft_model
from labtools.attacks.join_loop import MODEL, settings


@pytest.mark.parametrize("targets", [None, ("q_proj", "embed_tokens")], ids=["default", "embed"])
def test_the_adapter_state_is_pefts_default_and_its_base_config_is_read_once(
    lab_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, targets: tuple | None
) -> None:
    lora = settings(tmp_path, lab_cache).lora
    if targets is not None:
        lora = replace(lora, target_modules=list(targets))
    model = peft_model(MODEL, lora, cache_dir=lab_cache)
    expected = get_peft_model_state_dict(model)  # PEFT's default: save_embedding_layers="auto"
    config_class = type(model.config)
    reads: list[object] = []
    original = config_class.from_pretrained.__func__

    def counted(cls: type, *args: object, **kwargs: object) -> object:
        reads.append(args)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(config_class, "from_pretrained", classmethod(counted))
    for _ in range(3):
        state = adapter_state(model)
        assert sorted(state) == sorted(expected)
        assert all(torch.equal(state[k], expected[k].cpu()) for k in expected)
        check_adapter_state(model, state)
    assert len(reads) <= 1  # "auto" reads the base config per call; decided once here
