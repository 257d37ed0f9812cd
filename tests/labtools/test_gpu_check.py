"""`make gpu-check` in parts: what it runs, what it remembers between calls, what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labtools import gpu_check
from labtools.gpu_check import Check


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Three quick checks on a pretend GPU; each leaves a mark so a rerun shows."""
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(gpu_check, "gpu", lambda: "Pretend GPU")

    def check(name: str, code: int) -> Check:
        script = (
            f"import pathlib; p = pathlib.Path({str(marks / name)!r}); "
            "p.write_text(p.read_text() + 'x' if p.exists() else 'x'); "
            f"print('last words of {name}'); raise SystemExit({code})"
        )
        return Check(name, ("-c", script))

    monkeypatch.setattr(
        gpu_check, "CHECKS", (check("first", 0), check("second", 3), check("third", 0))
    )
    return marks


def test_without_a_gpu_it_says_so_and_checks_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main(["--state", str(tmp_path / "state.json")]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().err
    assert not (tmp_path / "state.json").exists()


def test_a_later_call_resumes_where_the_last_stopped(
    checks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.json"
    assert gpu_check.main(["--state", str(state), "--only", "first"]) == 0
    out = capsys.readouterr().out
    assert "first: ok" in out and "second: not run yet" in out and "third: not run yet" in out
    assert json.loads(state.read_text())["first"]["last_line"] == "last words of first"

    # the next call runs what is left; the failed check is named with its exit and last line
    assert gpu_check.main(["--state", str(state)]) == 1
    out = capsys.readouterr().out
    assert "second: FAILED (exit 3)" in out and "last words of second" in out
    assert out.strip().splitlines()[-1] == "gpu-check: 2 of 3 checks ok, 0 not run yet"
    assert [(checks / n).read_text() for n in ("first", "second", "third")] == ["x", "x", "x"]
    assert (tmp_path / "second.log").read_text().strip() == "last words of second"

    # the next call runs the failed check again, not the ones that passed
    gpu_check.main(["--state", str(state)])
    assert [(checks / n).read_text() for n in ("first", "second", "third")] == ["x", "xx", "x"]
    gpu_check.main(["--state", str(state), "--again"])  # or starts over
    assert (checks / "first").read_text() == "xx"


def test_a_state_entry_missing_fields_is_summarised_not_a_crash(
    checks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"first": {"ok": True}, "second": {}}))
    gpu_check.main(["--state", str(state), "--only", "third"])
    out = capsys.readouterr().out
    assert "first: ok" in out and "second: FAILED" in out and "third: ok" in out


def test_the_budget_stops_new_checks_and_keeps_what_ended(
    checks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.json"
    gpu_check.main(["--state", str(state), "--budget-s", "1e-9"])
    out = capsys.readouterr().out
    assert "the rest next time" in out
    assert list(json.loads(state.read_text())) == ["first"]  # started before the budget ran out
    assert not (checks / "second").exists()


def test_an_unreadable_state_starts_over_saying_so(
    checks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.json"
    state.write_text("{not json")
    gpu_check.main(["--state", str(state), "--only", "third"])
    assert "unreadable" in capsys.readouterr().err
    assert list(json.loads(state.read_text())) == ["third"]
