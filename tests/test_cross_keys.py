"""Every pair (or set) of settings whose values the schemas tie together, refused at start in one
line naming the keys: before a role starts, before anything waits (issue 50). A row per pair,
found by reading each experiment's config.py and run.py checks; a new tie gets a row here.

The settings alone decide these; the ties that need a file (a model's layer count against
split.num_stages, a checkpoint against dp.resume) are tested where they are read:
tests/lab/test_cli.py, tests/split/, tests/data_parallel/."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from lab import experiment
from lab.cli import ConfigError
from lab.config import CONF_DIR

# fmt: off
TIES = [
    # fed_learn: the roster
    ("fed_learn", ["fed.min_fit_clients=5"],  # with the default fed.num_clients=3
     r"fed\.min_fit_clients=5 is more than fed\.num_clients=3"),
    ("fed_learn", ["role=client", "client_index=5"],
     r"client_index=5 must be in 0\.\.2: fed\.num_clients=3"),
    ("fed_learn", ["role=simulator", "client_index=3", "fed.simulate=2"],
     r"client_index=3 must be in 0\.\.2"),
    ("fed_learn", ["fed.data_dir=/tmp"], r"fed\.data_dir is a real client's own data"),
    ("fed_learn", ["fed.heartbeat_s=30", "fed.heartbeat_timeout_s=30"],
     r"fed\.heartbeat_timeout_s must exceed fed\.heartbeat_s"),
    ("fed_learn", ["fed.simulate_dropout=0.1"], r"fed\.simulate_dropout applies to simulated"),
    # fed_learn: how a round combines updates
    ("fed_learn", ["fed.aggregator=median", "fed.mode=async"],
     r"fed\.aggregator=median .* fed\.mode=async"),
    ("fed_learn", ["fed.aggregator=median", "fed.compression=topk"],
     r"fed\.aggregator=median with fed\.compression=topk"),
    ("fed_learn", ["fed.strategy=svd", "fed.mode=async"], r"fed\.strategy=svd .* fed\.mode=async"),
    ("fed_learn", ["fed.secure_aggregation=true", "fed.mode=async"],
     r"fed\.secure_aggregation=true with fed\.mode=async"),
    ("fed_learn", ["fed.secure_aggregation=true", "fed.compression=topk"],
     r"fed\.secure_aggregation=true with fed\.compression=topk"),
    ("fed_learn", ["fed.secure_aggregation=true", "fed.strategy=svd"],
     r"fed\.secure_aggregation=true with fed\.strategy=svd"),
    ("fed_learn", ["fed.dp.enabled=true", "fed.mode=async"],
     r"fed\.dp\.enabled=true with fed\.mode=async"),
    ("fed_learn", ["fed.dp.enabled=true", "fed.aggregator=median"],
     r"fed\.dp\.enabled=true with fed\.aggregator=median"),
    ("fed_learn", ["fed.dp.enabled=true", "fed.dp.target_epsilon=0"],
     r"fed\.dp: set noise_multiplier > 0 or target_epsilon > 0"),
    # spec_decoding: two models, no `model`
    ("spec_decoding", ["model.dtype=float16"], r"spec_decoding reads target\.\* and draft\.\*"),
    # the split engine (both split modules)
    ("split_inference", ["split.num_stages=3", "split.boundaries=[2]"],
     r"split\.boundaries=\[2\] must hold num_stages-1=2"),
    ("split_inference", ["split.rank=3"], r"split\.rank=3 must be in 1\.\.2"),
    ("split_training", ["split.batch_size=6", "split.microbatches=4"],
     r"split\.batch_size=6 must be a multiple of split\.microbatches=4"),
    ("split_training", ["split.export=true", "split.lora=true"],
     r"split\.export=true .* split\.lora=true"),
    # data_parallel
    ("data_parallel", ["dp.fragments=2"], r"dp\.fragments and dp\.overlap_steps are for dp\.sync"),
    ("data_parallel", ["dp.sync=diloco", "dp.inner_steps=4", "dp.fragments=5"],
     r"dp\.fragments=5 must be at most dp\.inner_steps=4"),
    ("data_parallel", ["dp.sync=diloco", "dp.inner_steps=4", "dp.overlap_steps=4"],
     r"dp\.overlap_steps=4 must be below dp\.inner_steps=4"),
    ("data_parallel", ["dp.sync=diloco", "dp.fragments=2", "dp.balance=tokens"],
     r"dp\.balance=tokens needs rounds the workers end together"),
    ("data_parallel", ["dp.target_val_loss=3", "dp.eval_every=0"],
     r"dp\.target_val_loss=3\.0 needs evaluations"),
    ("data_parallel", ["dp.powersgd_start_step=1"], r"dp\.powersgd_start_step=1 must be >= 2"),
    ("data_parallel", ["dp.engine=fsdp", "dp.sync=fp16"], r"dp\.sync=fp16 is for dp\.engine=ddp"),
    ("data_parallel", ["dp.engine=fsdp", "dp.balance=tokens"],
     r"dp\.balance=tokens is for dp\.engine=ddp"),
    ("data_parallel", ["dp.slow_worker=5:2"],
     r"dp\.slow_worker=5:2 names worker 5, and the job has 2"),
    ("data_parallel", ["dp.nnodes=2"], r"dp\.nnodes=2 is for role=worker"),
    ("data_parallel", ["role=worker", "dp.nnodes=2"], r"dp\.nnodes=2 needs dp\.checkpoint_dir"),
    ("data_parallel", ["model.quantization=4bit"], r"model\.quantization=4bit: data_parallel"),
    # every experiment's cluster section
    ("fed_learn", ["cluster.secret=a", "cluster.secret_file=/etc/hostname"],
     r"set one of cluster\.secret and cluster\.secret_file"),
    ("split_inference", ["cluster.overlay.up=true", "cluster.overlay.interface=wg0"],
     r"set one of cluster\.overlay\.up and cluster\.overlay\.interface"),
    ("spec_decoding", ["cluster.tls.enabled=true"], r"cluster\.tls\.enabled=true needs"),
]
# fmt: on


def settings_of(module: str, overrides: list[str]):
    """What `python -m <module> <overrides>` refuses before it starts anything."""
    exp = experiment.get(module)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=module, overrides=[*overrides, "paths.run_dir=unused"])
    finally:
        GlobalHydra.instance().clear()
    return experiment.validated(exp, cfg)


@pytest.mark.parametrize(("module", "overrides", "says"), TIES)
def test_settings_tied_together_are_refused_at_start_in_one_line(
    module: str, overrides: list[str], says: str
) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        settings_of(module, overrides)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("module", sorted({module for module, _, _ in TIES}))
def test_each_modules_defaults_pass_the_same_checks(module: str) -> None:
    settings_of(module, [])
