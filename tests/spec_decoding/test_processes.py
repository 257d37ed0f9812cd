"""Real processes: the local run end to end, and a verifier killed mid-generation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lab.config import ModelConfig
from lab.experiment import serving
from lab.models import load_model, load_tokenizer
from lab.tracking import OUTPUTS_FILE
from netproto import Connection
from spec_decoding.drafter import Drafter, VerifierLostError
from spec_decoding.gamma import GammaController
from spec_decoding.run import EXPERIMENT, run
from tests.clocks import HANG_GUARD_S


@pytest.mark.parametrize(
    ("pipeline", "alone"),
    [("true", "true"), ("true", "false"), ("false", "true")],
    ids=["pipelined", "pipelined_waiting", "rounds"],
)
def test_local_run_end_to_end(
    compose_config, tiny_models: Path, tmp_path: Path, pipeline: str, alone: str
) -> None:
    cfg = compose_config(
        "spec_decoding",
        [
            f"spec.pipeline={pipeline}",
            f"spec.decode_alone={alone}",
            "target.lab_preset=debug",
            "draft.lab_preset=debug",
            "tracking.wandb=false",
            "spec.num_prompts=2",
            "spec.max_new_tokens=12",
            "spec.prompt_tokens=16",
        ],
    )
    metrics = run(cfg)
    assert metrics["greedy_match"] == 1.0
    assert metrics["new_tokens"] == 24
    # what it generated, a row per prompt, readable: the tokens and their text
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "tiny_draft")
    rows = [json.loads(line) for line in (tmp_path / OUTPUTS_FILE).read_text().splitlines()]
    assert [row["prompt"] for row in rows] == [0, 1]
    assert all(len(row["tokens"]) == 12 for row in rows)
    assert [row["text"] for row in rows] == [tokenizer.decode(row["tokens"]) for row in rows]
    assert 0.0 <= metrics["acceptance_rate"] <= 1.0
    assert ("forward_share" in metrics) == (pipeline == "true")
    if pipeline == "true" and alone == "true":
        # the debug pair's target decodes a token about as fast as its draft drafts one:
        # the verifier may finish alone before the drafter has drafted anything, or never
        # need to (the tests of sessions decode alone for sure)
        assert 0 <= metrics["alone_share"] <= 1 and metrics["drafted_per_token"] >= 0
    else:
        assert metrics["drafted_per_token"] > 0
        assert metrics.get("alone_share", 0.0) == 0.0
    for key in (
        "tokens_per_s",
        "target_tokens_per_s",
        "speedup",
        "predicted_speedup",
        "measured_over_predicted",
    ):
        assert metrics[key] > 0


class KillAfter(GammaController):
    """Kills the verifier process after a few rounds: a crash in the middle of generation."""

    def __init__(self, proc: subprocess.Popen, rounds: int) -> None:
        super().__init__(fixed=2, max_gamma=8)
        self.proc, self.rounds = proc, rounds

    def observe_checks(self, **kwargs) -> None:  # every verdict, in either mode
        super().observe_checks(**kwargs)
        self.rounds -= 1
        if self.rounds == 0:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.mark.parametrize("pipeline", [False, True], ids=["rounds", "pipelined"])
def test_killed_verifier_gives_the_drafter_a_clear_error(
    compose_config, tiny_models: Path, lab_cache: Path, pipeline: bool
) -> None:
    cfg = compose_config("spec_decoding", ["tracking.wandb=false"])
    with serving(EXPERIMENT, cfg) as (local, group):  # the verifier as `role=local` starts it
        proc, port = group.process("verifier"), local.spec.verifier.port
        draft_cfg = ModelConfig(pretrained="lab:tiny_draft", lab_preset="debug")
        model = load_model(draft_cfg, cache_dir=lab_cache)
        tokenizer = load_tokenizer(draft_cfg, cache_dir=lab_cache)
        # the hang guard: no busy-machine lapse may stand in for the closed connection
        conn = Connection.connect("127.0.0.1", port, read_timeout_s=HANG_GUARD_S)
        drafter = Drafter(
            model, tokenizer, conn, gamma=KillAfter(proc, rounds=3), pipeline=pipeline
        )
        with pytest.raises(VerifierLostError, match=f"lost the verifier at 127.0.0.1:{port}") as e:
            drafter.generate([5, 6, 7, 8], max_new_tokens=56)  # 3 rounds of 3: never done
        # found from the closed connection, not waited out to the read timeout's end (which
        # would say "did not answer within the timeout"): the message says which
        assert "within the timeout" not in str(e.value), e.value
