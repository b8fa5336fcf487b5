"""Shutdown as containers need it, timed on the real binary: after SIGTERM health
turns NOT_SERVING at once, accepted requests complete, and the process exits
within a second of the last answer (no internal timer to wait out); idle exit
is immediate; a second signal exits at once; all of it also as PID 1 of a PID
namespace, as in a container without an init."""

import os
import shutil
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

import harness
import serving_util as su
from attnserve_client import AttentionClient, stubs

pb = stubs.attention_pb2

# The bound of the issue: exit at most 1 s after the last answer went out.
EXIT_AFTER_LAST_ANSWER_S = 1.0


def _kill(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _health(client):
    try:
        return client.health(timeout=2)
    except grpc.RpcError as e:
        return e.code().name


class _ExitWatch:
    """Records when a process exits (monotonic seconds), from a thread."""

    def __init__(self, proc):
        self.proc = proc
        self.at = None
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self):
        self.proc.wait()
        self.at = time.monotonic()

    def join(self, timeout):
        self._thread.join(timeout)
        return self.at is not None


def _slow_requests(client, n, rng):
    """n sdpa requests of 33M scores each: about 0.15 s each on one core of
    the 2-vCPU development machine, so n = 8 compute for a second or more."""
    reqs = []
    for i in range(n):
        q = rng.standard_normal((1, 8, 2048, 32)).astype(np.float32)
        k = rng.standard_normal((1, 8, 2048, 32)).astype(np.float32)
        v = rng.standard_normal((1, 8, 2048, 32)).astype(np.float32)
        reqs.append((client.build_request(q, k, v, model="sdpa", request_id=f"r{i}"), q, k, v))
    return reqs


def _attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v in float64 through BLAS matmuls (the harness's
    einsum oracle takes seconds per request at these sizes)."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = np.matmul(q, np.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.matmul(p / p.sum(axis=-1, keepdims=True), v)


def _drain_in_flight(srv, proc, n=8):
    """Sends n slow requests, SIGTERMs `proc` once all are accepted, and checks
    health, answers and exit timing. Returns (exit code, seconds from the last
    answer to the exit)."""
    rng = np.random.default_rng(12)
    with AttentionClient(srv.target, timeout=120) as c:
        reqs = _slow_requests(c, n, rng)
        answered = {}
        futures = []
        for r, *_ in reqs:
            f = c.stub.Attend.future(r, timeout=120)
            f.add_done_callback(lambda f, rid=r.id: answered.setdefault(rid, time.monotonic()))
            futures.append(f)
        su.wait_for(lambda: su.metric(su.scrape(srv), "attnserve_inflight_requests", model="sdpa") == n,
                    60, f"{n} accepted requests")
        watch = _ExitWatch(proc)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # Health reports NOT_SERVING while the accepted requests still compute.
        su.wait_for(lambda: _health(c) == "NOT_SERVING", 5, "health NOT_SERVING")
        not_serving_after = time.monotonic() - signalled
        assert not_serving_after < 0.5, f"health took {not_serving_after:.2f}s to turn NOT_SERVING"
        assert len(answered) < n, "every request was answered before health turned (make them slower)"
        for (r, q, k, v), f in zip(reqs, futures):
            resp = f.result(timeout=120)
            assert resp.id == r.id
            got = np.frombuffer(resp.output.data, np.float32).reshape(q.shape)
            # Query rows are independent: every 16th row checked keeps the oracle cheap.
            np.testing.assert_allclose(got[:, :, ::16], _attention(q[:, :, ::16], k, v),
                                       rtol=1e-4, atol=1e-5)
    assert watch.join(30), f"no exit within 30 s of the last answer:\n{srv.log()}"
    return proc.returncode, watch.at - max(answered.values())


# The requests wait in the queue (60 s batching delay, room for all) until the
# signal closes their batch, so all are accepted and none answered when the
# signal comes, on any machine; one worker on one thread then computes them.
HOLD = ("--threads", "1", "--instances", "1", "--max-batch-requests", "64", "--max-batch-tokens", "0",
        "--max-queue-delay-us", "60000000", "--shutdown-grace", "60s")


def _server():
    return harness.ServerProcess(*HOLD)


