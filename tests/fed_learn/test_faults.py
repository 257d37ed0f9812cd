"""Rounds that survive a dead client, a clear error for too few, and resume after a crash."""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fed_learn.admission import NotEnoughClientsError
from fed_learn.client import LoRAClient
from fed_learn.config import FedConfig, FedLearnRunConfig
from fed_learn.coordinator import Coordinator
from fed_learn.lora import adapter_state, block_size, client_data, load_adapter_state, peft_model
from fed_learn.run import CoordinatorLostError, take_part
from lab.cluster import connect, serve
from lab.config import Endpoint, ModelConfig, PathsConfig, TrackingConfig
from lab.launch import free_port
from lab.models import load_tokenizer
from lab.tracking import METRICS_FILE, Tracker, read_records
from netproto import Connection, ConnectionClosed

MODEL = ModelConfig(pretrained="lab:tiny_target", lab_preset="debug")


def settings_for(tmp_path: Path, lab_cache: Path, **fed) -> FedLearnRunConfig:
    base = FedConfig(
        rounds=1,
        num_clients=3,
        min_fit_clients=2,
        round_timeout_s=30,
        wait_clients_s=10,
        local_steps=3,
        max_examples_per_client=32,
        eval_blocks=4,
        heartbeat_s=0.5,
        heartbeat_timeout_s=10,
    )
    return FedLearnRunConfig(
        model=MODEL,
        fed=replace(base, **fed),
        paths=PathsConfig(run_dir=str(tmp_path), cache_dir=str(lab_cache)),
        tracking=TrackingConfig(wandb=False, console=False),
    )


class DyingClient(LoRAClient):
    """Vanishes in the middle of its first round, as a laptop whose lid closes."""

    conn: Connection

    def train_round(self, task, global_state):
        self.conn._abort()
        raise ConnectionClosed("this client died mid-round")


@pytest.fixture
def federation(tiny_models: Path, lab_cache: Path) -> Iterator[Callable]:
    servers, threads = [], []

    def start(settings: FedLearnRunConfig, *, clients: int, dying: int = 0) -> Coordinator:
        model = peft_model(MODEL, settings.lora, cache_dir=lab_cache)
        tokenizer = load_tokenizer(MODEL, cache_dir=lab_cache)
        coordinator = Coordinator(settings, model, torch.randint(0, 300, (4, 32)))
        server = serve(coordinator.handle, settings.cluster, Endpoint(), name="coordinator")
        servers.append(server)
        for index in range(clients):
            cls = DyingClient if index < dying else LoRAClient
            train, val = client_data(
                tokenizer,
                index=index,
                num_clients=3,
                seed=0,
                block=block_size(model),
                max_examples=32,
            )
            client = cls(
                peft_model(MODEL, settings.lora, cache_dir=lab_cache), train, val, name=f"c{index}"
            )
            conn = connect(settings.cluster, server.address)
            client.conn = conn  # type: ignore[attr-defined]

            def serve_client(client=client, conn=conn) -> None:
                with contextlib.suppress(ConnectionClosed):  # the dying client's own end
                    client.run(conn, heartbeat_s=settings.fed.heartbeat_s)

            threads.append(threading.Thread(target=serve_client, daemon=True))
            threads[-1].start()
        return coordinator

    yield start
    for server in servers:
        server.stop()
    for thread in threads:
        thread.join(timeout=10)


def run_rounds(coordinator: Coordinator, tmp_path: Path) -> dict[str, float]:
    with Tracker(
        tmp_path, config={}, tracking=TrackingConfig(wandb=False, console=False), job="test"
    ) as tracker:
        return coordinator.run_rounds(tracker)


def test_a_client_dying_mid_round_leaves_the_round_to_the_others(
    federation, tmp_path, lab_cache
) -> None:
    settings = settings_for(tmp_path, lab_cache)
    coordinator = federation(settings, clients=3, dying=1)
    coordinator.wait_for_clients(3)
    metrics = run_rounds(coordinator, tmp_path)
    assert metrics["mean_clients_per_round"] == 2
    # (Not the roster's alive flags: after FINISH the other two leave as well.)
    rounds = [r for r in read_records(tmp_path / METRICS_FILE) if "clients" in r]
    assert [(r["clients"], r["failures"]) for r in rounds] == [(2, 1)]


def test_too_few_clients_is_a_clear_error_not_a_hang(federation, tmp_path, lab_cache) -> None:
    settings = settings_for(tmp_path, lab_cache, wait_clients_s=1.0)
    coordinator = federation(settings, clients=1)
    # the wait's own deadline (fed.wait_clients_s=1) ends it: no other path says this
    with pytest.raises(NotEnoughClientsError, match=r"only 1 of the 2 clients needed .* after 1s"):
        run_rounds(coordinator, tmp_path)


def test_restarted_coordinator_resumes_at_the_next_round(federation, tmp_path, lab_cache) -> None:
    first = federation(settings_for(tmp_path, lab_cache, rounds=1, num_clients=2), clients=2)
    run_rounds(first, tmp_path)
    saved = load_file(str(tmp_path / "checkpoints" / "round_0001" / "adapter_model.safetensors"))
    # A new coordinator process after a crash: fresh model, same run directory.
    settings = settings_for(tmp_path, lab_cache, rounds=2, resume=True)
    restarted = Coordinator(
        settings,
        peft_model(MODEL, settings.lora, cache_dir=lab_cache),
        torch.randint(0, 300, (4, 32)),
    )
    assert restarted.resume() == 1  # round 2 is next
    state = adapter_state(restarted.model)
    assert all(torch.equal(state[k], saved[k]) for k in saved)


