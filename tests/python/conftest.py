"""The pools of ranks (harness.py) live for the whole test session: a module
finds the warm ranks of the modules before it (the same world size, backend,
timeout, environment and pool name), so a test run starts each kind of rank
set once rather than once per module. LIONBIT_TEST_POOLS_PER_MODULE=1 ends
them at each module's end instead (the old lifetime, to rule sharing across
modules out when a test fails); LIONBIT_TEST_FRESH_RANKS=1 gives every call
fresh ranks."""

import os

import pytest

import harness


@pytest.fixture(autouse=True, scope="session")
def _rank_pools_per_session():
    yield
    harness.close_pools()
    harness.close_zygote()


@pytest.fixture(autouse=True, scope="module")
def _rank_pools_per_module():
    yield
    if os.environ.get("LIONBIT_TEST_POOLS_PER_MODULE") == "1":
        harness.close_pools()
