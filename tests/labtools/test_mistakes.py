"""`python -m labtools.mistakes`: the replay holds every case issue 50 named (items 1 and 3), and
an answer that repeats Hydra's advice fails it, however right the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from labtools import mistakes

ISSUE_50 = [
    # item 1: settings tied together, Hydra's raw answers
    "a client index beyond the clients",  # client_index=5 with 3 clients: was a traceback
    "more clients a round than the federation has",  # min_fit 5 of 3: was 120 s of silence
    "a key and its value apart",  # fed.rounds 3: was `missing EQUAL at '<EOF>'`
    "a list where one value goes",  # spec.gamma=[1,2]: was "of the schema's type"
    "an option-style flag",  # --rounds=3: was argparse's usage
    # item 3: a sweep's recorded command, and Hydra's override errors in run_matrix
    "a sweep's recorded command pasted back",  # it lost its + and ~
    "a new axis without its +",  # grid.window=[1,4]: was `Could not override 'grid.window'`
    "a typo in a sweep's overrides",  # the checker passed on Hydra's lines and its advice
    "a sweep that keeps the default grid's batch axis",  # its answer held Hydra's advice
]


def test_the_replay_holds_every_case_of_issue_50() -> None:
    names = [m.name for m in mistakes.MISTAKES]
    assert len(names) == len(set(names))
    missing = [name for name in ISSUE_50 if name not in names]
    assert not missing


@pytest.mark.parametrize("advice", mistakes.HYDRA_ADVICE)
def test_an_answer_with_hydras_advice_fails_the_replay(tmp_path: Path, advice: str) -> None:
    said = f"error: spec.gama is not a setting of spec_decoding. {advice} +spec.gama=4"
    case = mistakes.Mistake("typo", "python -m spec_decoding spec.gama=4", "spec.gama",
                            lambda folder: mistakes.Outcome(2, said + "\n"))  # fmt: skip
    ok, seen = mistakes.judge(case, tmp_path)
    assert not ok and "Hydra's advice" in seen
    answer = "error: spec.gama is not a setting of spec_decoding\n"
    clean = mistakes.Mistake("typo", "", "spec.gama", lambda folder: mistakes.Outcome(2, answer))
    assert mistakes.judge(clean, tmp_path)[0]


QUICK = ["a key and its value apart", "a list where one value goes", "an option-style flag",
         "more clients a round than the federation has"]  # fmt: skip
"""Cases refused before anything loads: seconds each (the others: `python -m labtools.mistakes`)."""


@pytest.mark.parametrize("name", QUICK)
def test_a_quick_case_is_answered_in_one_line(tmp_path: Path, name: str) -> None:
    (case,) = [m for m in mistakes.MISTAKES if m.name == name]
    ok, seen = mistakes.judge(case, tmp_path)
    assert ok, seen
