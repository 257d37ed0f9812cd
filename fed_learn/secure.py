"""Secure rounds over netproto: fed_learn.secagg's protocol between the coordinator and the
round's clients, each message checked before use.

    coordinator -> client  TASK {..., "secure": round parameters}   GLOBAL (as in a plain round)
    client -> coordinator  SA_KEYS    {"task", "c", "s"}              two X25519 public keys
    coordinator -> client  SA_ROSTER  {"task", "keys": {id: [c, s]}}  its neighbours' keys
    client -> coordinator  SA_SHARES  {"task", "boxes": {id: box}, "commit"}
    coordinator -> client  SA_BOXES   {"task", "boxes": {id: box}, "holders": {id: [id, ...]}}
                           the boxes addressed to it, each with its sender's holder list
    (the client trains)
    client -> coordinator  RESULT (as in a plain round, plus "weight": the weight it masked
                           with, in clear) then SA_MASKED {"masked": uint64[L]};
                           or SKIP {"task", "reason"}: its training came out non-finite
    coordinator -> client  SA_UNMASK  {"task", "survivors": [...], "dropped": [...]}
    client -> coordinator  SA_REVEAL  {"task", "shares": {id: [kind, index, share]}}

Bytes travel base64 in JSON. The coordinator's round thread runs the steps (`SecureRound`);
each client's session thread hands what it reads to the round (`secure_inbox`) only if it answers
that client's outstanding task, once per step. A client that sends something malformed is
refused by name and left out from that step on; the round goes on while the threshold holds,
else it fails in one line and the run goes on to the next round with the adapter it had.

What the coordinator sums: each client's trained adapter tensors minus the global ones
(`strategy.trained`: all of them, or FFA-LoRA's B), clipped by the client to
fed.max_update_norm, times its weight (its examples, capped by what it declared at JOIN: the
round's parameters carry the cap); the weights' sum comes out exactly, and the new global
adapter is the old one plus sum / weights: FedAvg's weighted mean.

What it enforces, since it sees no single update: each client's weight travels in clear beside
its masked input, and one over what it declared is refused by name before unmasking; a masked
input seen before (any client's, any round: `InputDigests`) is refused by name; and the
unmasked sum must pass `check_aggregate` (its weights equal the clear ones, it is finite, its
norm within fed.max_update_norm times the weights) or the round is refused whole. What no
check can attribute: garbage inside that aggregate bound, which moves the round's mean by at
most fed.max_update_norm whoever sent it. A client refused by name is excluded from the run,
except a revealer suspected of a wrong share (see `SecureRound.unmask`: not proven).
"""

from __future__ import annotations

import binascii
import logging
import math
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fed_learn import secagg
from fed_learn.fixed_point import frac_bits_for
from fed_learn.privacy import clip, flat_delta, gaussian, noise_std, unflatten
from fed_learn.protocol import FedMsg, parse_result
from fed_learn.secagg_params import RoundFloor, params_message, parse_params, shares_needed
from fed_learn.secure_inbox import InputDigests, SecureInbox, Skipped
from netproto import Connection, NetprotoError
from netproto.errors import peer_text

log = logging.getLogger(__name__)

NOISE_SIGMAS = 12.0
"""The fixed point leaves room for noise this many standard deviations out (a clipped,
weighted update's entries are at most its norm bound times its weight)."""


# ---------------------------------------------------------------------------- encoding


def b64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def unb64(value: Any, client: int, what: str, *, size: int | None = None) -> bytes:
    """Bytes a peer sent as base64, checked: a string, decodable (canonical base64, nothing
    outside its alphabet), of `size` bytes."""
    if not isinstance(value, str) or len(value) > 4 * ((size or 4096) + 2) // 3 + 4:
        raise secagg.Refused(client, f"{what} must be a base64 string")
    try:
        data = binascii.a2b_base64(value.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError):
        raise secagg.Refused(client, f"{what} is not base64") from None
    if size is not None and len(data) != size:
        raise secagg.Refused(client, f"{what} must be {size} bytes, not {len(data)}")
    return data


