"""`python -m labtools.readme_check`: replay the documented commands as a new user would, quickly.

The README's and every docs/*.md page's (or only the files named on the command line). Every
`python ...` line of their ```bash blocks runs as written, plus quick settings for
the keys it does not set itself (debug models, few rounds and tokens, one repeat), each in a
folder of its own under `--out`. Lines written as `host$ command` are a multi-machine example:
consecutive ones run together, as separate processes on this machine, with every endpoint its
manifest declares (`fed.coordinator`, `cluster.master`) moved to loopback on free ports and one
shared secret. A command passes when it exits
0 and prints nothing a user would read as an error (a traceback, a Python warning, TensorPipe's
shutdown lines, an RRef leak, a C++ warning). Lines that need what this machine cannot have (a
hub model, a placeholder to fill in) are listed as skipped, with their file:line and why; a
command written in several places runs once. Each file's count is printed, then the last line,
over all of them: `README commands ok: N of M`.

First, before any command runs, every figure tagged as a bench figure
(`<!-- bench NAME: KEY > KEY -->`, lab.benchfigures) is compared with bench/results/NAME.json at
the precision it is printed with; one that differs is named with the file's figure and stops
the check (exit 1). `--figures` does only this (a second).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from lab import benchfigures, registry
from lab.cli import EXIT_INTERRUPTED
from lab.experiment import override_key
from lab.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT_DIR = "split.checkpoint_dir"
SERVER_GRACE_S = 20.0
"""How long a multi-machine example's servers get to end by themselves once the rest have."""

QUICK: dict[str, list[str]] = {
    "lab.pretrain": ["pretrain=debug"],
    "run_matrix.py": ["repeats=1"],
}
"""Quick settings per command that is no experiment (an experiment's are its manifest's
`quick`), each added only where the documented line does not set that key."""

NOISE = re.compile(
    r"Traceback \(most recent call last\)|\w+Warning: |Detected RRef Leaks|Leaking RRef|"
    r"tensorpipe_agent\.cpp|pipe closed|EOF: end of file|^\s*(\[\w+\] )?\[?[WE]\d{4} |"
    r"^\s*(\[\w+\] )?error: |wandb: WARNING",
    re.MULTILINE,
)
"""What a successful command must not print: lines a user reads as errors."""

NEEDS = [
    (re.compile(r"<[^>]+>|\.\.\.(?!\S)|=\.\.\."), "a placeholder to fill in"),
    (re.compile(r"tinyllama|my_small_llama|llama3_8b"), "a hub model (no hub here)"),
    (re.compile(r"bench_models/"), "the model bench/split_bench.py builds"),
    (
        re.compile(r"bench_target|bench_draft|pretrain=bench"),
        "the bench pair (built once in about 13 minutes: too long for a quick replay)",
    ),
    (re.compile(r"submitit|hydra-ray"), "a Hydra launcher plugin"),
    (
        re.compile(r"lab\.hosts curves"),
        "the delay x rate grid of every module: an hour (tests/multihost runs one cell)",
    ),
]
"""Lines that cannot run here as written, and why."""
if importlib.util.find_spec("ray") is None:
    NEEDS.append((re.compile(r"hydra/launcher=ray"), "the Ray extra (`make ray-deps`)"))

ACROSS_HOSTS_ONLY = (
    re.compile(r"(?<!\S)cluster=mine(?!\S)"),
    "cluster=mine, the file docs/two_machines.md step 3 has you write: `python -m labtools.hosts "
    "docs` runs these across hosts; the README's two-machine lines run here on loopback",
)
"""Lines replayed across hosts by labtools.hosts, not here (readme_commands still returns them:
labtools.hosts reads them through it)."""


def documented_files(root: Path = ROOT) -> list[Path]:
    """What `make readme-check` replays: the README, then every docs/*.md page, sorted."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def shown(path: Path) -> str:
    """`path` as the user would name it: relative to the repository where it lies inside."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@dataclass
class Command:
    """One README line (or a group of `host$` lines that run together)."""

    text: str
    argvs: list[list[str]] = field(default_factory=list)
    skipped: str = ""
    where: str = ""
    """`file:line` of its (first) line."""


