"""The commands users run, end to end, and what happens when a stage dies or lies."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from lab.cli import ConfigError
from lab.plots import legend_check
from lab.tracking import METRICS_FILE, OUTPUTS_FILE, read_records
from split_engine.workers import StageLostError
from split_training.run import run as run_training
from tests.clocks import HANG_GUARD_S

from .conftest import rpc_world

ALARMING = (
    "Detected RRef Leaks",
    "Leaking RRef",
    "rref_context.cpp",
    "tensorpipe_agent.cpp",
    "encountered error",
    "pipe closed",
    "EOF",
    "won't send response",
    "could not leave the RPC world",
    "Traceback",
    "as a ProcessGroup",
)
"""What a user reads as an error: TensorPipe's and the RRef bookkeeping's shutdown reports, a
traceback, torch's Gloo deprecation warning from inside init_rpc."""


def module_command(module: str, model: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`python -m module` on `model`, into `run_dir`, W&B off."""
    return [
        sys.executable,
        "-m",
        module,
        f"model.pretrained={model}",
        "tracking.wandb=false",
        f"hydra.run.dir={run_dir}",
        f"paths.run_dir={run_dir}",
        *overrides,
    ]


TRAINING_BATCHES = [
    "split.batch_size=4",
    "split.microbatches=2",
    "split.block_size=16",
    "split.max_train_blocks=64",
]
TINY_RUNS = {
    "split_inference": [
        "generate.num_prompts=2",
        "generate.max_new_tokens=6",
        "generate.prompt_tokens=16",
    ],
    "split_training": ["split.steps=2", "split.eval_every=1", *TRAINING_BATCHES],
}
"""Two prompts, or two steps evaluated after each: what every test of a module's command reads
(its end to end checks, its resume, and that it prints nothing alarming)."""


@dataclass
class CommandRun:
    returncode: int
    output: str
    """stdout and stderr as the user's terminal shows them."""
    run_dir: Path

    def metrics(self) -> dict:
        """The run's final metrics, as `run` returned them (its summary record)."""
        assert self.returncode == 0, self.output[-3000:]
        records = read_records(self.run_dir / METRICS_FILE)
        return [r for r in records if r.get("kind") == "summary"][-1]


@pytest.fixture(scope="module")
def command_run(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory):
    """`command_run(module)`: `python -m <module>` with TINY_RUNS on the random Llama, run once
    for every test here that reads it (a run is three processes: the driver, two stages)."""
    done: dict[str, CommandRun] = {}

    def run(module: str) -> CommandRun:
        if module not in done:
            run_dir = tmp_path_factory.mktemp(module)
            result = subprocess.run(
                module_command(module, llama_folder, run_dir, *TINY_RUNS[module]),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                timeout=HANG_GUARD_S,  # 300 s was passed at load 12-20: a hang guard only
            )
            done[module] = CommandRun(result.returncode, result.stdout, run_dir)
        return done[module]

    return run


def test_local_split_inference_end_to_end(command_run) -> None:
    done = command_run("split_inference")
    metrics, run_dir = done.metrics(), done.run_dir
    assert metrics["greedy_match"] == 1.0
    rows = [json.loads(line) for line in (run_dir / OUTPUTS_FILE).read_text().splitlines()]
    assert [row["prompt"] for row in rows] == [0, 1]
    assert all(0 < len(row["tokens"]) <= 6 and row["text"] for row in rows)
    for key in (
        "prefill_ms",
        "token_ms_p50",
        "token_ms_p95",
        "tokens_per_s",
        "unsplit_token_ms_p50",
    ):
        assert metrics[key] > 0
    assert metrics["stage1_peak_rss_mib"] > 0 and metrics["stage2_peak_rss_mib"] > 0
    # where a token's time goes: each stage's own forward is a part of it, timed in the stage
    for rank in (1, 2):
        assert 0 < metrics[f"stage{rank}_compute_ms_p50"] < metrics["token_ms_p50"]
    # hidden states of one new token per row, in and out of the driver, float32
    assert metrics["bytes_between_stages_per_token"] > 0
    assert legend_check(run_dir / "split_latency.png") == "none"  # the legend clear of the bars


def test_local_split_training_checkpoints_and_resumes(
    command_run, compose_config, llama_folder: Path, tmp_path: Path
) -> None:
    """`python -m split_training` (two steps), then resumed here to three and exported."""
    done = command_run("split_training")
    first, first_dir = done.metrics(), done.run_dir
    assert first["steps"] == 2
    # validation after each step: forward only, a finite loss per step, and the run's last
    records = read_records(first_dir / METRICS_FILE)
    evaluated = [r for r in records if r["kind"] == "metrics" and "val_loss" in r]
    assert [r["step"] for r in evaluated] == [1, 2]
    assert first["val_loss"] == evaluated[-1]["val_loss"] and 0 < first["val_loss"] < 20
    assert (first_dir / "loss_curve.png").stat().st_size > 1000
    assert legend_check(first_dir / "loss_curve.png") == "none"  # not over the validation point
    ckpt = tmp_path / "ckpt"  # a copy: the command's own folder stays as it ended
    shutil.copytree(first_dir / "checkpoints", ckpt)
    manifest = json.loads((ckpt / "latest.json").read_text())
    assert manifest["step"] == 2
    common = [
        f"model.pretrained={llama_folder}",
        "tracking.wandb=false",
        *TRAINING_BATCHES,
        f"split.checkpoint_dir={ckpt}",
    ]
    second = run_training(
        compose_config(
            "split_training", [*common, "split.steps=3", "split.resume=true", "split.export=true"]
        )
    )
    assert second["steps"] == 3
    assert json.loads((ckpt / "latest.json").read_text())["step"] == 3
    # resuming a finished run: nothing to train, said before any stage starts (was exit 0 with
    # final_loss nan and tokens_per_s 0)
    with pytest.raises(ConfigError, match=r"nothing left to train.* at step 3 and split\.steps=3"):
        run_training(
            compose_config("split_training", [*common, "split.steps=3", "split.resume=true"])
        )
    assert 0.0 <= second["idle_share"] <= 1.0
    # split.export=true: the whole trained model as one folder that transformers loads
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    saved = load_file(str(ckpt / "step-000003" / "stage1.safetensors"))
    torch.testing.assert_close(
        exported.model.embed_tokens.weight, saved["model.embed_tokens.weight"], rtol=0, atol=0
    )


@pytest.mark.parametrize("module", sorted(TINY_RUNS))
def test_a_successful_run_prints_nothing_that_reads_as_an_error(module: str, command_run) -> None:
    """Every process drops its RRefs and the agents agree that the world ends before any pipe
    closes: no leak report, no TensorPipe error line, no warning from torch's RPC start-up."""
    result = command_run(module)
    output = result.output
    assert result.returncode == 0, output[-3000:]
    assert "final metrics" in output
    for stage in ("stage1", "stage2"):  # both stages did take part, and say so
        assert f"{stage} joined the run" in output
    alarming = [line for line in output.splitlines() if any(p in line for p in ALARMING)]
    assert not alarming, "\n".join(alarming[:20])
    from labtools.readme_check import NOISE  # and what every module's successful run must not print

    assert not NOISE.search(output), [m.group(0) for m in NOISE.finditer(output)]


def test_a_killed_stage_ends_the_run_with_a_clear_error(llama_folder: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        module_command(
            "split_inference",
            llama_folder,
            tmp_path,
            "generate.baseline=false",
            "generate.num_prompts=16",
            "generate.max_new_tokens=200",
            "split.rpc_timeout_s=10",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    output = []
    for line in proc.stdout:
        output.append(line)
        if "stage layers [2, 4)" in line:
            break
    else:
        pytest.fail("the run never built its stages:\n" + "".join(output[-30:]))
    time.sleep(2.0)  # let it generate for a while
    stages = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "role=stage" in " ".join(p.cmdline())
    ]
    victim = next(p for p in stages if "split.rank=2" in p.cmdline())
    victim.send_signal(signal.SIGKILL)
    rest, _ = proc.communicate(timeout=HANG_GUARD_S)  # an end, found or at split.rpc_timeout_s
    text = "".join(output) + rest
    assert proc.returncode != 0
    assert "stage2" in text and (
        "failed or stopped answering" in text or "exited" in text or "killed" in text
    )
    for stage in stages:
        assert not stage.is_running() or stage.status() == psutil.STATUS_ZOMBIE


def test_a_stage_with_another_secret_is_refused(llama_folder: Path, tmp_path: Path) -> None:
    """Refused at the rendezvous already: the store is the lab's, behind the secret's handshake.
    The driver stops (it does not wait out split.join_timeout_s) and quotes the stage's line."""
    with (
        pytest.raises(
            StageLostError,
            match=r"(?s)stage\d.*rendezvous store .* refused this "
            r"process: the server's shared secret differs",
        ),
        rpc_world(llama_folder, tmp_path, stage_env={"LAB_SECRET": "theirs"}, driver_secret="ours"),
    ):
        pass


def test_stages_refuse_a_driver_without_the_secret(llama_folder: Path, tmp_path: Path) -> None:
    stage_secret = {"LAB_SECRET": "theirs"}
    with (
        pytest.raises(StageLostError, match=r"(?s)rendezvous store .* refused this process"),
        rpc_world(llama_folder, tmp_path, stage_env=stage_secret),
    ):
        pass


def test_matching_secrets_let_the_run_go_on(llama_folder: Path, tmp_path: Path) -> None:
    from split_engine.sharded import ShardedModel

    with rpc_world(
        llama_folder, tmp_path, stage_env={"LAB_SECRET": "shared"}, driver_secret="shared"
    ) as settings:
        sharded = ShardedModel.build(settings.model, settings.split)
        assert sharded.call_all("held_layers") == [[0, 1], [2, 3]]


@pytest.mark.parametrize("module", ["split_inference", "split_training"])
def test_4bit_asked_of_a_split_run_is_said_not_to_apply(compose_config, module: str) -> None:
    """Stages load their share in full precision: a 4-bit request is not ignored silently."""
    from lab import experiment
    from split_engine.roles import split_experiment

    cfg = compose_config(module, ["model.quantization=4bit", "role=driver"])
    driver_only = split_experiment(module, lambda s: {"ran": 1.0})
    with pytest.warns(RuntimeWarning, match=rf"model.quantization=4bit is not applied by {module}"):
        assert experiment.run(driver_only, cfg) == {"ran": 1.0}


def test_a_rank_without_the_secret_cannot_make_anyone_do_anything(
    llama_folder: Path, tmp_path: Path
) -> None:
    """A stranger in the world (stage2 here, with no secret) calls stage1 after the driver has
    authenticated it, and the driver during its handshake: every Python call is refused
    unserved, then the driver stops the run because stage2 cannot prove the secret."""
    import json
    import sys

    from lab.config import ClusterConfig, Endpoint
    from lab.launch import Role, free_port, services
    from split_engine.roles import driving
    from split_inference.config import ServingSplitConfig, SplitInferenceRunConfig
    from tests.split_engine.conftest import model_config, stage_role

    port, out = free_port(), tmp_path / "rogue.json"
    honest = stage_role("split_inference", llama_folder, 1, port, tmp_path, num_stages=2, extra=[])
    honest.env["LAB_SECRET"] = "shared"
    rogue = Role(
        "stage2",
        [sys.executable, "-m", "tests.split_engine.rogue_stage", str(port), str(out), "shared"],
        service=True,
    )
    settings = SplitInferenceRunConfig(
        model=model_config(llama_folder),
        split=ServingSplitConfig(num_stages=2, rpc_timeout_s=20, join_timeout_s=120),
        cluster=ClusterConfig(master=Endpoint("127.0.0.1", port), secret="shared"),
    )
    with (
        pytest.raises(PermissionError, match="stage2 could not prove the shared secret"),
        services([honest, rogue], out=sys.stderr) as stages,
        driving(settings, settings.split, stages=stages),
    ):
        pass
    outcome = json.loads(out.read_text())
    assert len(outcome) == 6
    assert set(outcome.values()) == {"refused"}, outcome


def test_a_loopback_run_listens_on_loopback_only(llama_folder: Path, tmp_path: Path) -> None:
    """The rendezvous store (torch binds it to every interface) and TensorPipe's listeners
    (torch picks the host name's interface) of a loopback run cannot be reached from outside."""
    import ipaddress

    with rpc_world(llama_folder, tmp_path):
        me = psutil.Process()
        listening = [
            conn.laddr
            for proc in (me, *me.children(recursive=True))
            for conn in proc.net_connections(kind="inet")
            if conn.status == psutil.CONN_LISTEN
        ]
    assert listening
    assert all(ipaddress.ip_address(addr.ip).is_loopback for addr in listening), listening


@pytest.mark.slow
def test_the_split_bench_prints_no_rref_leak_or_tensorpipe_report(tmp_path: Path) -> None:
    """`python bench/split_bench.py --quick`, five split runs one after another: each driver is
    a process of its own (torch's RRef context is spent at a process's first RPC shutdown),
    so no stage reports RRefs leaked and no pipe error is printed. Minutes: slow."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "split_bench.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--quick", "--results", str(tmp_path / "split.json")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=1200,
    )  # fmt: skip
    output = result.stdout
    assert result.returncode == 0, output[-3000:]
    assert "split/unsplit per-token latency:" in output
    alarming = [line for line in output.splitlines() if any(p in line for p in ALARMING)]
    assert not alarming, "\n".join(alarming[:20])
