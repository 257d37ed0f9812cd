"""world.group.process_group: the one call that brings up a world of N ranks (what
tensor_parallel and any later parallelism call). Real gloo groups on loopback, their store the
lab's with the secret."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from lab.config import ClusterConfig, Endpoint
from lab.launch import free_port
from tests.clocks import HANG_GUARD_S

SECRET = "group-secret-0123456789"


def _rank(rank: int, port: int, secret: str, out: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    from world.group import process_group

    cluster = ClusterConfig(master=Endpoint("127.0.0.1", port), secret=secret)
    try:
        with process_group(
            cluster, rank=rank, world_size=2, name="tp", timeout_s=timeout_s
        ) as group:
            total = torch.tensor([float(rank + 1)])
            dist.all_reduce(total)
            Path(out).write_text(f"{group.rank} {group.world_size} {total.item()}")
    except Exception as exc:  # the test reads what each rank said
        Path(out).write_text(f"error: {exc}")


def _start(tmp_path: Path, secrets: tuple[str, str], timeout_s: float) -> list[str]:
    """Two spawned ranks, each waiting `timeout_s` for the other (each imports torch first:
    on a busy machine one may come many seconds after the other)."""
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"rank{rank}") for rank in range(2)]
    procs = [ctx.Process(target=_rank, args=(rank, port, secrets[rank], outs[rank], timeout_s))
             for rank in range(2)]  # fmt: skip
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(HANG_GUARD_S + timeout_s)
        assert proc.exitcode == 0
    return [Path(out).read_text() for out in outs]


def test_two_ranks_meet_on_the_lab_store_and_all_reduce(tmp_path: Path) -> None:
    assert _start(tmp_path, (SECRET, SECRET), HANG_GUARD_S) == ["0 2 3.0", "1 2 3.0"]


def test_a_rank_with_another_secret_is_refused_in_one_line(tmp_path: Path) -> None:
    # rank 0 waits out its 20 s whatever the machine: rank 1 is refused, never joins
    rank0, rank1 = _start(tmp_path, (SECRET, "another secret 0123456"), 20)
    assert rank1.startswith("error: the tp world's store at 127.0.0.1:") and "\n" not in rank1
    assert "secret" in rank1
    assert rank0.startswith("error:")  # rank 0 waited for a rank that never came, and said so


def test_a_world_on_a_plain_network_is_refused_naming_the_setting() -> None:
    from world.group import process_group

    cluster = ClusterConfig(master=Endpoint("192.0.2.1", 29500))  # TEST-NET-1: never dialled
    with (
        pytest.raises(ValueError, match=r"a tp run listens only on loopback .*unsafe_plain"),
        process_group(cluster, rank=0, world_size=2, name="tp", timeout_s=5),
    ):
        pass
