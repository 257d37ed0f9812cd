"""Every attack class of the security review, against live local servers.

Run: `python bench/abuse_bench.py [--quick]`.

Four surfaces, each served by a process of its own, attacked by another, while this process
plays an honest client and times it, without the attack and then under it. The honest client
dials from 127.0.0.2 (the coordinator's newcomers each from an address of their own), the
attackers from 127.0.0.1 and, for the classes that need a host to themselves, 127.0.0.3-4:
other hosts, as the servers see them.
  - netproto (a secret set): idle and slow strangers by the hundred, PING before the handshake,
    malformed frames before and after authentication (overflowing tensor dims, JSON nested
    5,000 deep, a 5,000-digit integer, NaN, 1e999, 100,000 tensors, ERROR text forging log
    lines), authenticated peers dribbling a frame a byte every 2 s (within the read timeout:
    the frame deadline must cut them), one address asking for every slot (it gets its share).
    Honest: connect, authenticate, one request.
  - spec_decoding's verifier (the debug target): malformed OPEN fields, a 40,000-token
    BASELINE, q <= 0 drafts, a session growing past its cap. Honest: OPEN and one DRAFT.
  - fed_learn's coordinator: two of five clients (in an attacker process) answer every task
    with a malformed RESULT or a poisoned update (NaN, Inf, 3e38) after a flood of unsolicited
    results, with median aggregation on, while two more secret holders JOIN and leave in a
    loop. Honest: a newcomer's JOIN while the rounds run, against the same with five honest
    clients and no loop.
  - a split stage (a shared secret set): a rank without the secret calls stage functions
    unsigned, and TorchScript builtin operators, which TensorPipe runs in C++ without any Python
    check (reported as served: see docs/security.md). Honest: the driver's call
    to the stage.
Then the insiders and neighbours of issue 48, each a real attack run here (labtools.attacks,
the tests' own scripts), rows without a latency:
  - another local user (uid nobody) against a fenced local split_training run: rogue_rpc's six
    attacks on each stage's TensorPipe listener; the run must train to its end (root, nft and
    setpriv; else skipped, saying why). The same user on each host of a split run across hosts
    is `labtools.hosts.probe_exposure`'s local arm (root and WireGuard, with the stranger rows).
  - a secret holder in a secure federation: an offset of 2^58 on its masked input (the round
    refused whole), a replayed masked input and a weight of 2^40 (refused by name); the adapter
    within fed.max_update_norm.
  - two secret holders JOINing and leaving from rotating 127.0.x.y addresses beside two honest
    clients: every counted round must aggregate the honest two.
  - data_parallel (issue 49): a stranger to its rendezvous with torch's own TCPStore client
    (read the state and the job token, join as a host, overwrite the state) and junk to gloo's
    ports: another local user and this user against a local run (the honest job must end with
    the unattacked run's final loss), a stranger outside the overlay against a run across
    hosts. `--only data_parallel` runs these rows alone.
Bounded counts and time (`--quick`: 300 strangers instead of 1,000, shorter attacks). Prints a
table per attack class (attempts, refused, crashes: answers `internal` or a dead server, must be
0; served: answered as if legitimate), then one per surface with the honest client's latency,
writes bench/results/abuse_bench.json, and ends with the worst surface's honest-client p50
latency under attack / without, the 1-minute load average read at start and the verdict: `pass`
at or under 2; over it, `busy` where the load was 0.3 or more (not a quiet machine), else
`fail`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from lab.machine import announce_machine, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "abuse_bench.json"
SECRET = "abuse-bench-secret"
HANDSHAKE_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 30.0
HONEST_HOST = "127.0.0.2"
"""Where the honest client dials from: another host than the attackers, as servers see it."""
DRIBBLE_HOST, HOG_HOST = "127.0.0.3", "127.0.0.4"
"""The slowloris peers' and the slot hog's own addresses (each class is one host's doing)."""
LOOP_HOSTS = ("127.0.0.3", "127.0.0.4")
"""The coordinator's two JOIN-and-leave loops, one address each."""
DRIBBLE_STEP_S = 2.0
SLOWLORIS_S = 16.0
"""How long the dribblers dribble: past netproto's frame grace (10 s) and a few bytes more."""
NUM_DRIBBLERS = 32


@dataclass
class Outcome:
    """One attack class: how many tries, how many were refused, how many crashed something."""

    attempts: int = 0
    refused: int = 0
    crashes: int = 0
    served: int = 0  # answered as if legitimate (only where the README documents why)

    def add(self, verdict: str) -> None:
        self.attempts += 1
        if verdict == "refused":
            self.refused += 1
        elif verdict == "crash":
            self.crashes += 1
        else:
            self.served += 1


Outcomes = dict[str, Outcome]


def _verdict(exc: BaseException | None) -> str:
    """What an answer to an attack says: refused (an error naming the peer's fault, or the
    connection closed on it), crash (`internal`: the server failed), served (no error)."""
    from netproto import RemoteError

    if exc is None:
        return "served"
    if isinstance(exc, RemoteError) and exc.code == "internal":
        return "crash"
    return "refused"


def p50(samples: list[float]) -> float:
    return statistics.median(samples) if samples else math.nan


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (a read finds the end, or a reset)."""
    sock.settimeout(0.5)
    try:
        while sock.recv(4096):
            pass  # an ERROR first, perhaps
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


# ------------------------------------------------------------------ netproto


def _echo(conn: Any) -> None:
    from netproto import MsgType

    while True:
        message = conn.recv(expect=MsgType.DATA_JSON)
        conn.send_msg(MsgType.DATA_JSON, message.payload, request_id=message.request_id)


def _serve_in_child(make_handler: str, ready: Any, stop: Any, kwargs: dict[str, Any]) -> None:
    """Child process: a netproto server for `make_handler` until told to stop; then counters."""
    import logging

    from netproto import Server
    from netproto.connection import server_ssl_context

    logging.basicConfig(level=logging.ERROR)
    tls = kwargs.pop("tls", None)
    handler = globals()[make_handler](**kwargs)
    server = Server(
        handler,
        secret=SECRET.encode(),
        ssl_context=server_ssl_context(cert=tls[0], key=tls[1]) if tls else None,
        handshake_timeout_s=HANDSHAKE_TIMEOUT_S,
        read_timeout_s=READ_TIMEOUT_S,
        name=make_handler,
    ).start()
    ready.send(server.address)
    stop.recv()
    counters = {
        name: getattr(server, name)
        for name in (
            "sessions_started",
            "sessions_failed",
            "sessions_evicted",
            "sessions_refused",
            "sessions_capped",
        )
        if hasattr(server, name)
    }
    server.stop()
    ready.send(counters)


def echo_handler() -> Callable[[Any], None]:
    return _echo


def verifier_handler(cache_dir: str) -> Callable[[Any], None]:
    from lab.config import ModelConfig
    from lab.models import load_model, load_tokenizer
    from spec_decoding.verifier import Verifier

    torch.set_num_threads(1)
    config = ModelConfig(pretrained="lab:tiny_target", lab_preset="debug")
    verifier = Verifier(
        load_model(config, cache_dir=Path(cache_dir)),
        load_tokenizer(config, cache_dir=Path(cache_dir)),
    )
    return verifier.handle


@contextlib.contextmanager
def server_process(handler: str, **kwargs: Any) -> Iterator[tuple[tuple[str, int], dict]]:
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    stop_ours, stop_theirs = context.Pipe()
    proc = context.Process(target=_serve_in_child, args=(handler, theirs, stop_theirs, kwargs))
    proc.start()
    PLACEMENT.server(proc.pid)
    counters: dict[str, Any] = {}
    try:
        if not ours.poll(600):
            raise RuntimeError(f"the {handler} server did not start")
        yield ours.recv(), counters
        counters["alive"] = proc.is_alive()
        stop_ours.send("stop")
        if ours.poll(30):
            counters.update(ours.recv())
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def _connect(address: tuple[str, int], *, ca: str | None = None, host: str = "127.0.0.1") -> Any:
    from netproto import Connection
    from netproto.connection import client_ssl_context

    return Connection.connect(
        *address,
        secret=SECRET.encode(),
        ssl_context=client_ssl_context(ca=ca) if ca else None,
        connect_timeout_s=10,
        source_address=(host, 0),
    )


def self_signed_certificate(folder: Path) -> tuple[str, str] | None:
    """(cert.pem, key.pem) for 127.0.0.1, made with the openssl command (None without it)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(key), "-out", str(cert)],
            check=True,
            capture_output=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return str(cert), str(key)


