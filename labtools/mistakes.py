"""Replay the mistakes a new user made (issues 35 and 50), each as that user typed it, and check
that each is answered in one line: `error: ...` on stderr naming what is wrong, exit 2, no
traceback, never Hydra's advice (`HYDRA_ADVICE`), every role stopped (or, for Ctrl-C, a message
that tells the truth about what was kept).

    python -m labtools.mistakes              # every case
    python -m labtools.mistakes --only port  # the cases whose name says port

Its last line: `user mistakes answered in one line: N of M`.

Each case runs the lab's own commands in subprocesses on loopback, with the debug model
(`model.lab_preset=debug`) where a model is needed: about two minutes in all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lab.config import default_cache_dir

ROOT = Path(__file__).resolve().parent.parent
DEBUG = ("model.lab_preset=debug", "tracking.wandb=false")
SPEC_DEBUG = ("target.lab_preset=debug", "draft.lab_preset=debug", "tracking.wandb=false")


@dataclass
class Outcome:
    returncode: int | None
    stderr: str
    stdout: str = ""

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error: ")]


@dataclass
class Mistake:
    name: str
    what: str
    """What the user typed or did."""
    says: str
    """A fragment the answer must contain."""
    run: Callable[[Path], Outcome | list[Outcome]]
    exit_code: int = 2
    extra: Callable[[Path, list[Outcome]], str] = field(default=lambda folder, outcomes: "")
    """A further check: "" when it holds, else what is wrong."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def command(
    argv: list[str], folder: Path, *, env: dict[str, str] | None = None, timeout_s: float = 300
) -> Outcome:
    result = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    (folder / "stderr.log").write_text(result.stderr)
    return Outcome(result.returncode, result.stderr, result.stdout)


def module(name: str, *overrides: str, env: dict[str, str] | None = None) -> Callable:
    def run(folder: Path) -> Outcome:
        argv = [sys.executable, "-m", name, *overrides, f"hydra.run.dir={folder / 'run'}"]
        return command(argv, folder, env=env)

    return run


def _held_port(name: str, role_overrides: tuple[str, ...], key: str) -> Callable:
    """A server role told to listen on a port another process holds."""

    def run(folder: Path) -> Outcome:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen(1)
            port = holder.getsockname()[1]
            return module(name, *role_overrides, f"{key}={port}")(folder)

    return run


def _split_secrets_differ(folder: Path) -> list[Outcome]:
    """A stage with one secret, a driver with another: each is told what is really wrong."""
    port = _free_port()
    common = ["model.lab_preset=debug", "tracking.wandb=false", "split.num_stages=1",
              f"cluster.master.port={port}", "split.join_timeout_s=20"]  # fmt: skip
    stage = subprocess.Popen(
        # the stage waits long enough for a driver that starts slowly on a busy machine
        [sys.executable, "-m", "split_inference", "role=stage", "split.rank=1", *common,
         "split.join_timeout_s=120", f"hydra.run.dir={folder / 'stage'}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LAB_SECRET": "the-stages-secret"},
    )  # fmt: skip
    try:
        driver = command([sys.executable, "-m", "split_inference", "role=driver", *common,
                          f"hydra.run.dir={folder / 'driver'}"], folder,
                         env={"LAB_SECRET": "the-drivers-secret"})  # fmt: skip
        stdout, stderr = stage.communicate(timeout=120)
    finally:
        stage.kill()
    return [driver, Outcome(stage.returncode, stderr, stdout)]


def _stage_told_the_truth(folder: Path, outcomes: list[Outcome]) -> str:
    stage = outcomes[1]
    lines = stage.error_lines()
    if stage.returncode != 2 or len(lines) != 1 or "Traceback" in stage.stderr:
        return f"the stage ended {stage.returncode} with {stage.stderr[-400:]!r}"
    return "" if "secret" in lines[0] else f"the stage said {lines[0]!r}"


def _ctrl_c_early(folder: Path) -> Outcome:
    """Ctrl-C a federated run early: what it says it kept must be what is on disk."""
    run_dir = folder / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fed_learn", *DEBUG, "fed.num_clients=2", "fed.rounds=50",
         "fed.centralized_baseline=false", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (run_dir / "coordinator").is_dir():
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return Outcome(proc.returncode, stderr, stdout)


