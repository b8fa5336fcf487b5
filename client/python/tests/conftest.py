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

SESSIONS_PENDING = ("sessions are not implemented by this server yet (OpenSession answers UNIMPLEMENTED "
                    "until the sessions branch merges)")


@pytest.fixture(scope="session")
def server():
    yield from harness.server_fixture()


@pytest.fixture(scope="session")
def client(server):
    from attnserve_client import AttentionClient
    with AttentionClient(server.target, timeout=60) as c:
        yield c


def open_session_or_skip(client, *args, **kwargs):
    """client.open_session, skipping the test ONLY when the server answers
    UNIMPLEMENTED (sessions not merged yet)."""
    from attnserve_client import UnimplementedError
    try:
        return client.open_session(*args, **kwargs)
    except UnimplementedError:
        pytest.skip(SESSIONS_PENDING)