def honest_echo(address: tuple[str, int], ca: str | None = None) -> None:
    from netproto import MsgType

    with _connect(address, ca=ca, host=HONEST_HOST) as conn:
        conn.request(MsgType.DATA_JSON, {"hello": 1}, expect=MsgType.DATA_JSON)


def _frame(msg_type: int, kind: int, payload: bytes) -> bytes:
    from netproto.header import Header, PayloadKind, pack_header

    return pack_header(Header(msg_type, PayloadKind(kind), 0, 0, len(payload))) + payload


def crafted_frames() -> dict[str, bytes]:
    """Malformed frames of every decoding class the review found, by name."""
    from netproto import MsgType, PayloadKind
    from netproto.header import DTYPE_CODES

    def tensor(dims: list[int]) -> bytes:
        meta = struct.pack("!BB", DTYPE_CODES[torch.float32], len(dims))
        meta += b"".join(struct.pack("!Q", d) for d in dims)
        return meta + bytes(-len(meta) % 16)

    many = struct.pack("!I", 100_000) + b"".join(
        struct.pack("!H", 1) + b"x" + struct.pack("!BB", DTYPE_CODES[torch.uint8], 0)
        for _ in range(100_000)
    )
    json_frame = lambda text: _frame(MsgType.DATA_JSON, PayloadKind.JSON, text.encode())  # noqa: E731
    return {
        "zero-element tensor, huge dims": _frame(
            MsgType.DATA_TENSOR, PayloadKind.TENSOR, tensor([0, 2**40, 2**40, 2**40])
        ),
        "JSON nested 5,000 deep": json_frame('{"a":' + "[" * 5000 + "]" * 5000 + "}"),
        "5,000-digit JSON integer": json_frame('{"a":' + "9" * 5000 + "}"),
        "JSON NaN / Infinity / 1e999": json_frame('{"a":NaN,"b":Infinity,"c":1e999}'),
        "100,000 tiny tensors": _frame(MsgType.DATA_TENSORS, PayloadKind.TENSORS, many),
        "ERROR text forging a log line": _frame(
            MsgType.ERROR,
            PayloadKind.JSON,
            json.dumps(
                {"code": "x\nCRITICAL forged", "message": "boom\n[CRITICAL] server compromised"}
            ).encode(),
        ),
    }


