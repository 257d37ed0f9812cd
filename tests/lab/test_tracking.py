"""The tracker: JSONL always (and nothing lost on a crash), an offline W&B run, a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.config import TrackingConfig
from lab.tracking import METRICS_FILE, Tracker, resolve_wandb_mode


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tracker_writes_jsonl_and_an_offline_wandb_run(tmp_path: Path, capsys) -> None:
    tracking = TrackingConfig(wandb=True, wandb_mode="offline")
    with Tracker(
        tmp_path, config={"seed": 3, "model": {"name": "tiny"}}, tracking=tracking, job="unit"
    ) as tracker:
        tracker.log({"loss": 2.5, "tokens_per_s": 10.0}, step=1)
        tracker.log({"loss": 2.0, "ratio": float("nan")}, step=2)
        tracker.summary({"final_loss": 2.0})
        wandb_dir = tracker.wandb_dir
    records = read_jsonl(tmp_path / METRICS_FILE)
    assert [r["kind"] for r in records] == ["metrics", "metrics", "summary"]
    assert [r.get("step") for r in records[:2]] == [1, 2]
    assert records[0]["loss"] == 2.5 and records[1]["ratio"] == "nan"
    assert records[2]["final_loss"] == 2.0
    assert "seed: 3" in (tmp_path / "resolved_config.yaml").read_text()
    assert wandb_dir is not None and wandb_dir.parent == tmp_path / "wandb"
    assert wandb_dir.name.startswith("offline-run-")
    assert list(wandb_dir.glob("run-*.wandb"))
    assert "final_loss" in capsys.readouterr().out  # the console table


def test_metrics_logged_before_a_crash_are_kept(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="boom"),
        Tracker(tmp_path, config={}, tracking=TrackingConfig(wandb=False), job="unit") as tracker,
    ):
        tracker.log({"loss": 1.0}, step=1)
        raise RuntimeError("boom")
    assert read_jsonl(tmp_path / METRICS_FILE)[0]["loss"] == 1.0


def test_a_run_resumed_after_a_kill_mid_line_keeps_its_rows_and_skips_the_fragment(
    tmp_path: Path, caplog
) -> None:
    """A process killed while writing a row leaves half a line; the resumed run's tracker
    appends to the same file. Its rows start on a line of their own (before, the first was
    glued to the fragment and lost with it) and the reader skips the fragment with a warning
    (before, it raised and the run's summary could not be read)."""
    from lab.records import read_records

    (tmp_path / METRICS_FILE).write_text(
        '{"kind": "metrics", "step": 1, "loss": 2.0}\n{"kind": "met'
    )
    with Tracker(tmp_path, config={}, tracking=TrackingConfig(wandb=False), job="unit") as tracker:
        tracker.log({"loss": 1.5}, step=2)
    rows = read_records(tmp_path / METRICS_FILE)
    assert [(r["step"], r["loss"]) for r in rows if r.get("kind") == "metrics"] == [
        (1, 2.0),
        (2, 1.5),
    ]
    assert "a half-written record" in caplog.text and f"{METRICS_FILE}:2" in caplog.text


def test_wandb_can_be_turned_off(tmp_path: Path) -> None:
    with Tracker(tmp_path, config={}, tracking=TrackingConfig(wandb=False), job="unit") as tracker:
        tracker.summary({"x": 1.0})
    assert not (tmp_path / "wandb").exists()


def test_wandb_goes_online_only_when_configured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_wandb_mode("auto") == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password secretkey\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")  # the user's own setting wins
    assert resolve_wandb_mode("auto") == "offline"
    assert resolve_wandb_mode("online") == "online"
