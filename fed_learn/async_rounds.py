"""fed.mode=async: each update is applied as it arrives (FedAsync), the coordinator's round
driver in place of synchronous rounds (`fed_learn.drivers`)."""

from __future__ import annotations

import contextlib
import logging
import queue
import time

from fed_learn.admission import ClientHandle, NotEnoughClientsError, Task
from fed_learn.aggregate import mix, staleness_weight
from fed_learn.drivers import CpuClock, RoundDriver, timed_evaluate
from fed_learn.lora import adapter_state, load_adapter_state
from fed_learn.rounds import FIRST_ROUND_GRACE_S, WAKE_S, drain, progress_bar, round_averages
from fed_learn.updates import ANSWER_ERRORS, check_answer
from lab.tracking import Tracker
from netproto.errors import peer_text

log = logging.getLogger(__name__)


class AsyncRounds(RoundDriver):
    """Apply each update as it arrives, mixed in with a staleness-discounted weight.

    Every alive client always has work: the moment its update is applied (or refused as
    too stale) it gets the new global adapter. No round waits for a straggler. Each
    `min_fit_clients` applied updates count as a round: evaluated, logged, checkpointed.
    """

    name = "async"

    def run(self, tracker: Tracker) -> dict[str, float]:
        coordinator = self.coordinator
        fed = self.fed
        per_round = fed.min_fit_clients  # applied updates that count as a round
        rounds = coordinator.rounds_to_run()
        initial_loss = coordinator.initial_val_loss(tracker, rounds.start)
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
        clock = CpuClock()  # the round's CPU and wall time, from its first update's wait on
        last_arrival = time.monotonic()
        coordinator.round = rounds.start
        with progress_bar() as progress:  # transient: gone once the rounds are
            bar = progress.add_task("async rounds", total=len(rounds))
            while coordinator.round in rounds:
                for (
                    client
                ) in coordinator.alive_clients():  # idle (new or just reported): give it work
                    if client.client_id in busy:
                        continue
                    task = coordinator.send_task(client, version, versions[version])
                    if task is not None:
                        busy[client.client_id] = (client, task)
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
                        log.warning(
                            "refused client %d's answer: %s", client.client_id, peer_text(exc)
                        )
                        refused += 1
                        continue
                    weight = staleness_weight(
                        stale, mixing=fed.async_mixing, exponent=fed.staleness_exponent
                    )
                    load_adapter_state(
                        coordinator.model, mix(versions[version], full, weight=weight)
                    )
                    coordinator.took_part(client)
                    version += 1
                    versions[version] = adapter_state(coordinator.model)
                    for old in [v for v in versions if v < version - fed.max_staleness]:
                        del versions[old]
                    applied += 1
                    staleness.append(stale)
                    norms.append(norm)
                    if applied % per_round:
                        continue
                    val_loss, eval_ms = timed_evaluate(coordinator.model, coordinator.val_blocks)
                    traffic = coordinator.admission.traffic()
                    metrics = {
                        "val_loss": val_loss,
                        "eval_cpu_ms": eval_ms,
                        "clients": float(per_round),
                        "applied": float(applied),
                        "refused": float(refused),
                        "mean_staleness": sum(staleness[-per_round:]) / per_round,
                        "max_staleness_applied": float(max(staleness)),
                        "largest_update_norm": max(norms[-per_round:]),
                        "bytes_down": float(traffic[0] - bytes_before[0]),
                        "bytes_up": float(traffic[1] - bytes_before[1]),
                    }
                    history.append(
                        coordinator.close_round(
                            metrics, outcome=f"async: {applied} updates applied", clock=clock
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
                        staleness[-per_round:],
                    )
                    coordinator.round += 1
                    progress.advance(bar)
                    bytes_before = traffic
                    clock.start()
                    if coordinator.round not in rounds:
                        break
                if arrived:
                    last_arrival = time.monotonic()
                elif time.monotonic() - last_arrival > fed.round_timeout_s:
                    raise NotEnoughClientsError(
                        f"no update arrived for fed.round_timeout_s={fed.round_timeout_s:.0f}s "
                        f"({len(coordinator.alive_clients())} clients alive)"
                    )
                else:  # until an answer, a join or a departure (or WAKE_S)
                    with contextlib.suppress(queue.Empty):
                        coordinator.admission.news.get(timeout=WAKE_S)
                    drain(coordinator.admission.news)  # every busy queue is looked at
        # Clients still training get to hand in (and have discarded) what they are working on,
        # so that every client ends cleanly on FINISH rather than on a closed connection.
        deadline = time.monotonic() + fed.round_timeout_s
        for client, task in busy.values():
            coordinator.await_reply(client, task, deadline)
            coordinator.withdraw(client, task)
        coordinator.finish_clients()
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