def _ctrl_c_truth(folder: Path, outcomes: list[Outcome]) -> str:
    kept = any((folder / "run").rglob("latest.json"))
    said = outcomes[0].stderr
    claims = "its checkpoints are kept" in said
    if claims != kept:
        return f"it said {said.strip().splitlines()[-1:]!r} with a checkpoint on disk: {kept}"
    return ""


def _costmodel_other_run(folder: Path) -> Outcome:
    run = folder / "a_split_training_run"
    run.mkdir()
    (run / "lab_run.json").write_text(json.dumps({"job": "split_training"}))
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "summary", "step_ms": 80.0}) + "\n")
    return command([sys.executable, "-m", "labtools.costmodel", "spec_decoding", str(run)], folder)


def _hub_unreachable(folder: Path) -> Outcome:
    endpoint = f"http://127.0.0.1:{_free_port()}"  # nobody listens: no address beyond this host
    return module("split_inference", "model.pretrained=TinyLlama/TinyLlama-1.1B-Chat-v1.0",
                  env={"HF_ENDPOINT": endpoint, "HF_HOME": str(folder / "hf")})(folder)  # fmt: skip


def _help_lists_keys(folder: Path, outcomes: list[Outcome]) -> str:
    text = outcomes[0].stdout
    return "" if "  spec.gamma=" in text and "--hydra-help" in text else text[-400:]


SPEC_QUICK = (*SPEC_DEBUG, "spec.num_prompts=1", "spec.max_new_tokens=8", "spec.prompt_tokens=16")


def _multirun(folder: Path) -> Outcome:
    return command([sys.executable, "-m", "spec_decoding", "-m", "seed=0,1", *SPEC_QUICK,
                    f"hydra.sweep.dir={folder / 'sweep'}"], folder)  # fmt: skip


def _multirun_named(folder: Path, outcomes: list[Outcome]) -> str:
    out = outcomes[0].stdout
    for seed in (0, 1):
        if f"spec_decoding: final metrics (seed={seed})" not in out:
            return f"no table names seed={seed}: {out[-400:]!r}"
    if not (folder / "sweep" / "summary.csv").is_file():
        return "no summary.csv in the sweep's folder"
    return ""


def _report_of_multirun(folder: Path) -> Outcome:
    _multirun(folder)
    return command([sys.executable, "-m", "labtools.report", str(folder / "sweep"),
                    "--out", str(folder / "report")], folder)  # fmt: skip


def _report_names_jobs(folder: Path, outcomes: list[Outcome]) -> str:
    index = folder / "report" / "index.md"
    if not index.is_file():
        return "no report written"
    text = index.read_text()
    wanted = ["## Summary", "## spec_decoding (seed=0)", "## spec_decoding (seed=1)"]
    missing = [w for w in wanted if w not in text]
    return f"the report lacks {missing}" if missing else ""


def _costmodel_help(folder: Path, outcomes: list[Outcome]) -> str:
    """Its first paragraph whole (it ended mid-sentence), and help for every option."""
    text = " ".join(outcomes[0].stdout.split())
    if "judged against what the host harness measured." not in text:
        return f"its description is cut: {text[:300]!r}"
    for option in ("one-way delays, ms", "link rates"):
        if option not in text:
            return f"no help for an option ({option!r}): {text[-300:]!r}"
    return ""


def _piped_sweep(folder: Path) -> Outcome:
    return command([sys.executable, "run_matrix.py", "workload=spec_decoding",
                    "grid.context=[16]", "~grid.batch", "axes.context=spec.prompt_tokens",
                    'overrides=["target.lab_preset=debug","draft.lab_preset=debug",'
                    '"spec.max_new_tokens=8"]', "repeats=1", "plot=false",
                    f"out_dir={folder / 'sweep'}"], folder)  # fmt: skip


def _piped_headers_whole(folder: Path, outcomes: list[Outcome]) -> str:
    out = outcomes[0].stdout
    for header in ("tokens_per_s (tokens/s)", "target_tokens_per_s (tokens/s)"):
        if header not in out:
            return f"no {header!r} whole in the piped table: {out[-600:]!r}"
    return ""


