"""Multi-host tests (marker `multihost`, `make test-multihost`): network namespaces on this
machine. Where it cannot make them (no root, no iproute2, not Linux) they skip, saying why."""

from __future__ import annotations

import pytest

from labtools.hosts import unavailable


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = None
    for item in items:
        if "multihost" in item.keywords:
            why = why or unavailable() or ""
            if why:
                item.add_marker(pytest.mark.skip(reason=f"needs network namespaces: {why}"))
