"""The pools of ranks (harness.py) live for one test module."""

import pytest

import harness


@pytest.fixture(autouse=True, scope="module")
def _rank_pools_per_module():
    yield
    harness.close_pools()
