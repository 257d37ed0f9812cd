"""Branches: the verifier goes on along a drafted alternative instead of waiting a round trip.

A branch roots at one of the drafter's next-best tokens at a position its stream has reached.
When the verifier's own token there is the root, it checks the branch's tokens without
waiting for the drafter; what it commits is its own choice at every position either way.
"""

from __future__ import annotations

import pytest
import torch

from netproto import Connection, RemoteError
from spec_decoding.protocol import SpecMsg
from spec_decoding.verifier import BadRequest, _Session
from tests.clocks import HANG_GUARD_S

from .test_greedy import PROMPTS, target_greedy
from .test_sessions import greedy_continuation, open_body, stream_payload

PROMPT = [5, 17, 42, 8]


def branch_payload(tokens: list[int], epoch: int, at: int) -> dict[str, torch.Tensor]:
    return {
        "tokens": torch.tensor(tokens, dtype=torch.int32),
        "epoch": torch.tensor([epoch], dtype=torch.int64),
        "at": torch.tensor([at], dtype=torch.int64),
    }


def session_for(verifier, tokenizer, *, alone: bool = False) -> _Session:
    body = open_body(tokenizer, prompt=PROMPT, pipeline=True, decode_alone=alone, max_new_tokens=8)
    return _Session.open(verifier, body)


def test_a_branch_rooted_at_the_verifiers_token_is_checked_without_waiting(
    verifier, target, tokenizer
) -> None:
    greedy = greedy_continuation(target, PROMPT, 8)
    wrong = (greedy[1] + 1) % len(tokenizer)
    session = session_for(verifier, tokenizer)
    session.stream(stream_payload([greedy[0], wrong, wrong], epoch=0, at=0))
    session.add_branch(branch_payload(greedy[1:4], epoch=0, at=1))
    first = session.step()
    assert first is not None and (first["accepted"], first["tokens"]) == (1, [greedy[1]])
    assert session.branch == greedy[2:4] and session.branches_taken == 1
    second = session.step()  # no message in between: the branch needs no round trip
    assert second is not None
    assert (second["accepted"], second["tokens"], second["branch"]) == (0, greedy[2:4], 2)
    assert second["fed"] == 3  # the correction and the branch's two tokens, in one forward
    assert session.decoder.tokens[len(PROMPT) :] == greedy[:4]
    assert session.step() is None  # caught up; the prediction after the branch is held


def test_a_wrong_token_in_a_branch_is_corrected_and_ends_it(verifier, target, tokenizer) -> None:
    greedy = greedy_continuation(target, PROMPT, 8)
    wrong = (greedy[1] + 1) % len(tokenizer)
    off = (greedy[3] + 1) % len(tokenizer)
    session = session_for(verifier, tokenizer)
    session.stream(stream_payload([greedy[0], wrong], epoch=0, at=0))
    session.add_branch(branch_payload([greedy[1], greedy[2], off, greedy[4]], epoch=0, at=1))
    session.step()
    checked = session.step()
    assert checked is not None
    assert (checked["tokens"], checked["branch"]) == ([greedy[2], greedy[3]], 1)
    assert session.branch == [] and session.has_work()  # the prediction after the correction
    assert session.decoder.tokens[len(PROMPT) :] == greedy[:4]


def test_a_branch_that_is_not_the_verifiers_token_is_not_taken(verifier, target, tokenizer) -> None:
    greedy = greedy_continuation(target, PROMPT, 8)
    wrong = (greedy[1] + 1) % len(tokenizer)
    other = (greedy[1] + 2) % len(tokenizer)
    session = session_for(verifier, tokenizer, alone=True)
    session.stream(stream_payload([greedy[0], wrong], epoch=0, at=0))
    session.add_branch(branch_payload([other, greedy[2]], epoch=0, at=1))
    session.step()
    assert session.branch == [] and session.branches_taken == 0
    assert session.step() is None and session.can_decode_alone()  # alone, as without one


