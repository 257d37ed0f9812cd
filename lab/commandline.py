"""The command line, checked before Hydra runs anything, and `--help` from the schemas.

Hydra reports a mistaken override in several lines and exits 1, and accepts `+key=value` for a
key no schema has (the run then ignores it). `check_or_exit` composes the config with the
command line's overrides first, as Hydra will, and turns every mistake into one `error:` line
naming the key and exit 2 (`lab.cli`): a key that is not a setting (with the closest one that
is), a `+key` the schema does not read, a value of the wrong type, a config group option that
does not exist, an override Hydra cannot parse, a key and its value apart (`fed.rounds 3`), a
list where one value goes (naming the schema's type), an option-style flag (`--rounds=3`, named
back as `fed.rounds=3`). A sweep (`-m key=a,b`) has each of its values checked. `--help` lists
every key of the experiment's schema with its default, its type and its docstring; Hydra's own
help stays at `--hydra-help`.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import itertools
import re
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab.cli import EXIT_USER_ERROR, ConfigError, full_errors
from lab.config import CONF_DIR, old_keys

if TYPE_CHECKING:
    from lab.experiment import Experiment

HYDRA_FLAGS_WE_CHECK = ("-m", "--multirun")
"""Flags that leave the overrides to compose (Hydra's other flags: Hydra's own business)."""
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve",
               "--package", "-p", "--run", "-r", "--multirun", "-m", "--shell-completion",
               "-sc", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
               "--experimental-rerun", "--info", "-i"}  # fmt: skip
"""Every flag Hydra's command line takes (hydra._internal.utils.get_args_parser)."""


def run_module(name: str) -> Any:
    """`python -m <name>`, the whole of every experiment's `__main__.py`: from its manifest
    (lab.registry) its schema (registered for Hydra) and its runner; the command line checked
    (`check_or_exit`); then Hydra composes `<name>.yaml` and `lab.experiment.main` runs it."""
    import hydra

    from lab import experiment, registry

    if registry.find(name) is None:  # a plug-in: its manifest registers itself as imported
        importlib.import_module(f"{name}.manifest")
    manifest = registry.manifest(name)
    manifest.load_schema()
    runner = manifest.load_runner()
    folder = config_dir_of(name)
    check_or_exit(runner, config_dir=folder)

    def main(cfg: Any) -> Any:
        return experiment.main(runner, cfg)

    return hydra.main(version_base="1.3", config_path=str(folder), config_name=name)(main)()


def config_dir_of(name: str) -> Path:
    """Where experiment `name`'s primary config lives: the lab's conf/, or for an experiment
    installed from elsewhere (a plug-in) its package's own conf/ beside its `__main__`."""
    if (CONF_DIR / f"{name}.yaml").exists():
        return CONF_DIR
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin:
        own = Path(spec.origin).parent / "conf"
        if (own / f"{name}.yaml").exists():
            return own
    return CONF_DIR  # composing it there says, in one line, that it is missing


def check_or_exit(
    experiment: Experiment, argv: Sequence[str] | None = None, *, config_dir: Path = CONF_DIR
) -> None:
    """`python -m <experiment>`'s first act: `--help` prints the keys and exits 0; a mistaken
    override prints one line and exits 2; otherwise nothing happens and Hydra goes on."""
    name, schema = experiment.name, experiment.schema
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print(help_text(name, schema, unread=experiment.unread_keys()))
        raise SystemExit(0)
    refuse_or_exit(name, schema, args, config_dir=config_dir)


def refuse_or_exit(
    name: str, schema: type, args: Sequence[str], *, command: str = "", config_dir: Path = CONF_DIR
) -> None:
    """The command line `args` of config `name`: a mistake prints one `error:` line and exits
    2 (Hydra's own flags are left to Hydra). `command`: how the user runs it, for hints."""
    try:
        refuse_flags(name, schema, args, command=command)
        if any(a.startswith("-") and a not in HYDRA_FLAGS_WE_CHECK for a in args):
            return  # --cfg, --info, --config-name, ...: Hydra's
        overrides = [a for a in args if not a.startswith("-")]
        check(name, schema, overrides, command=command, config_dir=config_dir)
    except ConfigError as exc:
        if full_errors():
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


