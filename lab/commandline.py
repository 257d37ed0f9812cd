"""The command line, checked before Hydra runs anything, and `--help` from the schemas.

Hydra reports a mistaken override in several lines and exits 1, and accepts `+key=value` for a
key no schema has (the run then ignores it). `check_or_exit` composes the config with the
command line's overrides first, as Hydra will, and turns every mistake into one `error:` line
naming the key and exit 2 (`lab.cli`): a key that is not a setting (with the closest one that
is), a `+key` the schema does not read, a value of the wrong type, a config group option that
does not exist, an override Hydra cannot parse. A sweep (`-m key=a,b`) has each of its values
checked. `--help` lists every key of the experiment's schema with its default, its type and its
docstring; Hydra's own help stays at `--hydra-help`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import re
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab.cli import EXIT_USER_ERROR, ConfigError, full_errors
from lab.config import CONF_DIR

if TYPE_CHECKING:
    from lab.experiment import Experiment

HYDRA_FLAGS_WE_CHECK = ("-m", "--multirun")
"""Flags that leave the overrides to compose (any other `-x` / `--x`: Hydra's own business)."""


def check_or_exit(experiment: Experiment, argv: Sequence[str] | None = None) -> None:
    """`python -m <experiment>`'s first act: `--help` prints the keys and exits 0; a mistaken
    override prints one line and exits 2; otherwise nothing happens and Hydra goes on."""
    name, schema = experiment.name, experiment.schema
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print(help_text(name, schema, unread=experiment.unread_keys()))
        raise SystemExit(0)
    if any(a.startswith("-") and a not in HYDRA_FLAGS_WE_CHECK for a in args):
        return  # --cfg, --info, --config-name, ...: Hydra's
    overrides = [a for a in args if not a.startswith("-")]
    try:
        check(name, schema, overrides)
    except ConfigError as exc:
        if full_errors():
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


def check(
    name: str, schema: type, overrides: Sequence[str], *, config_dir: Path = CONF_DIR
) -> None:
    """ConfigError (one line) for the first mistake in `overrides`, composed into config `name`
    with `schema` as its schema. Hydra's own settings (`hydra.*`) are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    # Hydra's own settings are Hydra's to check; its search path decides where groups are found
    ours = [o for o in overrides if _key(o) == "hydra.searchpath"
            or not (_key(o).startswith(("hydra.", "hydra/")) or _key(o) == "hydra")]  # fmt: skip
    parser = OverridesParser.create()
    parsed = []
    for text in ours:
        try:
            parsed.append(parser.parse_override(text))
        except HydraException as exc:  # the grammar's errors
            why = str(exc).strip().splitlines()[0]
            raise ConfigError(f"cannot read the override {text!r}: {why}") from None
    # each value of a sweep once, the other keys at their first value (a sweep that cannot
    # be enumerated, glob() or interval(), is left to Hydra)
    choices = [values for values in (_values(o) for o in parsed) if values]
    if not choices:
        return
    first = [values[0] for values in choices]
    _compose_checked(name, schema, first, config_dir)
    for index, values in enumerate(choices):
        for value in values[1:]:
            _compose_checked(name, schema, [*first[:index], value, *first[index + 1 :]],
                             config_dir)  # fmt: skip


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _values(override: Any) -> list[str]:
    """`override` as one plain override per value it sweeps over."""
    from hydra.errors import HydraException

    key = override.get_key_element()
    if not override.is_sweep_override():
        return [override.input_line]
    try:
        return [f"{key}={value}" for value in override.sweep_string_iterator()]
    except HydraException:
        return []


def _compose_checked(name: str, schema: type, overrides: list[str], config_dir: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name=name, overrides=overrides)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra's and OmegaConf's: each turned into one line
        raise ConfigError(_explain(exc, name, schema, overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    unknown = _unknown_keys(cfg, schema())
    if unknown:
        key = unknown[0]
        raise ConfigError(f"{key} is not a setting of {name}{_did_you_mean(key, name, schema)}")


def _explain(exc: BaseException, name: str, schema: type, overrides: list[str]) -> str:
    """Hydra's several lines as one, naming the key and what is wrong with its value."""
    text = str(exc).strip()
    cause = exc.__cause__
    found = re.search(r"override '([^']+)'|override (\S+)", text.splitlines()[0])
    named = next((g for g in found.groups() if g), "") if found else ""
    key = _key(named)
    given = {_key(o): o.split("=", 1)[1] if "=" in o else "" for o in overrides}
    if text.startswith("Could not override") and key:
        return f"{key} is not a setting of {name}{_did_you_mean(key, name, schema)}"
    if "Could not append to config. An item is already at" in text:
        at = re.search(r"already at '([^']+)'", text)
        key = at.group(1) if at else "?"
        return f"+{key}: {key} is a setting already; set it without the +: {key}={given.get(key)}"
    if cause is not None and type(cause).__name__ == "ValidationError" and key:
        wanted = re.search(r"converted to (\w+)|not a valid (\w+)", str(cause))
        name = next((g for g in wanted.groups() if g), "") if wanted else ""
        kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false",
                "int": "an integer", "float": "a number", "bool": "true or false"}.get(
            name, "of the schema's type")  # fmt: skip
        return f"{key}={given.get(key, '?')!s} must be {kind}"
    if cause is not None and type(cause).__name__ == "ConfigTypeError" and key:
        return f"~{key}: a setting of {name} cannot be removed; set it to a value instead"
    if type(exc).__name__ == "MissingConfigException":
        group = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        if group:
            return (
                f"{group.group(1)}={group.group(2)} is not one of conf/{group.group(1)}/: "
                f"choose one of {options}"
            )
    return text.splitlines()[0]