def test_topk_int8_updates_cost_many_times_fewer_bytes(federation, tmp_path, lab_cache) -> None:
    bytes_up = {}
    for method in ("none", "topk_int8"):
        run_dir = tmp_path / method
        settings = settings_for(
            run_dir, lab_cache, compression=method, topk_fraction=0.02, num_clients=2
        )
        coordinator = federation(settings, clients=2)
        metrics = run_rounds(coordinator, run_dir)
        assert metrics["mean_clients_per_round"] == 2
        bytes_up[method] = metrics["bytes_up_per_round"]
    # 2% of the entries at 5 bytes each (int32 index + int8 value) against 4 bytes for every
    # entry: 40x on the values alone, less what headers, heartbeats and results cost.
    assert bytes_up["none"] / bytes_up["topk_int8"] > 10


def test_a_client_without_a_coordinator_gives_up_with_a_clear_error(tmp_path, lab_cache) -> None:
    settings = settings_for(tmp_path, lab_cache, wait_clients_s=0.5)
    settings = replace(settings, cluster=replace(settings.cluster, connect_timeout_s=0.5))
    client = LoRAClient(None, torch.zeros(4, 8), torch.zeros(1, 8), name="lonely")
    port = free_port("127.0.0.1")  # nobody listens there
    # given up after connect_timeout_s + wait_clients_s (the message says 1s), not retried on
    with pytest.raises(CoordinatorLostError, match=f"no coordinator at 127.0.0.1:{port} for 1s"):
        take_part(client, settings=settings, address=("127.0.0.1", port))


def test_ffa_sends_only_b_both_ways_once_a_client_holds_the_frozen_a(
    federation, tmp_path, lab_cache
) -> None:
    """A is frozen at the shared initialization: after the first GLOBAL (whole adapter, so a
    client that started from another A still trains from the right one), only B crosses."""
    traffic: dict[str, list[tuple[float, float]]] = {}
    finals = {}
    for strategy in ("fedavg", "ffa"):
        run_dir = tmp_path / strategy
        settings = settings_for(run_dir, lab_cache, strategy=strategy, rounds=2, num_clients=2)
        coordinator = federation(settings, clients=2)
        initial = adapter_state(coordinator.model)
        run_rounds(coordinator, run_dir)
        rounds = [r for r in read_records(run_dir / METRICS_FILE) if "clients" in r]
        assert [r["clients"] for r in rounds] == [2, 2]
        traffic[strategy] = [(r["bytes_up"], r["bytes_down"]) for r in rounds]
        finals[strategy] = (initial, adapter_state(coordinator.model))
    a_bytes = sum(t.numel() * 4 for n, t in initial.items() if ".lora_A." in n)
    b_bytes = sum(t.numel() * 4 for n, t in initial.items() if ".lora_B." in n)
    for (up, _), (ffa_up, _) in zip(traffic["fedavg"], traffic["ffa"], strict=True):
        assert ffa_up < up - 2 * a_bytes * 0.9  # two clients, no A each
    assert traffic["ffa"][0][1] > traffic["fedavg"][0][1] * 0.95  # round 1: the whole adapter
    assert traffic["ffa"][1][1] < traffic["fedavg"][1][1] - 2 * a_bytes * 0.9  # round 2: B
    assert b_bytes > 0
    initial, final = finals["ffa"]
    for name, tensor in final.items():  # A where it started, B trained
        moved = not torch.equal(tensor, initial[name])
        assert moved == (".lora_B." in name), name


@pytest.mark.parametrize("rendered", [True, False], ids=["before-round-1", "at-checkpoint-1"])
def test_every_checkpoint_is_a_whole_peft_folder_byte_equal_to_pefts_own_save(
    tmp_path, lab_cache, rendered: bool
) -> None:
    """PEFT's `save_pretrained` renders the card and config once (before the first round, as
    `run_rounds` does, or at the first checkpoint); every checkpoint writes its files itself:
    each folder holds what PEFT would write for the adapter of its round (the weights of that
    round, the same card), byte for byte, and loads with PEFT."""
    from peft import PeftConfig

    settings = settings_for(tmp_path, lab_cache, rounds=3)
    coordinator = Coordinator(
        settings,
        peft_model(MODEL, settings.lora, cache_dir=lab_cache),
        torch.randint(0, 300, (4, 32)),
    )
    if rendered:
        coordinator._render_peft_files()
    folders = []
    for round_index in range(3):
        coordinator.round = round_index
        if round_index:  # a new global adapter each round
            moved = {k: v + 0.5 * round_index for k, v in adapter_state(coordinator.model).items()}
            load_adapter_state(coordinator.model, moved)
        folders.append(coordinator.checkpoint({"val_loss": 1.0}, outcome="aggregated"))
        pefts = tmp_path / f"pefts_{round_index}"  # PEFT's own save, from the first's card
        pefts.mkdir()
        if round_index:
            shutil.copy(folders[0] / "README.md", pefts / "README.md")
        coordinator.model.save_pretrained(pefts)
        written = sorted(p.name for p in pefts.iterdir())
        assert written == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
        for name in written:
            assert (folders[-1] / name).read_bytes() == (pefts / name).read_bytes(), name
    cards = [(folder / "README.md").read_text() for folder in folders]
    assert "library_name: peft" in cards[0] and cards[1] == cards[0] == cards[2]
    for folder in folders:
        assert PeftConfig.from_pretrained(str(folder)).r == settings.lora.r
    assert all(
        torch.equal(t, adapter_state(coordinator.model)[k])
        for k, t in load_file(str(folders[-1] / "adapter_model.safetensors")).items()
    )