def refuse_flags(name: str, schema: type, args: Sequence[str], *, command: str = "") -> None:
    """ConfigError for a flag Hydra does not take (`--rounds=3`, `--fed.rounds 3`): settings
    are `key=value`; the line names the key the flag meant, with its value."""
    for index, arg in enumerate(args):
        if not arg.startswith("-") or arg.split("=", 1)[0] in HYDRA_FLAGS or arg == "-":
            continue
        flag, has_value, value = arg.partition("=")
        if not has_value:
            following = args[index + 1] if index + 1 < len(args) else ""
            plain = following and not following.startswith("-") and "=" not in following
            value = following if plain else "<value>"
        word = flag.lstrip("-").replace("-", "_")
        key = _key_named(word, schema)
        run = command or f"python -m {name}"
        if key:
            raise ConfigError(f"{arg} is not an option: settings are key=value, as {key}={value}")
        raise ConfigError(
            f"{arg} is not an option, nor {word} a setting of {name}: settings are key=value "
            f"(`{run} --help` lists them)"
        )


def _key_named(word: str, schema: type) -> str:
    """The setting `word` names: itself, the one key whose last part it is, or the closest."""
    keys = [k for k, *_ in described(schema)]
    if word in keys:
        return word
    leaf = [k for k in keys if k.rsplit(".", 1)[-1] == word]
    if len(leaf) == 1:
        return leaf[0]
    close = difflib.get_close_matches(word, leaf or keys, n=1, cutoff=0.6)
    return close[0] if close else ""


def check(
    name: str,
    schema: type,
    overrides: Sequence[str],
    *,
    command: str = "",
    config_dir: Path = CONF_DIR,
) -> None:
    """ConfigError (one line) for the first mistake in `overrides`, composed into config `name`
    with `schema` as its schema. Hydra's own settings (`hydra.*`) are left to Hydra.
    `command`: how the user runs it (`python -m <name>`), named in hints."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    _refuse_apart(overrides)

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
    run = command or f"python -m {name}"
    _compose_checked(name, schema, first, config_dir, run)
    for index, values in enumerate(choices):
        for value in values[1:]:
            _compose_checked(name, schema, [*first[:index], value, *first[index + 1 :]],
                             config_dir, run)  # fmt: skip


def _refuse_apart(overrides: Sequence[str]) -> None:
    """ConfigError for a key and its value given apart (`fed.rounds 3`, `fed.rounds = 3`,
    `fed.rounds= 3`), which Hydra reads as a key with no value (`missing EQUAL`)."""
    words = list(overrides)
    for index, word in enumerate(words):
        following = words[index + 1 :]
        if word.startswith("~") or word.startswith("-"):
            continue
        if "=" not in word:
            if following[:1] == ["="] and len(following) > 1:
                value = following[1]
            elif following and following[0].startswith("=") and len(following[0]) > 1:
                value = following[0][1:]
            elif following and "=" not in following[0] and not following[0].startswith("-"):
                value = following[0]
            else:
                raise ConfigError(
                    f"{word} has no value: an override is key=value, as {word.lstrip('+')}=<value>"
                    " (`~key` removes a key)"
                )
            given = " ".join([word, *following[: 2 if following[0] == "=" else 1]])
            raise ConfigError(
                f"{given!r}: the key and its value are one word, key=value with no space: "
                f"{word}={value}"
            )
        apart = following and "=" not in following[0] and not following[0].startswith("-")
        if word.endswith("=") and apart:
            raise ConfigError(
                f"{word + ' ' + following[0]!r}: the key and its value are one word, "
                f"key=value with no space: {word}{following[0]}"
            )


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


def _compose_checked(
    name: str, schema: type, overrides: list[str], config_dir: Path, command: str
) -> None:
    from hydra import compose, initialize_config_dir

    try:
        with (
            _hydra_of_our_own(),
            initialize_config_dir(config_dir=str(config_dir), version_base="1.3"),
        ):
            cfg = compose(config_name=name, overrides=overrides)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra's and OmegaConf's: each turned into one line
        raise ConfigError(_explain(exc, name, schema, overrides, command)) from None
    unknown = _unknown_keys(cfg, _defaults(schema))
    if unknown:
        key = unknown[0]
        raise ConfigError(
            f"{key} is not a setting of {name}{_did_you_mean(key, name, schema, command)}"
        )


@contextlib.contextmanager
def _hydra_of_our_own() -> Iterator[None]:
    """Compose with a Hydra of our own for the block, and give back the one running (a check
    made inside a Hydra app, as run_matrix's sweep makes one per workload)."""
    from hydra.core.global_hydra import GlobalHydra

    global_hydra = GlobalHydra.instance()
    running = global_hydra.hydra if global_hydra.is_initialized() else None
    global_hydra.clear()
    try:
        yield
    finally:
        global_hydra.clear()
        if running is not None:
            global_hydra.initialize(running)


KINDS = {"int": "an integer", "float": "a number", "bool": "true or false",
         "str": "one value (str)", "str | None": "one value (str) or null",
         "int | None": "an integer or null", "float | None": "a number or null",
         "list[str]": "a list (list[str]), e.g. [a,b]",
         "list[int]": "a list of integers (list[int]), e.g. [1,2]"}  # fmt: skip
"""The schema's field types in words, as an error names them."""


def _explain(
    exc: BaseException, name: str, schema: type, overrides: list[str], command: str = ""
) -> str:
    """Hydra's several lines as one, naming the key and what is wrong with its value."""
    text = str(exc).strip()
    cause = exc.__cause__
    found = re.search(r"override '([^']+)'|override (\S+)", text.splitlines()[0])
    named = next((g for g in found.groups() if g), "") if found else ""
    key = _key(named)
    given = {_key(o): o.split("=", 1)[1] if "=" in o else "" for o in overrides}
    if text.startswith("Could not override") and key:
        mapping = _mapping_field(key, schema)
        if mapping:  # a new key of a mapping (run_matrix's grid, axes): added with +
            return (
                f"{key} is not in {mapping}'s entries (conf/{name}.yaml): a new one takes a +, "
                f"as +{key}={given.get(key, '<value>')}"
            )
        return f"{key} is not a setting of {name}{_did_you_mean(key, name, schema, command)}"
    if "Could not append to config. An item is already at" in text:
        at = re.search(r"already at '([^']+)'", text)
        key = at.group(1) if at else "?"
        return f"+{key}: {key} is a setting already; set it without the +: {key}={given.get(key)}"
    if cause is not None and type(cause).__name__ == "ValidationError" and key:
        types = {k: kind for k, _, kind, _ in described(schema)}
        value = given.get(key, "?")
        kind = KINDS.get(types.get(key, ""), f"of type {types[key]}" if key in types else "")
        if not kind:
            wanted = re.search(r"converted to (\w+)|not a valid (\w+)", str(cause))
            found_type = next((g for g in wanted.groups() if g), "") if wanted else ""
            words = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}
            kind = words.get(found_type, "another kind of value")
        if value.startswith("[") and not types.get(key, "").startswith("list"):
            return (
                f"{key}={value} must be {kind}, not a list; a run for each value: "
                f"{command or f'python -m {name}'} -m {key}={value.strip('[]')}"
            )
        return f"{key}={value!s} must be {kind}"
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