def _unknown_keys(cfg: Any, defaults: Any, prefix: str = "") -> list[str]:
    """Keys of the composed `cfg` that the schema instance `defaults` has no field for
    (added with `+`): the run would ignore them."""
    names = {f.name for f in dataclasses.fields(defaults)}
    unknown = []
    for key in cfg:
        dotted = f"{prefix}{key}"
        if key not in names:
            unknown.append(dotted)
            continue
        value = getattr(defaults, key)
        if dataclasses.is_dataclass(value) and hasattr(cfg[key], "keys"):
            unknown += _unknown_keys(cfg[key], value, prefix=f"{dotted}.")
    return unknown


def _did_you_mean(key: str, name: str, schema: type) -> str:
    keys = [k for k, *_ in described(schema)]
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close:  # the right word in the wrong section: the same last part
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1]
    return f"; did you mean {close[0]}?" if close else f"; `python -m {name} --help` lists them"


# ------------------------------------------------------------------ --help


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right under it) in `cls` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def described(schema: type) -> list[tuple[str, Any, str, str]]:
    """(dotted key, default, type name, docstring) of every setting of `schema`, in order."""
    return list(_walk(schema()))


def _walk(instance: Any, prefix: str = "") -> Iterator[tuple[str, Any, str, str]]:
    docs = field_docs(type(instance))
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            yield from _walk(value, f"{prefix}{f.name}.")
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        yield f"{prefix}{f.name}", value, str(kind), docs.get(f.name, "")


def help_text(
    name: str, schema: type, *, unread: Mapping[str, str] | None = None, config_dir: Path = CONF_DIR
) -> str:
    """`python -m <name> --help`: every key the experiment reads, its value in conf/<name>.yaml
    (the default a run takes), its type, what it does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name=name)
    finally:
        GlobalHydra.instance().clear()
    raw = OmegaConf.to_container(cfg, resolve=False)
    skipped = tuple(unread or ())
    lines = [
        f"python -m {name} [key=value ...]    (-m key=a,b: a run for each value)",
        "",
        f"Settings of {name}, as conf/{name}.yaml sets them (schema: {schema.__name__}).",
        "Hydra's own options: --hydra-help.",
    ]
    section = None
    for key, default, kind, doc in described(schema):
        if any(key == k or key.startswith(k + ".") for k in skipped):
            continue  # a key this experiment does not read (it refuses it)
        head = key.split(".", 1)[0] if "." in key else ""
        if head != section:
            section = head
            lines += ["", f"[{head}]" if head else "[run]"]
        value: Any = raw
        for part in key.split("."):  # unresolved: `${hydra:...}` shows as written
            value = value.get(part, default) if isinstance(value, dict) else default
        lines.append(f"  {key}={_shown(value)}  ({kind})")
        if doc:
            lines += textwrap.wrap(doc, width=96, initial_indent="      ",
                                   subsequent_indent="      ")  # fmt: skip
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if not value or " " in value else value
    return str(value)