def _sweep_pasted_again(folder: Path) -> Outcome:
    """The piped sweep, then its recorded command (sweep.json, the report's `Command:`)
    pasted into a shell as written: it finds every cell done."""
    _piped_sweep(folder)
    recorded = json.loads((folder / "sweep" / "sweep.json").read_text())["command"]
    script = f'python() {{ "{sys.executable}" "$@"; }}\n{recorded}'
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    (folder / "pasted.log").write_text(f"$ {recorded}\n{result.stdout}{result.stderr}")
    return Outcome(result.returncode, result.stderr, result.stdout)


def _all_done(folder: Path, outcomes: list[Outcome]) -> str:
    out = outcomes[0].stdout
    return "" if "0 to run" in out else f"the pasted command ran cells again: {out[-400:]!r}"


def _one_warning_names_the_new_key(folder: Path, outcomes: list[Outcome]) -> str:
    """The old key still works until version 0.3, saying so in one line naming the new one."""
    output = outcomes[0].stdout + outcomes[0].stderr  # Hydra logs to stdout
    said = [line for line in output.splitlines() if "cluster.coordinator" in line]
    if len(said) != 1 or "fed.coordinator" not in said[0]:
        return f"{len(said)} lines name cluster.coordinator: {output[-600:]!r}"
    return ""


def _closed_port() -> str:
    return f"fed.coordinator.port={_free_port()}"


