"""Starts and stops the real attnserve binary for the Python tests (integration
and parity): ephemeral loopback ports, the port read from the server's
"attnserve listening on 127.0.0.1:PORT" line, SIGTERM at the end."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

LISTENING = re.compile(r"attnserve listening on (127\.0\.0\.1):(\d+)")
HTTP = re.compile(r"attnserve http on (\S+)")


def _env_path(name):
    """A binary named by the environment (set by ctest); a missing one fails the
    test rather than skipping it."""
    path = os.environ.get(name)
    if not path:
        pytest.fail(f"${name} is not set: run these tests through ctest, or export {name}")
    if not os.access(path, os.X_OK):
        pytest.fail(f"${name}={path} is not an executable file")
    return path


def server_bin():
    return _env_path("ATTNSERVE_BIN")


def client_bin():
    return _env_path("ATTN_CLIENT_BIN")


def use_python_client():
    """Makes client/python importable, with stubs cached under the build dir."""
    source = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.normpath(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    path = os.path.join(source, "client", "python")
    if path not in sys.path:
        sys.path.insert(0, path)


class ServerProcess:
    """One attnserve process. Its combined stdout/stderr is drained by a thread
    (so a chatty server never blocks on a full pipe) and kept for diagnostics."""

    def __init__(self, *extra_args, startup_timeout=60.0, preexec_fn=None, wrapper=(), env=None):
        """`preexec_fn` runs in the child before exec (e.g. to set rlimits);
        `wrapper` is a command line the server runs under (e.g. unshare);
        `env` replaces the environment it inherits."""
        self.args = [*wrapper, server_bin(), "--address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
                     "--http-address", "127.0.0.1:0", *extra_args]
        self.lines = []
        self.port = None
        self.http_target = None  # "127.0.0.1:PORT" of the KServe HTTP endpoint, when on
        self._listening = threading.Event()
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace",
                                     preexec_fn=preexec_fn, env=env)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + startup_timeout
        while not self._listening.wait(0.05):
            if self.proc.poll() is not None:
                self._reader.join(5)
                pytest.fail(f"attnserve exited with {self.proc.returncode} before listening:\n{self.log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(f"attnserve printed no 'listening on' line within {startup_timeout}s:\n{self.log()}")

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            h = HTTP.search(line)
            if h and self.http_target is None:
                self.http_target = h.group(1)
            m = LISTENING.search(line)
            if m and self.port is None:
                self.port = int(m.group(2))
                self._listening.set()

    @property
    def target(self):
        return f"127.0.0.1:{self.port}"

    def log(self):
        return "".join(self.lines[-200:])

    def alive(self):
        return self.proc.poll() is None

    def wait(self, timeout=30.0):
        """Waits for an exit already under way (after a signal the test sent:
        a second signal would end the drain at once) and returns the exit code."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"attnserve did not exit within {timeout}s:\n{self.log()}")
        self._reader.join(5)
        return self.proc.returncode

    def stop(self, sig=signal.SIGTERM, timeout=30.0):
        """Sends `sig` and returns the exit code (fails if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(f"attnserve did not exit within {timeout}s of signal {sig}:\n{self.log()}")
        self._reader.join(5)
        return self.proc.returncode


def server_fixture():
    """Body of a session fixture: one server for the whole file; its clean
    SIGTERM exit is checked at teardown."""
    server = ServerProcess()
    yield server
    code = server.stop()
    assert code == 0, f"attnserve exited with {code} after SIGTERM:\n{server.log()}"


def reference_attention(q, k, v, *, causal=False, key_lengths=None, mask=None, scale=0.0,
                        window=0, softcap=0.0, sinks=None):
    """NumPy float64 oracle of the sdpa model: (output [B,Hq,Lq,Dv], weights
    [B,Hq,Lq,Lk]). Rows with no visible key give zeros, as DESIGN.md says.
    window: query i sees key j only if j >= i + Lk - Lq - window + 1 (and,
    without causal, j <= i + Lk - Lq + window - 1: a two-sided window);
    softcap: scores c * tanh(s / c) before the mask; sinks [Hq]: one more
    logit per head in each row's softmax denominator, with no value."""
    import numpy as np
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    k = np.repeat(k, hq // hkv, axis=1)  # query head h reads kv head h // (Hq/Hkv)
    v = np.repeat(v, hq // hkv, axis=1)
    lq, lk = q.shape[2], k.shape[2]
    s = scale if scale else 1.0 / np.sqrt(q.shape[-1])
    scores = np.einsum("bhid,bhjd->bhij", q, k) * s
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    allowed = np.ones(scores.shape, dtype=bool)
    if causal:
        allowed &= np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq)
    if window:
        allowed &= np.triu(np.ones((lq, lk), dtype=bool), k=lk - lq - window + 1)
        if not causal:
            allowed &= np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq + window - 1)
    if key_lengths is not None:
        allowed &= np.arange(lk)[None, None, None, :] < np.asarray(key_lengths)[:, None, None, None]
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            allowed &= mask
        else:
            scores = scores + mask.astype(np.float64)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[None, :, None, None]
        row_max = np.maximum(row_max, sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sink - row_max)
    p = np.where(denom > 0, p / np.where(denom > 0, denom, 1.0), 0.0)
    return p @ v, p