def test_a_late_branch_is_compared_with_what_the_verifier_decoded_alone(
    verifier, target, tokenizer
) -> None:
    """A branch that reaches the verifier after its stream died at its root still counts:
    tokens the verifier decoded alone since are compared, the rest are checked."""
    greedy = greedy_continuation(target, PROMPT, 8)
    wrong = (greedy[0] + 1) % len(tokenizer)
    session = session_for(verifier, tokenizer, alone=True)
    session.stream(stream_payload([wrong], epoch=0, at=0))
    rejected = session.step()
    assert rejected is not None and (rejected["fed"], rejected["tokens"]) == (0, [greedy[0]])
    assert session.step() is None  # the prediction after its correction
    assert session.decode_alone()["tokens"] == [greedy[1]]
    late = greedy[:4]
    session.add_branch(branch_payload(late, epoch=0, at=0))
    assert session.branch == greedy[2:4] and not session.can_decode_alone()
    checked = session.step()
    assert checked is not None and (checked["tokens"], checked["branch"]) == (greedy[2:4], 2)
    # one that differs from a token decoded alone is of no use
    session = session_for(verifier, tokenizer, alone=True)
    session.stream(stream_payload([wrong], epoch=0, at=0))
    session.step(), session.step(), session.decode_alone()
    session.add_branch(branch_payload([greedy[0], wrong, greedy[2]], epoch=0, at=0))
    assert session.branch == [] and session.branches_taken == 0


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (branch_payload([4], epoch=1, at=0), "BRANCH of epoch 1 before any STREAM"),
        (branch_payload([4] * 17, epoch=0, at=0), r"a branch holds 1\.\.16 tokens"),
        (branch_payload([], epoch=0, at=0), r"a branch holds 1\.\.16 tokens"),
        (branch_payload([4], epoch=0, at=-1), "before the first generated token"),
        (branch_payload([4], epoch=0, at=3), "the stream has not reached it"),
        (branch_payload([4], epoch=0, at=10**6), "reached its cap"),
        (branch_payload([10**6], epoch=0, at=0), "holds token ids outside"),
        ({**branch_payload([4], 0, 0), "q": torch.ones(1)}, r"BRANCH holds \['q'\]"),
        ({**branch_payload([4], 0, 0), "at": torch.tensor([0.5])}, "int64 `at`"),
        ({"tokens": torch.tensor([4], dtype=torch.int32)}, "int64 `epoch`"),
        (
            {**branch_payload([4], 0, 0), "tokens": torch.tensor([4], dtype=torch.int64)},
            "int32 vector `tokens`",
        ),
    ],
)
def test_a_bad_branch_is_a_bad_request(verifier, tokenizer, payload, error: str) -> None:
    session = session_for(verifier, tokenizer)
    session.stream(stream_payload([3, 3], epoch=0, at=0))
    with pytest.raises(BadRequest, match=error):
        session.add_branch(payload)


def test_branches_at_a_position_are_bounded(verifier, tokenizer) -> None:
    session = session_for(verifier, tokenizer)
    session.stream(stream_payload([3, 3], epoch=0, at=0))
    for root in range(4, 8):
        session.add_branch(branch_payload([root, 9], epoch=0, at=1))
        session.add_branch(branch_payload([root, 9], epoch=0, at=1))  # a root again: replaced
    with pytest.raises(BadRequest, match="more than 4 branches at token 1"):
        session.add_branch(branch_payload([8, 9], epoch=0, at=1))
    assert sum(len(roots) for roots in session.branches.values()) == 4


def test_a_bad_branch_closes_that_session_only(verifier_server, target, tokenizer) -> None:
    address = verifier_server.address
    (right,) = greedy_continuation(target, [1, 2, 3], 1)  # (the stream stays live)
    with Connection.connect(*address) as bad, pytest.raises(RemoteError, match="BRANCH before"):
        bad.send(SpecMsg.BRANCH, branch_payload([4], epoch=0, at=0))
        bad.recv(expect={SpecMsg.PROGRESS}, timeout_s=HANG_GUARD_S)
    with Connection.connect(*address) as good, Connection.connect(*address) as bad:
        for conn in (good, bad):
            body = open_body(tokenizer, pipeline=True, decode_alone=False, max_new_tokens=4)
            conn.send_msg(SpecMsg.OPEN, body)
            conn.recv_msg(SpecMsg.OPENED)
        with pytest.raises(RemoteError, match="the stream has not reached it"):
            bad.send(SpecMsg.STREAM, stream_payload([right], epoch=0, at=0))
            bad.send(SpecMsg.BRANCH, branch_payload([5, 6], epoch=0, at=3))
            for _ in range(4):
                bad.recv(expect={SpecMsg.PROGRESS}, timeout_s=HANG_GUARD_S)
        good.send(SpecMsg.STREAM, stream_payload([4], epoch=0, at=0))
        assert good.recv_msg(SpecMsg.PROGRESS)["epoch"] == 0


