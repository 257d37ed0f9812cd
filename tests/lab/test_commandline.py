"""The command line checked before Hydra runs: each mistake one line naming the key, and
`--help` listing every key with its default and what it does (lab.commandline)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import data_parallel.config
import fed_learn.config
import spec_decoding.config
import split_inference.config
import split_training.config
from lab.cli import ConfigError
from lab.commandline import check, described, field_docs
from tests.clocks import HANG_GUARD_S
from tests.conftest import import_schemas

SCHEMAS = {
    "data_parallel": data_parallel.config.DataParallelRunConfig,
    "fed_learn": fed_learn.config.FedLearnRunConfig,
    "spec_decoding": spec_decoding.config.SpecDecodingRunConfig,
    "split_inference": split_inference.config.SplitInferenceRunConfig,
    "split_training": split_training.config.SplitTrainingRunConfig,
}


@pytest.fixture(autouse=True, scope="module")
def _schemas() -> None:
    """Every schema registered, as a whole run has them: the file passes run alone too."""
    import_schemas()


@pytest.mark.parametrize(
    ("module", "overrides", "says"),
    [
        ("spec_decoding", ["spec.gama=4"],
         r"^spec\.gama is not a setting of spec_decoding; did you mean spec\.gamma\?$"),
        ("spec_decoding", ["+spec.gama=4"],
         r"^spec\.gama is not a setting of spec_decoding; did you mean spec\.gamma\?$"),
        ("fed_learn", ["spec.verifier.port=1"],  # another experiment's endpoint, named so
         r"^spec\.verifier\.port is not a setting of fed_learn: it is spec_decoding's endpoint"),
        ("data_parallel", ["+inner_steps=5"],  # the right word, the wrong section
         r"^inner_steps is not a setting of data_parallel; did you mean dp\.inner_steps\?$"),
        ("fed_learn", ["fed.rounds=two"], r"^fed\.rounds=two must be an integer$"),
        ("fed_learn", ["fed.rounds=2,two"], r"^fed\.rounds=two must be an integer$"),  # a sweep
        ("data_parallel", ["dp.outer_lr=fast"], r"^dp\.outer_lr=fast must be a number$"),
        ("spec_decoding", ["spec.pipeline=maybe"], r"^spec\.pipeline=maybe must be true or false$"),
        ("spec_decoding", ["model=nope"],
         r"^model=nope is not one of conf/model/: choose one of \[.*'tiny_target'"),
        ("fed_learn", ["fed.rounds=[1"], r"^cannot read the override 'fed\.rounds=\[1'"),
        ("fed_learn", ["+fed.rounds=3"],
         r"^\+fed\.rounds: fed\.rounds is a setting already; set it without the \+: "
         r"fed\.rounds=3$"),
        ("fed_learn", ["~fed.rounds"], r"^~fed\.rounds: a setting of fed_learn cannot be removed"),
        # a key and its value apart: Hydra's `missing EQUAL at '<EOF>'`
        ("fed_learn", ["fed.rounds", "3"],
         r"^'fed\.rounds 3': the key and its value are one word, key=value with no space: "
         r"fed\.rounds=3$"),
        ("fed_learn", ["fed.rounds", "=", "3"], r"^'fed\.rounds = 3': .* fed\.rounds=3$"),
        ("fed_learn", ["fed.rounds=", "3"], r"^'fed\.rounds= 3': .* fed\.rounds=3$"),
        ("fed_learn", ["fed.rounds"], r"^fed\.rounds has no value: .* fed\.rounds=<value>"),
        # a list where the schema holds one value: its type named, and the sweep that was meant
        ("spec_decoding", ["spec.gamma=[1,2]"],
         r"^spec\.gamma=\[1,2\] must be one value \(str\), not a list; a run for each value: "
         r"python -m spec_decoding -m spec\.gamma=1,2$"),
        ("fed_learn", ["fed.rounds=[1,2]"], r"^fed\.rounds=\[1,2\] must be an integer, not a list"),
        ("fed_learn", ["lora.target_modules=q_proj"],
         r"^lora\.target_modules=q_proj must be a list \(list\[str\]\)"),
    ],
)  # fmt: skip
def test_a_mistaken_override_is_one_line_naming_the_key(
    module: str, overrides: list[str], says: str
) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        check(module, SCHEMAS[module], overrides)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("module", sorted(SCHEMAS))
def test_every_modules_defaults_and_hydras_own_settings_pass(module: str) -> None:
    check(module, SCHEMAS[module], ["hydra.run.dir=/tmp/x", "hydra/job_logging=disabled",
                                    "tracking.wandb=false", "seed=3"])  # fmt: skip


def test_right_overrides_and_sweeps_pass() -> None:
    check(
        "data_parallel",
        SCHEMAS["data_parallel"],
        ["dp.sync=diloco", "dp.fragments=2", "dp.inner_steps=4,8", "model.lab_preset=debug"],
    )
    check("spec_decoding", SCHEMAS["spec_decoding"], ["spec.gamma=4", "model@target=tiny_target"])
    # a sweep no list can hold (a sweeper plug-in's interval) is left to Hydra
    check("data_parallel", SCHEMAS["data_parallel"], ["dp.lr=interval(0.1,1)", "dp.steps=3"])


def test_field_docstrings_are_read_from_the_schema_source() -> None:
    docs = field_docs(data_parallel.config.DPConfig)
    assert docs["fragments"].startswith("dp.sync=diloco: the model cut into this many fragments")
    assert "\n" not in docs["fragments"]
    keys = {key: (default, doc) for key, default, _, doc in described(SCHEMAS["data_parallel"])}
    assert keys["dp.inner_steps"][0] == 50 and "H" in keys["dp.inner_steps"][1]
    assert keys["seed"][0] == 0  # the base schema's too
    assert "model.pretrained" in keys and "cluster.master.host" in keys


def test_help_lists_every_key_it_reads_with_its_default_and_docstring() -> None:
    from spec_decoding.run import EXPERIMENT

    result = subprocess.run(
        [sys.executable, "-m", "spec_decoding", "--help"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    unread = tuple(EXPERIMENT.unread_keys())
    for key, _, _, doc in described(SCHEMAS["spec_decoding"]):
        shown = f"  {key}=" in text
        assert shown != any(key == k or key.startswith(k + ".") for k in unread), key
        if shown and doc:
            assert " ".join(doc.split()[:4]) in " ".join(text.split()), key
    # its own endpoint, whose host defaults to the cluster file's serving host; not the master's
    assert "  spec.verifier.host=${cluster.master.host}" in text
    assert "  spec.verifier.port=29520" in text and "  cluster.master.host=" not in text
    assert "--hydra-help" in text


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rounds=3"], r"^--rounds=3 is not an option: settings are key=value, as fed\.rounds=3"),
        (["--rounds", "3"], r"^--rounds is not an option: .* fed\.rounds=3$"),
        (["--fed.lr=0.1"], r"^--fed\.lr=0\.1 is not an option: .* fed\.lr=0\.1$"),
        (["--num-clients=4"], r"as fed\.num_clients=4$"),
        (["--bogus"], r"^--bogus is not an option, nor bogus a setting of fed_learn"),
    ],
)  # fmt: skip
def test_an_option_style_flag_is_one_line_naming_the_key_form(args: list[str], says: str) -> None:
    from lab.commandline import refuse_flags

    with pytest.raises(ConfigError, match=says):
        refuse_flags("fed_learn", SCHEMAS["fed_learn"], args)
    refuse_flags("fed_learn", SCHEMAS["fed_learn"], ["-m", "--cfg", "job", "fed.rounds=3"])


def test_a_flag_mistake_from_the_command_line_is_one_line_and_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fed_learn", "--rounds=3"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --rounds=3 is not an option: settings are key=value, as fed.rounds=3"
    ]