def attack_netproto(
    address: tuple[str, int], seconds: float, scale: int, crowd_only: bool = False
) -> Outcomes:
    """Runs in the attacker process; every class at once for about `seconds` (`crowd_only`:
    the strangers and the PINGs, which is what a TLS server sees of any of them)."""
    from netproto import MsgType, NetprotoError, PayloadKind

    outcomes: Outcomes = {}
    label = "netproto+TLS" if crowd_only else "netproto"

    def strangers() -> None:
        """Idle and slow strangers: the server must drop them (deadline or to make room)."""
        outcome = outcomes.setdefault(f"{label}: {scale} idle/slow strangers", Outcome())
        socks = []
        for index in range(scale):
            with contextlib.suppress(OSError):
                sock = socket.create_connection(address, timeout=5)
                socks.append((index % 2, sock))
        ends = time.monotonic() + seconds
        header = _frame(MsgType.AUTH_CHALLENGE, PayloadKind.BYTES, bytes(32))
        step = 0
        while time.monotonic() < ends:  # the slow half sends its challenge a byte at a time
            for slow, sock in socks:
                if slow and step < len(header):
                    with contextlib.suppress(OSError):
                        sock.send(header[step : step + 1])
            step += 1
            time.sleep(0.5)
        for _, sock in socks:
            sock.settimeout(0.5)
            try:
                sock.recv(4096)  # an ERROR, then the close; or the close alone
                closed = True
            except TimeoutError:
                closed = False
            except OSError:
                closed = True
            outcome.add("refused" if closed else "served")
            sock.close()

    def slowloris() -> None:
        """Authenticated peers each dribbling a frame a byte every 2 s, well inside the read
        timeout: the frame deadline must cut every one (refused) before the attack ends."""
        outcome = outcomes.setdefault(
            f"{label}: {NUM_DRIBBLERS} authenticated peers dribbling a frame, a byte per 2 s",
            Outcome(),
        )
        conns = []
        for _ in range(NUM_DRIBBLERS):
            try:
                conns.append(_connect(address, host=DRIBBLE_HOST))
            except (OSError, NetprotoError):
                outcome.add("refused")
        frame = _frame(MsgType.DATA_BYTES, PayloadKind.BYTES, bytes(1000))
        ends = time.monotonic() + max(seconds, SLOWLORIS_S)
        for step in range(len(frame)):
            if time.monotonic() >= ends:
                break
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn._sock.send(frame[step : step + 1])
            time.sleep(DRIBBLE_STEP_S)
        for conn in conns:
            outcome.add("refused" if _closed_by_server(conn._sock) else "served")
            conn.close()

    def hog() -> None:
        """One address asks for every slot, authenticating each: it gets its share (served),
        the rest are closed at accept (refused), and it holds them while the attack lasts."""
        outcome = outcomes.setdefault(f"{label}: one address asking for all 256 slots", Outcome())
        conns = []
        for _ in range(256):
            try:
                conns.append(_connect(address, host=HOG_HOST))
                outcome.add("served")
            except (OSError, NetprotoError):
                outcome.add("refused")
        time.sleep(seconds)
        for conn in conns:
            conn.close()

    def ping_first() -> None:
        outcome = outcomes.setdefault(f"{label}: PING before the handshake", Outcome())
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            try:
                with socket.create_connection(address, 5) as sock:
                    sock.sendall(_frame(MsgType.PING, PayloadKind.EMPTY, b""))
                    sock.settimeout(5)
                    reply = sock.recv(64)
                pong = len(reply) >= 6 and struct.unpack("!H", reply[4:6])[0] == MsgType.PONG
                outcome.add("served" if pong else "refused")
            except OSError:  # reset: a TLS server takes the PING for a broken ClientHello
                outcome.add("refused")
            time.sleep(0.05)

    def malformed(authenticated: bool) -> None:
        frames = crafted_frames()
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            for name, frame in frames.items():
                when = "after auth" if authenticated else "before auth"
                outcome = outcomes.setdefault(f"netproto: {name} ({when})", Outcome())
                try:
                    if authenticated:
                        conn = _connect(address)
                        conn._sendall([frame])
                        try:
                            conn.recv(timeout_s=10)
                            outcome.add("served")
                        except NetprotoError as exc:
                            outcome.add(_verdict(exc))
                        conn.close()
                    else:
                        with socket.create_connection(address, 5) as sock:
                            sock.sendall(frame)
                            sock.settimeout(10)
                            while sock.recv(65536):
                                pass  # the server answers (auth_required) and closes
                        outcome.add("refused")
                except (OSError, NetprotoError) as exc:
                    outcome.add(_verdict(exc))

    threads = [threading.Thread(target=f) for f in (strangers, ping_first)]
    if not crowd_only:
        threads += [threading.Thread(target=malformed, args=(auth,)) for auth in (False, True)]
        threads += [threading.Thread(target=f) for f in (slowloris, hog)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


# ------------------------------------------------------------------ verifier


def _open(conn: Any, tokenizer_hash: str, **fields: Any) -> Any:
    from spec_decoding.protocol import SpecMsg

    body = {"prompt": list(range(5, 13)), "vocab_hash": tokenizer_hash, **fields}
    return conn.request(SpecMsg.OPEN, body, expect=SpecMsg.OPENED).payload


def _vocab_hash(cache_dir: str) -> str:
    from lab.config import ModelConfig
    from lab.models import load_tokenizer
    from spec_decoding.verifier import vocab_hash

    config = ModelConfig(pretrained="lab:tiny_target", lab_preset="debug")
    return vocab_hash(load_tokenizer(config, cache_dir=Path(cache_dir)))


def honest_verifier(address: tuple[str, int], tokenizer_hash: str) -> None:
    from spec_decoding.protocol import SpecMsg

    with _connect(address, host=HONEST_HOST) as conn:
        _open(conn, tokenizer_hash)
        conn.request(
            SpecMsg.DRAFT, {"tokens": torch.tensor([7], dtype=torch.int32)}, expect=SpecMsg.VERDICT
        )


def attack_verifier(address: tuple[str, int], seconds: float, tokenizer_hash: str) -> Outcomes:
    from netproto import NetprotoError
    from spec_decoding.protocol import SpecMsg

    bad_opens: dict[str, dict[str, Any]] = {
        "prompt not a list": {"prompt": "import os"},
        "prompt of floats": {"prompt": [1.5, 2.5]},
        "prompt of 40,000 tokens": {"prompt": [5] * 40_000},
        "seed 2**70": {"seed": 2**70},
        "temperature 1e-320": {"temperature": 1e-320},
        "top_p 5": {"temperature": 1.0, "top_p": 5},
        "max_new_tokens 10**6": {"max_new_tokens": 10**6},
    }
    outcomes: Outcomes = {}
    ends = time.monotonic() + seconds

    def attempt(name: str, run: Callable[[Any], None]) -> None:
        outcome = outcomes.setdefault(f"verifier: {name}", Outcome())
        try:
            with _connect(address) as conn:
                run(conn)
            outcome.add("served")
        except NetprotoError as exc:
            outcome.add(_verdict(exc))

    def baseline(conn: Any) -> None:
        body = {"prompt": [5] * 40_000, "max_new_tokens": 8, "vocab_hash": tokenizer_hash}
        conn.request(SpecMsg.BASELINE, body, expect=SpecMsg.BASELINE_DONE)

    def q_zero(conn: Any) -> None:
        vocab = _open(conn, tokenizer_hash, temperature=1.0)["vocab_size"]
        q = torch.zeros(1, vocab)
        for _ in range(10_000):  # q <= 0 once made every draft pass, without end
            conn.request(
                SpecMsg.DRAFT,
                {"tokens": torch.tensor([5], dtype=torch.int32), "q": q},
                expect=SpecMsg.VERDICT,
            )

    def grow(conn: Any) -> None:
        _open(conn, tokenizer_hash)
        for _ in range(100_000):  # past the target's context, the session is refused
            conn.request(
                SpecMsg.DRAFT,
                {"tokens": torch.tensor([5] * 8, dtype=torch.int32)},
                expect=SpecMsg.VERDICT,
            )

    while time.monotonic() < ends:
        for name, fields in bad_opens.items():

            def bad_open(conn: Any, fields: dict[str, Any] = fields) -> None:
                _open(conn, tokenizer_hash, **fields)

            attempt(f"OPEN with {name}", bad_open)
        attempt("BASELINE of 40,000 tokens", baseline)
        attempt("drafts with q = 0", q_zero)
        attempt("a session growing past its cap", grow)
    return outcomes


# ------------------------------------------------------------------ coordinator


def _fed_settings(cache_dir: str, rounds: int) -> Any:
    """The coordinator surface's federation. Its JOIN budget per address range is out of reach:
    the honest newcomers JOIN and leave from 127/8, as the loops do, and 127/8 is one range, so
    the loops would spend the budget the newcomers' latency is timed against (the loops' own
    JOIN rate per address still holds; the budget has a row of its own, the rotating loop)."""
    from fed_learn.config import FedConfig, FedLearnRunConfig
    from lab.config import ClusterConfig, ModelConfig, PathsConfig, TrackingConfig

    return FedLearnRunConfig(
        model=ModelConfig(pretrained="lab:tiny_target", lab_preset="debug"),
        fed=FedConfig(
            rounds=rounds,
            num_clients=5,
            min_fit_clients=2,
            round_timeout_s=60,
            wait_clients_s=60,
            max_examples_per_client=32,
            eval_blocks=4,
            heartbeat_s=0.5,
            heartbeat_timeout_s=30,
            aggregator="median",
            idle_join_budget=10**6,  # see below
        ),
        cluster=ClusterConfig(secret=SECRET),
        paths=PathsConfig(run_dir=tempfile.mkdtemp(prefix="abuse-fed-"), cache_dir=cache_dir),
        tracking=TrackingConfig(wandb=False, console=False),
    )


POISONS = [math.nan, math.inf, 3e38]
BAD_RESULTS: list[dict[str, Any]] = [
    {"num_examples": "10"},
    {"num_examples": -10},
    {"num_examples": 0},
    {"train_loss": None},
    {"round": None},
    {"round": "1"},
]


def _fed_client(
    address: tuple[str, int],
    index: int,
    rogue: bool,
    sent: list[int],
    joined: threading.Event | None = None,
) -> None:
    """A scripted client: the global adapter plus a small offset (no training: the figure is
    about the coordinator). Rogue 3 sends malformed RESULT fields; rogue 4 floods unsolicited
    results, then sends a poisoned update (NaN, Inf, 3e38 in turn). Sets `joined` once in."""
    from fed_learn.protocol import FedMsg
    from netproto import NetprotoError

    conn = _connect(address)
    try:
        conn.request(FedMsg.JOIN, {"name": f"c{index}", "num_examples": 10}, expect=FedMsg.WELCOME)
        if joined is not None:
            joined.set()
        turn = 0
        while True:
            message = conn.recv(expect={FedMsg.TASK, FedMsg.FINISH})
            if message.type == FedMsg.FINISH:
                return
            task = message.payload
            state = conn.recv_tensors(FedMsg.GLOBAL)
            result: dict[str, Any] = {
                "task": task["task"],
                "round": task["round"],
                "num_examples": 10,
                "train_loss": 1.0,
                "val_loss": 1.0,
                "seconds": 0.1,
            }
            update = {n: t + 0.01 * (index + 1) for n, t in state.items()}
            if rogue:
                turn += 1
                if index == 3:
                    result.update(BAD_RESULTS[turn % len(BAD_RESULTS)])
                else:
                    for _ in range(20):
                        conn.send_msg(FedMsg.RESULT, {**result, "task": 1})
                        conn.send_tensors(FedMsg.UPDATE, update)
                    sent[0] += 20
                    name = sorted(update)[0]
                    update[name] = update[name].clone()
                    update[name].view(-1)[0] = POISONS[turn % len(POISONS)]
                sent[0] += 1
            conn.send_msg(FedMsg.RESULT, result)
            conn.send_tensors(FedMsg.UPDATE, update)
    except NetprotoError:
        pass  # a rogue the coordinator cut off
    finally:
        conn.close()


def _join_loop(
    address: tuple[str, int], host: str, stop: threading.Event, outcome: Outcome
) -> None:
    """A secret holder joining and leaving as fast as it can: welcomed within its address's
    JOIN rate (served), answered `rate_limited` past it (refused)."""
    from fed_learn.protocol import FedMsg
    from netproto import NetprotoError

    while not stop.is_set():
        try:
            with _connect(address, host=host) as conn:
                conn.request(
                    FedMsg.JOIN, {"name": "loop", "num_examples": 10}, expect=FedMsg.WELCOME
                )
            outcome.add("served")
        except (OSError, NetprotoError) as exc:
            outcome.add(_verdict(exc))


def _rogue_clients(pipe: Any, address: tuple[str, int]) -> None:
    """Attacker process: clients 3 and 4, both rogue, and once they are in, two JOIN-and-leave
    loops until the rounds end; sends how many messages the rogues sent and the loops' JOINs."""
    sent = [0]
    joined = [threading.Event() for _ in range(2)]
    threads = [
        threading.Thread(target=_fed_client, args=(address, i, True, sent, event))
        for i, event in zip((3, 4), joined, strict=True)
    ]
    for thread in threads:
        thread.start()
    for event in joined:
        event.wait(600)
    stop, joins = threading.Event(), Outcome()
    loops = [
        threading.Thread(target=_join_loop, args=(address, host, stop, joins))
        for host in LOOP_HOSTS
    ]
    for thread in loops:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    for thread in loops:
        thread.join()
    pipe.send((sent[0], vars(joins)))


def _federation(
    pipe: Any, rogues: bool, rounds: int, cache_dir: str, placement: Placement
) -> dict[str, Any]:
    """Child process: a coordinator with 5 scripted clients (clients 3 and 4 rogue, in an
    attacker process of their own, when `rogues`), median aggregation. Sends its address once
    the clients have joined (honest newcomers may JOIN while the rounds run), then returns what
    the rogues sent, what the coordinator refused or dropped, and whether the adapter stayed
    finite."""
    import logging

    from fed_learn.coordinator import Coordinator
    from fed_learn.lora import adapter_state, peft_model
    from lab.cluster import serve
    from lab.config import Endpoint
    from lab.tracking import METRICS_FILE, Tracker, read_records

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    settings = _fed_settings(cache_dir, rounds)
    run_dir = Path(settings.paths.run_dir)
    model = peft_model(settings.model, settings.lora, cache_dir=Path(cache_dir))
    coordinator = Coordinator(settings, model, torch.randint(0, 300, (4, 32)))
    server = serve(coordinator.handle, settings.cluster, Endpoint(), name="coordinator")
    peak, watching = [0], threading.Event()

    def watch_table() -> None:  # what the client table grows to (loops join and leave)
        while not watching.wait(0.01):
            peak[0] = max(peak[0], len(coordinator.clients))

    watcher = threading.Thread(target=watch_table, daemon=True)
    watcher.start()
    sent = [0]
    threads = [
        threading.Thread(target=_fed_client, args=(server.address, i, False, sent), daemon=True)
        for i in range(3 if rogues else 5)
    ]
    for thread in threads:
        thread.start()
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    attacker = context.Process(target=_rogue_clients, args=(theirs, server.address))
    if rogues:
        attacker.start()
        placement.attacker(attacker.pid)
    coordinator.wait_for_clients(5)
    pipe.send(server.address)
    crashed, metrics = False, {}
    try:
        with Tracker(run_dir, config={}, tracking=settings.tracking, job="abuse") as tracker:
            metrics = coordinator.run_rounds(tracker)
    except Exception as exc:  # the coordinator must survive its clients
        crashed = True
        print(f"coordinator crashed: {exc!r}", file=sys.stderr)
    joins: dict[str, int] = {}
    if rogues:
        if ours.poll(60):
            rogue_sent, joins = ours.recv()
            sent[0] += rogue_sent
        attacker.join(timeout=10)
    server.stop()
    watching.set()
    watcher.join(timeout=10)
    records = [r for r in read_records(run_dir / METRICS_FILE) if "clients" in r]
    finite = all(bool(torch.isfinite(t).all()) for t in adapter_state(model).values())
    return {
        "sent": sent[0],
        "refused": sum(int(r.get("refused", 0)) for r in records),
        "dropped": int(metrics.get("dropped_results", 0)),
        "finite": finite,
        "crashed": crashed,
        "rounds": len(records),
        "joins": joins,
        "table_peak": peak[0],
    }


def _federation_child(
    pipe: Any, rogues: bool, rounds: int, cache_dir: str, placement: Placement
) -> None:
    pipe.send(_federation(pipe, rogues, rounds, cache_dir, placement))


def honest_join(address: tuple[str, int], host: str) -> None:
    """A newcomer's JOIN from `host` answered with WELCOME. It leaves at once; a round that
    sampled it in the meantime counts it as a failure, like any client that leaves."""
    from fed_learn.protocol import FedMsg

    with _connect(address, host=host) as conn:
        conn.request(FedMsg.JOIN, {"name": "newcomer", "num_examples": 1}, expect=FedMsg.WELCOME)


def newcomer_hosts() -> Iterator[str]:
    """Each newcomer from an address of its own (127.0.1.1, ...): JOINs are limited per
    address, and a newcomer is a new host."""
    for index in itertools.count():
        yield f"127.0.{1 + index // 250}.{1 + index % 250}"


def run_federation(
    rogues: bool, rounds: int, cache_dir: str, *, samples: int
) -> tuple[list[float], dict[str, Any]]:
    """Runs a federation in a child process and times honest JOINs while its rounds run."""
    from netproto import NetprotoError

    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    proc = context.Process(
        target=_federation_child, args=(theirs, rogues, rounds, cache_dir, PLACEMENT)
    )
    proc.start()
    PLACEMENT.server(proc.pid)
    try:
        if not ours.poll(900):
            raise RuntimeError("the federation did not start")
        address = ours.recv()
        times: list[float] = []
        hosts = newcomer_hosts()
        while not ours.poll() and len(times) < samples:
            try:
                host = next(hosts)
                times += timed(lambda: honest_join(address, host), count=1)  # noqa: B023
            except NetprotoError:
                if not ours.poll(5):  # not the federation ending under our feet
                    raise
        if not ours.poll(900):
            raise RuntimeError("the federation did not finish")
        return times, ours.recv()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


# ------------------------------------------------------------------ split stage (RPC)


def rpc_driver(port: int, out: str, samples: int, go: str) -> None:
    """Subprocess: the driver of a world of stage1 (honest, with the secret) and stage2 (a rogue
    without it). Authenticates stage1 only, then times its own calls to stage1 before and while
    the rogue attacks."""
    import torch.distributed.rpc as rpc

    from lab.config import Endpoint
    from split_engine import handshake, memory_probes, rpc_guard, workers
    from split_engine.config import SplitConfig

    world = workers.World(
        0, Endpoint("127.0.0.1", port), SplitConfig(num_stages=2, rpc_timeout_s=20)
    )
    times: dict[str, list[float]] = {"without": [], "under": []}
    with workers.joined(world, secret=SECRET.encode()):
        handshake.authenticate_stage(
            "stage1", SECRET.encode(), handshake._auth.world_nonce, timeout_s=20
        )
        rpc_guard.start_signing()
        for phase in ("without", "under"):
            if phase == "under":
                Path(go).write_text("go")
                time.sleep(1.0)
            for _ in range(samples):
                started = time.perf_counter()
                rpc.rpc_sync("stage1", memory_probes.free_memory_bytes, timeout=20)
                times[phase].append(time.perf_counter() - started)
                time.sleep(0.01)
        while not Path(go + ".done").exists():
            time.sleep(0.2)
        workers.release_all(2)
    Path(out).write_text(json.dumps(times))


def rpc_rogue(port: int, out: str, seconds: float, go: str) -> None:
    """Subprocess: stage2 without the secret; once the driver says go, floods stage1 with
    unsigned calls and builtin operator calls for `seconds`."""
    import torch.distributed.rpc as rpc

    from lab.config import Endpoint
    from split_engine import handshake, memory_probes, stage, workers
    from split_engine.config import SplitConfig

    world = workers.World(
        2, Endpoint("127.0.0.1", port), SplitConfig(num_stages=2, rpc_timeout_s=20)
    )
    outcomes: Outcomes = {}
    python_calls = {
        "release the stage": (workers.release_stage, ()),
        "read its free memory": (memory_probes.free_memory_bytes, ()),
        "describe a model": (stage.describe_model, ({},)),
        "restart the handshake": (handshake.stage_prove, (b"n" * 32,)),
        "send a proof": (handshake.stage_accept_driver, (b"p" * 32, b"w" * 32)),
    }
    from tests.split_engine.rogue_stage import admit_to_store

    # The store (the lab's, behind the secret) refuses a rank without it: counted here, then
    # the rank is let in with the store's secret alone, so the RPC guard behind is attacked too.
    store_door = outcomes.setdefault(
        "split stage: a rank without the secret at the store", Outcome()
    )
    try:
        from netproto import Connection
        from world.store import NetprotoStoreClient

        conn = Connection.connect("127.0.0.1", port, connect_timeout_s=5)
        NetprotoStoreClient(conn, timeout=timedelta(seconds=5)).set("rpc_prefix_0/x", b"x")
        store_door.add("served")
    except Exception:
        store_door.add("refused")
    admit_to_store(SECRET.encode())
    with workers.joined(world, secret=None):
        while not Path(go).exists():
            time.sleep(0.05)
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            for name, (func, args) in python_calls.items():
                outcome = outcomes.setdefault(f"split stage: unsigned call: {name}", Outcome())
                try:
                    rpc.rpc_sync("stage1", func, args=args, timeout=20)
                    outcome.add("served")
                except Exception as exc:
                    outcome.add("refused" if "refused" in str(exc) else "crash")
            outcome = outcomes.setdefault(
                "split stage: TorchScript builtin op (C++ path, see README)", Outcome()
            )
            try:
                rpc.rpc_sync("stage1", torch.add, args=(torch.ones(2), 1), timeout=20)
                outcome.add("served")
            except Exception:
                outcome.add("refused")
            time.sleep(0.01)
        Path(out).write_text(json.dumps({k: vars(v) for k, v in outcomes.items()}))
        Path(go + ".done").write_text("done")
        with contextlib.suppress(workers.StageLostError):  # the driver refuses our pings
            workers.serve_until_released(ping_s=1.0, timeout_s=20)


def run_rpc(seconds: float, samples: int) -> tuple[dict[str, list[float]], Outcomes, bool]:
    from lab.launch import free_port

    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="abuse-rpc-"))
    go, times_file, rogue_file = folder / "go", folder / "times.json", folder / "rogue.json"
    me = [sys.executable, __file__]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    stage = subprocess.Popen(
        [
            sys.executable, "-m", "split_inference", "role=stage", "split.rank=1",
            "split.num_stages=2", f"cluster.master.port={port}", "split.rpc_timeout_s=20",
            "num_threads=1", "tracking.wandb=false", f"paths.run_dir={folder / 'stage1'}",
            f"hydra.run.dir={folder / 'stage1'}",
        ],
        env={**env, "LAB_SECRET": SECRET},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    rogue = subprocess.Popen(
        [*me, "--rpc-role", "rogue", str(port), str(rogue_file), str(seconds), str(go)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    PLACEMENT.server(stage.pid)
    PLACEMENT.attacker(rogue.pid)
    driver = subprocess.run(
        [*me, "--rpc-role", "driver", str(port), str(times_file), str(samples), str(go)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    stage_alive = stage.poll() is None or stage.returncode == 0
    for proc in (rogue, stage):
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if driver.returncode != 0:
        raise RuntimeError(f"the RPC driver failed: {driver.stderr[-2000:]}")
    outcomes = {k: Outcome(**v) for k, v in json.loads(rogue_file.read_text()).items()}
    return json.loads(times_file.read_text()), outcomes, stage_alive


# ------------------------------------------------------------------ the run


def split_cores() -> tuple[set[int], set[int]] | None:
    """(the servers' cores, the other cores), where this OS can pin processes."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


@dataclass
class Placement:
    """Where processes run. Servers have cores of their own, as on their own host. Attackers
    and the honest client share the others, the attackers at the lowest priority: on another
    host, an attacker's own CPU would not slow the honest client, so here it only takes what
    the honest client leaves idle. What a server spends on an attacker's behalf does count."""

    servers: set[int] | None = None
    others: set[int] | None = None

    def server(self, pid: int | None) -> None:
        _pin(pid, self.servers, nice=0)

    def attacker(self, pid: int | None) -> None:
        _pin(pid, self.others, nice=19)


def _pin(pid: int | None, cores: set[int] | None, *, nice: int) -> None:
    if pid is None or not cores or not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):  # the process may be gone already
        for task in Path(f"/proc/{pid}/task").iterdir():  # every thread it has so far
            os.sched_setaffinity(int(task.name), cores)
            if nice:
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


PLACEMENT = Placement()


def timed(honest: Callable[[], None], *, count: int, gap_s: float = 0.02) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        honest()
        times.append(time.perf_counter() - started)
        time.sleep(gap_s)
    return times


def _attacker_child(conn: Any, name: str, args: tuple) -> None:
    import logging

    logging.basicConfig(level=logging.CRITICAL)
    conn.send({k: vars(v) for k, v in globals()[name](*args).items()})


def under_attack(
    honest: Callable[[], None], attack: str, args: tuple, *, samples: int
) -> tuple[list[float], Outcomes]:
    """Time `honest` while `attack(*args)` runs in a process of its own."""
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    proc = context.Process(target=_attacker_child, args=(theirs, attack, args))
    proc.start()
    PLACEMENT.attacker(proc.pid)
    time.sleep(1.0)  # let the attack build up
    times: list[float] = []
    failures = 0
    while proc.is_alive() and not ours.poll():
        try:
            times += timed(honest, count=1)
        except Exception as exc:  # an honest client turned away: the figure to report
            failures += 1
            print(f"honest client failed under attack: {exc}", flush=True)
        if len(times) >= samples:
            time.sleep(0.05)
    outcomes = {k: Outcome(**v) for k, v in ours.recv().items()}
    proc.join(timeout=30)
    if failures:
        outcomes["honest client turned away"] = Outcome(failures, 0, failures)
    return times, outcomes


def split_across_hosts() -> Outcomes:
    """The split-stage attacks from a host outside the overlay (labtools.hosts.probe_exposure: a
    split_training run on three network namespaces, a fourth on the same LAN without the
    secret dialling every port the run listens on), and from another local user on each host of
    the run (`Exposure.local`: uid nobody dials the run's overlay listeners there, beside
    controls). Needs root and WireGuard; else skipped, saying why."""
    from labtools.hosts import probe_exposure
    from labtools.hosts import unavailable as no_namespaces
    from world.overlay import unavailable as no_overlay

    why = no_namespaces() or no_overlay()
    if why is not None:
        print(f"split stage across hosts skipped: {why}")
        print(f"local other user -> split stage (overlay host) skipped: {why}")
        return {}
    exposure = probe_exposure(
        Path(tempfile.mkdtemp(prefix="abuse-overlay-")), module="split_training", log=sys.stderr
    )
    print(f"split stage across hosts: {len(exposure.listeners)} listeners, all on the overlay: "
          f"{all(i.address.startswith('10.213.128.') for i in exposure.listeners)}; "
          f"run: {exposure.detail}", flush=True)  # fmt: skip
    outcomes = {}
    crashes = 0 if exposure.run_ok else 1
    for attack, tries in exposure.attempts.items():
        reached = exposure.reached[attack]
        outcomes[f"split, outside the overlay: {attack}"] = Outcome(
            attempts=len(tries), refused=len(tries) - reached, crashes=crashes, served=reached
        )
    dials = [d for local in exposure.local.values() for d in local.get("other user", [])]
    served = sum(d == "connected" for d in dials)
    controls = bool(exposure.local) and all(
        local["other user, unfenced LAN control"] == "connected"
        and local["run's user, overlay control"] == "connected"
        and local["other user, overlay control"].startswith("no connection")
        for local in exposure.local.values()
    )
    print(f"local other user -> split stage (overlay host): {len(dials)} dials of the run's "
          f"overlay listeners on {len(exposure.local)} hosts; controls (a LAN listener takes "
          f"that user, an overlay one the run's user): {'as expected' if controls else 'FAILED'}",
          flush=True)  # fmt: skip
    outcomes["local other user → split stage (overlay host)"] = Outcome(
        attempts=len(dials), refused=len(dials) - served, crashes=crashes, served=served
    )
    if not controls:  # the script, not the fence, may have stopped that user: no result
        outcomes["local other user → split stage (overlay host): controls"] = Outcome(1, 0, 1)
    return outcomes


def local_split_loopback() -> Outcomes:
    """Another local user (uid nobody) against a fenced local split_training run (debug model):
    rogue_rpc's six attacks on each stage's TensorPipe listener (labtools.attacks.local_user,
    the fence tests' own); the run must then train to its end. Needs root, nft and setpriv."""
    from labtools.attacks.local_user import attack_local_split_run, other_user_unavailable
    from world import fence

    why = fence.nftables_unavailable() or other_user_unavailable()
    if why is not None:
        print(f"local other user -> split stage (loopback) skipped: {why}")
        return {}
    folder = Path(tempfile.mkdtemp(prefix="abuse-fence-"))
    got = attack_local_split_run(folder)
    ok = got.returncode == 0 and len(got.losses) == 12 and all(got.stages_alive.values())
    print(f"local other user -> split stage (loopback): {got.fence.partition('fence: ')[2]}; "
          f"honest run: exit {got.returncode}, {len(got.losses)} of 12 steps, stages alive "
          f"after the attacks: {got.stages_alive}", flush=True)  # fmt: skip
    outcomes: Outcomes = {}
    for results in got.outcomes.values():
        for attack, result in results.items():
            outcome = outcomes.setdefault(
                f"local other user → split stage (loopback): {attack}", Outcome()
            )
            if result["connected"] or result["succeeded"]:
                outcome.add(
                    "crash" if attack.startswith("kill") and result["succeeded"] else "served"
                )
            else:
                outcome.add("refused")
    if not ok or got.files_written:
        outcomes["local other user → split stage (loopback): the run trained on"] = Outcome(1, 0, 1)
    return outcomes


def _served(results: list[str] | dict[str, str]) -> Outcome:
    tries = list(results.values()) if isinstance(results, dict) else results
    served = sum(not t.startswith(("refused", "no connection")) for t in tries)
    return Outcome(attempts=len(tries), refused=len(tries) - served, served=served)


def data_parallel_loopback() -> Outcomes:
    """A local data_parallel run (labtools.attacks.rendezvous: 40 steps, 2 workers) attacked
    with torch's own TCPStore client: its rendezvous state and job token read, a join as a
    host, the state overwritten; then junk to each worker's gloo port. Once by another local
    user (uid nobody: the fence; needs root, nft and setpriv), once by this user (past the
    fence: the store's secret). The honest job must finish with the unattacked run's loss."""
    from labtools.attacks.local_user import other_user_unavailable, split_run
    from labtools.attacks.rendezvous import TRAIN, attack_local_data_parallel_run, final_loss
    from world import fence

    with split_run(Path(tempfile.mkdtemp(prefix="abuse-dp-")), *TRAIN,
                   module="data_parallel") as run:  # fmt: skip
        code = run.proc.wait(timeout=900)
    reference = final_loss(run.run_dir) if code == 0 else None
    print(f"data_parallel (loopback), unattacked: exit {code}, final loss {reference}", flush=True)
    arms = [("this user, past the fence", False)]
    why = fence.nftables_unavailable() or other_user_unavailable()
    if why is None:
        arms.insert(0, ("other user", True))
    else:
        print(f"data_parallel (loopback), other user: skipped: {why}")
    outcomes: Outcomes = {}
    for label, other_user in arms:
        got = attack_local_data_parallel_run(Path(tempfile.mkdtemp(prefix="abuse-dp-")),
                                             other_user=other_user)  # fmt: skip
        same = reference is not None and got.final_loss == reference
        print(f"data_parallel (loopback), {label}: {got.fence.partition('fence: ')[2][:90]}; "
              f"store {got.listeners.store}, gloo {got.listeners.gloo}; honest job: exit "
              f"{got.returncode}, final loss {got.final_loss} (unattacked {reference})",
              flush=True)  # fmt: skip
        prefix = f"data_parallel (loopback), {label}"
        for attack, result in got.store.items():
            outcomes[f"{prefix}: store {attack}"] = _served([result])
        outcomes[f"{prefix}: TCPStore client at gloo ports"] = _served(got.tcpstore)
        if other_user:  # this user reaches gloo's ports by design: the fence is for others
            outcomes[f"{prefix}: junk to gloo ports"] = _served(got.gloo)
        if got.returncode != 0 or not same:
            outcomes[f"{prefix}: the honest job's final loss"] = Outcome(1, 0, 1)
    return outcomes


def data_parallel_across_hosts() -> Outcomes:
    """A data_parallel run across three hosts inside the lab's overlay, and a stranger on the
    same LAN dialling every port it listens on, its LAN and overlay addresses
    (labtools.hosts.probe_exposure, the split rows' harness); another local user on each host
    beside. Needs root and WireGuard; else skipped, saying why."""
    from labtools.hosts import probe_exposure
    from labtools.hosts import unavailable as no_namespaces
    from labtools.hosts.exposure import ATTACKS
    from world.overlay import unavailable as no_overlay

    why = no_namespaces() or no_overlay()
    if why is not None:
        print(f"data_parallel across hosts skipped: {why}")
        return {}
    exposure = probe_exposure(Path(tempfile.mkdtemp(prefix="abuse-dp-overlay-")),
                              module="data_parallel", log=sys.stderr)  # fmt: skip
    print(f"data_parallel across hosts: {len(exposure.listeners)} listeners, all on the "
          f"overlay: {all(i.address.startswith('10.213.128.') for i in exposure.listeners)}; "
          f"run: {exposure.detail}", flush=True)  # fmt: skip
    crashes = 0 if exposure.run_ok else 1
    outcomes: Outcomes = {}
    for surface, label in (("store", "rendezvous store"), ("gloo", "gloo ports")):
        tries = [t for name, ts in exposure.attempts.items()
                 if (ATTACKS[name] == "store") == (surface == "store") for t in ts]  # fmt: skip
        row = _served(tries)
        row.crashes = crashes
        outcomes[f"data_parallel, outside the overlay: {label}"] = row
    dials = [d for local in exposure.local.values() for d in local.get("other user", [])]
    outcomes["data_parallel, other user on a host (overlay)"] = _served(dials)
    return outcomes


def secagg_insider(cache_dir: str) -> Outcomes:
    """One client with the secret in a secure federation beside two honest ones, each attack in
    a federation of its own (labtools.attacks.secure_rounds, the tests' scripted attacks):
    refused means the offset's round refused whole, the replayer and the heavy weight named and
    excluded; the adapter must stay finite and within fed.max_update_norm of where it was."""
    from labtools.attacks.secure_rounds import secagg_attacks

    outcomes: Outcomes = {}
    for name, got in secagg_attacks(Path(cache_dir)).items():
        within = got.finite and got.moved <= got.bound
        print(f"secagg: {name}: {got.how}; adapter moved by L2 {got.moved:.4g} (bound "
              f"{got.bound:g}), finite: {got.finite}", flush=True)  # fmt: skip
        outcomes[f"secagg offset / replay / weight: {name}"] = Outcome(
            attempts=1, refused=int(got.refused), crashes=int(not within),
            served=int(not got.refused),
        )  # fmt: skip
    return outcomes


def rotating_join_loop(cache_dir: str) -> Outcomes:
    """Two secret holders JOINing and leaving from rotating 127.0.x.y addresses beside two
    honest clients that train (labtools.attacks.join_loop, the test's own): every counted
    round must aggregate the honest two (a round that did not is a crash)."""
    from labtools.attacks.join_loop import rotating_join_run

    got = rotating_join_run(Path(cache_dir))
    honest = sum(roster == ["honest0", "honest1"] for roster in got.rosters)
    missing = got.rounds - honest
    print(f"JOIN loop, rotating addresses: {honest} of {got.rounds} rounds aggregated the honest "
          f"two (clients per round {got.clients}); {got.welcomed} JOINs let in, {got.refused} "
          f"refused by the 127/8 budget of {got.budget}, {got.tasks_left} left holding a task"
          + (f"; errors: {got.errors[:3]}" if got.errors else ""), flush=True)  # fmt: skip
    return {
        "JOIN loop, rotating addresses: 2 secret holders, 2 honest": Outcome(
            attempts=got.welcomed + got.refused,
            refused=got.refused,
            crashes=missing + len(got.errors) + got.hung_threads,
            served=got.welcomed,
        )
    }


QUIET_LOAD = 0.3
"""The 1-minute load average under which a machine counts as quiet (issue 48, item 5)."""


def verdict(ratio: float, load: float) -> str:
    """`pass` at or under 2; over it, `busy` where the machine was not quiet at start."""
    if ratio <= 2:
        return "pass"
    return "busy" if load >= QUIET_LOAD else "fail"


def print_rows(rows: Outcomes) -> None:
    print(f"\n{'attack class':<66} {'attempts':>8} {'refused':>8} {'crashes':>8} {'served':>7}")
    for name, outcome in rows.items():
        print(f"{name:<66} {outcome.attempts:>8} {outcome.refused:>8} {outcome.crashes:>8} "
              f"{outcome.served:>7}")  # fmt: skip


def main_data_parallel() -> None:
    """`--only data_parallel`: its rows alone (no honest-latency surfaces), in their own file."""
    machine = announce_machine()
    rows = {**data_parallel_loopback(), **data_parallel_across_hosts()}
    print_rows(rows)
    served = sum(o.served for o in rows.values())
    crashes = sum(o.crashes for o in rows.values())
    write_results(RESULTS.with_name("abuse_bench_data_parallel.json"),
                  {"attacks": {k: vars(v) for k, v in rows.items()}, "served": served,
                   "crashes": crashes}, machine=machine)  # fmt: skip
    print(f"\ndata_parallel attacks served: {served}, crashes: {crashes} (both must be 0)")


def main(quick: bool) -> None:
    from lab.config import ModelConfig, default_cache_dir
    from lab.models import load_model

    os.environ.setdefault("TQDM_DISABLE", "1")  # the children's model-loading bars (HF)
    load = os.getloadavg()[0]
    machine = announce_machine()
    print(f"1-minute load average at start: {load:.2f} (quiet under {QUIET_LOAD})", flush=True)
    cores = split_cores()
    if cores is None:
        print("cannot pin processes to cores here: attackers share the servers' cores")
    else:
        PLACEMENT.servers, PLACEMENT.others = cores
        os.sched_setaffinity(0, cores[1])
        print(f"servers on cores {sorted(cores[0])}; the honest client and, at the lowest "
              f"priority, the attackers on {sorted(cores[1])}")  # fmt: skip
    seconds, scale, samples, rounds = (6.0, 300, 30, 20) if quick else (12.0, 1000, 60, 40)
    cache_dir = str(default_cache_dir())
    load_model(
        ModelConfig(pretrained="lab:tiny_target", lab_preset="debug"), cache_dir=Path(cache_dir)
    )
    rows: Outcomes = {}
    latency: dict[str, dict[str, float]] = {}

    def record(surface: str, without: list[float], under: list[float], outcomes: Outcomes) -> None:
        latency[surface] = {
            "without_p50_ms": 1e3 * p50(without),
            "under_p50_ms": 1e3 * p50(under),
            "under_max_ms": 1e3 * max(under, default=math.nan),
            "samples_under": len(under),
        }
        rows.update(outcomes)
        row = latency[surface]
        print(f"{surface}: honest p50 {row['without_p50_ms']:.1f} ms without, "
              f"{row['under_p50_ms']:.1f} ms under attack (max {row['under_max_ms']:.1f} ms "
              f"of {row['samples_under']})", flush=True)  # fmt: skip

    def server_surface(
        surface: str,
        handler: str,
        honest: Callable[[Any], Any],
        attack: str,
        args: tuple[Any, ...],
        **server: Any,
    ) -> None:
        """A server in its own process: the honest client timed without, then under, `attack`."""
        with server_process(handler, **server) as (address, counters):
            probe = lambda: honest(address)  # noqa: E731
            without = timed(probe, count=samples)
            under, outcomes = under_attack(probe, attack, (address, *args), samples=samples)
        if not counters.get("alive"):
            outcomes[f"{surface}: server survived"] = Outcome(1, 0, 1)
        record(surface, without, under, outcomes)

    server_surface("netproto", "echo_handler", honest_echo, "attack_netproto", (seconds, scale))
    certificate = self_signed_certificate(Path(tempfile.mkdtemp(prefix="abuse-tls-")))
    if certificate is None:
        print("no openssl command: the TLS surface is skipped")
    else:
        ca = certificate[0]
        server_surface("netproto+TLS", "echo_handler", lambda address: honest_echo(address, ca),
                       "attack_netproto", (seconds, scale, True), tls=certificate)  # fmt: skip
    tokenizer_hash = _vocab_hash(cache_dir)
    server_surface("verifier", "verifier_handler",
                   lambda address: honest_verifier(address, tokenizer_hash),
                   "attack_verifier", (seconds, tokenizer_hash), cache_dir=cache_dir)  # fmt: skip

    without, _ = run_federation(False, rounds, cache_dir, samples=samples)
    under, attacked = run_federation(True, rounds, cache_dir, samples=samples)
    refused = attacked["refused"] + attacked["dropped"]
    broken = attacked["crashed"] or not attacked["finite"] or attacked["rounds"] < rounds
    fed_outcome = Outcome(
        attempts=attacked["sent"],
        refused=refused,
        crashes=int(broken),
        served=attacked["sent"] - refused,
    )
    joins = Outcome(**attacked["joins"]) if attacked["joins"] else Outcome()
    joins.crashes += int(broken)
    print(f"coordinator: client table peaked at {attacked['table_peak']} "
          f"(5 clients, 2 JOIN-and-leave loops)", flush=True)  # fmt: skip
    record(
        "coordinator",
        without,
        under,
        {
            "coordinator: 2 of 5 clients malformed / poisoned / flooding": fed_outcome,
            "coordinator: 2 secret holders JOINing and leaving in a loop": joins,
        },
    )

    times, outcomes, stage_alive = run_rpc(seconds, samples)
    if not stage_alive:
        outcomes["split stage: survived"] = Outcome(1, 0, 1)
    record("split stage", times["without"], times["under"], outcomes)
    rows.update(split_across_hosts())
    rows.update(local_split_loopback())
    rows.update(secagg_insider(cache_dir))
    rows.update(rotating_join_loop(cache_dir))
    rows.update(data_parallel_loopback())
    rows.update(data_parallel_across_hosts())

    print_rows(rows)
    print(f"\n{'surface':<14} {'classes':>7} {'attempts':>8} {'refused':>8} {'crashes':>7} "
          f"{'served':>6} {'honest p50 without/under (ms)':>30} {'worst (ms)':>10}")  # fmt: skip
    for surface, row in latency.items():
        mine = [o for name, o in rows.items() if name.split(":")[0] == surface]
        print(f"{surface:<14} {len(mine):>7} {sum(o.attempts for o in mine):>8} "
              f"{sum(o.refused for o in mine):>8} {sum(o.crashes for o in mine):>7} "
              f"{sum(o.served for o in mine):>6} "
              f"{row['without_p50_ms']:>14.1f} / {row['under_p50_ms']:<13.1f} "
              f"{row['under_max_ms']:>10.1f}")  # fmt: skip
    worst = max(latency.items(), key=lambda kv: kv[1]["under_p50_ms"] / kv[1]["without_p50_ms"])
    ratio = worst[1]["under_p50_ms"] / worst[1]["without_p50_ms"]
    write_results(
        RESULTS,
        {
            "quick": quick,
            "attacks": {k: vars(v) for k, v in rows.items()},
            "honest_latency": latency,
            "worst_surface": worst[0],
            "ratio": ratio,
            "load_1min_at_start": load,
            "verdict": verdict(ratio, load),
            "crashes": sum(o.crashes for o in rows.values()),
        },
        machine=machine,
    )
    print(
        f"\ncrashes: {sum(o.crashes for o in rows.values())} (must be 0); worst surface: {worst[0]}"
    )
    print(f"honest-client p50 latency under attack / without: {ratio:.2f} "
          f"(load {load:.2f} at start: {verdict(ratio, load)})")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer attempts, shorter attacks")
    parser.add_argument("--rpc-role", nargs=5, metavar=("ROLE", "PORT", "OUT", "N", "GO"))
    parser.add_argument("--only", choices=["data_parallel"], help="one experiment's rows alone")
    args = parser.parse_args()
    if args.rpc_role:
        role, port, out, number, go = args.rpc_role
        if role == "driver":
            rpc_driver(int(port), out, int(number), go)
        else:
            rpc_rogue(int(port), out, float(number), go)
    elif args.only == "data_parallel":
        main_data_parallel()
    else:
        main(args.quick)
