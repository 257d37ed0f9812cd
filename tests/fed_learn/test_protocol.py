"""What a client sends, checked before the coordinator uses any of it: one named case each."""

from __future__ import annotations

from typing import Any

import pytest

from fed_learn.protocol import answers, parse_join, parse_result

TASK = 1234
GOOD = {
    "task": TASK,
    "round": 2,
    "num_examples": 10,
    "train_loss": 1.5,
    "val_loss": 2,
    "seconds": 0.25,
}


def test_a_well_formed_result_is_parsed() -> None:
    result = parse_result(dict(GOOD), task=TASK, round_index=2)
    assert (result.round, result.num_examples, result.train_loss) == (2, 10, 1.5)
    assert isinstance(result.val_loss, float)


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != key}


MALFORMED = {
    "num_examples_missing": (without("num_examples"), "no num_examples"),
    "num_examples_zero": ({**GOOD, "num_examples": 0}, "num_examples=0"),
    "num_examples_negative": ({**GOOD, "num_examples": -5}, "num_examples=-5"),
    "num_examples_string": ({**GOOD, "num_examples": "10"}, "num_examples='10'"),
    "num_examples_float": ({**GOOD, "num_examples": 10.0}, "num_examples=10.0"),
    "num_examples_bool": ({**GOOD, "num_examples": True}, "num_examples=True"),
    "train_loss_missing": (without("train_loss"), "no train_loss"),
    "train_loss_nan": ({**GOOD, "train_loss": float("nan")}, "train_loss=nan"),
    "train_loss_inf": ({**GOOD, "train_loss": float("inf")}, "train_loss=inf"),
    "train_loss_string": ({**GOOD, "train_loss": "low"}, "train_loss='low'"),
    "train_loss_negative": ({**GOOD, "train_loss": -1.0}, "train_loss=-1.0"),
    "train_loss_huge_int": ({**GOOD, "train_loss": 10**400}, "train_loss="),
    "val_loss_missing": (without("val_loss"), "no val_loss"),
    "seconds_null": ({**GOOD, "seconds": None}, "seconds=None"),
    "round_string": ({**GOOD, "round": "2"}, "round='2'"),
    "round_null": ({**GOOD, "round": None}, "round=None"),
    "round_missing": (without("round"), "no round"),
    "round_of_another_task": ({**GOOD, "round": 1}, "round=1 must be the task's round, 2"),
    "round_bool": ({**GOOD, "round": True}, "round=True"),
    "task_missing": (without("task"), "answers task None"),
    "task_other": ({**GOOD, "task": TASK + 1}, "answers task 1235"),
    "not_an_object": ([1, 2], "must be a JSON object"),
}


@pytest.mark.parametrize(("payload", "message"), MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_result_is_refused_naming_the_field(payload: Any, message: str) -> None:
    with pytest.raises(ValueError, match="RESULT") as caught:
        parse_result(payload, task=TASK, round_index=2)
    assert message in str(caught.value)


def test_a_result_answers_only_the_task_whose_number_it_echoes() -> None:
    assert answers(GOOD, TASK)
    assert not answers({**GOOD, "task": float(TASK)}, TASK)
    assert not answers({**GOOD, "task": str(TASK)}, TASK)
    assert not answers(without("task"), TASK)
    assert not answers(["task", TASK], TASK)
    assert not answers({"task": True}, 1)


def test_a_join_is_parsed_and_its_name_made_printable() -> None:
    join = parse_join({"name": "evil\n[CRITICAL] forged" + "x" * 100, "num_examples": 10**12})
    assert join.num_examples == 10**12  # capped by the coordinator, not here
    assert "\n" not in join.name and len(join.name) == 64
    assert parse_join({"num_examples": 3}).name == ""


@pytest.mark.parametrize(
    "payload",
    [
        {"name": "a"},
        {"name": "a", "num_examples": 0},
        {"name": "a", "num_examples": "10"},
        {"name": "a", "num_examples": True},
        {"name": ["a"], "num_examples": 10},
        [],
    ],
    ids=["no_examples", "zero", "string", "bool", "name_not_a_string", "not_an_object"],
)
def test_a_malformed_join_is_refused(payload: Any) -> None:
    with pytest.raises(ValueError, match="JOIN"):
        parse_join(payload)