def _defaults(schema: type) -> Any:
    """`schema`'s default instance, built without its checks (run_matrix's has no valid
    default: its workload is set by its YAML)."""
    instance: Any = object.__new__(schema)
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        object.__setattr__(instance, f.name, value)
    return instance


def _mapping_field(key: str, schema: type) -> str:
    """The field of `schema` that is a mapping and holds `key` (`grid` for `grid.window`)."""
    head = key.split(".", 1)[0]
    if "." not in key:
        return ""
    kinds = {k: kind for k, _, kind, _ in described(schema)}
    return head if kinds.get(head, "").startswith("dict") else ""


def _unknown_keys(cfg: Any, defaults: Any, prefix: str = "") -> list[str]:
    """Keys of the composed `cfg` that the schema instance `defaults` has no field for
    (added with `+`): the run would ignore them."""
    names = {f.name for f in dataclasses.fields(defaults)}
    unknown = []
    for key in cfg:
        dotted = f"{prefix}{key}"
        if key not in names:
            if dotted not in old_keys():  # an endpoint's old key is moved as it is read
                unknown.append(dotted)
            continue
        value = getattr(defaults, key)
        if dataclasses.is_dataclass(value) and hasattr(cfg[key], "keys"):
            unknown += _unknown_keys(cfg[key], value, prefix=f"{dotted}.")
    return unknown


def _did_you_mean(key: str, name: str, schema: type, command: str = "") -> str:
    from lab import registry

    for other in registry.manifests().values():  # another experiment's endpoint, say whose
        if other.name != name and any(key.startswith(e + ".") for e in other.endpoints):
            return f": it is {other.name}'s endpoint, not {name}'s"
    keys = [k for k, *_ in described(schema)]
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close:  # the right word in the wrong section: the same last part
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1]
    run = command or f"python -m {name}"
    return f"; did you mean {close[0]}?" if close else f"; `{run} --help` lists them"


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
    return list(_walk(_defaults(schema)))


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
