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


def write_mha_model(folder, embed, heads, seed=0, scale=1.0):
    """A model folder for nn.MultiheadAttention(embed, heads, bias=False):
    random weights (normal, std 1/sqrt(embed), times `scale`) written by the
    Python client's own exporter. Returns the weights (in_proj, out_proj)."""
    import sys
    import numpy as np
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "client", "python"))
    from attnserve_client.export import write_model_folder
    rng = np.random.default_rng(seed)
    std = scale / np.sqrt(embed)
    in_proj = (rng.standard_normal((3 * embed, embed)) * std).astype(np.float32)
    out_proj = (rng.standard_normal((embed, embed)) * std).astype(np.float32)
    write_model_folder(folder, {"embed_dim": embed, "num_heads": heads},
                       {"in_proj_weight": in_proj, "out_proj.weight": out_proj})
    return in_proj, out_proj


if __name__ == "__main__":  # bench/soak.sh: write-mha-model FOLDER EMBED HEADS
    import sys
    if len(sys.argv) != 5 or sys.argv[1] != "write-mha-model":
        sys.exit("usage: serving_util.py write-mha-model FOLDER EMBED HEADS")
    write_mha_model(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