def _client_id(key: Any, client: int, what: str) -> int:
    """A client id a peer sent as a JSON object key (a decimal string)."""
    if not isinstance(key, str) or not key.isdigit() or len(key) > 5:
        raise secagg.Refused(client, f"{what}: {key!r:.20} is not a client id")
    return int(key)


def _json_object(payload: Any, client: int, what: str, keys: Iterable[str]) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise secagg.Refused(client, f"{what} must be a JSON object")
    missing = [k for k in keys if k not in payload]
    if missing:
        raise secagg.Refused(client, f"{what} has no {missing[0]}")
    return payload


# ---------------------------------------------------------------------------- client side


class RoundAbandoned(Exception):
    """The coordinator moved on (a new TASK, an EVALUATE or FINISH) while this client was
    mid-round."""

    def __init__(self, message: Any) -> None:
        super().__init__("the coordinator moved on")
        self.message = message


def _expect(conn: Connection, kind: int, task: int, timeout_s: float | None) -> dict[str, Any]:
    """The coordinator's next step message for `task`; a TASK or FINISH instead means the
    round was abandoned (RoundAbandoned carries it)."""
    while True:
        moved_on = {FedMsg.TASK, FedMsg.FINISH, FedMsg.EVALUATE}
        message = conn.recv(expect={kind, *moved_on}, timeout_s=timeout_s)
        if message.type != kind:
            raise RoundAbandoned(message)
        payload = message.payload
        if isinstance(payload, dict) and payload.get("task") == task:
            return payload
        log.warning("dropped a message of type %#x for another task", kind)


def client_round(
    conn: Connection,
    *,
    client_id: int,
    task: dict[str, Any],
    train: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]],
    weight: int,
    timeout_s: float | None,
    max_clients: int,
    floor: RoundFloor,
) -> bool:
    """This client's side of a secure round, from a TASK to its last message. `train()` runs
    local training and returns (RESULT payload, trained tensors, the global ones they started
    from). Whether its input went in: False if its training came out non-finite (it says so,
    SKIP, and sits the round out). Raises RoundAbandoned when the coordinator moved on, and
    ValueError on parameters it refuses (a round of more than `max_clients`, or weaker than
    its config's `floor`, among others), before it sends anything."""
    params, weight_cap, bound, share_std = parse_params(task["secure"], max_clients=max_clients)
    floor.check(params, weight_cap=weight_cap, bound=bound, share_std=share_std)
    number = int(task["task"])
    me = secagg.Client(client_id, params)
    c_key, s_key = me.public_keys()
    conn.send_msg(FedMsg.SA_KEYS, {"task": number, "c": b64(c_key), "s": b64(s_key)})
    roster = _expect(conn, FedMsg.SA_ROSTER, number, timeout_s)
    keys = {
        _client_id(k, -1, "roster"): tuple(
            unb64(v, -1, "a relayed key", size=secagg.KEY_BYTES) for v in pair
        )
        for k, pair in _mapping(roster, "keys").items()
        if isinstance(pair, list) and len(pair) == 2
    }
    boxes, commitment = me.share(keys)  # type: ignore[arg-type]
    conn.send_msg(
        FedMsg.SA_SHARES,
        {
            "task": number,
            "boxes": {str(c): b64(box) for c, box in boxes.items()},
            "commit": b64(commitment),
        },
    )
    relayed = _expect(conn, FedMsg.SA_BOXES, number, timeout_s)
    inbox = {}
    for k, v in _mapping(relayed, "boxes").items():
        sender = _client_id(k, -1, "boxes")
        inbox[sender] = unb64(v, sender, "a share box", size=secagg.BOX_BYTES)
    holders = {_client_id(k, -1, "holders"): v for k, v in _mapping(relayed, "holders").items()}
    for refused in me.receive(inbox, holders):  # each checked there
        log.warning("secure round %d: %s", params.round, refused)
    result, trained, base = train()
    flat = flat_delta(trained, base)
    if flat.numel() + 1 != params.length:  # before the noise is drawn at the round's length
        raise ValueError(f"the round carries {params.length - 1} entries, not {flat.numel()}")
    if not bool(torch.isfinite(flat).all()):
        log.warning("round %d: local training gave non-finite values: sitting out", params.round)
        conn.send_msg(FedMsg.SKIP, {"task": number, "reason": "non-finite update"})
        return False
    delta, norm = clip(flat, bound)
    if norm > bound:
        log.info("update norm %.3g clipped to %.3g (the coordinator cannot check it)", norm, bound)
    noise = gaussian(params.length - 1, share_std).numpy() if share_std > 0 else None
    used = min(weight, weight_cap)
    masked = me.masked_input(delta.numpy(), used, noise)
    conn.send_msg(FedMsg.RESULT, {**result, "weight": used})
    conn.send_tensors(FedMsg.SA_MASKED, {"masked": torch.from_numpy(masked)})
    ask = _expect(conn, FedMsg.SA_UNMASK, number, timeout_s)
    survivors, dropped = ask.get("survivors"), ask.get("dropped")
    if not all(
        isinstance(x, list) and all(type(i) is int for i in x) for x in (survivors, dropped)
    ):
        raise ValueError("SA_UNMASK must list survivors and dropped client ids")
    shares = me.reveal(survivors, dropped)  # type: ignore[arg-type]  # checked just above
    conn.send_msg(
        FedMsg.SA_REVEAL,
        {
            "task": number,
            "shares": {str(c): [k, i, b64(s)] for c, (k, i, s) in shares.items()},
        },
    )
    return True


