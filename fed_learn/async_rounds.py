"""fed.mode=async: each update is applied as it arrives (FedAsync), run by the coordinator's
round loop in place of synchronous rounds."""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from fed_learn.admission import ClientHandle, NotEnoughClientsError, Task
from fed_learn.aggregate import mix, staleness_weight
from fed_learn.lora import adapter_state, load_adapter_state
from fed_learn.rounds import FIRST_ROUND_GRACE_S, progress_bar, round_averages
from fed_learn.updates import ANSWER_ERRORS, check_answer
from lab.losses import evaluate
from lab.tracking import Tracker
from netproto.errors import peer_text

log = logging.getLogger(__name__)


def run_async(coordinator: Any, tracker: Tracker) -> dict[str, float]:
    """Apply each update as it arrives, mixed in with a staleness-discounted weight.
    (`coordinator`: the `fed_learn.coordinator.Coordinator` driving the run, typed loosely
    because that module imports this one.)

    Every alive client always has work: the moment its update is applied (or refused as
    too stale) it gets the new global adapter. No round waits for a straggler. Each
    `min_fit_clients` applied updates count as a round: evaluated, logged, checkpointed.
    """
    fed = coordinator.fed
    rounds = coordinator._rounds_to_run()
    initial_loss = coordinator._initial_loss(tracker, rounds.start)
    coordinator.wait_for_clients(
        fed.min_fit_clients,
        hoped=fed.num_clients,
        grace_s=min(FIRST_ROUND_GRACE_S, fed.wait_clients_s),
    )
    version = 0
    versions = {version: adapter_state(coordinator.model)}  # what clients may be training from
    busy: dict[int, tuple[ClientHandle, Task]] = {}  # client_id -> it, its task (version)
    history = coordinator.history
    applied, refused = 0, 0
    staleness: list[int] = []
    norms: list[float] = []  # of the applied updates (see fed.max_update_norm)
    bytes_before = coordinator.admission.traffic()
    round_started = time.perf_counter()
    coordinator_s = 0.0
    last_arrival = time.monotonic()
    coordinator.round = rounds.start
    with progress_bar() as progress:  # transient: gone once the rounds are
        bar = progress.add_task("async rounds", total=len(rounds))
        while coordinator.round in rounds:
            for client in coordinator.alive_clients():  # idle (new or just reported): give it work
                if client.client_id in busy:
                    continue
                send_started = time.perf_counter()
                task = coordinator._send_task(client, version, versions[version])
                if task is not None:
                    busy[client.client_id] = (client, task)
                coordinator_s += time.perf_counter() - send_started
            arrived = False
            for client, task in list(busy.values()):  # (a client gone keeps its marker)
                try:
                    reply = client.results.get_nowait()
                except queue.Empty:
                    continue
                if reply is not None and reply.task is not task:
                    continue  # answers a task withdrawn earlier: not wanted
                arrived = True
                base = busy.pop(client.client_id)[1].round
                if reply is None:  # the client is gone
                    continue
                work_started = time.perf_counter()
                stale = version - base
                if stale > fed.max_staleness:
                    refused += 1
                    log.info(
                        "refused client %d's update: %d versions old (fed.max_staleness=%d)",
                        client.client_id,
                        stale,
                        fed.max_staleness,
                    )
                    continue
                try:
                    _result, full, norm = check_answer(
                        reply, versions[base], strategy=coordinator.strategy, fed=fed
                    )
                except ANSWER_ERRORS as exc:
                    log.warning("refused client %d's answer: %s", client.client_id, peer_text(exc))
                    refused += 1
                    continue
                weight = staleness_weight(
                    stale, mixing=fed.async_mixing, exponent=fed.staleness_exponent
                )
                load_adapter_state(coordinator.model, mix(versions[version], full, weight=weight))
                coordinator._took_part(client)
                version += 1
                versions[version] = adapter_state(coordinator.model)
                for old in [v for v in versions if v < version - fed.max_staleness]:
                    del versions[old]
                applied += 1
                staleness.append(stale)
                norms.append(norm)
                coordinator_s += time.perf_counter() - work_started
                if applied % fed.min_fit_clients:
                    continue
                eval_started = time.perf_counter()
                val_loss = evaluate(coordinator.model, coordinator.val_blocks)
                coordinator_s += time.perf_counter() - eval_started
                traffic = coordinator.admission.traffic()
                metrics = {
                    "val_loss": val_loss,
                    "clients": float(fed.min_fit_clients),
                    "applied": float(applied),
                    "refused": float(refused),
                    "mean_staleness": sum(staleness[-fed.min_fit_clients :]) / fed.min_fit_clients,
                    "max_staleness_applied": float(max(staleness)),
                    "largest_update_norm": max(norms[-fed.min_fit_clients :]),
                    "bytes_down": float(traffic[0] - bytes_before[0]),
                    "bytes_up": float(traffic[1] - bytes_before[1]),
                }
                history.append(
                    coordinator._close_round(
                        metrics,
                        outcome=f"async: {applied} updates applied",
                        started=round_started,
                        coordinator_s=coordinator_s,
                    )
                )
                tracker.log(metrics, step=coordinator.round + 1)
                log.info(
                    "async round %d/%d: val loss %.4f (applied %d, refused %d, staleness %s)",
                    coordinator.round + 1,
                    rounds.stop,
                    val_loss,
                    applied,
                    refused,
                    staleness[-fed.min_fit_clients :],
                )
                coordinator.round += 1
                progress.advance(bar)
                bytes_before, round_started, coordinator_s = traffic, time.perf_counter(), 0.0
                if coordinator.round not in rounds:
                    break
            if arrived:
                last_arrival = time.monotonic()
            elif time.monotonic() - last_arrival > fed.round_timeout_s:
                raise NotEnoughClientsError(
                    f"no update arrived for fed.round_timeout_s={fed.round_timeout_s:.0f}s "
                    f"({len(coordinator.alive_clients())} clients alive)"
                )
            else:
                time.sleep(0.02)
    # Clients still training get to hand in (and have discarded) what they are working on,
    # so that every client ends cleanly on FINISH rather than on a closed connection.
    deadline = time.monotonic() + fed.round_timeout_s
    for client, task in busy.values():
        coordinator._await_reply(client, task, deadline)
        coordinator._withdraw(client, task)
    coordinator._finish_clients()
    final = history[-1] if history else {"val_loss": initial_loss}
    return {
        "initial_val_loss": initial_loss,
        "final_val_loss": final["val_loss"],
        "rounds": float(len(history)),
        "applied": float(applied),
        "refused": float(refused),
        "dropped_results": float(coordinator.admission.dropped_results()),
        "max_staleness_applied": float(max(staleness, default=0)),
        **round_averages(history),
    }
