"""Multi-node tests on real network namespaces. Every test here needs root; without
it they skip, saying which privilege is missing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deploy.testbed import Testbed, missing_privileges

REASON = missing_privileges()


def pytest_collection_modifyitems(config, items):
    if REASON is None:
        return
    skip = pytest.mark.skip(reason=f"testbed unavailable: {REASON}")
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    """One 3-node testbed shared by a module's tests (building one costs ~1 s)."""
    with Testbed(nodes=3) as tb:
        yield tb
