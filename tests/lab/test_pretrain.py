"""The tiny models: ordinary HF folders that describe themselves, cached by their settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lab.config import default_cache_dir
from lab.pretrain import META_FILE, ensure_tiny_models, load_preset, models_dir
from tests.clocks import HANG_GUARD_S


def test_tiny_models_are_hf_folders_with_their_provenance(tiny_models: Path) -> None:
    debug = load_preset("debug")
    for name, layers in (
        ("tiny_target", debug.target.num_layers),
        ("tiny_draft", debug.draft.num_layers),
    ):
        folder = tiny_models / name
        assert {"config.json", "model.safetensors", "tokenizer.json", META_FILE} <= {
            p.name for p in folder.iterdir()
        }
        meta = json.loads((folder / META_FILE).read_text())
        assert meta["pretrain"]["preset"] == "debug"
        assert meta["val_loss"] > 0
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.num_hidden_layers == layers
        assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(folder))


def test_tokenizer_round_trips_any_python_source(tiny_models: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "tiny_target")
    text = 'def naïve(x):\n\treturn f"{x!r} → ✓"  # unicode and tabs\n'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_changed_setting_builds_elsewhere_thread_count_does_not(tmp_path: Path) -> None:
    debug = load_preset("debug")
    assert models_dir(replace(debug, num_threads=1), tmp_path) == models_dir(debug, tmp_path)
    assert models_dir(replace(debug, target_steps=41), tmp_path) != models_dir(debug, tmp_path)


def test_built_models_are_reused_not_retrained(tiny_models: Path, lab_cache: Path) -> None:
    stamp = (tiny_models / "tiny_target" / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_models(load_preset("debug"), lab_cache) == tiny_models
    assert (tiny_models / "tiny_target" / "model.safetensors").stat().st_mtime_ns == stamp


def test_concurrent_builders_train_once_and_agree(tmp_path: Path) -> None:
    """Two roles started together both ask for the models: one trains, the other waits."""
    code = (
        "import sys, logging; from lab.pretrain import *; from dataclasses import replace; "
        "logging.basicConfig(level=logging.INFO); "
        "cfg = replace(load_preset('debug'), target_steps=5, draft_steps=5); "
        "print(ensure_tiny_models(cfg, sys.argv[1]))"
    )
    env = {**os.environ, "WANDB_MODE": "disabled"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=HANG_GUARD_S) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    assert outputs[0][0].splitlines()[-1] == outputs[1][0].splitlines()[-1]
    trained = [err.count("training the lab's tiny models") for _, err in outputs]
    assert sorted(trained) == [0, 1]
    leftovers = [
        p.name for p in (tmp_path / "tiny_models").iterdir() if not p.name.endswith(".lock")
    ]
    assert len(leftovers) == 1  # no staging folder left behind


def test_same_preset_seed_and_threads_build_identical_weights(tmp_path: Path) -> None:
    """`pretrain=debug` built twice, each in a fresh process into an empty cache, with the
    thread count pinned: every tensor and the tokenizer are identical (the metadata files,
    which hold build timings, are not compared)."""
    from safetensors.torch import load_file

    code = (
        "import sys; from dataclasses import replace; from lab.pretrain import *; "
        "print(ensure_tiny_models(replace(load_preset('debug'), num_threads=2), sys.argv[1]))"
    )
    env = {**os.environ, "WANDB_MODE": "disabled"}
    folders = []
    for cache in ("cache_a", "cache_b"):
        result = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / cache)],
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        folders.append(Path(result.stdout.splitlines()[-1]))
    first, second = folders
    assert first != second and first.name == second.name  # same settings, separate caches
    for name in ("tiny_target", "tiny_draft"):
        a = load_file(str(first / name / "model.safetensors"))
        b = load_file(str(second / name / "model.safetensors"))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key} differs between two builds"
        assert (first / name / "tokenizer.json").read_bytes() == (
            second / name / "tokenizer.json"
        ).read_bytes()


@pytest.mark.slow
def test_default_target_is_clearly_better_than_its_draft(tmp_path: Path) -> None:
    folder = ensure_tiny_models(
        load_preset("default"),
        default_cache_dir(),
    )
    metrics = json.loads((folder / "tiny_target" / META_FILE).read_text())["metrics"]
    assert metrics["target_val_loss"] < metrics["draft_val_loss"] - 0.1
    assert metrics["draft_target_agreement"] > 0.4


def test_pretrain_prints_the_readme_table_of_the_pair(tiny_models: Path, capsys) -> None:
    from rich.console import Console

    from lab.pretrain import TINY_MODELS, models_table, read_build_metrics

    metrics = read_build_metrics(tiny_models)
    Console(width=150).print(models_table(tiny_models, metrics))
    out = capsys.readouterr().out
    debug = load_preset("debug")
    layers_of = (debug.target.num_layers, debug.draft.num_layers)
    for name, layers in zip(TINY_MODELS, layers_of, strict=True):
        row = next(line for line in out.splitlines() if name in line)
        short = name.removeprefix("tiny_")
        assert f" {layers} " in row and f"{metrics[f'{short}_val_loss']:.3f}" in row
    assert f"{metrics['draft_target_agreement']:.1%}" in out