def readme_commands(readme: Path) -> list[Command]:
    """The `python ...` lines of `readme`'s bash blocks, `host$` lines grouped."""
    commands: list[Command] = []
    group: Command | None = None
    in_block = False
    lines = readme.read_text().splitlines()
    joined: list[str] = []
    starts: list[int] = []  # each joined line's first line number
    for number, line in enumerate(lines, start=1):  # join `\` continuations
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line)
            starts.append(number)
    name = shown(readme)
    for line, number in zip(joined, starts, strict=True):
        if line.startswith("```"):
            in_block = line.strip() == "```bash"
            group = None
            continue
        if not in_block:
            continue
        text = line.split(" #", 1)[0].strip() if " #" in line else line.strip()
        host = re.match(r"^[\w-]+\$\s+(.*)$", text)
        body = host.group(1) if host else text
        body = re.sub(r"^LAB_SECRET=\S+\s+", "", body)
        if not body.startswith("python "):
            group = None
            continue
        filled = body.replace(f"{CHECKPOINT_DIR}=...", "")  # one `...` this script fills in
        skipped = next((why for pattern, why in NEEDS if pattern.search(filled)), "")
        if host:
            if group is None:
                group = Command(text=text, skipped=skipped, where=f"{name}:{number}")
                commands.append(group)
            else:
                group.text += "  &  " + text
                group.skipped = group.skipped or skipped
            group.argvs.append(shlex.split(body))
        else:
            group = None
            commands.append(
                Command(text=text, argvs=[shlex.split(body)], skipped=skipped,
                        where=f"{name}:{number}")
            )  # fmt: skip
    return commands


def target_of(argv: list[str]) -> str:
    """`spec_decoding` for `python -m spec_decoding ...`, `run_matrix.py` for the script."""
    return argv[2] if argv[1] == "-m" else Path(argv[1]).name


HOSTS_QUICK: dict[str, list[str]] = {
    # the full grid is an hour or more (6 variants x 12 cells): one variant, two cells, one
    # calibration run (docs/hosts.md: split_inference within 1.02-1.09 of its model there)
    "curves": ["--only", "split_inference", "--delay-ms", "10", "50", "--rate", "1gbit",
               "--calibration-runs", "1"],
}  # fmt: skip
"""`python -m labtools.hosts <subcommand>`'s quick flags, added where the line sets none."""


def quick_of(target: str) -> list[str]:
    """The quick settings of a command: an experiment's manifest's, or QUICK's."""
    manifest = registry.find(target)
    return list(manifest.quick) if manifest is not None else QUICK.get(target, [])


def with_quick(argv: list[str], *, out: Path, extra: Sequence[str] = ()) -> list[str]:
    """`argv` plus the quick settings and `extra` for every key it does not set, into `out`."""
    target = target_of(argv)
    head = 3 if argv[1] == "-m" else 2
    args = argv[head:]
    multirun = "-m" in args or "--multirun" in args
    given = {override_key(a) for a in args if "=" in a and not a.startswith("-")}
    added = [o for o in [*quick_of(target), *extra] if override_key(o) not in given]
    if target == "labtools.hosts" and args and not any(a.startswith("--") for a in args[1:]):
        added += HOSTS_QUICK.get(args[0], [])
    if target == "run_matrix.py":
        where = [f"out_dir={out}"]
    elif target == "labtools.hosts":  # argparse, not Hydra
        where = ["--out", str(out)]
    elif multirun:
        where = [f"hydra.sweep.dir={out}"]
    else:
        where = [f"hydra.run.dir={out}"]
    return [sys.executable, *argv[1:head], *args, *added, *where]


def with_shared(argv: list[str], out: Path) -> list[str]:
    """`argv` with each folder its experiment needs every host to see (its scenario's
    `shared` keys: dp.checkpoint_dir, which the docs point at a mount) one under `out`."""
    manifest = registry.find(target_of(argv))
    keys = manifest.scenario.shared if manifest and manifest.scenario else ()
    if not any(a.split("=", 1)[0] in keys for a in argv):
        return argv
    kept = [a for a in argv if a.split("=", 1)[0] not in keys]
    return [*kept, *(f"{key}={out / 'shared' / key}" for key in keys)]


