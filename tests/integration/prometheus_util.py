"""A real Prometheus (Debian package, /usr/bin/prometheus) for the tests: started
on a free loopback port with a temporary config and TSDB, scraping the given
targets every second, stopped by stop()."""

import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request

import pytest

import serving_util as su

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
have_prometheus = pytest.mark.skipif(
    not (os.access(PROMETHEUS, os.X_OK) and os.access(PROMTOOL, os.X_OK)),
    reason="Debian package prometheus not installed (scripts/install-deps.sh installs it)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, tmp_path, scrape_target, rule_files=()):
        """`scrape_target`: one host:port or a list of them (job "attnserve")."""
        targets = [scrape_target] if isinstance(scrape_target, str) else list(scrape_target)
        self.port = free_port()
        config = tmp_path / "prometheus.yml"
        rules = "".join(f"  - '{r}'\n" for r in rule_files)
        config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  evaluation_interval: 1s\n"
            + (f"rule_files:\n{rules}" if rules else "") +
            "scrape_configs:\n"
            "  - job_name: attnserve\n"
            f"    static_configs: [{{targets: {json.dumps(targets)}}}]\n")
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

    def api(self, path, **params):
        """GET /api/v1/PATH; the decoded body (any status: the caller checks)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:  # 400/422: a bad query; the body says why
            return json.load(e)

    def query_result(self, expr):
        """Instant query; the list of result series (fails on a query error)."""
        body = self.api("query", query=expr)
        assert body["status"] == "success", f"{expr}\n{body}"
        return body["data"]["result"]

    def query(self, expr):
        """Instant query; the value of the single result, or None."""
        result = self.query_result(expr)
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
