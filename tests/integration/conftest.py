"""Fixtures for the integration tests: one real attnserve process per test file
and a Python client connected to it."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

harness.use_python_client()


@pytest.fixture(scope="session")
def server():
    yield from harness.server_fixture()


@pytest.fixture(scope="session")
def client(server):
    from attnserve_client import AttentionClient
    with AttentionClient(server.target, timeout=60) as c:
        yield c
