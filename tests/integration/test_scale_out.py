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
import threading
import time

import numpy as np
import pytest

import harness
import serving_util as su
from prometheus_util import free_port

ROOT = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")
NGINX_CONF = os.path.join(ROOT, "deploy", "loadbalancer", "nginx.conf")
REPLICAS = 3
BENCH_SECONDS = 6
STOP_AFTER = 2.0  # seconds into the run when replica 0 gets SIGTERM
# RPCs that may fail because a replica is stopping: the ones it refuses
# (UNAVAILABLE) while it drains, or that reach it as its gRPC server stops
# (CANCELLED), at most this share of all; everything it had accepted must
# still be answered OK.
MAX_REFUSED_SHARE = 0.01


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
        """(upstream addresses tried, grpc-status, grpc-message) of every Attend RPC."""
        out = []
        for line in (self.prefix / "access.log").read_text().splitlines():
            if "/Attend " not in line:
                continue
            upstream = re.search(r"upstream=(.*?) upstream_status=", line).group(1)
            # TRAILER/HEADER, "-" for the absent one (deploy/loadbalancer/nginx.conf).
            status = "".join(re.search(r"grpc_status=(\S*)/(\S*) ", line).groups()).strip("-")
            message = "".join(re.search(r'grpc_message="(.*)/(.*)"', line).groups()).strip("-")
            out.append(([u.strip() for u in upstream.split(",")], status, message))
        return out

    def upstream_errors(self):
        """nginx's error-log lines about the replicas (refused connections,
        streams a replica reset or refused with GOAWAY)."""
        with open(self.log.name) as f:
            return [line.strip() for line in f if "upstream" in line]

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


class Accepted(threading.Thread):
    """Scrapes a stopping replica until it exits. Its last scrape gives the
    requests it had accepted: answered OK by then plus those still in
    flight. (After SIGTERM it accepts no new ones, it refuses them.)"""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.last = server, None
        self.start()

    def run(self):
        while self.server.alive():
            try:
                samples = su.scrape(self.server)
            except OSError:
                break
            self.last = (su.metric(samples, "attnserve_requests_total", code="OK"),
                         su.metric(samples, "attnserve_inflight_requests"))
            time.sleep(0.005)

    def count(self):
        self.join(30)
        assert self.last is not None, "no scrape of the stopping replica"
        return sum(self.last)


