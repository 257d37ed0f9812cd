"""`generate.clients`: a split run that also serves concurrent requests through its stages logs
throughput and latency per client count, and its report draws them against clients."""

from __future__ import annotations

from pathlib import Path

from lab.plots import step_rows
from lab.tracking import METRICS_FILE, read_records
from split_inference.load import client_counts
from split_inference.manifest import plots
from split_inference.run import run as run_inference


def test_client_counts_double_up_to_the_bound() -> None:
    assert client_counts(1) == [1]
    assert client_counts(3) == [1, 2, 3]
    assert client_counts(8) == [1, 2, 4, 8]


def test_a_run_with_clients_logs_each_count_and_plots_them(
    compose_config, llama_folder: Path, tmp_path: Path
) -> None:
    cfg = compose_config(
        "split_inference",
        [
            f"model.pretrained={llama_folder}",
            "tracking.wandb=false",
            "generate.num_prompts=2",
            "generate.max_new_tokens=5",
            "generate.prompt_tokens=16",
            "generate.baseline=false",
            "generate.clients=3",
        ],
    )
    metrics = run_inference(cfg)
    records = step_rows(read_records(tmp_path / METRICS_FILE), "serve_clients")
    assert [r["serve_clients"] for r in records] == [1.0, 2.0, 3.0]
    assert metrics["serve_clients"] == 3.0
    for key in ("serve_tokens_per_s", "serve_ttft_ms_p50", "serve_token_ms_p50"):
        assert metrics[key] > 0
    assert metrics["serve_mean_batch"] >= 1.0
    assert (tmp_path / "split_serving.png").is_file()
    assert plots(tmp_path)[-1].name == "split_serving.png"
