"""fed.* settings that cannot work together are refused at start-up, naming the key."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from fed_learn.config import FedConfig

REFUSED = {
    "aggregator_unknown": ({"aggregator": "mode"}, "fed.aggregator='mode' is not allowed"),
    "median_with_async": ({"aggregator": "median", "mode": "async"}, "fed.mode=async"),
    "trimmed_mean_with_topk": (
        {"aggregator": "trimmed_mean", "compression": "topk"},
        "fed.compression=topk",
    ),
    "median_with_topk_int8": (
        {"aggregator": "median", "compression": "topk_int8"},
        "fed.compression=topk_int8",
    ),
    "trim_fraction_half": ({"trim_fraction": 0.5}, "fed.trim_fraction=0.5"),
    "trim_fraction_negative": ({"trim_fraction": -0.1}, "fed.trim_fraction=-0.1"),
    "max_update_norm_zero": ({"max_update_norm": 0.0}, "fed.max_update_norm=0.0"),
    "max_update_norm_inf": ({"max_update_norm": float("inf")}, "fed.max_update_norm=inf"),
    "max_update_norm_nan": ({"max_update_norm": float("nan")}, "fed.max_update_norm=nan"),
    "join_rate_zero": ({"join_rate_per_address": 0.0}, "fed.join_rate_per_address=0.0"),
    "join_rate_inf": ({"join_rate_per_address": float("inf")}, "fed.join_rate_per_address=inf"),
    "join_rate_nan": ({"join_rate_per_address": float("nan")}, "fed.join_rate_per_address=nan"),
    "join_burst_zero": ({"join_burst_per_address": 0}, "fed.join_burst_per_address=0"),
}


@pytest.mark.parametrize(("fields", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_bad_fed_settings_are_refused_naming_the_key(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="fed\\.") as caught:
        FedConfig(**fields)
    assert message in str(caught.value)


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "ffa", "svd"])
@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
def test_robust_aggregators_combine_with_every_sync_strategy(
    strategy: str, aggregator: str
) -> None:
    assert FedConfig(strategy=strategy, aggregator=aggregator).aggregator == aggregator


def test_a_trimmed_mean_that_trims_nothing_says_so() -> None:
    """floor(0.2 x 3 clients) = 0: the run would be a plain mean without a word."""
    with pytest.warns(UserWarning, match="trims nothing from 3 clients a round"):
        FedConfig(aggregator="trimmed_mean", trim_fraction=0.2, num_clients=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FedConfig(aggregator="trimmed_mean", trim_fraction=0.2, num_clients=5)
