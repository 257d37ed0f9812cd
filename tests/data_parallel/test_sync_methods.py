"""The dp.sync registry (data_parallel.sync_methods): one row per registered method, so a new
method is checked by being registered."""

from __future__ import annotations

import pytest

from data_parallel.config import ENGINES, DPConfig
from data_parallel.sync_methods import SyncMethod, sync_method

METHODS = sorted(SyncMethod.registry)


def test_every_documented_choice_is_registered() -> None:
    assert set(METHODS) == {"ddp", "none", "fp16", "bf16", "topk", "powersgd", "diloco", "auto"}


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_method_is_accepted_under_exactly_its_engines(name: str, engine: str) -> None:
    if engine in sync_method(name).engines:
        assert DPConfig(sync=name, engine=engine).sync == name
    else:
        with pytest.raises(ValueError, match=rf"dp\.sync={name} is for dp\.engine=ddp"):
            DPConfig(sync=name, engine=engine)


@pytest.mark.parametrize("name", METHODS)
def test_a_methods_label_names_it(name: str) -> None:
    assert sync_method(name).label(DPConfig(sync=name)).startswith(name)


@pytest.mark.parametrize("name", METHODS)
def test_only_a_method_that_trains_apart_takes_fragments(name: str) -> None:
    if sync_method(name).apart:
        assert DPConfig(sync=name, fragments=2, inner_steps=4).fragments == 2
    else:
        with pytest.raises(ValueError, match=r"dp\.fragments and dp\.overlap_steps are for"):
            DPConfig(sync=name, fragments=2, inner_steps=4)


def test_an_unknown_method_is_one_error_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"dp\.sync='gossip': choose one of .*'diloco'"):
        sync_method("gossip")
    with pytest.raises(ValueError, match=r"dp\.sync"):
        DPConfig(sync="gossip")


def test_a_subclass_registers_itself_and_is_then_a_choice() -> None:
    class Gossip(SyncMethod):
        name = "gossip"

    try:
        assert sync_method("gossip") is Gossip
        assert DPConfig(sync="gossip").sync == "gossip"
    finally:
        del SyncMethod.registry["gossip"]