# fmt: off
MISTAKES = [
    Mistake("key typo", "python -m spec_decoding spec.gama=4",
            "spec.gama is not a setting of spec_decoding; did you mean spec.gamma?",
            module("spec_decoding", "spec.gama=4", *SPEC_DEBUG)),
    Mistake("Hydra's + hint on a typo", "python -m spec_decoding +spec.gama=4",
            "spec.gama is not a setting of spec_decoding; did you mean spec.gamma?",
            module("spec_decoding", "+spec.gama=4", *SPEC_DEBUG)),
    Mistake("a word for a number", "python -m fed_learn fed.rounds=two",
            "fed.rounds=two must be an integer", module("fed_learn", "fed.rounds=two", *DEBUG)),
    Mistake("a word for a boolean", "python -m spec_decoding spec.pipeline=maybe",
            "spec.pipeline=maybe must be true or false",
            module("spec_decoding", "spec.pipeline=maybe", *SPEC_DEBUG)),
    Mistake("a config group option that is not there", "python -m spec_decoding model=tinylama",
            "model=tinylama is not one of conf/model/",
            module("spec_decoding", "model=tinylama", *SPEC_DEBUG)),
    Mistake("the verifier's port is taken", "python -m spec_decoding role=verifier "
            "spec.verifier.port=<a port in use>", "Address already in use",
            _held_port("spec_decoding", ("role=verifier", *SPEC_DEBUG), "spec.verifier.port")),
    Mistake("the coordinator's port is taken", "python -m fed_learn role=coordinator "
            "fed.coordinator.port=<a port in use>", "Address already in use",
            _held_port("fed_learn", ("role=coordinator", *DEBUG), "fed.coordinator.port")),
    Mistake("split roles with different secrets", "LAB_SECRET=a python -m split_inference "
            "role=stage ... & LAB_SECRET=b python -m split_inference role=driver ...",
            "failed the shared-secret handshake", _split_secrets_differ,
            extra=_stage_told_the_truth),
    Mistake("a workload typo", "python run_matrix.py workload=fed_lern",
            "did you mean fed_learn?",
            lambda folder: command([sys.executable, "run_matrix.py", "workload=fed_lern",
                                    f"hydra.run.dir={folder / 'run'}"], folder)),
    Mistake("a hub model, offline", "python -m split_inference model.pretrained=<hub id> "
            "(no network)", "the hub cannot be reached from here", _hub_unreachable),
    Mistake("Ctrl-C before the first checkpoint", "python -m fed_learn, Ctrl-C in round 1",
            "interrupted", _ctrl_c_early, exit_code=130, extra=_ctrl_c_truth),
    Mistake("the cost model given another module's run",
            "python -m labtools.costmodel spec_decoding <a split_training run>",
            "is a run of split_training, not spec_decoding", _costmodel_other_run),
    Mistake("a role the module does not have", "python -m fed_learn role=drafter",
            "fed_learn has roles", module("fed_learn", "role=drafter", *DEBUG)),
    Mistake("a value out of range", "python -m fed_learn fed.rounds=-1", "fed.rounds",
            module("fed_learn", "fed.rounds=-1", *DEBUG)),
    Mistake("--help", "python -m spec_decoding --help", "",
            lambda folder: command([sys.executable, "-m", "spec_decoding", "--help"], folder),
            exit_code=0, extra=_help_lists_keys),
    Mistake("a multirun", "python -m spec_decoding -m seed=0,1", "spec_decoding: 2 jobs",
            _multirun, exit_code=0, extra=_multirun_named),
    Mistake("the report of a multirun folder", "python -m labtools.report multirun/...",
            "report:", _report_of_multirun, exit_code=0, extra=_report_names_jobs),
    Mistake("the cost model's --help", "python -m labtools.costmodel --help", "",
            lambda folder: command([sys.executable, "-m", "labtools.costmodel", "--help"],
                                   folder),
            exit_code=0, extra=_costmodel_help),
    Mistake("a sweep that keeps the default grid's batch axis",
            "python run_matrix.py workload=spec_decoding grid.context=[16] "
            "axes.context=spec.prompt_tokens overrides=[]", "~grid.batch drops that axis",
            lambda folder: command([sys.executable, "run_matrix.py", "workload=spec_decoding",
                                    "grid.context=[16]", "axes.context=spec.prompt_tokens",
                                    "overrides=[]", f"out_dir={folder / 'sweep'}"], folder)),
    Mistake("a sweep's table piped", "python run_matrix.py ... | cat", "cells ok: 1 of 1",
            _piped_sweep, exit_code=0, extra=_piped_headers_whole),
    # issue 50, item 1: settings tied together, and what Hydra answered in its own words
    Mistake("a client index beyond the clients",
            "python -m fed_learn role=client client_index=5 (3 clients)",
            "client_index=5 must be in 0..2",
            lambda folder: module("fed_learn", "role=client", "client_index=5", _closed_port(),
                                  *DEBUG)(folder)),
    Mistake("more clients a round than the federation has",
            "python -m fed_learn fed.min_fit_clients=5 (3 clients)",
            "fed.min_fit_clients=5 is more than fed.num_clients=3",
            module("fed_learn", "fed.min_fit_clients=5", *DEBUG)),
    Mistake("a key and its value apart", "python -m fed_learn fed.rounds 3",
            "key=value with no space: fed.rounds=3",
            module("fed_learn", "fed.rounds", "3", *DEBUG)),
    Mistake("a list where one value goes", "python -m spec_decoding spec.gamma=[1,2]",
            "spec.gamma=[1,2] must be one value (str), not a list",
            module("spec_decoding", "spec.gamma=[1,2]", *SPEC_DEBUG)),
    Mistake("an option-style flag", "python -m fed_learn --rounds=3",
            "settings are key=value, as fed.rounds=3",
            lambda folder: command([sys.executable, "-m", "fed_learn", "--rounds=3"], folder)),
    # issue 50, item 3: a sweep's command as recorded, and Hydra's override errors in run_matrix
    Mistake("a sweep's recorded command pasted back", "python run_matrix.py ... (from the "
            "report's Command: line)", "0 to run", _sweep_pasted_again, exit_code=0,
            extra=_all_done),
    Mistake("a new axis without its +", "python run_matrix.py workload=spec_decoding "
            "grid.window=[1,4]", "a new one takes a +, as +grid.window=[1,4]",
            lambda folder: command([sys.executable, "run_matrix.py", "workload=spec_decoding",
                                    "grid.window=[1,4]", f"out_dir={folder / 'sweep'}"],
                                   folder)),
    # issue 54: the endpoints moved into each experiment's section
    Mistake("an endpoint's old key", "python -m fed_learn role=client client_index=5 "
            "cluster.coordinator.port=<a closed port>", "client_index=5 must be in 0..2",
            lambda folder: module("fed_learn", "role=client", "client_index=5",
                                  _closed_port().replace("fed.", "cluster.", 1), *DEBUG)(folder),
            extra=_one_warning_names_the_new_key),
    Mistake("a misspelt endpoint key", "python -m fed_learn role=client fed.coordinater.port=1",
            "fed.coordinater.port is not a setting of fed_learn; did you mean "
            "fed.coordinator.port?",
            module("fed_learn", "role=client", "fed.coordinater.port=1", *DEBUG)),
    Mistake("another experiment's endpoint", "python -m fed_learn role=client spec.verifier.port=1",
            "spec.verifier.port is not a setting of fed_learn: it is spec_decoding's endpoint",
            module("fed_learn", "role=client", "spec.verifier.port=1", *DEBUG)),
    Mistake("a typo in a sweep's overrides", "python run_matrix.py workload=spec_decoding "
            "... overrides=[spec.gama=3]",
            "spec.gama is not a setting of spec_decoding; did you mean spec.gamma?",
            lambda folder: command([sys.executable, "run_matrix.py", "workload=spec_decoding",
                                    "grid.context=[16]", "~grid.batch",
                                    "axes.context=spec.prompt_tokens",
                                    'overrides=["spec.gama=3"]', f"out_dir={folder / 'sweep'}"],
                                   folder)),
]

