"""`python -m fed_learn`: the coordinator, the clients, and the local (loopback) set-up."""

from __future__ import annotations

import gc
import logging
import random
import resource
import threading
import time
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from fed_learn.admission import MAX_PROMISED_REFILLS
from fed_learn.client import LoRAClient, round_floor
from fed_learn.config import FedLearnRunConfig
from fed_learn.coordinator import Coordinator
from fed_learn.lora import block_size, client_data, peft_model, train_local, validation_blocks
from lab import experiment
from lab.cli import ConfigError, UserError
from lab.cluster import connect_when_ready, emulated_link, serve
from lab.experiment import Experiment, LocalPlan, Process
from lab.losses import evaluate
from lab.models import count_4bit_layers, load_tokenizer
from lab.tables import print_wide
from lab.tracking import METRICS_FILE, Tracker, read_records
from lab.waiting import Wait, speaking
from netproto import Connection, ConnectionClosed, NetTimeout, RemoteError, TruncatedFrame

log = logging.getLogger(__name__)


def run_coordinator(settings: FedLearnRunConfig) -> dict[str, float]:
    cache_dir = settings.paths.cache_path
    model = peft_model(settings.model, settings.lora, cache_dir=cache_dir, seed=settings.seed)
    tokenizer = load_tokenizer(settings.model, cache_dir=cache_dir)
    val = validation_blocks(tokenizer, block=block_size(model), count=settings.fed.eval_blocks)
    coordinator = Coordinator(settings, model, val)
    # What the process holds by now (model, libraries: ~500k objects) lives as long as it does:
    # kept out of the collector's full passes, each of which would walk it all (~0.4 s CPU)
    gc.collect()  # what loading left in cycles goes first, not frozen for good
    gc.freeze()
    # a whole roster may share one address (a simulation, a NAT): room for it, as JOINs have
    cluster = settings.cluster
    per_address = max(cluster.max_connections_per_address, settings.fed.num_clients + 4)
    cluster = replace(cluster, max_connections_per_address=per_address)
    server = serve(coordinator.handle, cluster, settings.fed.coordinator, name="coordinator")
    try:
        log.info("coordinator ready on %s:%d", *server.address)
        with Tracker.from_settings(settings, job="fed_learn") as tracker:
            metrics = coordinator.run_rounds(tracker)
            metrics["base_4bit_layers"] = float(count_4bit_layers(model))
            # the coordinator's own peak (RSS, MiB): what serving the round's clients costs it
            metrics["coordinator_peak_rss_mib"] = (
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            )
            tracker.summary(metrics)
            return metrics
    finally:
        server.stop()


