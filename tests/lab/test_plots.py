"""Plots a user reads: legends never over data (judged on matplotlib's drawn extents), and a
remark where validation loss rises."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lab.plots import legend_check, legend_overlaps, pyplot, rising_validation, save


def test_the_overlap_check_sees_a_legend_over_data_and_clears_one_beside_it() -> None:
    """The check can fail: a legend placed on a line's points is caught; moved off, it is not."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([0, 1, 2, 3], [3.85] * 4, label="flat at the top")
    ax.set_ylim(0, 4)
    ax.legend(loc="upper center")
    assert legend_overlaps(fig) == ["axes 0"]
    ax.legend(loc="lower center")
    assert legend_overlaps(fig) == []
    plt.close(fig)


def test_save_moves_a_legend_off_the_data_inside_where_there_is_room(tmp_path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    x = np.linspace(0, 10, 50)
    ax.plot(x, 10 - x, label="falling loss")  # from the upper left to the lower right
    ax.bar([8, 9], [9, 9], label="tall bars at the right")
    ax.legend(loc="upper right")  # on the bars' tops
    assert legend_overlaps(fig)
    png = save(fig, plt, tmp_path / "room.png")
    assert legend_check(png) == "none"


def test_save_puts_a_legend_below_the_axes_when_data_fill_them(tmp_path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    rng = np.random.default_rng(0)
    ax.plot(rng.uniform(0, 1, 400), rng.uniform(0, 1, 400), ".", label="everywhere")
    ax.plot([0, 1], [0.5, 0.5], label="a line")
    ax.legend()
    png = save(fig, plt, tmp_path / "full.png")
    assert legend_check(png) == "none"


def test_rising_validation_loss_is_remarked_only_when_it_rises() -> None:
    falling = [4.0, 3.5, 3.0, 2.6, 2.3, 2.0]
    assert rising_validation([(0, 3.9), (5, 3.4), (10, 3.2)], falling) == ""
    assert rising_validation([(0, 3.9), (5, 3.4), (10, 3.41)], falling) == ""  # within 0.5%
    # one evaluation above the lowest, or a rise that fell back: a short run's noise
    assert rising_validation([(0, 3.9), (5, 3.4), (10, 3.6)], falling) == ""
    assert rising_validation([(0, 3.9), (5, 3.4), (10, 3.6), (15, 3.5)], falling) == ""
    remark = rising_validation([(0, 3.9), (5, 3.4), (10, 3.5), (15, 3.6)], falling)
    assert remark.startswith("validation loss rose from 3.400 (step 5) to 3.600 (step 15)")
    assert "overfitting" in remark
    rounds = rising_validation([(0, 3.4), (1, 3.5), (2, 3.6)], None, step="round")
    assert rounds and "overfitting" not in rounds
    assert rising_validation([(0, 3.4)], falling) == ""
