"""labtools.readme_check: which files it reads and how it counts (no command is run here)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lab import registry
from labtools import readme_check
from labtools.readme_check import ROOT, documented_files, readme_commands

PAGE = """# A page

```bash
python -m fed_learn                # the same line as another page's
python -m spec_decoding model@target=tinyllama model@draft=my_small_llama
python run_matrix.py workload=spec_decoding '~grid.context' \\
    '+grid.window=[1,2]'
desktop$ python -m spec_decoding role=verifier cluster=mine
laptop$  python -m spec_decoding role=drafter cluster=mine
```
"""


def test_make_readme_check_reads_the_readme_then_every_docs_page_sorted() -> None:
    files = documented_files()
    assert files[0] == ROOT / "README.md"
    pages = files[1:]
    assert pages == sorted(pages)
    assert ROOT / "docs" / "two_machines.md" in pages
    assert all(p.parent == ROOT / "docs" and p.suffix == ".md" for p in pages)


def test_each_command_knows_its_file_and_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    commands = readme_commands(page)
    assert [c.where.rsplit(":", 1)[1] for c in commands] == ["4", "5", "6", "8"]
    assert commands[0].where == f"{page}:4"  # outside the repository: the whole path
    assert "'+grid.window=[1,2]'" in commands[2].text  # a continued line is one command
    assert commands[1].skipped == "a hub model (no hub here)"
    assert len(commands[3].argvs) == 2  # host$ lines run together, as before
    assert not commands[3].skipped  # labtools.hosts reads these through readme_commands
    assert readme_commands(ROOT / "README.md")[0].where.startswith("README.md:")


def test_counts_per_file_and_once_over_all_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "first.md", tmp_path / "second.md"
    first.write_text("```bash\npython -m fed_learn\npython -m split_training\n```\n")
    second.write_text(PAGE)
    ran: list[str] = []

    def fake_run(command: readme_check.Command, **_: object) -> tuple[bool, str]:
        ran.append(command.where)
        return "split_training" not in command.text, "exit 1: broken"

    monkeypatch.setattr(readme_check, "run_command", fake_run)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: None)  # the tiny models' build
    with pytest.raises(SystemExit):
        readme_check.main([str(first), str(second), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert ran == [f"{first}:2", f"{first}:3", f"{second}:6"]  # fed_learn once
    assert f"skip  {second}:4  python -m fed_learn  (the same command as {first}:2" in out
    assert f"skip  {second}:5  python -m spec_decoding" in out
    assert f"skip  {second}:8  desktop$" in out and "cluster=mine" in out
    lines = out.strip().splitlines()
    assert lines[-3] == f"{first}: 1 of 2 ok; 0 run above, 0 skipped"
    assert lines[-2] == f"{second}: 1 of 1 ok; 1 run above, 2 skipped"
    assert lines[-1] == "README commands ok: 2 of 3"


def test_a_page_with_nothing_to_run_builds_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "page.md"
    page.write_text("```bash\npython -m spec_decoding model@target=tinyllama\n```\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("built the tiny models"))
    readme_check.main([str(page), "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2:] == [
        f"{page}: 0 of 0 ok; 0 run above, 1 skipped",
        "README commands ok: 0 of 0",
    ]


TAGGED = "1.43x<!-- bench split_bench: rows > decode latency > ratio -->"


def test_every_tagged_bench_figure_agrees_with_bench_results() -> None:
    from lab.benchfigures import check_tags

    total, wrong = check_tags(documented_files(), root=ROOT)
    assert total >= 60  # the README's bench tables, its module table, its prose
    assert wrong == []


def test_readme_check_fails_on_a_figure_that_differs_from_bench_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    assert TAGGED in text
    readme.write_text(text)
    readme_check.main([str(readme), "--figures"])  # as written: it agrees
    readme.write_text(text.replace(TAGGED, TAGGED.replace("1.43x", "1.44x")))
    with pytest.raises(SystemExit) as exited:
        readme_check.main([str(readme), "--figures"])
    assert exited.value.code == 1
    line = 1 + text[: text.index(TAGGED)].count("\n")
    out = capsys.readouterr().out
    assert f"{readme}:{line}: 1.44 where bench/results has 1.43" in out


def test_a_rerun_bench_that_moves_a_figure_fails_it_at_the_printed_precision(
    tmp_path: Path,
) -> None:
    import json
    import os

    from lab.benchfigures import check_line

    results = tmp_path / "results"
    results.mkdir()
    data = json.loads((ROOT / "bench" / "results" / "split_bench.json").read_text())
    for second, (value, agrees) in enumerate(((1.4306, True), (1.4249, False), (1.4351, False))):
        data["rows"]["decode latency"]["ratio"] = value
        (results / "split_bench.json").write_text(json.dumps(data))
        os.utime(results / "split_bench.json", (0, second))  # a rewritten file: a new mtime
        found, wrong = check_line(f"| **{TAGGED}** |", where="x", results=results)
        assert found == 1 and (wrong == []) == agrees, (value, wrong)
    found, wrong = check_line("no figure <!-- bench split_bench: rows > nope -->", where="x",
                              results=results)  # fmt: skip
    assert found == 1 and "no figure right before" in wrong[0].expected


def test_the_readme_module_tables_figures_are_the_bench_tables() -> None:
    """Every ratio in the README's module table is tagged, so it reads the same bench result
    as the bench table below it and the two cannot disagree."""
    import re

    from lab.benchfigures import TAG

    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| `")]  # fmt: skip
    assert len(rows) >= 8
    ratios = 0
    for row in rows:
        for figure in re.finditer(r"\d+\.\d+x(?!\d)", row):
            ratios += 1
            assert TAG.match(row, figure.end()), f"untagged {figure[0]} in: {row[:60]}"
    assert ratios >= 5


def test_a_manifests_benchmark_text_reads_bench_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from lab import benchfigures

    data = json.loads((ROOT / "bench" / "results" / "split_bench.json").read_text())
    data["rows"]["decode latency"].update(ratio=1.234, ours=20.0, baseline=16.2)
    (tmp_path / "split_bench.json").write_text(json.dumps(data))
    monkeypatch.setattr(benchfigures, "RESULTS", tmp_path)
    head = registry.manifests()["split_inference"].headline
    assert "1.23x (20.0 against 16.2 ms" in head.benchmark_text()
    (tmp_path / "split_bench.json").unlink()
    assert head.benchmark_text().startswith("not available (") and "split_bench.py" in (
        head.benchmark_text()
    )


def test_a_tag_shown_in_code_is_an_example_not_a_figure(tmp_path: Path) -> None:
    from lab.benchfigures import check_tags

    page = tmp_path / "page.md"
    tag = TAGGED[5:]
    page.write_text(f"the tag: `9.99x{tag}`, and a figure {TAGGED}\n"
                    f"```bash\n9.99x{tag}\n```\nlast: `ends on 1.43x`{tag}\n")  # fmt: skip
    assert check_tags([page], root=tmp_path) == (2, [])  # the two outside code, both right


def test_the_readme_stays_a_front_page() -> None:
    """README.md is the front page (docs/architecture.md): at most 300 lines, detail in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to a docs/ page"
