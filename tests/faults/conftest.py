"""The fault suite: every test here carries the `faults` marker (run by default, and alone
with `pytest -m faults`)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/faults/ with `faults`."""
    for item in items:
        if "/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)
