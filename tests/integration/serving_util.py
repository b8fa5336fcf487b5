"""Helpers for the serving tests (batching, streaming, shutdown, metrics): the
server's metrics endpoint, a tiny Prometheus text parser, polling, and the
attn_bench binary."""

import os
import re
import time
import urllib.request

import pytest

METRICS_LINE = re.compile(r"attnserve metrics on (127\.0\.0\.1):(\d+)")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metrics_port(server):
    """The port of `server`'s /metrics (it prints it before 'listening on')."""
    for line in server.lines:
        m = METRICS_LINE.search(line)
        if m:
            return int(m.group(2))
    pytest.fail(f"no 'attnserve metrics on' line:\n{server.log()}")


def scrape(server):
    """{(name, frozenset(labels.items())): value} of every sample."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(server)}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = frozenset(LABEL.findall(m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(samples, name, **labels):
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def flag_value(args, name):
    """The value of --name in a server's argument list ("--name", "v" or
    "--name=v"); None when absent."""
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def wait_for(predicate, timeout, what, interval=0.02):
    """Polls `predicate` until it returns a truthy value (returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def attn_bench_bin():
    build = os.environ.get("ATTNSERVE_BUILD_DIR")
    if not build:
        pytest.fail("$ATTNSERVE_BUILD_DIR is not set: run these tests through ctest")
    path = os.path.join(build, "client", "attn_bench")
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is not an executable file (build the attn_bench target)")
    return path
