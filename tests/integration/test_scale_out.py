"""Scale-out: three attnserve replicas (processes on loopback ports) behind a
real gRPC load balancer, nginx with grpc_pass (deploy/loadbalancer/nginx.conf,
only its ports rewritten), and behind gRPC's client-side round_robin (what a
headless Kubernetes Service gives clients). Under attn_bench load: every
replica serves requests (its own attnserve_requests_total), one replica is
stopped with SIGTERM mid-run and every request it had accepted is answered OK,
and the errors attn_bench reports by code stay within a stated bound."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

import harness
import serving_util as su
from prometheus_util import free_port

ROOT = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")
NGINX_CONF = os.path.join(ROOT, "deploy", "loadbalancer", "nginx.conf")
REPLICAS = 3
BENCH_SECONDS = 6
STOP_AFTER = 2.0  # seconds into the run when replica 0 gets SIGTERM
# RPCs that may fail because a replica went away: only UNAVAILABLE, and at
# most this many (a request racing the replica's GOAWAY; everything the
# replica had accepted must still be answered).
MAX_UNAVAILABLE = 0


def _ok_requests(server):
    return su.metric(su.scrape(server), "attnserve_requests_total", code="OK")


def _wait_listening(port, proc, what):
    def up():
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    su.wait_for(up, 20, f"{what} to listen on {port}", interval=0.05)


class Nginx:
    """deploy/loadbalancer/nginx.conf with our listen port and replicas."""

    def __init__(self, tmp_path, backends):
        if shutil.which("nginx") is None:
            pytest.skip("nginx not installed (Debian package nginx; scripts/install-deps.sh)")
        self.port = free_port()
        self.prefix = tmp_path / "nginx"
        (self.prefix / "tmp").mkdir(parents=True)
        with open(NGINX_CONF) as f:
            conf = f.read()
        conf, n = re.subn(r"listen 127\.0\.0\.1:\d+ http2;", f"listen 127.0.0.1:{self.port} http2;", conf)
        assert n == 1, "nginx.conf: the test expects one `listen 127.0.0.1:PORT http2;` line"
        servers = re.findall(r"^(\s*)server 127\.0\.0\.1:\d+( [^;]*);\n", conf, re.M)
        assert servers, "nginx.conf: the test expects `server 127.0.0.1:PORT ...;` lines"
        indent, options = servers[0]
        conf = re.sub(r"^\s*server 127\.0\.0\.1:\d+[^;]*;\n", "", conf, flags=re.M)
        lines = "".join(f"{indent}server {b}{options};\n" for b in backends)
        conf = conf.replace("  upstream attnserve {\n", "  upstream attnserve {\n" + lines, 1)
        (self.prefix / "nginx.conf").write_text(conf)
        # As root, nginx's workers would switch to nobody, who cannot write here.
        directives = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")
        self.log = open(tmp_path / "nginx.log", "w")
        self.proc = subprocess.Popen(
            ["nginx", "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf"), "-g", directives],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _wait_listening(self.port, self.proc, "nginx")

    @property
    def target(self):
        return f"127.0.0.1:{self.port}"

    def attend_log(self):
        """(upstream addresses tried, final grpc-status) of every Attend RPC."""
        out = []
        for line in (self.prefix / "access.log").read_text().splitlines():
            if "/Attend " not in line:
                continue
            upstream = re.search(r"upstream=(.*?) upstream_status=", line).group(1)
            status = re.search(r"grpc_status=(\S*)", line).group(1)
            out.append(([u.strip() for u in upstream.split(",")], status))
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish open requests
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _start_bench(target, *extra):
    return subprocess.Popen(
        [su.attn_bench_bin(), f"--target={target}", "--model=demo-mha", "--batch=1", "--seq=16",
         "--concurrency=12", "--channels=4", f"--duration={BENCH_SECONDS}", "--timeout-ms=20000",
         "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_with_a_replica_stopped(target, replicas, *bench_flags):
    """Runs attn_bench against `target`, SIGTERMs replicas[0] STOP_AFTER s in;
    returns (bench result, OK counts per replica at the stop, OK counts of the
    others at the end)."""
    bench = _start_bench(target, *bench_flags)
    try:
        time.sleep(STOP_AFTER)
        at_stop = [_ok_requests(r) for r in replicas]
        replicas[0].proc.send_signal(signal.SIGTERM)
        stopped = replicas[0].stop()  # waits for the exit
        assert stopped == 0, replicas[0].log()
        out, err = bench.communicate(timeout=BENCH_SECONDS + 60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == 0, err
    result = json.loads(out)
    at_end = [None] + [_ok_requests(r) for r in replicas[1:]]
    print(f"{target}: {result['requests']} requests, {result['ok_throughput_rps']:.0f} OK/s, "
          f"errors {result['errors']}; OK per replica at the stop {at_stop}, at the end {at_end}")
    return result, at_stop, at_end


def _check_load_spread_and_errors(result, at_stop, at_end):
    assert all(n > 0 for n in at_stop), f"load did not reach every replica: {at_stop}"
    assert all(at_end[i] > at_stop[i] for i in range(1, REPLICAS)), \
        f"the other replicas did not take the load after the stop: {at_stop} -> {at_end}"
    errors = dict(result["errors"])
    unavailable = errors.pop("UNAVAILABLE", 0)
    assert errors == {}, f"errors other than UNAVAILABLE: {result['errors']}"
    assert unavailable <= MAX_UNAVAILABLE, f"{unavailable} UNAVAILABLE (bound {MAX_UNAVAILABLE})"
    assert result["requests"] == result["ok"] + unavailable


@pytest.fixture
def replicas():
    servers = [harness.ServerProcess() for _ in range(REPLICAS)]
    yield servers
    for s in servers[1:]:
        assert s.stop() == 0, s.log()


def test_nginx_spreads_rpcs_and_loses_nothing_when_a_replica_stops(tmp_path, replicas):
    lb = Nginx(tmp_path, [r.target for r in replicas])
    try:
        result, at_stop, at_end = _run_with_a_replica_stopped(lb.target, replicas)
    finally:
        lb.stop()
    _check_load_spread_and_errors(result, at_stop, at_end)

    # nginx's view: every RPC that ended on the stopped replica got OK (none
    # it accepted was lost), and its per-replica counts match the replicas' own.
    rpcs = nginx_rpcs = lb.attend_log()
    assert len(rpcs) == result["requests"]
    final = {}
    for tried, status in rpcs:
        final.setdefault(tried[-1], []).append(status)
    stopped = replicas[0].target
    assert set(final[stopped]) == {"0"}, f"RPCs on the stopped replica ended {set(final[stopped])}"
    assert len(final[stopped]) >= at_stop[0]
    for i in range(1, REPLICAS):
        assert final[replicas[i].target].count("0") == at_end[i]
    retried = sum(1 for tried, _ in nginx_rpcs if len(tried) > 1)
    print(f"nginx: {len(rpcs)} Attend RPCs, {retried} retried on another replica")


def test_client_side_round_robin_spreads_rpcs_and_loses_nothing(replicas):
    # What a client of a headless Service gets from dns:///NAME: every
    # replica's address, one subchannel each; ipv4: lists them directly.
    target = "ipv4:" + ",".join(r.target for r in replicas)
    result, at_stop, at_end = _run_with_a_replica_stopped(target, replicas, "--lb-policy=round_robin")
    _check_load_spread_and_errors(result, at_stop, at_end)


def test_attn_bench_rejects_an_unknown_lb_policy():
    out = subprocess.run([su.attn_bench_bin(), "--target=127.0.0.1:1", "--lb-policy=roundrobin"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "--lb-policy must be pick_first or round_robin" in out.stderr