@pytest.mark.parametrize("draft_name", ["unrelated", "noisy"])
@pytest.mark.parametrize(("gamma", "width"), [(2, 1), (4, 2)])
def test_greedy_output_with_branches_is_the_targets(
    make_drafter, drafts, target, tokenizer, draft_name: str, gamma: int, width: int
) -> None:
    drafter = make_drafter(
        drafts[draft_name], gamma=gamma, pipeline=True, branch_depth=3, branch_width=width
    )
    sent = 0
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        result = drafter.generate(ids, max_new_tokens=24)
        assert result.tokens == target_greedy(target, tokenizer, ids, 24)
        sent += result.branches
        assert result.branch_tokens <= sum(c.branch for c in result.checks)
    assert sent > 0  # the drafter had waits to fill (a window of a few, a draft as slow)


def test_a_seed_gives_the_same_sampled_text_with_or_without_branches(make_drafter, drafts) -> None:
    """Sampled, each position's token is the target's draw with the position's noise: whether
    a branch, a stream or the verifier alone got it there cannot change it."""
    prompt, texts = [5, 17, 42, 8], []
    for depth, gamma in ((0, 3), (3, 3), (4, 6)):
        drafter = make_drafter(
            drafts["noisy"], gamma=gamma, temperature=0.7, pipeline=True, branch_depth=depth
        )
        texts.append([drafter.generate(prompt, max_new_tokens=16, seed=s).tokens for s in (1, 2)])
    assert texts[0] == texts[1] == texts[2]
    assert texts[0][0] != texts[0][1]  # (the seeds do matter)


def test_the_drafter_takes_a_branchs_tokens_as_the_verifiers_own(make_drafter, drafts) -> None:
    """A branch's PROGRESS commits tokens the drafter's new stream may hold already: those it
    holds go on, the first that differs ends that stream too."""
    from spec_decoding.drafter import _Flight

    drafter = make_drafter(drafts["noisy"], pipeline=True, branch_depth=3)
    progress = {"epoch": 0, "at": 3, "accepted": 0, "tokens": [7, 9], "branch": 2, "fed": 3,
                "verify_ms": 1.0}  # fmt: skip
    flight = _Flight(confirmed=[1, 2, 3], inflight=[7, 8, 4], sent_at=[0.0] * 3, epoch=1)
    stats = drafter._take_progress(progress, flight, received=0.0, waited=False, window=4)
    assert (stats.branch, stats.accepted, stats.rejected, stats.rewound) == (2, 1, True, True)
    assert (flight.confirmed, flight.inflight, flight.epoch) == ([1, 2, 3, 7, 9], [], 2)
    flight = _Flight(confirmed=[1, 2, 3], inflight=[7, 9, 4], sent_at=[0.0] * 3, epoch=1)
    stats = drafter._take_progress(progress, flight, received=0.0, waited=False, window=4)
    assert not stats.rewound and (flight.inflight, flight.epoch) == ([4], 1)
    for bad, error in (
        ({"branch": 5}, "took 5 of 2 tokens along a branch"),
        ({"branch": 0}, "took 0 of 2 tokens"),  # at most one of them the correction
        ({"accepted": 1}, "accepted 1 of 0 tokens in flight"),
        ({"tokens": [7] * 17, "branch": 17}, "too many tokens of its own"),
        ({"forward_before": [0, 1.0]}, "forward_before"),
        ({"forward_before": [1, float("nan")]}, "forward_before"),
        ({"forward_before": [1, -2.0]}, "forward_before"),
        ({"forward_before": "1,2"}, "forward_before"),
        # a time that is no number: "nan" through float() once left the model's simulation
        # running forever at the end of the generation
        ({"verify_ms": "nan"}, "verify_ms"),
        ({"verify_ms": "inf"}, "verify_ms"),
        ({"verify_ms": True}, "verify_ms"),
        ({"fed": 10**400}, "fed="),  # (float() of it overflowed in the fit)
        ({"fed": "3"}, "fed="),
        ({"held_ms": 0.5}, "held_ms for 2 tokens"),  # a branch's tokens were never ours
    ):
        flight = _Flight(confirmed=[1, 2, 3], inflight=[7], sent_at=[0.0], epoch=1)
        with pytest.raises(ValueError, match=error):
            drafter._take_progress({**progress, **bad}, flight, 0.0, False, 4)


