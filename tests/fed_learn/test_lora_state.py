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


def test_a_parameter_replaced_after_the_first_call_is_the_one_read_and_loaded(
    lab_cache: Path, tmp_path: Path
) -> None:
    """The adapter's parameters are found once per model: one replaced since (a load with
    `assign=True`, a layer swapped) is found again, not read from or loaded into the stale
    object, which no longer takes part in the model."""
    model = peft_model(MODEL, settings(tmp_path, lab_cache).lora, cache_dir=lab_cache)
    state = adapter_state(model)  # the parameters found and held
    name = next(k for k in state if "lora_B" in k)
    path = next(p for p, t in model.named_parameters() if name.replace(".weight", "") in p)
    owner, leaf = model.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
    stale = owner.get_parameter(leaf)
    setattr(owner, leaf, torch.nn.Parameter(torch.full_like(stale, 3.0)))
    assert torch.equal(adapter_state(model)[name], torch.full_like(stale, 3.0))
    load_adapter_state(model, {name: torch.full_like(stale, 5.0)})
    assert torch.equal(owner.get_parameter(leaf).detach(), torch.full_like(stale, 5.0))
    assert not torch.equal(stale.detach(), torch.full_like(stale, 5.0))
    assert torch.equal(get_peft_model_state_dict(model)[name], torch.full_like(stale, 5.0))
    parent_path, child = path.rsplit(".", 1)[0].rsplit(".", 1)  # the layer itself swapped
    swapped = torch.nn.Linear(stale.shape[1], stale.shape[0], bias=False)
    torch.nn.init.constant_(swapped.weight, 7.0)
    setattr(model.get_submodule(parent_path), child, swapped)
    assert torch.equal(adapter_state(model)[name], torch.full_like(stale, 7.0))
    table = dict(swapped._parameters)  # the layer's table of parameters replaced whole
    table["weight"] = torch.nn.Parameter(torch.full_like(stale, 9.0))
    swapped._parameters = table
    assert torch.equal(adapter_state(model)[name], torch.full_like(stale, 9.0))
