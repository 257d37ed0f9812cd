"""Checking a client's answer before a round takes it: nothing a client sends is trusted.

An answer's result must have parsed (see `protocol`); its update's tensors must hold a dtype
there is arithmetic for and finite values, fit the global adapter's layout (the whole adapter
or only the tensors the strategy trains, compressed or not: `fed.compression`), stay within
`fed.max_update_norm` of the adapter it was trained from, and keep the strategy's rules. An
answer that fails is that client's failure in the round, never the round's.
"""

from __future__ import annotations

import math

import torch

from fed_learn.admission import Reply
from fed_learn.aggregate import flatten, in_groups, update_norm
from fed_learn.compression import decompress
from fed_learn.config import FedConfig
from fed_learn.protocol import ClientResult
from fed_learn.strategy import Strategy

UPDATE_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32}
)
"""What an update's tensors may hold: adapters in a float dtype, compressed ones int32 indices
and int8 values (decompress checks which goes where)."""
ANSWER_ERRORS = (ValueError, TypeError, RuntimeError)
"""What checking an answer may raise on a peer's input (torch raises RuntimeError and its
NotImplementedError): that client's failure, never the round's."""


def check_answer(
    reply: Reply, base: dict[str, torch.Tensor], *, strategy: Strategy, fed: FedConfig
) -> tuple[ClientResult, dict[str, torch.Tensor], float]:
    """The result, full adapter and update norm (distance from `base`) of an answer
    trained from `base`; ValueError if the result is malformed or the update is: wrong
    layout, not finite, breaking the strategy's rules, or further from `base` than
    fed.max_update_norm."""
    if reply.result is None:
        raise ValueError(reply.error)
    for name, tensor in reply.update.items():
        if tensor.dtype not in UPDATE_DTYPES:  # float8/float4: no arithmetic to check with
            raise ValueError(f"update tensor {name!r:.80} has dtype {tensor.dtype}")
    floats = {name: t for name, t in reply.update.items() if t.is_floating_point()}
    for names in in_groups(list(floats), floats):  # a group at once; which one, only if one is not
        if not bool(torch.isfinite(flatten([floats[n] for n in names])).all()):
            for name in names:
                if not bool(torch.isfinite(floats[name]).all()):
                    raise ValueError(f"update tensor {name!r:.80} is not finite")
    try:
        full = expand(reply.update, base, strategy=strategy, compression=fed.compression)
    except KeyError as exc:
        raise ValueError(f"update lacks tensor {exc}") from None
    norm = update_norm(full, base)
    if not math.isfinite(norm):
        raise ValueError("update is not finite in the adapter's dtype")
    if norm > fed.max_update_norm:
        raise ValueError(
            f"update norm {norm:.3g} is above fed.max_update_norm={fed.max_update_norm:g}"
        )
    strategy.check_update(full, base)
    return reply.result, full, norm


def expand(
    update: dict[str, torch.Tensor],
    global_state: dict[str, torch.Tensor],
    *,
    strategy: Strategy,
    compression: str,
) -> dict[str, torch.Tensor]:
    """A client's full adapter, in the global adapter's dtypes: as sent, or global + its
    decompressed delta. A client may send only the tensors the strategy trains (FFA-LoRA:
    B); the others are the global adapter's. ValueError if it fits neither layout."""
    shapes = {name: tensor.shape for name, tensor in global_state.items()}
    trained = {name: shapes[name] for name in strategy.trained(global_state)}
    if compression == "none":
        sent = {n: t.shape for n, t in update.items()}
        if sent != shapes and sent != trained:
            raise ValueError("adapter tensors do not match the global adapter's layout")
        if not all(t.is_floating_point() for t in update.values()):
            raise ValueError("adapter tensors must be floating point")
        return {
            name: update[name].to(global_state[name].dtype) if name in update
            else global_state[name]
            for name in shapes
        }  # fmt: skip
    layout = trained if len(trained) < len(shapes) else shapes
    delta = decompress(update, method=compression, shapes=layout)
    return {
        name: (global_state[name].float() + delta[name]).to(global_state[name].dtype)
        if name in delta else global_state[name]
        for name in shapes
    }  # fmt: skip
