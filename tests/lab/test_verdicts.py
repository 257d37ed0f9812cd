"""Each experiment's last lines say what its figures mean: the headline against its baseline,
faster or slower and why, and what to run for the realistic case (lab.registry.verdict_lines),
printed after the final table and the plots, before the W&B line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lab import registry

SUMMARIES: dict[str, dict[str, Any]] = {
    "spec_decoding": {"speedup": 0.62, "tokens_per_s": 60.0, "target_tokens_per_s": 96.8,
                      "acceptance_rate": 0.55, "draft_ms_per_token": 3.9},
    "split_inference": {"latency_ratio": 1.3, "token_ms_p50": 13.0, "unsplit_token_ms_p50": 10.0,
                        "memory_ratio": 0.64},
    "split_training": {"idle_share": 0.3, "idle_share_gpipe": 0.2, "first_loss": 4.2,
                       "final_loss": 3.9, "tokens_per_s": 500.0, "steps": 40.0},
    "fed_learn": {"initial_val_loss": 4.2, "final_val_loss": 3.9, "rounds": 3.0,
                  "federated_over_centralized": 1.02, "centralized_val_loss": 3.82},
    "data_parallel": {"step_ms": 60.0, "tokens_per_s": 4000.0, "final_loss": 3.3, "workers": 2.0,
                      "comm_share": 0.3, "sync": "ddp (ddp)", "one_process_tokens_per_s": 3000.0,
                      "one_process_final_loss": 3.3, "tokens_per_s_over_one_process": 1.333},
}  # fmt: skip
"""A final table of each experiment, as its run prints it."""


@pytest.mark.parametrize("name", sorted(SUMMARIES))
def test_every_experiment_says_what_its_figures_mean(name: str) -> None:
    lines = registry.verdict_lines(name, SUMMARIES[name])
    assert len(lines) >= 2, lines
    assert not registry.verdict_lines(name, {"unrelated": 1.0})  # a role's own table: nothing


def test_every_registered_experiment_has_a_verdict_and_a_summary_here() -> None:
    assert set(registry.manifests()) <= set(SUMMARIES) | {"tensor_parallel"}
    assert all(m.headline.verdict is not None for n, m in registry.manifests().items()
               if n in SUMMARIES)  # fmt: skip


def test_spec_decoding_says_slower_and_why_below_1x_and_faster_above() -> None:
    slower = registry.verdict_lines("spec_decoding", SUMMARIES["spec_decoding"])
    assert "0.62x, slower than the target alone" in slower[0]
    assert "a draft step cost 0.38 of a target step" in slower[1]
    assert slower[-1].startswith("For the realistic case: python -m spec_decoding target.lab_")
    faster = registry.verdict_lines(
        "spec_decoding", {**SUMMARIES["spec_decoding"], "speedup": 1.3, "tokens_per_s": 125.8}
    )
    assert "1.30x, faster than the target alone" in faster[0]


def test_fed_learn_sets_its_loss_beside_centralized_training() -> None:
    lines = registry.verdict_lines("fed_learn", SUMMARIES["fed_learn"])
    assert "1.020x its loss, 2.0% worse" in lines[1]


def test_the_verdict_comes_last_before_the_wandb_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lab.config import TrackingConfig
    from lab.tracking import Tracker

    with Tracker(tmp_path, config={}, tracking=TrackingConfig(wandb=False), job="fed_learn") as t:
        t.summary(SUMMARIES["fed_learn"])
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-3].startswith("federated: validation loss 4.200 -> 3.900")
    assert out[-1].startswith("Across real hosts")
