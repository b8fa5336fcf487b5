"""Triton's perf_analyzer with its default protocol, KServe v2 over HTTP/REST,
against a real attnserve: the load generator Triton users point at port 8000
works unchanged. perf_analyzer 2.60.0 runs in its own container (its PyPI
wheel needs glibc >= 2.38: a debootstrapped Debian trixie image,
bench/perf_analyzer/build_image.sh) with --network host, on 127.0.0.1. Its
requests are counted at the server, since perf_analyzer reports throughput
for failed calls too: every one must be answered OK, and the server must have
answered at least as many as perf_analyzer says it measured. A fixed request
rate bounds perf_analyzer's memory (it keeps every request's data;
docs/PERFORMANCE.md). bench/perf_analyzer.sh is the longer measurement."""

import json
import os
import re

import numpy as np

import harness
import serving_util as su
from docker_util import ROOT, docker, run  # noqa: F401 (fixture)

PA_VERSION = "2.60.0"
IMAGE = f"attnserve-perf-analyzer:{PA_VERSION}"


def _answers(server):
    """attnserve_requests_total of model sdpa, by status code."""
    counts = {}
    for (name, labels), value in su.scrape(server).items():
        labels = dict(labels)
        if name == "attnserve_requests_total" and labels.get("model") == "sdpa":
            counts[labels["code"]] = counts.get(labels["code"], 0) + int(value)
    return counts


def test_perf_analyzer_with_its_default_protocol(docker, tmp_path):
    run([os.path.join(ROOT, "bench", "perf_analyzer", "build_image.sh"), IMAGE, PA_VERSION],
        env=docker.env, timeout=1500)
    rng = np.random.default_rng(0)
    shapes = {"query": [1, 4, 8, 32], "key": [1, 4, 64, 32], "value": [1, 4, 64, 32]}
    # Only the inputs a caller sends: perf_analyzer would otherwise make up
    # the optional ones (attn_mask, key_lengths) too.
    data = {name: {"content": rng.standard_normal(shape).astype(np.float32).ravel().tolist(),
                   "shape": shape} for name, shape in shapes.items()}
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": [data]}))
    os.chmod(path, 0o644)
    server = harness.ServerProcess("--backend=cpu")
    try:
        before = _answers(server)
        out = docker("run", "--rm", "--network", "host", "--memory", "4g",
                     "-v", f"{path}:/data.json:ro", IMAGE, "-m", "sdpa",
                     "-u", server.http_target, "--input-data", "/data.json",
                     "--request-rate-range", "100", "--measurement-interval", "2000",
                     # Ten windows at most, as bench/perf_analyzer.sh: on a shared
                     # 2-vCPU machine four were once not enough for three windows
                     # within 50% of each other (perf_analyzer: "Failed to obtain
                     # stable measurement", exit 2).
                     "--stability-percentage", "50", "--max-trials", "10", timeout=300)
        after = _answers(server)
    finally:
        assert server.stop() == 0, server.log()
    report = out.stdout
    assert "Request Rate: 100" in report, report[-3000:]
    measured = [int(n) for n in re.findall(r"Request count: (\d+)", report)]
    assert measured and measured[-1] >= 100, report[-3000:]
    delta = {code: after.get(code, 0) - before.get(code, 0) for code in after}
    assert delta.get("OK", 0) >= measured[-1], (delta, report[-3000:])
    assert {code: n for code, n in delta.items() if code != "OK" and n} == {}, delta
