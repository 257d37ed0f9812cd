"""The driver's wait on a step's calls, one per stage: a stage's refusal must not start the
driver's next step while another stage is still in this one (stop 63's CI: stage 1's refusal
came back first, the driver raised it at once, sent the next step, and stage 2, still ending
step 1, refused it as 'in a step already' without a word to stage 1, which then waited 40
minutes for a gradient)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from split_engine.sharded import wait_all


def _completed_later(value: object) -> torch.futures.Future:
    """A future that a thread completes a moment from now: wait_all must still be waiting then."""
    future: torch.futures.Future = torch.futures.Future()

    def complete() -> None:
        time.sleep(0.3)  # long enough that a wait_all that does not wait has long returned
        future.set_result(value)

    threading.Thread(target=complete, daemon=True).start()
    return future


def _failed(exc: Exception) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_exception(exc)
    return future


class _NoPeerLost:
    """The driver's watch over peers that all stay alive (its checks find nothing)."""

    def check(self) -> None:
        pass

    def settle(self) -> None:
        pass


@pytest.mark.parametrize("watch", [None, _NoPeerLost()], ids=["unwatched", "watched"])
def test_a_refusal_is_raised_only_after_every_stage_has_ended_its_call(watch: Any) -> None:
    refused = ValueError("stage 2 gave up: activation of shape (1, 3, 64)")
    still_running = _completed_later({"losses": [0.0]})
    with pytest.raises(ValueError, match="stage 2 gave up") as caught:
        wait_all([_failed(refused), still_running], watch=watch)
    assert caught.value is refused
    assert still_running.done()  # the stage had ended its call before the driver went on


def test_the_first_refusal_in_stage_order_is_the_one_raised() -> None:
    first, second = ValueError("stage 1 refused"), ValueError("stage 2 refused")
    with pytest.raises(ValueError, match="stage 1 refused"):
        wait_all([_failed(first), _failed(second), _completed_later(None)])


def test_a_transport_failure_is_returned_with_its_stage_after_the_others_end() -> None:
    lost = RuntimeError("RPC ran over its timeout")
    still_running = _completed_later("answer")
    results, failed = wait_all([still_running, _failed(lost)])
    assert failed == (1, lost)
    assert still_running.done() and results == ["answer"]


def test_watched_a_transport_failure_returns_at_once() -> None:
    """A peer gone: the calls left running end with the run, so the driver does not wait."""
    lost = RuntimeError("connection reset by peer")
    never: torch.futures.Future = torch.futures.Future()  # a stage that will not answer
    watch: Any = _NoPeerLost()  # duck-typed as the driver's PeerWatch
    results, failed = wait_all([never, _failed(lost)], watch=watch)
    assert (results, failed) == ([], (1, lost))
    assert not never.done()


def test_every_call_answered_gives_every_result_in_stage_order() -> None:
    results, failed = wait_all([_completed_later("a"), _completed_later("b")])
    assert (results, failed) == (["a", "b"], None)