# ---------------------------------------------------------------------------- coordinator side


def _mapping(message: dict[str, Any], key: str) -> dict[Any, Any]:
    """A message's `key` as the object it must be: anything else leaves the round (a
    ValueError the client's loop answers), not the process."""
    value = message.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"the coordinator's {key} is a {type(value).__name__}, not an object")
    return value


def check_weight(client: int, value: Any, declared: int) -> int:
    """The weight `client` says, in clear, it masked its update with: an int in 1..what it
    declared at JOIN (capped), else Refused by name before anything is unmasked."""
    if type(value) is not int or not 1 <= value <= declared:
        raise secagg.Refused(
            client, f"a weight of {value!r:.24} in clear; it may use 1..{declared} (its JOIN)"
        )
    return value


def check_aggregate(
    total: np.ndarray,
    weight_sum: int,
    *,
    weights: Mapping[int, int],
    bound: float,
    noise_std: float,
    frac_bits: int,
) -> float:
    """The unmasked sum, before it is applied: its weights equal the ones its clients sent in
    clear, it is finite, and its L2 norm is within what clipped updates can reach (`bound` x
    the weights, plus the DP noise and rounding room); its norm, else RoundFailed in one line
    giving the bound and the value. What fails it is not attributable: the round goes whole."""
    declared = sum(weights.values())
    if weight_sum != declared:
        raise secagg.RoundFailed(
            f"the masked weights sum to {weight_sum:.4g}; the clients sent {declared} in clear"
        )
    if not np.isfinite(total).all():
        raise secagg.RoundFailed("the unmasked sum is not finite")
    entries, clients = total.size, len(weights)
    noise = noise_std * math.sqrt(clients) * (math.sqrt(entries) + NOISE_SIGMAS)
    rounding = clients * 2.0 ** -(frac_bits + 1) * math.sqrt(entries)
    limit = bound * declared + noise + rounding
    # Not np.linalg.norm: its BLAS dot wakes OpenBLAS's worker threads, which then spin (about
    # 30 ms of the coordinator's CPU a round, measured); einsum sums in one thread, no BLAS.
    flat = np.asarray(total, dtype=np.float64).ravel()  # an int array would wrap in einsum
    norm = math.sqrt(float(np.einsum("i,i->", flat, flat)))
    if not norm <= limit:
        raise secagg.RoundFailed(
            f"the sum's L2 norm {norm:.4g} is over its bound {limit:.4g} (the clip {bound:g} "
            f"x the weights {declared}{' + DP noise' if noise_std else ''})"
        )
    return norm


