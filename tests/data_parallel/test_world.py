"""data_parallel inside the world (issue 49): no TCPStore listens anywhere in a run, and a
stranger who reaches a local run's store (this machine's own user, past the fence) reads,
writes and joins nothing; the same script against torch's TCPStore, as the run served before,
does all of it (the control arm)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from labtools.attacks.local_user import split_run
from labtools.attacks.rendezvous import (
    STORE_ATTACKS,
    TRAIN,
    attack_local_data_parallel_run,
    attack_store,
    final_loss,
)


@pytest.fixture(scope="module")
def unattacked_loss(tmp_path_factory: pytest.TempPathFactory, tiny_models: Path) -> float:
    with split_run(tmp_path_factory.mktemp("dp_plain"), *TRAIN, module="data_parallel") as run:
        assert run.proc.wait(timeout=600) == 0, "".join(run.lines[-40:])
    loss = final_loss(run.run_dir)
    assert loss is not None
    return loss


def test_the_attack_script_reads_overwrites_and_joins_torchs_own_store() -> None:
    """The control arm: a TCPStore as data_parallel served it before (any client, no secret)
    with a run's rendezvous keys in it gives the stranger everything."""
    run_id = "data_parallel-1"
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))  # fmt: skip
    server.set("data_parallel/job", "0123456789abcdef")
    server.compare_set(f"torch.rendezvous.{run_id}", "", "Y2FuaW1hZGFt")  # the backend's sentinel
    got = attack_store("127.0.0.1", server.port, run_id)
    assert all(got[name].startswith("served") for name in ("connect", *STORE_ATTACKS)), got
    assert "0123456789abcdef" in got["read the job token"]


def test_no_tcpstore_listens_during_a_run_and_a_stranger_gets_nothing_from_its_store(
    tmp_path: Path, unattacked_loss: float
) -> None:
    """psutil's view of the run's process tree while its workers train: the agent listens once
    (its store), each worker on gloo's ports; none answers torch's TCPStore client (which does
    answer a TCPStore: the test above). The store attacks, from this user (whom the fence lets
    through), are all refused; the run trains to its end with the unattacked run's final loss."""
    got = attack_local_data_parallel_run(tmp_path, other_user=False)
    assert got.returncode == 0
    assert len(got.listeners.agent.inet) == 1 and len(got.listeners.gloo) >= 2
    assert all(got.store[name].startswith("refused") for name in ("connect", *STORE_ATTACKS)), (
        got.store
    )
    assert all(answer.startswith("refused") for answer in got.tcpstore.values()), got.tcpstore
    assert got.final_loss == pytest.approx(unattacked_loss, rel=1e-6)
