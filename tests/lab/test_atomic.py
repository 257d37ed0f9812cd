"""Checkpoints and manifests are written so that a crash leaves the old version or the new."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab import atomic


def test_write_text_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    target = tmp_path / "latest.json"
    target.write_text("old")
    atomic.write_text(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["latest.json"]


def test_a_write_that_fails_midway_leaves_the_old_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "weights.safetensors"
    target.write_bytes(b"old weights")

    def crash_halfway(tmp: Path) -> None:
        tmp.write_bytes(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.replace_file(target, crash_halfway)
    assert target.read_bytes() == b"old weights"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.safetensors"]


def test_a_staged_folder_replaces_the_old_one_only_when_complete(tmp_path: Path) -> None:
    final = tmp_path / "round_0002"
    final.mkdir()
    (final / "adapter.bin").write_text("round 1")
    with pytest.raises(RuntimeError), atomic.staged_dir(final) as staging:
        (staging / "adapter.bin").write_text("half of round 2")
        raise RuntimeError("killed while saving")
    assert (final / "adapter.bin").read_text() == "round 1"
    assert [p.name for p in tmp_path.iterdir()] == ["round_0002"]  # no staging left behind
    with atomic.staged_dir(final) as staging:
        (staging / "adapter.bin").write_text("round 2")
    assert (final / "adapter.bin").read_text() == "round 2"
    assert [p.name for p in tmp_path.iterdir()] == ["round_0002"]
