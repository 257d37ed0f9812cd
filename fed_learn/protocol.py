"""fed_learn's netproto messages (range 0x0100-0x01FF), and the checks on what clients send.

    client -> coordinator  JOIN     JSON {"name", "num_examples", "client_index" (optional)}
                                                                    -> WELCOME {"client_id"}
    coordinator -> client  TASK     JSON {"task", "round", "strategy", "local_epochs",
                                          "local_steps", "batch_size", "lr", "prox_mu", ...}
    coordinator -> client  GLOBAL   TENSORS  the global adapter (PEFT state dict)
    client -> coordinator  RESULT   JSON {"task", "round", "num_examples", "train_loss",
                                          "val_loss", "seconds"}
    client -> coordinator  UPDATE   TENSORS  the client's adapter after local training
    coordinator -> client  FINISH   EMPTY    training is over
    coordinator -> client  EVALUATE JSON {"task", "round"}, then GLOBAL: evaluate it on the
                                         client's own held-out shard (fed.evaluate_on_clients)
    client -> coordinator  EVAL_RESULT JSON {"task", "round", "loss", "tokens"}
JOIN may also declare "eval_tokens", the size of the client's held-out shard in predicted
tokens: an EVAL_RESULT counting more is refused.
With fed.secure_aggregation the round adds the SA_* steps of `fed_learn.secure` and the update
travels masked (SA_MASKED) instead of as an UPDATE; a client whose training came out
non-finite sends SKIP {"task", "reason"} instead, in clear, and sits the round out.
Heartbeats are netproto PINGs from the client; only adapters ever cross the wire.

"task" is a number the coordinator draws at random for each TASK; a RESULT answers the task
whose number it echoes, so a result built before its task was sent, a duplicate or a late one
for an earlier task answers nothing and is dropped. A client has one task outstanding at most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, TypeGuard

from fed_learn.compression import COMPRESSIONS
from netproto import REGISTRY, PayloadKind

MAX_NAME_CHARS = 64
MAX_CLIENT_INDEX = 65_535
MAX_EVAL_TOKENS = 2**40
"""The most held-out tokens a JOIN may declare (a trillion: beyond any client's shard)."""


class FedMsg(IntEnum):
    JOIN = 0x0101
    WELCOME = 0x0102
    TASK = 0x0103
    GLOBAL = 0x0104
    RESULT = 0x0105
    UPDATE = 0x0106
    FINISH = 0x0107
    SA_KEYS = 0x0108
    SA_ROSTER = 0x0109
    SA_SHARES = 0x010A
    SA_BOXES = 0x010B
    SA_MASKED = 0x010C
    SA_UNMASK = 0x010D
    SA_REVEAL = 0x010E
    SKIP = 0x010F
    EVALUATE = 0x0110
    EVAL_RESULT = 0x0111


SECURE_JSON = (
    FedMsg.SA_KEYS,
    FedMsg.SA_ROSTER,
    FedMsg.SA_SHARES,
    FedMsg.SA_BOXES,
    FedMsg.SA_UNMASK,
    FedMsg.SA_REVEAL,
    FedMsg.SKIP,
)
"""Secure aggregation's steps (fed_learn.secure), besides the masked input's TENSORS."""

REGISTRY.register(
    "fed_learn",
    0x0100,
    0x01FF,
    {
        FedMsg.JOIN: PayloadKind.JSON,
        FedMsg.WELCOME: PayloadKind.JSON,
        FedMsg.TASK: PayloadKind.JSON,
        FedMsg.GLOBAL: PayloadKind.TENSORS,
        FedMsg.RESULT: PayloadKind.JSON,
        FedMsg.UPDATE: PayloadKind.TENSORS,
        FedMsg.FINISH: PayloadKind.EMPTY,
        **{kind: PayloadKind.JSON for kind in SECURE_JSON},
        FedMsg.SA_MASKED: PayloadKind.TENSORS,
        FedMsg.EVALUATE: PayloadKind.JSON,
        FedMsg.EVAL_RESULT: PayloadKind.JSON,
    },
)


@dataclass(frozen=True)
class Join:
    name: str
    """Printable characters only (it goes into logs and checkpoints), at most 64."""
    num_examples: int
    client_index: int | None = None
    """The index the client claims (its shard, its budget of update-less JOINs)."""
    eval_tokens: int = 0
    """Its held-out shard's size in predicted tokens (0: it cannot evaluate)."""


@dataclass(frozen=True)
class Evaluation:
    """An EVAL_RESULT whose every field has been checked (`parse_evaluation`)."""

    task: int
    round: int
    loss: float
    """Mean next-token loss (nats) of the global adapter on the client's held-out shard."""
    tokens: int
    """The tokens it was measured on: its weight in the round's mean."""


@dataclass(frozen=True)
class ClientResult:
    """A RESULT whose every field has been checked (`parse_result`)."""

    task: int
    round: int
    num_examples: int
    train_loss: float
    val_loss: float
    seconds: float


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite JSON number (an integer too big for a float is not one)."""
    if _is_int(value):
        return abs(value) <= 2**53
    return isinstance(value, float) and math.isfinite(value)


def printable(text: str, *, limit: int = MAX_NAME_CHARS) -> str:
    """`text` cut to `limit` characters, anything unprintable (newlines included) as '?'."""
    return "".join(ch if ch.isprintable() else "?" for ch in text[:limit])


def answers(payload: Any, task: int) -> bool:
    """Whether a RESULT payload echoes task number `task` (else it answers nothing: dropped)."""
    return isinstance(payload, dict) and _is_int(payload.get("task")) and payload["task"] == task


def parse_join(payload: Any) -> Join:
    """A JOIN's fields; ValueError naming the first bad one."""
    if not isinstance(payload, dict):
        raise ValueError(f"JOIN must be a JSON object, not {type(payload).__name__}")
    num_examples = payload.get("num_examples")
    if not _is_int(num_examples) or num_examples < 1:
        raise ValueError(f"JOIN needs num_examples an integer >= 1, not {num_examples!r:.40}")
    name = payload.get("name", "")
    if not isinstance(name, str):
        raise ValueError(f"JOIN's name must be a string, not {type(name).__name__}")
    index = payload.get("client_index")
    if index is not None and (not _is_int(index) or not 0 <= index <= MAX_CLIENT_INDEX):
        raise ValueError(f"JOIN's client_index must be an integer in 0..{MAX_CLIENT_INDEX}")
    eval_tokens = payload.get("eval_tokens", 0)
    if not _is_int(eval_tokens) or not 0 <= eval_tokens <= MAX_EVAL_TOKENS:
        raise ValueError(f"JOIN's eval_tokens must be an integer in 0..{MAX_EVAL_TOKENS}")
    return Join(
        name=printable(name),
        num_examples=num_examples,
        client_index=index,
        eval_tokens=eval_tokens,
    )


def parse_evaluation(
    payload: Any, *, task: int, round_index: int, declared_tokens: int
) -> Evaluation:
    """An EVAL_RESULT answering task `task` of round `round_index`, from a client that
    declared `declared_tokens` held-out tokens at JOIN; ValueError naming the first bad field
    (a loss that is not a finite number >= 0, a token count not in 1..declared_tokens)."""
    if not isinstance(payload, dict):
        raise ValueError(f"EVAL_RESULT must be a JSON object, not {type(payload).__name__}")
    if not answers(payload, task):
        raise ValueError(f"EVAL_RESULT answers task {payload.get('task')!r:.40}, not {task}")
    checks = (
        ("round", _is_int(payload.get("round")) and payload["round"] == round_index,
         f"the task's round, {round_index}"),
        ("loss", _is_number(payload.get("loss")) and payload["loss"] >= 0,
         "a finite number >= 0"),
        ("tokens", _is_int(payload.get("tokens")) and 1 <= payload["tokens"] <= declared_tokens,
         f"an integer in 1..{declared_tokens}, the held-out tokens declared at JOIN"),
    )  # fmt: skip
    for key, valid, wanted in checks:
        if key not in payload:
            raise ValueError(f"EVAL_RESULT has no {key}")
        if not valid:
            raise ValueError(f"EVAL_RESULT's {key}={payload[key]!r:.40} must be {wanted}")
    return Evaluation(
        task=task, round=payload["round"], loss=float(payload["loss"]), tokens=payload["tokens"]
    )


def parse_result(payload: Any, *, task: int, round_index: int) -> ClientResult:
    """A RESULT answering task `task` (of round or global version `round_index`), every field
    checked for type and range; ValueError naming the first bad one."""
    if not isinstance(payload, dict):
        raise ValueError(f"RESULT must be a JSON object, not {type(payload).__name__}")
    if not answers(payload, task):
        raise ValueError(f"RESULT answers task {payload.get('task')!r:.40}, not {task}")
    fields: tuple[tuple[str, bool, str], ...] = (
        (
            "round",
            _is_int(payload.get("round")) and payload["round"] == round_index,
            f"the task's round, {round_index}",
        ),
        (
            "num_examples",
            _is_int(payload.get("num_examples")) and payload["num_examples"] >= 1,
            "an integer >= 1",
        ),
        *(
            (key, _is_number(payload.get(key)) and payload[key] >= 0, "a finite number >= 0")
            for key in ("train_loss", "val_loss", "seconds")
        ),
    )
    for key, valid, wanted in fields:
        if key not in payload:
            raise ValueError(f"RESULT has no {key}")
        if not valid:
            raise ValueError(f"RESULT's {key}={payload[key]!r:.40} must be {wanted}")
    return ClientResult(
        task=task,
        round=payload["round"],
        num_examples=payload["num_examples"],
        train_loss=float(payload["train_loss"]),
        val_loss=float(payload["val_loss"]),
        seconds=float(payload["seconds"]),
    )


MAX_ROUND = 2**32 - 1
TASK_RANGES: dict[str, tuple[int, int]] = {
    "local_epochs": (1, 10_000),
    "local_steps": (0, 10_000_000),
    "batch_size": (1, 65_536),
}
"""What a client accepts of a TASK's training fields (the coordinator's config is checked
against the same floors; the ceilings keep a lying coordinator from asking for years of work)."""


def parse_task(payload: Any, *, evaluate: bool = False) -> dict[str, Any]:
    """A TASK (or, `evaluate`, an EVALUATE) as the coordinator sent it, every field this client
    reads checked for type and range before it is used; ValueError naming the first bad one.
    The secure round's own fields are parse_params's (fed_learn.secagg_params)."""
    kind = "EVALUATE" if evaluate else "TASK"
    if not isinstance(payload, dict):
        raise ValueError(f"{kind} must be a JSON object, not {type(payload).__name__}")
    checks: list[tuple[str, bool, str]] = [
        ("task", _is_int(payload.get("task")) and 0 <= payload["task"] < 2**53, "an id"),
        (
            "round",
            _is_int(payload.get("round")) and 0 <= payload["round"] <= MAX_ROUND,
            f"an integer in [0, {MAX_ROUND}]",
        ),
    ]
    if not evaluate:
        checks += [
            (key, _is_int(payload.get(key)) and low <= payload[key] <= high, f"in [{low}, {high}]")
            for key, (low, high) in TASK_RANGES.items()
        ]
        checks.append(("lr", _is_number(payload.get("lr")) and payload["lr"] > 0, "a number > 0"))
    for key, valid, wanted in checks:
        if key not in payload:
            raise ValueError(f"{kind} has no {key}")
        if not valid:
            raise ValueError(f"{kind}'s {key}={payload[key]!r:.40} must be {wanted}")
    if evaluate:
        return payload
    optional: list[tuple[str, bool, str]] = [
        ("prox_mu", _is_number(payload.get("prox_mu")) and payload["prox_mu"] >= 0, ">= 0"),
        ("freeze_a", isinstance(payload.get("freeze_a"), bool), "true or false"),
        ("compression", payload.get("compression") in COMPRESSIONS, f"one of {COMPRESSIONS}"),
        (
            "topk_fraction",
            _is_number(payload.get("topk_fraction")) and 0 < payload["topk_fraction"] <= 1,
            "in (0, 1]",
        ),
    ]
    for key, valid, wanted in optional:
        if key in payload and not valid:
            raise ValueError(f"TASK's {key}={payload[key]!r:.40} must be {wanted}")
    compressed = payload.get("compression", "none") != "none"
    if compressed and "topk_fraction" not in payload:
        raise ValueError("TASK asks for compression without a topk_fraction")
    if compressed and "secure" in payload:  # a masked sum needs every entry (fed.config too)
        raise ValueError("TASK asks for compression in a secure round")
    return payload
