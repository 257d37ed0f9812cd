"""Federated rounds across real processes; PEFT checkpoints; authentication."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from fed_learn.config import FedLearnRunConfig
from fed_learn.coordinator import Coordinator
from fed_learn.lora import adapter_state, peft_model
from fed_learn.protocol import FedMsg
from fed_learn.run import round_table, run
from lab.cluster import serve
from lab.config import ClusterConfig, Endpoint, ModelConfig, to_settings
from lab.plots import legend_check
from lab.tracking import METRICS_FILE, read_records
from netproto import Connection, RemoteError
from tests.conftest import compose_into

QUICK = [
    "model.lab_preset=debug",
    "tracking.wandb=false",
    "fed.num_clients=2",
    "fed.rounds=2",
    "fed.local_steps=40",
    "fed.lr=0.01",
    "fed.max_examples_per_client=512",
    "fed.eval_blocks=32",
]


@pytest.fixture(scope="module")
def two_clients(
    tmp_path_factory: pytest.TempPathFactory, lab_cache: Path, tiny_models: Path
) -> tuple[dict[str, float], Path]:
    """A local run of QUICK, W&B on, every client evaluating each round's global adapter on
    its own held-out text: (its metrics, its folder), read by the tests below (a run is
    three processes)."""
    run_dir = tmp_path_factory.mktemp("two_clients")
    overrides = [*QUICK, "tracking.wandb=true", "fed.evaluate_on_clients=true"]
    return run(compose_into(run_dir, lab_cache, "fed_learn", overrides)), run_dir


def test_two_clients_lower_the_global_validation_loss(two_clients, tiny_models: Path) -> None:
    metrics, run_dir = two_clients
    assert metrics["final_val_loss"] < metrics["initial_val_loss"] - 0.02
    assert metrics["mean_clients_per_round"] == 2
    # one W&B run for the execution (the coordinator's process made a second one), and this
    # run's own metrics.jsonl holds every round, not only the summary
    assert len(list(run_dir.rglob("offline-run-*"))) == 1
    rounds = [r for r in read_records(run_dir / METRICS_FILE) if "clients" in r]
    assert [r["step"] for r in rounds] == [1, 2]
    assert legend_check(run_dir / "fed_rounds.png") == "none"  # not over the traffic bars
    assert 0 < metrics["bytes_up_per_round"] < 1e6  # adapters only: never the base weights
    # the pooled-data baseline ran on the same steps, and the ratio is reported
    assert metrics["centralized_val_loss"] < metrics["initial_val_loss"]
    assert metrics["federated_over_centralized"] == pytest.approx(
        metrics["final_val_loss"] / metrics["centralized_val_loss"]
    )

    # The summary a user reads: the evaluation before training, then one row per round.
    console = Console(width=200, record=True)
    records = read_records(run_dir / "coordinator" / METRICS_FILE)
    console.print(round_table(records))
    table = console.export_text()
    assert f"{metrics['initial_val_loss']:.4f}" in table
    assert f"{metrics['final_val_loss']:.4f}" in table
    assert round_table(records).row_count == 3

    # Every round left a PEFT checkpoint that PEFT itself loads.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoints = run_dir / "coordinator" / "checkpoints"
    latest = json.loads((checkpoints / "latest.json").read_text())
    assert latest["round"] == 2
    folder = checkpoints / latest["path"]
    state = json.loads((folder / "fed_state.json").read_text())
    assert state["round"] == 2 and len(state["roster"]) == 2
    base = AutoModelForCausalLM.from_pretrained(tiny_models / "tiny_target")
    loaded = PeftModel.from_pretrained(base, folder)
    saved = load_file(str(folder / "adapter_model.safetensors"))
    restored = adapter_state(loaded)
    assert set(restored) == set(saved)
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # trained


def test_federated_evaluation_in_a_real_run_logs_each_client_and_plots_them(two_clients) -> None:
    from fed_learn.manifest import plots

    metrics, run_dir = two_clients
    rounds = [r for r in read_records(run_dir / METRICS_FILE) if "clients" in r]
    assert len(rounds) == 2
    for record in rounds:
        per_client = {k: v for k, v in record.items() if k.startswith("client_eval_loss/")}
        assert len(per_client) == 2 and record["client_eval_clients"] == 2
        assert min(per_client.values()) <= record["client_eval_loss"] <= max(per_client.values())
    assert metrics["final_client_eval_loss"] == rounds[-1]["client_eval_loss"]
    assert metrics["client_eval_round"] == 2
    written = plots(run_dir)
    assert run_dir / "fed_client_eval.png" in written
    assert legend_check(run_dir / "fed_client_eval.png") == "none"  # off the clients' lines


def test_each_round_splits_the_coordinators_cpu_between_its_own_thread_and_the_rest(
    two_clients,
) -> None:
    """What the coordinator's CPU a round went on: its round thread (the protocol, aggregation,
    evaluation, checkpoint), of which evaluation, within its whole process's figure."""
    metrics, run_dir = two_clients
    rounds = [r for r in read_records(run_dir / METRICS_FILE) if "clients" in r]
    for r in rounds:
        assert 0 < r["eval_cpu_ms"] < r["coordinator_thread_cpu_ms"] <= r["coordinator_cpu_ms"]
    assert metrics["eval_cpu_ms_per_round"] == pytest.approx(
        sum(r["eval_cpu_ms"] for r in rounds) / len(rounds)
    )
    thread_ms = metrics["coordinator_thread_cpu_ms_per_round"]
    assert 0 < thread_ms <= metrics["coordinator_cpu_ms_per_round"]


