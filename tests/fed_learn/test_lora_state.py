"""The adapter's state as PEFT gives it by default, its embedding-layer check made once; a load
as PEFT's own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from fed_learn.lora import adapter_state, check_adapter_state, load_adapter_state, peft_model
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


@pytest.mark.parametrize("targets", [None, ("q_proj", "embed_tokens")], ids=["default", "embed"])
def test_a_load_sets_what_pefts_own_load_sets(
    lab_cache: Path, tmp_path: Path, targets: tuple | None
) -> None:
    """`load_adapter_state` writes the model's parameters in place, as PEFT's
    `set_peft_model_state_dict` would: the whole adapter, then a subset (FFA-LoRA's B) that
    leaves the rest as held; `adapter_state` reads each load back, not a stale copy."""
    lora = settings(tmp_path, lab_cache).lora
    if targets is not None:
        lora = replace(lora, target_modules=list(targets))
    ours, theirs = (peft_model(MODEL, lora, cache_dir=lab_cache) for _ in range(2))
    start = adapter_state(ours)
    whole = {k: v + torch.randn_like(v) for k, v in start.items()}
    subset = {k: v - 1.0 for k, v in whole.items() if "lora_B" in k}
    assert subset and len(subset) < len(whole)
    for state in (whole, subset):
        load_adapter_state(ours, {k: v.double() for k, v in state.items()})  # cast, as PEFT's
        set_peft_model_state_dict(theirs, state)
        expected = get_peft_model_state_dict(theirs)
        got = adapter_state(ours)
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert all(torch.equal(got[k], subset.get(k, whole[k])) for k in whole)