def shard(
    settings: FedLearnRunConfig, tokenizer: Any, model: Any, index: int, *, own_data: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Client `index`'s (train, validation) blocks as the run's settings cut them; with
    `own_data`, from `fed.data_dir` when set (a real client's private files), else the lab's
    stand-in share of the stdlib test suite (virtual clients, the pooled baseline)."""
    fed = settings.fed
    return client_data(
        tokenizer,
        index=index,
        num_clients=fed.num_clients,
        seed=settings.seed,
        block=block_size(model),
        max_examples=fed.max_examples_per_client,
        data_dir=fed.data_dir if own_data else "",
        data_glob=fed.data_glob,
        partition=fed.partition,
    )


def run_client(settings: FedLearnRunConfig) -> dict[str, float]:
    cache_dir = settings.paths.cache_path
    model = peft_model(settings.model, settings.lora, cache_dir=cache_dir, seed=settings.seed)
    tokenizer = load_tokenizer(settings.model, cache_dir=cache_dir)
    train, val = shard(settings, tokenizer, model, settings.client_index, own_data=True)
    address = (settings.fed.coordinator.host, settings.fed.coordinator.port)
    client = LoRAClient(
        model,
        train,
        val,
        seed=settings.seed + settings.client_index,
        index=settings.client_index,
        name=settings.client_name or f"client{settings.client_index}",
        max_round_clients=settings.fed.secagg.max_clients,
        floor=round_floor(settings.fed),
    )
    with emulated_link(settings.cluster, address) as dial:  # cluster.link.*: a LAN/WAN here
        rounds = take_part(client, settings=settings, address=dial)
    return {"rounds": float(rounds), "num_examples": float(len(train))}


def run_simulator(settings: FedLearnRunConfig) -> dict[str, float]:
    """`role=simulator`: fed.simulate virtual clients from client_index on, in this process.

    Each has its own shard, seed, connection (its own session at the coordinator, heartbeats
    included) and, under secure aggregation, its own keys and masks; they share one copy of the
    model and take turns to train on it (`VirtualClient`), as Flower's simulation shares a
    machine among many clients. What one virtual client sends is what a client process would.
    """
    fed = settings.fed
    cache_dir = settings.paths.cache_path
    model = peft_model(settings.model, settings.lora, cache_dir=cache_dir, seed=settings.seed)
    tokenizer = load_tokenizer(settings.model, cache_dir=cache_dir)
    first = settings.client_index
    indices = range(first, min(fed.num_clients, first + max(fed.simulate, 1)))
    turn = threading.RLock()
    floor = round_floor(fed)
    clients = []
    for index in indices:
        train, val = shard(settings, tokenizer, model, index)
        clients.append(
            VirtualClient(
                model,
                train,
                val,
                seed=settings.seed + index,
                index=index,
                name=f"client{index}",
                turn=turn,
                dropout=fed.simulate_dropout,
                max_round_clients=fed.secagg.max_clients,
                floor=floor,
            )
        )
    address = (settings.fed.coordinator.host, settings.fed.coordinator.port)
    log.info("simulating clients %d-%d (%d) in one process", indices.start, indices.stop - 1,
             len(clients))  # fmt: skip
    rounds: list[int] = []
    errors: list[BaseException] = []

    finished = threading.Event()  # one got FINISH: a dropped one redialing need not wait

    def serve_one(client: LoRAClient) -> None:
        try:
            with emulated_link(settings.cluster, address) as dial:
                rounds.append(take_part(client, settings=settings, address=dial, stop=finished))
            finished.set()
        except BaseException as exc:  # reported below: one client's failure is not silent
            errors.append(exc)

    threads = [
        threading.Thread(target=serve_one, args=(c,), name=c.name, daemon=True) for c in clients
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"rounds": float(sum(rounds)), "clients": float(len(clients))}


class VirtualClient(LoRAClient):
    """A client of a simulator process: its own data and connection, the process's one model,
    held (`turn`) from loading the global adapter to reading its own back."""

    def __init__(
        self, *args: Any, turn: threading.RLock, dropout: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.turn = turn
        self.dropout = dropout
        self.conn: Connection | None = None

    def run(self, conn: Connection, *, heartbeat_s: float, timeout_s: float | None = None) -> int:
        self.conn = conn
        return super().run(conn, heartbeat_s=heartbeat_s, timeout_s=timeout_s)

    def _maybe_drop(self, task: dict[str, Any]) -> None:
        """fed.simulate_dropout: leave the round now (the connection closes; `take_part`
        joins again for a later round), as a phone losing its signal would."""
        draw = random.Random(f"{self.seed}-{task.get('round')}-dropout").random()
        if self.dropout and draw < self.dropout and self.conn is not None:
            log.info("%s drops out of round %d (simulated)", self.name, int(task["round"]) + 1)
            self.conn.close()
            raise ConnectionClosed(f"{self.name} dropped out (fed.simulate_dropout)")

    def evaluate_global(
        self, task: dict[str, Any], global_state: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        with self.turn:
            return super().evaluate_global(task, global_state)

    def train_round(
        self, task: dict[str, Any], global_state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        self._maybe_drop(task)
        with self.turn:
            return super().train_round(task, global_state)

    def _train_for_sum(
        self, task: dict[str, Any], global_state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        self._maybe_drop(task)
        with self.turn:
            return super()._train_for_sum(task, global_state)


def take_part(
    client: LoRAClient,
    *,
    settings: FedLearnRunConfig,
    address: tuple[str, int],
    stop: threading.Event | None = None,
) -> int:
    """Serve the coordinator until it says FINISH; returns the rounds taken part in.

    A coordinator that is lost (crashed, its host gone silent past fed.heartbeat_timeout_s)
    is dialed again for fed.wait_clients_s: restarted with fed.resume=true, it picks up at the
    next round with the same clients, their local data and error-feedback residuals intact.
    `stop` (a simulator's: another of its clients got FINISH) ends a redial at once.
    """
    fed = settings.fed
    wait_s = settings.cluster.connect_timeout_s + fed.wait_clients_s
    host, port = address
    while True:
        try:  # the coordinator may still be loading its model, or restarting
            conn = connect_when_ready(
                settings.cluster,
                address,
                wait_s=wait_s,
                check=None if stop is None else lambda: _stop_if(stop),
                what="the coordinator",
                where=f"{settings.fed.coordinator.host}:{settings.fed.coordinator.port}",
                key=f"cluster.connect_timeout_s={settings.cluster.connect_timeout_s:g} + "
                f"fed.wait_clients_s={fed.wait_clients_s:g}",
            )
        except _Stopped:
            return client.rounds  # training is over (`stop`): nothing to rejoin
        except (ConnectionClosed, NetTimeout) as exc:
            raise CoordinatorLostError(
                f"no coordinator at {host}:{port} for {wait_s:.0f}s "
                f"(cluster.connect_timeout_s + fed.wait_clients_s): {exc}"
            ) from exc
        with conn:
            try:
                return client.run(
                    conn, heartbeat_s=fed.heartbeat_s, timeout_s=fed.heartbeat_timeout_s
                )
            except (ConnectionClosed, NetTimeout, TruncatedFrame) as exc:
                # a coordinator killed while sending the global adapter ends mid-frame
                log.warning(
                    "lost the coordinator after %d rounds (%s); dialing it again for up to %.0fs",
                    client.rounds,
                    exc,
                    wait_s,
                )
            except RemoteError as exc:
                if exc.code != "rate_limited":
                    raise
                pause = rejoin_pause(exc.retry_after_s, fed.join_rate_per_address)
                log.warning("the coordinator asks us to slow down (%s); again in %.1fs", exc, pause)
                if stop is not None and stop.wait(pause):
                    return client.rounds
                if stop is None:
                    time.sleep(pause)


def rejoin_pause(retry_after_s: float | None, rate: float, *, draw: float | None = None) -> float:
    """How long a client refused for too many JOINs waits before it asks again: when the
    coordinator said (`RemoteError.retry_after_s`, already checked to be finite, >= 0 and
    bounded), a little later rather than early (a token comes then, promised to it), yet
    never sooner than half a refill nor later than an honest coordinator ever says
    (MAX_PROMISED_REFILLS refills): whoever answers the JOIN cannot make the client spin on
    redials or park it for an hour; else, a coordinator that did not say, a refill of the JOIN
    rate or two at random."""
    draw = random.random() if draw is None else draw
    if retry_after_s is None:
        return (1.0 + draw) / rate
    told = retry_after_s * (1.0 + 0.05 * draw) + 0.02
    return min(max(told, 0.5 / rate), MAX_PROMISED_REFILLS * (1.0 + 0.05 * draw) / rate)


class _Stopped(Exception):
    """`take_part`'s `stop` was set while it dialed."""


def _stop_if(stop: threading.Event) -> None:
    if stop.is_set():
        raise _Stopped


class CoordinatorLostError(UserError, RuntimeError):
    """The coordinator could not be reached (again) within the configured wait."""


def client_role(settings: FedLearnRunConfig) -> dict[str, float]:
    if settings.fed.coordinator.port == 0:
        raise ConfigError("role=client needs fed.coordinator.port: the coordinator's, not 0")
    return run_client(settings)


def simulator_role(settings: FedLearnRunConfig) -> dict[str, float]:
    if settings.fed.coordinator.port == 0:
        raise ConfigError("role=simulator needs fed.coordinator.port: the coordinator's, not 0")
    return run_simulator(settings)


def check(settings: FedLearnRunConfig) -> None:
    fed = settings.fed
    if settings.role == "local" and fed.data_dir:
        raise ConfigError(
            "fed.data_dir is a real client's own data (role=client); a local run deals each "
            "client its own shard of the lab's corpus"
        )
    stand_in = settings.role == "simulator" or (settings.role == "client" and not fed.data_dir)
    if stand_in and not 0 <= settings.client_index < fed.num_clients:
        raise ConfigError(
            f"client_index={settings.client_index} must be in 0..{fed.num_clients - 1}: "
            f"fed.num_clients={fed.num_clients} shards of the lab's corpus (set fed.num_clients "
            "to the federation's size, or fed.data_dir to this client's own data)"
        )


def prepare(settings: FedLearnRunConfig) -> None:
    """Build the tiny models (or fetch a hub model) once, here; only the roles quantize."""
    from lab.models import load_model

    load_model(replace(settings.model, quantization="none"), cache_dir=settings.paths.cache_path)


def local_plan(settings: FedLearnRunConfig) -> LocalPlan:
    """The coordinator and every client as their own processes; then the rounds' table."""
    fed = settings.fed
    if fed.simulate:
        clients = [
            Process(f"simulator{i // fed.simulate}", ("role=simulator", f"client_index={i}"))
            for i in range(0, fed.num_clients, fed.simulate)
        ]
    else:
        clients = [
            Process(f"client{i}", ("role=client", f"client_index={i}"))
            for i in range(fed.num_clients)
        ]
    # The coordinator's rounds reach W&B and the console through this process (`finish_local`):
    # one W&B run and one final table per execution.
    coordinator = Process(
        "coordinator", ("role=coordinator", "tracking.wandb=false", "tracking.console=false")
    )
    return LocalPlan(processes=[coordinator, *clients], finish=finish_local)


def finish_local(local: FedLearnRunConfig) -> dict[str, float]:
    """A local run's metrics: the coordinator's summary, its rounds as a table, the baseline."""
    records = read_records(local.paths.run_path / "coordinator" / METRICS_FILE)
    metrics = _summary(records)
    if local.tracking.console:
        print_wide(round_table(records))
    with Tracker.from_settings(local, job="fed_learn") as tracker:
        for record in records:  # the rounds, into this run's metrics.jsonl and W&B run
            if record.get("kind") == "metrics":
                values = {k: v for k, v in record.items() if k not in ("kind", "time_s", "step")}
                tracker.log(values, step=record.get("step"))
        if local.fed.centralized_baseline:
            metrics["centralized_val_loss"] = centralized_baseline(local)
            metrics["federated_over_centralized"] = (
                metrics["final_val_loss"] / metrics["centralized_val_loss"]
            )
        tracker.summary(metrics)
    return metrics


EXPERIMENT = Experiment(
    name="fed_learn",
    roles={"coordinator": run_coordinator, "client": client_role, "simulator": simulator_role},
    plan=local_plan,
    servers=("coordinator",),
    check=check,
    prepare=prepare,
    resume="fed.resume=true",
    resume_roles=("local", "coordinator"),
)


def run(cfg: DictConfig | FedLearnRunConfig) -> dict[str, float]:
    return experiment.run(EXPERIMENT, cfg)


def centralized_baseline(settings: FedLearnRunConfig) -> float:
    """The same model trained on every client's shard pooled in one place, for comparison.

    Same total gradient steps as the federation (rounds x clients x local steps), or the same
    passes over each example when rounds are counted in epochs.
    """
    fed = settings.fed
    steps = {"done": 0, "total": 0}
    started = time.monotonic()

    def how_far() -> str:
        done, total = steps["done"], steps["total"]
        if not total:
            return "loading the model and pooling the clients' data"
        left = (time.monotonic() - started) / max(done, 1) * (total - done)
        return f"step {done} of {total}, about {left:.0f} s left"

    waiting = Wait(
        f"the centralized baseline (all {fed.num_clients} clients' data pooled)",
        key="fed.centralized_baseline=false skips it",
        progress=how_far,
    )
    with speaking(waiting):
        model, tokenizer = _pooled_training(settings, steps)
    val = validation_blocks(tokenizer, block=block_size(model), count=fed.eval_blocks)
    return evaluate(model, val)


def _pooled_training(settings: FedLearnRunConfig, steps: dict[str, int]) -> tuple[Any, Any]:
    """The centralized baseline's model, trained on every client's shard pooled; `steps`
    follows its progress (done, total)."""
    fed = settings.fed
    cache_dir = settings.paths.cache_path
    model = peft_model(settings.model, settings.lora, cache_dir=cache_dir, seed=settings.seed)
    tokenizer = load_tokenizer(settings.model, cache_dir=cache_dir)
    pooled = torch.cat([shard(settings, tokenizer, model, i)[0] for i in range(fed.num_clients)])
    log.info(
        "centralized baseline: the same LoRA trained on all %d clients' data pooled in one "
        "place, as many steps as the federation took (fed.centralized_baseline=false skips it)",
        fed.num_clients,
    )
    progress = Progress(
        TextColumn("centralized baseline"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        transient=True,
    )

    def on_step(done: int, total: int) -> None:
        steps.update(done=done, total=total)
        progress.update(task, completed=done, total=total)

    with progress:
        task = progress.add_task("baseline", total=None)
        train_local(
            model,
            pooled,
            epochs=fed.rounds * fed.local_epochs,
            max_steps=fed.rounds * fed.num_clients * fed.local_steps,
            batch_size=fed.batch_size,
            lr=fed.lr,
            seed=settings.seed,
            on_step=on_step,
        )
    return model, tokenizer


def round_table(records: list[dict[str, Any]]) -> Table:
    """The coordinator's rounds (its metrics.jsonl records) as a table: loss, clients, bytes
    each way, time."""
    table = Table(title="fed_learn: rounds", title_justify="left")
    for column in ("round", "val loss", "ppl", "clients", "failed", "kB up", "kB down"):
        table.add_column(column, justify="right")
    table.add_column("s", justify="right")
    table.add_column("coord.", justify="right")  # the coordinator process's CPU share of the round
    for line in records:
        if line.get("kind") != "metrics":
            continue
        if "clients" not in line:  # the evaluation before round 1 (or before resuming)
            table.add_row(str(line["step"]), f"{line['val_loss']:.4f}", *[""] * 7)
            continue
        table.add_row(
            str(line["step"]),
            f"{line['val_loss']:.4f}",
            f"{line['val_perplexity']:.2f}",
            f"{line['clients']:.0f}",
            f"{line.get('failures', line.get('refused', 0)):.0f}",
            f"{line['bytes_up'] / 1e3:,.1f}",
            f"{line['bytes_down'] / 1e3:,.1f}",
            f"{line['round_s']:.1f}",
            f"{line['coordinator_share']:.1%}",
        )
    return table


def _summary(records: list[dict[str, Any]]) -> dict[str, float]:
    summary = [line for line in records if line["kind"] == "summary"][-1]
    return {k: float(v) for k, v in summary.items() if k not in ("kind", "time_s")}
