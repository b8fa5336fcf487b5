"""attnserve's /metrics as a real Prometheus sees it: a Prometheus server
(Debian package, /usr/bin/prometheus) started on loopback with a temporary
config and TSDB scrapes attnserve every second while attn_bench loads it; its
HTTP API must then agree with what attn_bench measured (request count exactly,
p99 within a stated factor). Everything runs on 127.0.0.1 and stops by itself."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

import harness
import serving_util as su

PROMETHEUS = "/usr/bin/prometheus"

# histogram_quantile interpolates linearly inside a bucket (ours grow 1.78x
# per bucket), and the server's duration excludes the client and network
# share of the round trip: agreement within this factor either way.
P99_FACTOR = 3.0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, tmp_path, scrape_target):
        self.port = _free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: attnserve\n"
            f"    static_configs: [{{targets: ['{scrape_target}']}}]\n")
        self.log_path = tmp_path / "prometheus.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        su.wait_for(self._ready, 60, "Prometheus to be ready", interval=0.2)

    def _ready(self):
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr):
        """Instant query; the value of the single result, or None."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        result = body["data"]["result"]
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK), reason="Debian package prometheus not installed")
def test_prometheus_agrees_with_attn_bench(tmp_path):
    srv = harness.ServerProcess()
    prom = None
    try:
        prom = Prometheus(tmp_path, f"127.0.0.1:{su.metrics_port(srv)}")
        su.wait_for(lambda: prom.query('up{job="attnserve"}') == 1, 30, "the first scrape of attnserve",
                    interval=0.2)

        bench = subprocess.run(
            [su.attn_bench_bin(), f"--target={srv.target}", "--model=demo-mha", "--batch=1", "--seq=16",
             "--concurrency=8", "--duration=4", "--json"],
            capture_output=True, text=True, timeout=60)
        assert bench.returncode == 0, bench.stderr
        result = json.loads(bench.stdout)
        sent = result["requests"]
        assert sent > 0 and result["ok"] == sent, result

        # Every request attn_bench sent, counted once, all OK.
        model = 'model="demo-mha"'
        su.wait_for(lambda: prom.query(f"sum(attnserve_requests_total{{{model}}})") == sent, 20,
                    f"Prometheus to see {sent} requests", interval=0.25)
        assert prom.query(f'attnserve_requests_total{{{model},code="OK"}}') == sent
        assert prom.query(f"attnserve_request_duration_seconds_count{{{model}}}") == sent
        assert prom.query(f"attnserve_batch_requests_sum{{{model}}}") == sent
        assert prom.query(f"attnserve_tokens_total{{{model}}}") == 16 * sent
        assert prom.query(f"attnserve_inflight_requests{{{model}}}") == 0
        assert prom.query('count(attnserve_build_info{job="attnserve"} == 1)') == 1

        # The server started fresh, so the cumulative buckets are exactly the
        # run that attn_bench measured.
        p99 = prom.query("histogram_quantile(0.99, sum by (le) "
                         f"(attnserve_request_duration_seconds_bucket{{{model}}}))")
        bench_p99 = result["latency_us"]["p99"] / 1e6
        print(f"p99: Prometheus {p99 * 1e3:.3f} ms, attn_bench {bench_p99 * 1e3:.3f} ms, {sent} requests")
        assert p99 is not None and p99 > 0
        assert bench_p99 / P99_FACTOR <= p99 <= bench_p99 * P99_FACTOR, \
            f"Prometheus p99 {p99:.6f}s vs attn_bench p99 {bench_p99:.6f}s (factor {P99_FACTOR})"
    finally:
        if prom is not None:
            prom.stop()
        code = srv.stop()
    assert code == 0, srv.log()