def loopback_hosts(ports: dict[str, int]) -> list[str]:
    """Every endpoint (its dotted key) on loopback, at `ports`: a multi-machine example on one
    host."""
    return [
        o for key, port in ports.items() for o in (f"{key}.host=127.0.0.1", f"{key}.port={port}")
    ]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill `procs` and every process under them (roles and sweep cells lead sessions of
    their own, out of reach of a process-group kill)."""
    import psutil

    tree = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=10)


def run_command(command: Command, *, out: Path, timeout_s: float) -> tuple[bool, str]:
    """Run `command` (its processes together); (passed, why not)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    extra: list[str] = []
    if len(command.argvs) > 1 or any("role=" in " ".join(a) for a in command.argvs):
        env["LAB_SECRET"] = secrets.token_hex(16)
        endpoints = registry.manifest(target_of(command.argvs[0])).endpoints  # no other read
        ports = {key: free_port("127.0.0.1") for key in endpoints}
        extra = [*loopback_hosts(ports), "num_threads=1"]
    argvs = [
        with_shared(with_quick(argv, out=out / f"p{i}", extra=extra), out)
        for i, argv in enumerate(command.argvs)
    ]
    checkpoints = f"{CHECKPOINT_DIR}={out / 'checkpoints'}"  # the README's `...`, filled in
    argvs = [[checkpoints if a == f"{CHECKPOINT_DIR}=..." else a for a in argv] for argv in argvs]
    if "split.resume=true" in argvs[0]:  # a resume needs a run to go on from: 2 steps first
        first = ["split.resume=false" if a == "split.resume=true" else a for a in argvs[0]]
        first = [a for a in first if not a.startswith("split.steps=")] + ["split.steps=2"]
        first = [f"hydra.run.dir={out / 'first'}" if a.startswith("hydra.run.dir=") else a
                 for a in first]  # fmt: skip
        prime = subprocess.run(first, capture_output=True, text=True, env=env, timeout=timeout_s)
        if prime.returncode != 0:
            return False, f"the run to resume from failed (exit {prime.returncode})"
    logs = [out / f"p{i}.log" for i in range(len(argvs))]
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for argv, log_path in zip(argvs, logs, strict=True):
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          cwd=ROOT, start_new_session=True))  # fmt: skip
        time.sleep(1.0 if len(argvs) > 1 else 0.0)  # servers are listed first
    deadline = time.monotonic() + timeout_s
    interrupted: set[int] = set()
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() > deadline:
            stop(procs)
            return False, f"still running after {timeout_s:.0f}s (logs: {out})"
        running = [i for i, proc in enumerate(procs) if proc.poll() is None]
        if len(running) < len(procs) and all(procs[i].poll() is None for i in running):
            # the others are done: a server that serves on (the verifier) gets what its user
            # would give it, a Ctrl-C, after a grace period to end by itself
            settle = time.monotonic() + SERVER_GRACE_S
            while time.monotonic() < settle and any(procs[i].poll() is None for i in running):
                time.sleep(0.2)
            for i in running:
                if procs[i].poll() is None:
                    procs[i].send_signal(signal.SIGINT)
                    interrupted.add(i)
            for i in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs[i].wait(timeout=30)
            if any(procs[i].poll() is None for i in running):
                stop(procs)
                return False, f"a server did not stop on Ctrl-C (logs: {out})"
        time.sleep(0.2)
    codes = [proc.returncode for proc in procs]
    for index, (code, log_path) in enumerate(zip(codes, logs, strict=True)):
        text = log_path.read_text(errors="replace")
        if index in interrupted and code == EXIT_INTERRUPTED:
            code = 0  # stopped by the Ctrl-C above, as its user would, and said so cleanly
        if code != 0:
            last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
            return False, f"exit {code}: {last[0][:200]} (log: {log_path})"
        noise = NOISE.search(text)
        if noise:
            line = text[text.rfind("\n", 0, noise.start()) + 1 :].splitlines()[0]
            return False, f"exit 0 but printed: {line.strip()[:200]} (log: {log_path})"
    return True, ""


