"""RPC messages are unpickled through an allow-list: a peer cannot make a stage run code."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.distributed.rpc import internal as rpc_internal

from split_inference.workers import UnsafeMessageError, install_safe_unpickler, safe_loads


class RunsCommand:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class Evaluates:
    def __reduce__(self):
        return (eval, ("1+1",))


class ReachesThroughGetattr:
    """The classic escape: getattr on an allowed type walks to object.__subclasses__ and on."""

    def __reduce__(self):
        return (getattr, (str, "__mro__"))


@pytest.mark.parametrize("payload", [RunsCommand(), Evaluates(), ReachesThroughGetattr()])
def test_code_execution_payloads_are_refused(payload) -> None:
    with pytest.raises(UnsafeMessageError, match="refused"):
        safe_loads(pickle.dumps(payload))


def test_an_arbitrary_class_is_refused() -> None:
    from collections import Counter

    with pytest.raises(UnsafeMessageError, match=r"collections\.Counter"):
        safe_loads(pickle.dumps(Counter("ab")))


def test_what_split_runs_send_still_goes_through() -> None:
    """Tensors (via the RPC pickler's tensor table), plain data and exceptions."""
    install_safe_unpickler()
    x = torch.arange(6).view(2, 3)
    kwargs = {"request": 3, "last_only": True}
    data, tensors = rpc_internal.serialize({"x": x, "kwargs": kwargs})
    back: dict = rpc_internal.deserialize(data, tensors)
    assert torch.equal(back["x"], x) and back["kwargs"] == kwargs
    assert isinstance(safe_loads(pickle.dumps(ValueError("bad"))), ValueError)
    with pytest.raises(UnsafeMessageError, match=r"posix\.system"):
        rpc_internal.deserialize(*rpc_internal.serialize(RunsCommand()))