def _run_with_a_replica_stopped(target, replicas, *bench_flags):
    """Runs attn_bench against `target`, SIGTERMs replicas[0] STOP_AFTER s in;
    returns (bench result, OK counts per replica at the stop, at the end: the
    requests the stopped one accepted, the OK counts of the others)."""
    bench = _start_bench(target, *bench_flags)
    try:
        time.sleep(STOP_AFTER)
        at_stop = [_ok_requests(r) for r in replicas]
        replicas[0].proc.send_signal(signal.SIGTERM)
        accepted0 = Accepted(replicas[0])
        stopped = replicas[0].wait()  # the exit under way (a second signal would cut the drain short)
        assert stopped == 0, replicas[0].log()
        out, err = bench.communicate(timeout=BENCH_SECONDS + 60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == 0, err
    result = json.loads(out)
    at_end = [accepted0.count()] + [_ok_requests(r) for r in replicas[1:]]
    print(f"{target}: {result['requests']} requests, {result['ok_throughput_rps']:.0f} OK/s, "
          f"errors {result['errors']}; OK per replica at the stop {at_stop}, at the end {at_end} "
          "(the stopped one's: accepted)")
    return result, at_stop, at_end


def _check_load_spread_and_errors(result, at_stop, at_end):
    assert all(n > 0 for n in at_stop), f"load did not reach every replica: {at_stop}"
    assert all(at_end[i] > at_stop[i] for i in range(1, REPLICAS)), \
        f"the other replicas did not take the load after the stop: {at_stop} -> {at_end}"
    # Every request the stopped replica had accepted reached the client as
    # OK: the client's OKs beyond the live replicas' cover them all.
    ok_from_stopped = result["ok"] - sum(at_end[1:])
    assert ok_from_stopped >= at_end[0], \
        f"the stopped replica accepted {at_end[0]} requests, the client got {ok_from_stopped} OK"
    errors = dict(result["errors"])
    refused = errors.pop("UNAVAILABLE", 0) + errors.pop("CANCELLED", 0)
    assert errors == {}, f"errors other than a stopping replica's refusals: {result['errors']}"
    assert refused <= MAX_REFUSED_SHARE * result["requests"], \
        f"{refused} refused of {result['requests']} (bound {MAX_REFUSED_SHARE:.0%})"


@pytest.fixture
def replicas():
    servers = [harness.ServerProcess() for _ in range(REPLICAS)]
    yield servers
    for s in servers:  # the stopped one again too, in case the test failed before its stop
        assert s.stop() == 0, s.log()


def test_nginx_spreads_rpcs_and_loses_nothing_when_a_replica_stops(tmp_path, replicas):
    lb = Nginx(tmp_path, [r.target for r in replicas])
    try:
        result, at_stop, at_end = _run_with_a_replica_stopped(lb.target, replicas)
    finally:
        lb.stop()
    _check_load_spread_and_errors(result, at_stop, at_end)

    # nginx's view agrees, replica by replica: its log has one line per RPC
    # with every replica tried and the grpc-status the client got. What
    # failed on the stopped replica was refused (not accepted) by it.
    rpcs = lb.attend_log()
    assert len(rpcs) == result["requests"]
    ok_by_replica, failed_on_stopped = {}, []
    for tried, status, message in rpcs:
        if status == "0":
            ok_by_replica[tried[-1]] = ok_by_replica.get(tried[-1], 0) + 1
        elif tried[-1] == replicas[0].target:
            failed_on_stopped.append((status, message))
    assert [ok_by_replica.get(r.target, 0) for r in replicas[1:]] == at_end[1:]
    assert ok_by_replica[replicas[0].target] >= at_end[0]
    # Refused by the draining service, or cancelled by gRPC itself: a call
    # that arrived in the last instant, when the replica stops gRPC (its own
    # counts above show nothing accepted was lost).
    unexplained = [(s, m) for s, m in failed_on_stopped
                   if not ("shutting down" in m or (s, m) == ("1", "CANCELLED"))]
    assert unexplained == [], \
        (unexplained, [r for r in rpcs if r[1] != "0"][:20], lb.upstream_errors())
    retried = sum(1 for tried, _, _ in rpcs if len(tried) > 1)
    print(f"nginx: {len(rpcs)} Attend RPCs, {retried} tried on a second replica, "
          f"failed on the stopped one: {failed_on_stopped[:5]}")


def test_client_side_round_robin_spreads_rpcs_and_loses_nothing(replicas):
    # What a client of a headless Service gets from dns:///NAME: every
    # replica's address, one subchannel each; ipv4: lists them directly.
    target = "ipv4:" + ",".join(r.target for r in replicas)
    result, at_stop, at_end = _run_with_a_replica_stopped(
        target, replicas, "--lb-policy=round_robin",
        "--health-check-service=attnserve.v1.AttentionService")
    _check_load_spread_and_errors(result, at_stop, at_end)


def test_attn_bench_rejects_an_unknown_lb_policy():
    out = subprocess.run([su.attn_bench_bin(), "--target=127.0.0.1:1", "--lb-policy=roundrobin"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "--lb-policy must be pick_first or round_robin" in out.stderr
    out = subprocess.run([su.attn_bench_bin(), "--target=127.0.0.1:1", "--health-check-service=x"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "needs --lb-policy=round_robin" in out.stderr


def test_sessions_behind_nginx_stay_on_their_replica(tmp_path, replicas):
    """32 sessions x 64 decode steps through nginx (hashing on the
    x-attnserve-session metadata our client sends on every call of a
    session): every step equals the NumPy oracle over the session's whole
    sequence, none is NOT_FOUND, and the sessions spread over the replicas.
    Then one replica stops: its sessions end with a status naming the
    session (NOT_FOUND where nginx sends the call to another replica), the
    others go on."""
    import grpc
    from attnserve_client import AttentionClient
    lb = Nginx(tmp_path, [r.target for r in replicas])
    rng = np.random.default_rng(12)
    steps, n_sessions = 64, 32
    try:
        with AttentionClient(lb.target, timeout=60) as client:
            sessions = [client.open_session("sdpa") for _ in range(n_sessions)]
            q, k, v = (rng.standard_normal((n_sessions, 1, 2, steps + 1, 16)).astype(np.float32)
                       for _ in range(3))
            for t in range(steps):
                for i, s in enumerate(sessions):
                    sl = slice(t, t + 1)
                    out = s.attend(q[i][:, :, sl], k[i][:, :, sl], v[i][:, :, sl]).output
                    want, _ = harness.reference_attention(q[i][:, :, sl], k[i][:, :, :t + 1],
                                                          v[i][:, :, :t + 1], causal=True)
                    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            held = [su.metric(su.scrape(r), "attnserve_sessions_open", model="sdpa")
                    for r in replicas]
            assert sum(held) == n_sessions and all(h > 0 for h in held), held
            # One replica stops: only its sessions end, each with a clear status.
            assert replicas[0].stop() == 0
            lost, kept = [], 0
            for i, s in enumerate(sessions):
                sl = slice(steps, steps + 1)
                try:
                    out = s.attend(q[i][:, :, sl], k[i][:, :, sl], v[i][:, :, sl]).output
                    want, _ = harness.reference_attention(q[i][:, :, sl], k[i], v[i], causal=True)
                    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
                    kept += 1
                except grpc.RpcError as e:
                    lost.append((e.code(), e.details()))
            assert len(lost) == held[0] and kept == n_sessions - held[0], (lost, kept, held)
            for code, message in lost:
                assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE), lost
                assert code != grpc.StatusCode.NOT_FOUND or "session" in message, lost
    finally:
        lb.stop()