@dataclass
class SecureOutcome:
    """A secure round's end: the new trained tensors (None if it failed), the results of the
    clients whose input the sum holds, and who failed or was refused."""

    merged: dict[str, torch.Tensor] | None
    results: list[Any]
    participants: list[int]
    failures: list[int]
    refused: int
    reason: str = ""
    named: list[int] = field(default_factory=list)
    """The clients refused by name (the run excludes them from its later rounds)."""
    inputs: int = 0
    """Masked inputs taken (the round may still have failed after them)."""


class SecureRound:
    """One secure round, run by the coordinator's round thread."""

    def __init__(
        self,
        *,
        inbox: SecureInbox,
        clients: list[Any],
        trained: dict[str, torch.Tensor],
        round_index: int,
        neighbors: int,
        threshold: float,
        weight_cap: int,
        bound: float,
        step_timeout_s: float,
        input_timeout_s: float,
        declared: Mapping[int, int],
        noise_multiplier: float = 0.0,
        digests: InputDigests | None = None,
    ) -> None:
        self.inbox = inbox
        self.digests = InputDigests() if digests is None else digests
        """The run's masked-input digests (a replay of any earlier input is refused)."""
        self.declared = {c: min(int(n), weight_cap) for c, n in declared.items()}
        """Each client's examples as declared at JOIN, capped: the most weight it may use."""
        self.clients = {c.client_id: c for c in clients}
        self.trained = trained
        ids = tuple(sorted(self.clients))
        length = sum(t.numel() for t in trained.values()) + 1
        degree = min(neighbors or len(ids), len(ids) - 1)
        shares = shares_needed(threshold, degree)
        self.noise_std = 0.0
        """DP: the std of each client's noise share. Any `threshold` shares add up to the
        whole noise, noise_multiplier x bound x weight_cap: the most one client's weighted,
        clipped update can move the sum."""
        if noise_multiplier > 0:
            self.noise_std = noise_std(noise_multiplier, bound * weight_cap, shares=shares)
        self.denominator = float(sum(self.declared.values())) if noise_multiplier > 0 else 0.0
        """DP: the sum is divided by the sampled clients' capped weights, fixed before the
        round (McMahan et al.'s fixed denominator), not by the weights that came back."""
        largest = weight_cap * bound + NOISE_SIGMAS * self.noise_std  # one input's entry
        self.params = secagg.Params(
            round=round_index,
            clients=ids,
            threshold=shares,
            neighbors=neighbors or max(1, len(ids) - 1),
            frac_bits=frac_bits_for(len(ids), 1.0, largest),
            length=length,
            graph_seed=secrets.token_bytes(8),
        )
        self.server = secagg.Server(self.params)
        self.weight_cap, self.bound = weight_cap, bound
        self.step_timeout_s, self.input_timeout_s = step_timeout_s, input_timeout_s
        self.failures: set[int] = set()
        self.named: set[int] = set()
        self.weights: dict[int, int] = {}
        """The weight each client whose input was taken sent in clear."""
        self.refused = 0

    @classmethod
    def for_round(
        cls,
        fed: Any,
        inbox: SecureInbox,
        clients: list[Any],
        trained: dict[str, torch.Tensor],
        round_index: int,
        noise_multiplier: float,
        digests: InputDigests | None = None,
    ) -> SecureRound:
        """A round of `clients` as `fed` (FedConfig) sets it: SecAgg+'s graph and threshold,
        the clip (fed.dp.clip_norm under DP, else fed.max_update_norm) and weight cap."""
        dp = fed.dp.enabled
        return cls(
            inbox=inbox,
            clients=clients,
            trained=trained,
            round_index=round_index,
            neighbors=fed.secagg.neighbors,
            threshold=fed.secagg.threshold,
            weight_cap=fed.dp.weight_cap if dp else fed.max_examples_per_client,
            bound=fed.dp.clip_norm if dp else fed.max_update_norm,
            noise_multiplier=noise_multiplier,
            step_timeout_s=fed.secagg.step_timeout_s,
            input_timeout_s=fed.round_timeout_s,
            declared={c.client_id: c.num_examples for c in clients},
            digests=digests,
        )

    def task_fields(self, client: int) -> dict[str, Any]:
        """The TASK's secure parameters for `client` (its own weight cap included)."""
        cap = self.declared[client]
        message = params_message(
            self.params, weight_cap=cap, bound=self.bound, share_std=self.noise_std
        )
        return {"secure": message}

    def _refuse(self, exc: secagg.Refused | ValueError, client: int) -> None:
        log.warning("round %d: refused client %d: %s", self.params.round, client, peer_text(exc))
        self.failures.add(client)
        self.named.add(client)
        self.refused += 1

    def _send(self, client: int, kind: int, payload: dict[str, Any]) -> None:
        try:
            self.clients[client].conn.send_msg(kind, payload)
        except NetprotoError as exc:
            log.warning("round %d: cannot reach client %d: %s", self.params.round, client, exc)
            self.failures.add(client)

    def _step(self, kind: int, clients: Iterable[int]) -> dict[int, Any]:
        """`kind` from `clients`: masked inputs within fed.round_timeout_s (the clients train
        first), every other step within fed.secagg.step_timeout_s."""
        if kind == FedMsg.SA_MASKED:
            timeout_s, key = self.input_timeout_s, "fed.round_timeout_s"
        else:
            timeout_s, key = self.step_timeout_s, "fed.secagg.step_timeout_s"
        wanted = [c for c in clients if c not in self.failures]
        what = f"{FedMsg(kind).name} in secure round {self.params.round + 1} ({key}={timeout_s:g})"
        got = self.inbox.gather(kind, wanted, self.inbox.clock() + timeout_s, what=what)
        self.failures |= set(wanted) - set(got)
        return got

    def run(self, tasks: Mapping[int, int]) -> SecureOutcome:
        """The steps after the TASKs went out (`tasks`: client id -> task number)."""
        try:
            return self._run(tasks)
        except secagg.RoundFailed as exc:
            log.warning("round %d: secure aggregation failed: %s", self.params.round, exc)
            return SecureOutcome(
                None,
                [],
                [],
                sorted(self.failures),
                self.refused,
                str(exc),
                sorted(self.named),
                len(self.server.inputs),
            )
        finally:
            self.inbox.close()

    def _run(self, tasks: Mapping[int, int]) -> SecureOutcome:
        server = self.server
        relayed_keys: dict[int, list[str]] = {}  # each client's keys, encoded once, as relayed
        for client, payload in self._step(FedMsg.SA_KEYS, tasks).items():
            try:
                body = _json_object(payload, client, "SA_KEYS", ("c", "s"))
                keys = [
                    unb64(body[k], client, f"its {k} key", size=secagg.KEY_BYTES)
                    for k in ("c", "s")
                ]
                server.add_keys(client, *keys)
                relayed_keys[client] = [b64(key) for key in keys]
            except secagg.Refused as exc:
                self._refuse(exc, client)
        self._enough(server.keys, "advertised keys")
        for client in server.keys:
            roster = {str(c): relayed_keys[c] for c in server.keys_for(client)}
            self._send(client, FedMsg.SA_ROSTER, {"task": tasks[client], "keys": roster})
        for client, payload in self._step(FedMsg.SA_SHARES, list(server.keys)).items():
            try:
                body = _json_object(payload, client, "SA_SHARES", ("boxes", "commit"))
                if not isinstance(body["boxes"], dict):
                    raise secagg.Refused(client, "its boxes must be a JSON object")
                boxes = {
                    _client_id(k, client, "a box's recipient"): unb64(
                        v, client, "a share box", size=secagg.BOX_BYTES
                    )
                    for k, v in body["boxes"].items()
                }
                commit = unb64(body["commit"], client, "its commitment", size=secagg.COMMIT_BYTES)
                server.add_shares(client, boxes, commit)
            except secagg.Refused as exc:
                self._refuse(exc, client)
        self._enough(server.commitments, "shared their keys")
        for client in server.commitments:
            relayed = server.boxes_for(client)
            self._send(
                client,
                FedMsg.SA_BOXES,
                {
                    "task": tasks[client],
                    "boxes": {str(c): b64(b) for c, b in relayed.items()},
                    "holders": {str(c): server.holders(c) for c in relayed},  # JSON arrays
                },
            )
        results: dict[int, Any] = {}
        for client, answer in self._step(FedMsg.SA_MASKED, list(server.commitments)).items():
            if isinstance(answer, Skipped):  # said in clear: a dropout, not a refusal
                log.info(
                    "round %d: client %d sits out: %s", self.params.round, client, answer.reason
                )
                self.failures.add(client)
                continue
            payload, tensors = answer
            try:
                results[client] = parse_result(
                    payload, task=tasks[client], round_index=self.params.round
                )
                weight = check_weight(client, payload.get("weight"), self.declared[client])
                masked = tensors.get("masked") if isinstance(tensors, dict) else None
                if len(tensors) != 1 or not isinstance(masked, torch.Tensor):
                    raise secagg.Refused(client, "SA_MASKED must hold one tensor, 'masked'")
                if masked.dtype != torch.uint64:
                    raise secagg.Refused(client, f"a masked input of {masked.dtype}, not uint64")
                array = masked.numpy()  # the frame's own buffer (`Coordinator.handle`)
                server.add_input(client, array)  # checked before its digest is recorded
                self.digests.admit(client, self.params.round, array)
                self.weights[client] = weight
            except (secagg.Refused, ValueError) as exc:
                results.pop(client, None)
                server.inputs.pop(client, None)
                self._refuse(exc, client)
        survivors, dropped = server.unmask_request()
        for client in survivors:
            self._send(
                client,
                FedMsg.SA_UNMASK,
                {"task": tasks[client], "survivors": survivors, "dropped": dropped},
            )
        for client, payload in self._step(FedMsg.SA_REVEAL, survivors).items():
            try:
                body = _json_object(payload, client, "SA_REVEAL", ("shares",))
                if not isinstance(body["shares"], dict):
                    raise secagg.Refused(client, "its shares must be a JSON object")
                shares = {}
                for k, item in body["shares"].items():
                    owner = _client_id(k, client, "a share's owner")
                    if not isinstance(item, list) or len(item) != 3 or type(item[1]) is not int:
                        raise secagg.Refused(client, "a revealed share is [kind, index, bytes]")
                    shares[owner] = (item[0], item[1], unb64(item[2], client, "a share", size=None))
                server.add_reveal(client, shares)
            except secagg.Refused as exc:
                self._refuse(exc, client)
        total, weight, refused = server.aggregate()
        for client in dict.fromkeys(wrong.client for wrong in refused):  # once per suspect
            lies = [wrong for wrong in refused if wrong.client == client]
            # Suspected, not proven: a secret that rebuilds once one share is left out shows a
            # wrong share among the rest, and one liar is the one left out, but two revealers
            # colluding can make an honest one's absence the one that passes. So the suspect's
            # shares stay out of this round only; it is not excluded from the run.
            log.warning(
                "round %d: %s (%d wrong in all); its shares are left out of this round; not "
                "excluded from the run (a leave-one-out check cannot tell one liar from two "
                "blaming an honest revealer)",
                self.params.round,
                peer_text(lies[0]),
                len(lies),
            )
            self.refused += 1
        check_aggregate(
            total,
            weight,
            weights={c: self.weights[c] for c in survivors},
            bound=self.bound,
            noise_std=self.noise_std,
            frac_bits=self.params.frac_bits,
        )
        mean = torch.from_numpy(total / (self.denominator or weight))
        merged = {
            name: (base.double() + step.double()).to(base.dtype)
            for (name, base), step in zip(
                self.trained.items(), unflatten(mean, self.trained).values(), strict=True
            )
        }
        return SecureOutcome(
            merged,
            [results[c] for c in survivors if c in results],
            survivors,
            sorted(self.failures),
            self.refused,
            named=sorted(self.named),
            inputs=len(server.inputs),
        )

    def _enough(self, present: Mapping[int, Any], what: str) -> None:
        if len(present) < self.params.threshold:
            raise secagg.RoundFailed(
                f"{len(present)} clients {what}; the threshold is {self.params.threshold}"
            )