def check_figures(files: Sequence[Path], *, results: Path | None = None) -> bool:
    """Every tagged bench figure of `files` against bench/results; prints each that differs
    and the count; False when one does."""
    total, wrong = benchfigures.check_tags(files, root=ROOT, results=results)
    for bad in wrong:
        shown_as = f"{bad.printed} where bench/results has" if bad.printed else "no figure:"
        print(f"{bad.where}: {shown_as} {bad.expected}")
    print(f"bench figures agree with bench/results: {total - len(wrong)} of {total}")
    if wrong:
        print("rerun the bench that moved, then write its figures as bench/results has them")
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m labtools.readme_check", description=__doc__)
    parser.add_argument(
        "files", nargs="*", type=Path,
        help="replay only these Markdown files (default: README.md, then docs/*.md, sorted)",
    )  # fmt: skip
    parser.add_argument("--readme", type=Path, action="append", default=[],
                        help="the same as naming the file (repeatable)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per command")
    parser.add_argument("--only", default="", help="run only commands containing this text")
    parser.add_argument("--figures", action="store_true", help="only check the bench figures")
    args = parser.parse_args(argv)
    files = list(dict.fromkeys([*args.files, *args.readme])) or documented_files()
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    if not check_figures(files):
        raise SystemExit(1)
    if args.figures:
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="readme_check_"))
    console = Console(highlight=False)
    commands: list[Command] = []
    first_at: dict[tuple[tuple[str, ...], ...], str] = {}  # a command written twice runs once
    for path in files:
        for command in readme_commands(path):
            if args.only not in command.text:
                continue
            commands.append(command)
            pattern, why = ACROSS_HOSTS_ONLY
            if not command.skipped and pattern.search(command.text):
                command.skipped = why
            if command.skipped:
                continue
            key = tuple(tuple(a) for a in command.argvs)
            if key in first_at:
                command.skipped = f"the same command as {first_at[key]}: replayed once"
            else:
                first_at[key] = command.where
    runnable = [c for c in commands if not c.skipped]
    for command in commands:
        if command.skipped:
            console.print(f"[dim]skip[/]  {command.where}  {escape(command.text)}  "
                          f"[dim]({escape(command.skipped)})[/]", soft_wrap=True)  # fmt: skip
    if runnable:
        # As `make run` does first: the lab's tiny models, built once (minutes on 2 cores)
        # rather than inside whichever command happens to need them first, under its limit.
        console.print("building the lab's tiny models first: python -m lab.pretrain (once)")
        for preset in ("default", "debug"):
            subprocess.run(
                [sys.executable, "-m", "lab.pretrain", f"pretrain={preset}", "tracking.wandb=false",
                 f"hydra.run.dir={out / 'pretrain' / preset}"],
                check=True, cwd=ROOT,
            )  # fmt: skip
    passed: dict[str, int] = {}
    for number, command in enumerate(runnable, start=1):
        console.print(f"[bold]{number}/{len(runnable)}[/] {command.where}  "
                      f"{escape(command.text)}", soft_wrap=True)  # fmt: skip
        started = time.monotonic()
        ok, why = run_command(command, out=out / f"{number:02d}", timeout_s=args.timeout_s)
        seconds = time.monotonic() - started
        source = command.where.rsplit(":", 1)[0]
        passed[source] = passed.get(source, 0) + ok
        if ok:
            console.print(f"  [green]ok[/] in {seconds:.0f}s")
        else:
            console.print(f"  [red]FAILED[/] after {seconds:.0f}s: {escape(why)}", soft_wrap=True)
    console.print(f"outputs and logs: {out}")
    for path in files:
        name = shown(path)
        mine = [c for c in commands if c.where.rsplit(":", 1)[0] == name]
        ran = sum(not c.skipped for c in mine)
        same = sum(c.skipped.startswith("the same command as ") for c in mine)
        print(f"{name}: {passed.get(name, 0)} of {ran} ok; {same} run above, "
              f"{len(mine) - ran - same} skipped")  # fmt: skip
    total = sum(passed.values())
    print(f"README commands ok: {total} of {len(runnable)}")
    if total != len(runnable):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