def test_a_forward_that_only_predicted_is_reported_with_the_next_verdict(
    verifier, target, tokenizer
) -> None:
    """After a correction the verifier runs the corrected token alone, for its next
    prediction; that forward travels with the next PROGRESS (`forward_before`), so the
    drafter's cost model sees one-token forwards too."""
    greedy = greedy_continuation(target, PROMPT, 8)
    wrong = (greedy[0] + 1) % len(tokenizer)
    session = session_for(verifier, tokenizer)
    session.stream(stream_payload([wrong], epoch=0, at=0))
    rejected = session.step()  # (it carries OPEN's forward for the first prediction)
    assert rejected is not None and rejected["fed"] == 0
    assert session.step() is None  # the prediction after the correction, alone
    session.stream(stream_payload([greedy[1], greedy[2]], epoch=1, at=1))
    checked = session.step()
    assert checked is not None and checked["accepted"] == 2
    fed, ms = checked["forward_before"]
    assert fed == 1 and ms > 0
    assert "forward_before" not in (session.step() or {})  # reported once


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_only_tokens_the_draft_is_unsure_of_are_branched(
    make_drafter, drafts, target, tokenizer, temperature: float
) -> None:
    """`branch_flatness`: a drafted token is branched only where its next-best is at least
    that likely next to it. Stricter settings branch fewer tokens; the output is the same.
    Which tokens a pipelined run drafts depends on when verdicts arrive (timing), so the
    choice is checked token by token along the output's own path, where it is fixed. The
    verifier waits for drafts (decode_alone=false): decoding alone, a verifier that outran a
    busy drafter decoded 22 of 24 tokens itself and left 2 drafted, none branched."""
    prompt = tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    results, drafters = {}, {}
    for flatness in (0.0, 0.9, 1.0):
        drafters[flatness] = make_drafter(
            drafts["noisy"], gamma=4, pipeline=True, branch_depth=3, branch_flatness=flatness,
            temperature=temperature, decode_alone=False,
        )  # fmt: skip
        results[flatness] = drafters[flatness].generate(prompt, max_new_tokens=24, seed=3)
        assert results[flatness].roots
    every, some, none = results[0.0], results[0.9], results[1.0]
    # (whether a flat token's branch is sent depends on timing: only while no verdict waits)
    assert every.flat == every.drafted > 0
    assert some.flat <= some.drafted
    assert none.flat == none.branches == 0  # p2 / p1 < 1 but for exact ties
    assert every.tokens == some.tokens == none.tokens
    if temperature == 0:
        assert every.tokens == target_greedy(target, tokenizer, prompt, 24)
    # the draft's guess at each position of the output, as the run makes it
    path = [*prompt, *every.tokens]
    with torch.no_grad():
        logits = drafts["noisy"](input_ids=torch.tensor([path])).logits[0]  # (T, V)
    branched = {
        flatness: {
            at
            for at in range(len(prompt), len(path))
            if drafter._guess(logits[at - 1], 3, at, others=drafter.branch_width)[1]
        }
        for flatness, drafter in drafters.items()
    }
    assert branched[0.0] == set(range(len(prompt), len(path)))
    assert branched[1.0] == set()
    # the noisy draft is sure of some of its tokens, not all
    assert 0 < len(branched[0.9]) < len(branched[0.0])


def test_flatness_outside_0_to_1_is_refused(make_drafter, drafts) -> None:
    from spec_decoding.config import SpecConfig

    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="branch_flatness"):
            make_drafter(drafts["noisy"], pipeline=True, branch_depth=3, branch_flatness=bad)
        with pytest.raises(ValueError, match=r"spec\.branch_flatness"):
            SpecConfig(branch_flatness=bad)