HYDRA_ADVICE = ("To append to your config use", "Set the environment variable HYDRA_FULL_ERROR")
"""Hydra's own advice, wrong here (a `+` for a typo) or beside the point: no answer repeats it."""
# fmt: on


def judge(mistake: Mistake, folder: Path) -> tuple[bool, str]:
    """(answered in one line, what was seen)."""
    try:
        got = mistake.run(folder)
    except subprocess.TimeoutExpired as exc:
        return False, f"still running after {exc.timeout:.0f} s"
    outcomes = got if isinstance(got, list) else [got]
    first = outcomes[0]
    if first.returncode != mistake.exit_code:
        return False, f"exit {first.returncode}, not {mistake.exit_code}: {first.stderr[-600:]}"
    if "Traceback" in first.stderr:
        return False, f"a traceback: {first.stderr[-600:]}"
    for outcome in outcomes:
        advice = [a for a in HYDRA_ADVICE if a in outcome.stderr + outcome.stdout]
        if advice:
            return False, f"Hydra's advice ({advice[0]!r}): {outcome.stderr[-600:]}"
    if mistake.exit_code == 2:
        lines = first.error_lines()
        if len(lines) != 1:
            return False, f"{len(lines)} error lines: {first.stderr[-600:]}"
        if mistake.says not in lines[0]:
            return False, f"it said {lines[0]!r}"
        seen = lines[0]
    else:
        if mistake.says not in first.stderr + first.stdout:
            return False, f"no {mistake.says!r} in {first.stderr[-300:]!r}"
        said = [line for line in (first.stdout + first.stderr).splitlines()
                if mistake.says and mistake.says in line]  # fmt: skip
        seen = (said or first.stderr.strip().splitlines() or ["(exit 0)"])[-1]
    wrong = mistake.extra(folder, outcomes)
    return (not wrong, wrong or seen)


def main(argv: list[str] | None = None) -> int:
    about = " ".join((__doc__ or "").split("\n\n")[0].split())
    parser = argparse.ArgumentParser(prog="python -m labtools.mistakes", description=about)
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    parser.add_argument("--out", type=Path, default=None, help="default: a temporary folder")
    args = parser.parse_args(argv)
    os.environ.setdefault("LAB_CACHE", str(default_cache_dir()))
    out = args.out or Path(tempfile.mkdtemp(prefix="mistakes_"))
    chosen = [m for m in MISTAKES if args.only in m.name]
    answered = 0
    for index, mistake in enumerate(chosen):
        folder = out / f"{index:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        ok, seen = judge(mistake, folder)
        answered += ok
        mark = "ok  " if ok else "FAIL"
        print(f"{mark} {mistake.name} ({time.monotonic() - started:.0f} s): {mistake.what}")
        print(f"       {seen.strip()[:300]}", flush=True)
    print(f"user mistakes answered in one line: {answered} of {len(chosen)}")
    return 0 if answered == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
