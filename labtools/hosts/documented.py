"""The documented multi-machine commands (`host$ python -m ...` lines), each on its host."""

from __future__ import annotations

import io
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lab import registry
from labtools.hosts.network import ROOT, HostsError, Network
from labtools.hosts.scenarios import _wait, provision

DOCUMENTED = ("docs/two_machines.md", "README.md")
"""Where the commands a user types on each machine are written (`host$ python -m ...` lines)."""
DOC_SERVER = "192.168.1.20"
"""The serving host's address in conf/cluster/two_hosts.yaml and docs/two_machines.md; the
other hosts get 192.168.1.10, .11, ... (inside the namespaces only: nothing leaves them)."""


def serves(argv: Sequence[str]) -> bool:
    """Whether `python -m <module> ...` runs a role its manifest says serves until stopped
    (every other documented role finishes by itself)."""
    manifest = registry.find(argv[2]) if len(argv) > 2 else None
    return manifest is not None and any(f"role={role}" in argv for role in manifest.serving)


@dataclass
class Documented:
    source: str
    text: str
    lines: list[tuple[str, list[str]]]
    """(host, argv) in the order written."""


def documented_runs(paths: Sequence[str] = DOCUMENTED) -> list[Documented]:
    """Each group of `host$ python -m <module> role=...` lines in `paths`: one run on several
    machines, as written (readme_check reads the same blocks)."""
    from labtools.readme_check import readme_commands

    runs = []
    for path in paths:
        for command in readme_commands(ROOT / path):
            hosts = [part.strip().split("$", 1)[0] for part in command.text.split("  &  ")]
            multi = len(set(hosts)) > 1 and all(h.isidentifier() for h in hosts)
            if multi and not command.skipped and len(hosts) == len(command.argvs):
                runs.append(
                    Documented(path, command.text, list(zip(hosts, command.argvs, strict=True)))
                )
    return runs


def run_documented(
    run: Documented, out: Path, *, rate: str | None = None, timeout_s: float = 600.0
) -> tuple[bool, str]:
    """`run`'s lines, each in its host's namespace, the serving host at the address the cluster
    file names; `cluster=mine` is conf/cluster/two_hosts.yaml copied (docs step 3)."""
    from labtools.readme_check import with_quick, with_shared

    names = list(dict.fromkeys(host for host, _ in run.lines))
    others = iter(range(10, 250))
    addresses = [DOC_SERVER if name == run.lines[0][0] else f"192.168.1.{next(others)}"
                 for name in names]  # fmt: skip
    conf = out / "conf" / "cluster"
    conf.mkdir(parents=True, exist_ok=True)
    example = (ROOT / "conf" / "cluster" / "two_hosts.yaml").read_text()
    (conf / "mine.yaml").write_text(example.replace("name: two_hosts", "name: mine"))
    with Network(names, addresses=addresses, rate=rate, root=out / "hosts") as network:
        provision(network, log=io.StringIO())
        procs: dict[str, subprocess.Popen] = {}
        for index, (host, argv) in enumerate(run.lines):
            manifest = registry.find(argv[2])
            extra = [*(manifest.documented if manifest else ()), "tracking.wandb=false"]
            # a folder the docs say every host mounts (dp.checkpoint_dir): one of the run's own
            full = with_shared(with_quick(argv, out=out / f"{index}-{host}", extra=extra), out)
            full.append(f"hydra.searchpath=[file://{out / 'conf'}]")
            name = f"{index}-{host}"
            procs[name] = network[host].start(
                full, out / f"{name}.log", env={"LAB_SECRET": "a-secret-both-hosts-share"}
            )
        finishing = [
            name for name, (_, argv) in zip(procs, run.lines, strict=True) if not serves(argv)
        ]
        try:
            _wait(procs, finishing, timeout_s)
        except HostsError as exc:
            return False, f"{exc} (logs in {out})"
    where = ", ".join(f"{n} {a}" for n, a in zip(names, addresses, strict=True))
    return True, f"every role finished on its host ({where})"


def _docs_main(out: Path, timeout_s: float) -> int:
    runs = documented_runs()
    passed = 0
    for index, run in enumerate(runs):
        ok, detail = run_documented(run, out / str(index), timeout_s=timeout_s)
        passed += ok
        print(f"{'ok' if ok else 'FAILED':<6} {run.source}: {run.text}\n       {detail}",
              flush=True)  # fmt: skip
    print(f"documented commands ok across hosts: {passed} of {len(runs)}", flush=True)
    return 0 if passed == len(runs) else 1
