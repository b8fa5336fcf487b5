"""Fixtures for the client package's own tests. They run against the installed
attnserve-client (a wheel in a fresh venv; run_suite.py stages them outside
the checkout next to a copy of tests/integration/harness.py) and a real
attnserve process ($ATTNSERVE_BIN)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import harness  # staged next to the tests by run_suite.py
except ImportError:  # run from the checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", "tests", "integration"))
    import harness  # noqa: E402

@pytest.fixture(scope="session")
def server():
    yield from harness.server_fixture()


@pytest.fixture(scope="session")
def client(server):
    from attnserve_client import AttentionClient
    with AttentionClient(server.target, timeout=60) as c:
        yield c