def test_qlora_round_on_4bit_base_weights_completes_and_reports_its_4bit_layers(
    compose_config, tiny_models: Path
) -> None:
    """`python -m fed_learn model.quantization=4bit fed.rounds=1` on CPU: every client trains,
    evaluates and trains again on NF4 base weights; the coordinator says how many layers."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes cannot be imported here")
    overrides = [*QUICK, "model.quantization=4bit", "fed.rounds=1", "fed.local_steps=10"]
    metrics = run(compose_config("fed_learn", overrides))
    assert metrics["base_4bit_layers"] == 7 * 2  # the debug target's 2 blocks, 7 projections each
    assert metrics["mean_clients_per_round"] == 2
    assert metrics["final_val_loss"] < metrics["initial_val_loss"]


def test_async_mode_applies_updates_as_they_arrive_and_refuses_stale_ones(
    compose_config, tiny_models: Path
) -> None:
    """max_staleness=0: of two clients training from the same global adapter, the second to
    report is one version behind and must be refused; what is applied still lowers the loss.
    (min_fit_clients=2: both have joined before version 0 goes out, so both train from it
    whatever the machine's speed; with 1, a client that joined late could start from a newer
    version and nothing would be stale.)"""
    overrides = [
        *QUICK,
        "fed.mode=async",
        "fed.max_staleness=0",
        "fed.min_fit_clients=2",
        "fed.rounds=2",
        "fed.local_steps=20",
        "fed.lr=0.003",
        "fed.centralized_baseline=false",
    ]
    metrics = run(compose_config("fed_learn", overrides))
    assert metrics["applied"] == 4  # two rounds of min_fit_clients applied updates
    assert metrics["refused"] >= 1
    assert metrics["max_staleness_applied"] == 0
    assert metrics["final_val_loss"] < metrics["initial_val_loss"]
    # the coordinator process's CPU seconds over the rounds' wall time: at most every core busy
    assert 0 < metrics["coordinator_share"] <= (os.cpu_count() or 1)
    assert metrics["coordinator_cpu_ms_per_round"] > 0
    assert 0 < metrics["eval_cpu_ms_per_round"] < metrics["coordinator_thread_cpu_ms_per_round"]
    assert 0 < metrics["bytes_up_per_client_round"] < 1e6  # adapters only


def test_a_client_without_the_secret_is_refused(
    tiny_models: Path, lab_cache: Path, tmp_path: Path
) -> None:
    settings = to_settings(
        FedLearnRunConfig(
            model=ModelConfig(pretrained="lab:tiny_target", lab_preset="debug"),
            cluster=ClusterConfig(secret="federation-secret"),
        ),
        FedLearnRunConfig,
    )
    settings.paths.run_dir = str(tmp_path)
    model = peft_model(settings.model, settings.lora, cache_dir=lab_cache)
    coordinator = Coordinator(settings, model, torch.zeros(1, 8, dtype=torch.long))
    server = serve(coordinator.handle, settings.cluster, Endpoint(), name="coordinator")
    try:
        with (
            Connection.connect(*server.address) as conn,
            pytest.raises(RemoteError, match="auth_required"),
        ):
            conn.request(
                FedMsg.JOIN, {"name": "intruder", "num_examples": 10}, expect=FedMsg.WELCOME
            )
        assert coordinator.clients == {}
        with Connection.connect(*server.address, secret=b"federation-secret") as conn:
            welcome = conn.request(
                FedMsg.JOIN, {"name": "member", "num_examples": 10}, expect=FedMsg.WELCOME
            ).payload
        assert welcome == {"client_id": 0}
    finally:
        server.stop()