def test_sigterm_drains_in_flight_requests_and_exits_within_a_second_of_the_last():
    srv = _server()
    try:
        code, lag = _drain_in_flight(srv, srv.proc)
        assert code == 0, f"exit code {code}:\n{srv.log()}"
        assert lag <= EXIT_AFTER_LAST_ANSWER_S, f"exit {lag:.2f}s after the last answer:\n{srv.log()}"
    finally:
        _kill(srv.proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_idle_exit_is_immediate(sig):
    """No internal poll (gRPC's, the metrics server's, the batcher's) is waited
    out: three idle servers, each after serving a request and a scrape."""
    for _ in range(3):
        srv = harness.ServerProcess()
        try:
            with AttentionClient(srv.target) as c:
                assert c.health() == "SERVING"
                q = np.ones((1, 1, 2, 8), np.float32)
                c.attend(q, q, q, model="sdpa")
            su.scrape(srv)
            start = time.monotonic()
            code = srv.stop(sig)
            took = time.monotonic() - start
            assert code == 0, srv.log()
            assert took < 0.5, f"idle exit took {took:.2f}s after {sig.name}:\n{srv.log()}"
        finally:
            _kill(srv.proc)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_second_signal_exits_at_once(second):
    """The drain waits (up to the grace) for a stream whose client does not
    read its answers; a second signal ends the process now, with 128 + signal."""
    srv = harness.ServerProcess("--shutdown-grace", "60s")
    release = threading.Event()
    try:
        rng = np.random.default_rng(3)
        with AttentionClient(srv.target, timeout=120) as c:
            q = rng.standard_normal((1, 1, 4096, 64)).astype(np.float32)
            k = rng.standard_normal((1, 1, 8, 64)).astype(np.float32)
            big = c.build_request(q, k, k, model="sdpa")

            def messages():
                for i in range(32):  # 1 MiB answers, far more than HTTP/2 windows hold unread
                    m = pb.AttendRequest()
                    m.CopyFrom(big)
                    m.id = f"s{i}"
                    yield m
                release.wait(120)

            stream = c.stub.AttendStream(messages(), timeout=120)
            su.wait_for(lambda: su.metric(su.scrape(srv), "attnserve_requests_total", model="sdpa",
                                          code="OK") >= 8, 60, "stream answers computed")
            srv.proc.send_signal(signal.SIGTERM)
            su.wait_for(lambda: _health(c) == "NOT_SERVING", 5, "health NOT_SERVING")
            time.sleep(0.3)
            assert srv.alive(), "the drain should be waiting for the unread stream"
            start = time.monotonic()
            srv.proc.send_signal(second)
            try:
                srv.proc.wait(5)
            except subprocess.TimeoutExpired:
                pytest.fail(f"no exit within 5 s of a second {second.name}:\n{srv.log()}")
            took = time.monotonic() - start
            stream.cancel()
        assert srv.proc.returncode == 128 + second, srv.log()
        assert took < 0.5, f"second {second.name}: exit took {took:.2f}s"
        srv._reader.join(5)
        assert "second signal" in srv.log()
    finally:
        release.set()
        _kill(srv.proc)


def _pid_namespace_child(unshare_pid):
    """The host pid of the process that unshare forked as PID 1."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{unshare_pid}/task/{unshare_pid}/children") as f:
                kids = f.read().split()
        except FileNotFoundError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    pytest.fail("unshare started no child")


class _Pid1:
    """Adapts a ServerProcess run under `unshare --pid --fork` so signals go to
    the server (PID 1 inside) instead of to unshare."""

    def __init__(self, srv):
        self.srv = srv
        self.pid = _pid_namespace_child(srv.proc.pid)
        with open(f"/proc/{self.pid}/status") as f:
            nspid = [l.split()[1:] for l in f if l.startswith("NSpid:")][0]
        assert nspid[-1] == "1", f"the server is not PID 1 in its namespace: NSpid {nspid}"

    def send_signal(self, sig):
        os.kill(self.pid, sig)

    def poll(self):
        return self.srv.proc.poll()

    def wait(self, timeout=None):
        return self.srv.proc.wait(timeout)

    @property
    def returncode(self):
        return self.srv.proc.returncode


def _unshare_or_skip():
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("util-linux unshare is not installed")
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here ({probe.stderr.strip()}); the container "
                    "test covers PID 1 where dockerd runs")
    return unshare


def test_as_pid_1_sigterm_drains_and_exits_zero():
    """PID 1 gets no default signal actions from the kernel: the server must
    (and does: it sigwaits) handle SIGTERM itself, with no init in front."""
    unshare = _unshare_or_skip()
    srv = harness.ServerProcess(*HOLD, wrapper=(unshare, "--pid", "--fork", "--mount-proc"))
    try:
        pid1 = _Pid1(srv)
        code, lag = _drain_in_flight(srv, pid1)
        # unshare passes on its child's exit code.
        assert code == 0, f"exit code {code}:\n{srv.log()}"
        assert lag <= EXIT_AFTER_LAST_ANSWER_S, f"exit {lag:.2f}s after the last answer:\n{srv.log()}"
    finally:
        _kill(srv.proc)
