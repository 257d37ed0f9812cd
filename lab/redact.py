"""Keep the shared secret out of everything the lab writes: one redaction for every writer.

A run gets its secret from `cluster.secret=...`, `cluster.secret_file=PATH` or the LAB_SECRET
environment variable. Only the last two keep it out of `ps` and shell history, but the first is
accepted too, so every record of a run shows `***` in its place: Hydra's `.hydra/*.yaml` and
`multirun.yaml`, `resolved_config.yaml` and `lab_run.json` (lab.tracking), W&B's config and the
command line it records, the roles' configs and argv (lab.launch), run_matrix's sweep, results
and W&B run, and the report.

Hydra writes its files before any of the lab's code runs, so `SecretOffDisk`, a Hydra callback
that every entry point's config registers, acts before that: it moves the secret into LAB_SECRET
(where this run's roles read it, and where child processes inherit it) and leaves `***` in the
config, in its overrides and in this process's `sys.argv`. `cluster.secret=***` then means "the
secret is in LAB_SECRET" (lab.config.ClusterConfig.resolved_secret), so a recorded command runs
again as it is wherever LAB_SECRET is set.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write

from lab.config import REDACTED, SECRET_ENV

SECRET_KEY = "cluster.secret"
"""The config key that holds the secret (its `_file` sibling names a file: not a secret)."""

_EMBEDDED = re.compile(
    r"(?<![\w.])((?:\+\+|\+)?cluster\.secret\s*=\s*)(?:'[^']*'|\"[^\"]*\"|[^\s,\]'\"]*)"
)
"""`cluster.secret=VALUE` inside a longer text (a joined command, `overrides=[...]`, Hydra's
`override_dirname`): the value ends at a space, a comma or a `]` unless it is quoted."""


def _override_key(word: str) -> str:
    return word.split("=", 1)[0].strip().lstrip("+~")


def redact_text(text: str) -> str:
    """`text` with the value of every `cluster.secret=VALUE` in it replaced by `***`."""
    return _EMBEDDED.sub(lambda match: match.group(1) + REDACTED, text)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line (or a list of Hydra overrides) that sets no secret in the clear: a word
    that sets `cluster.secret` shows `***` as its whole value, and one that holds such an
    override (run_matrix's `overrides=[...]`) shows `***` inside it."""
    return [
        word.split("=", 1)[0] + "=" + REDACTED
        if "=" in word and _override_key(word) == SECRET_KEY
        else redact_text(word)
        for word in argv
    ]


def split_secret(overrides: Sequence[str]) -> tuple[list[str], str | None]:
    """`overrides` redacted, and the secret the last `cluster.secret=VALUE` of them sets in the
    clear (None if none does): what a process is given in LAB_SECRET instead of its argv."""
    secret = None
    for word in overrides:
        if "=" in word and _override_key(word) == SECRET_KEY:
            value = word.split("=", 1)[1].strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if value and value != REDACTED:
                secret = value
    return redact_argv(overrides), secret


def redact_config(data: Any) -> Any:
    """A copy of a config (nested mappings and lists, as `dataclasses.asdict` or
    `OmegaConf.to_container` give) with `***` for a set `secret` and for the secret of every
    override string in it."""
    if isinstance(data, Mapping):
        return {
            key: REDACTED
            if key == "secret" and isinstance(value, str) and value
            else redact_config(value)
            for key, value in data.items()
        }
    if isinstance(data, list | tuple):
        return [redact_config(value) for value in data]
    if isinstance(data, str):
        return redact_text(data)
    return data


def scrub_argv() -> None:
    """Redact this process's own `sys.argv`, which W&B records as the run's command line."""
    sys.argv[1:] = redact_argv(sys.argv[1:])


def hide_secret(config: DictConfig) -> None:
    """Move the secret a composed Hydra config holds in the clear into LAB_SECRET, leaving `***`
    in the config, its recorded overrides and `sys.argv`: before Hydra writes any of them."""
    secret = None
    with read_write(config), open_dict(config):
        value = OmegaConf.select(config, SECRET_KEY, default=None)
        if isinstance(value, str) and value and value != REDACTED:
            secret = value
            OmegaConf.update(config, SECRET_KEY, REDACTED)
        overrides = config.get("overrides")  # run_matrix's, given to every cell
        if isinstance(overrides, ListConfig):
            redacted, in_overrides = split_secret([str(o) for o in overrides])
            config.overrides = redacted
            secret = secret or in_overrides
        task = OmegaConf.select(config, "hydra.overrides.task", default=None)
        if isinstance(task, ListConfig):
            config.hydra.overrides.task = redact_argv([str(o) for o in task])
        dirname = OmegaConf.select(config, "hydra.job.override_dirname", default=None)
        if isinstance(dirname, str):
            config.hydra.job.override_dirname = redact_text(dirname)
    scrub_argv()
    if secret is not None:
        os.environ[SECRET_ENV] = secret


class SecretOffDisk(Callback):
    """Hydra callback: `hide_secret` as a run or a sweep starts, before Hydra saves its config.

    Registered in `conf/config.yaml` and `conf/matrix.yaml` (`hydra.callbacks`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        hide_secret(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # the sweep's jobs are composed from `hydra.overrides.task` once this returns
        hide_secret(config)
