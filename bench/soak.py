"""The soak's load and its judge (bench/soak.sh runs it against a real server):
mixed traffic for a given time while the server's RSS and open file
descriptors are sampled; fails on any answer whose status the request's kind
does not allow, on RSS growth after warm-up over a bound, and on descriptors
left open.

    soak.py TARGET PID DURATION_S     Env: SOAK_RSS_BOUND_MB (default 10),
                                      SOAK_THREADS (default 4),
                                      SOAK_WARMUP_S (default max(30, 25% of DURATION)),
                                      SOAK_SAMPLES (CSV of the samples, optional),
                                      SOAK_JSON (the summary as JSON, optional)

Mix (each client thread draws one per iteration): unary and stream; valid
small (sdpa, B1 H2 L8 D16, every 50th checked against NumPy) and large (sdpa
B1 H8 L256 D64, demo-mha 128 tokens); invalid (shape mismatch, NaN, scores
over the work bound, unknown model, unparseable bytes on every RPC); cancelled
in flight; deadlines of 1 ms; with SOAK_HTTP, KServe v2 over HTTP (JSON and binary inferences,
malformed JSON, an unknown model, a Content-Length over the limit, a body cut
short); with SOAK_MODEL (a repository model, explicit model control), that
model inferred, unloaded and loaded again over HTTP. RSS growth is the median of the last 10% of
samples minus the median of the first 10% after warm-up (a leak moves both the
trend and the peak; transient large requests move only the peak, which is
reported too), and it fails the soak only when the RSS 2 s after the load
has stopped is over the bound too: a leak stays, while what the load itself
holds (requests in flight, their connections, a model being reloaded) goes
with it. One CI run ended its load 14.0 MB over its warm-up and was 0.5 MB
under it 2 s later.
"""

import collections
import json
import os
import random
import statistics
import sys
import threading
import time

import grpc
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client", "python"))
from attnserve_client import AttentionClient, stubs  # noqa: E402

pb = stubs.attention_pb2
SERVICE = "/attnserve.v1.AttentionService/"
C = grpc.StatusCode


def _identity(x):
    return x


def rss_and_fds(pid):
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb / 1024.0, len(os.listdir(f"/proc/{pid}/fd"))


def reference(q, k, v):
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    s = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", s / s.sum(-1, keepdims=True), v.astype(np.float64))


class Load:
    def __init__(self, target):
        self.target = target
        self.counts = collections.Counter()  # (kind, code) -> n
        self.unexpected = []  # (kind, code, details), first 50 kept
        self.unexpected_n = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def record(self, kind, code, allowed, details=""):
        with self.lock:
            self.counts[(kind, code.name)] += 1
            if code not in allowed:
                self.unexpected_n += 1
                if len(self.unexpected) < 50:
                    self.unexpected.append((kind, code.name, details[:300]))

    # ------------------------------------------------------------ requests

    def run_thread(self, seed):
        rng = np.random.default_rng(seed)
        pick = random.Random(seed)
        with AttentionClient(self.target, timeout=60) as client:
            channel = grpc.insecure_channel(self.target, options=[
                ("grpc.max_receive_message_length", 1 << 30),
                ("grpc.max_send_message_length", 1 << 30)])
            raw = {m: channel.unary_unary(SERVICE + m, request_serializer=_identity,
                                          response_deserializer=_identity)
                   for m in ("Attend", "ListModels", "GetModel")}
            stream = channel.stream_stream(SERVICE + "AttendStream", request_serializer=_identity,
                                           response_deserializer=_identity)
            kinds = [k for k, w in WEIGHTS.items() for _ in range(w)]
            n = 0
            while not self.stop.is_set():
                kind = pick.choice(kinds)
                n += 1
                try:
                    getattr(self, "do_" + kind)(client, raw, stream, rng, n)
                except grpc.RpcError as e:
                    self.record(kind, e.code(), ALLOWED[kind], e.details() or "")
                except Exception as e:  # a bug in the soak or a wrong answer
                    self.record(kind, C.UNKNOWN, ALLOWED[kind], f"{type(e).__name__}: {e}")
            channel.close()

    def _small(self, client, rng, ident="", **kw):
        q = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
        k = rng.standard_normal((1, 2, 12, 16)).astype(np.float32)
        v = rng.standard_normal((1, 2, 12, 16)).astype(np.float32)
        r = client.build_request(q, k, v, model="sdpa", **kw)
        r.id = ident
        return r, (q, k, v)

    def _large(self, client, rng):
        q = rng.standard_normal((1, 8, 256, 64)).astype(np.float32)
        return client.build_request(q, q, q, model="sdpa")

    def do_small(self, client, raw, stream, rng, n):
        r, (q, k, v) = self._small(client, rng)
        out = client.attend_request(r).output
        if out.shape != (1, 2, 8, 16):
            raise AssertionError(f"output shape {out.shape}")
        if n % 50 == 0 and not np.allclose(out, reference(q, k, v), rtol=1e-4, atol=1e-5):
            raise AssertionError("output differs from the NumPy reference")
        self.record("small", C.OK, ALLOWED["small"])

    def do_large(self, client, raw, stream, rng, n):
        if n % 2:
            out = client.attend_request(self._large(client, rng)).output
            ok = out.shape == (1, 8, 256, 64)
        else:
            x = rng.standard_normal((1, 128, 512)).astype(np.float32)
            out = client.attend(x, model="demo-mha").output
            ok = out.shape == (1, 128, 512)
        if not ok or not np.isfinite(out).all():
            raise AssertionError(f"bad large output {out.shape}")
        self.record("large", C.OK, ALLOWED["large"])

    def do_http(self, client, raw, stream, rng, n):
        """KServe v2 over HTTP, valid and hostile, each with the status the
        API gives it: JSON and binary inferences (every 10th checked against
        NumPy), malformed JSON 400, an unknown model 404, a Content-Length
        over the limit 413, and a body cut short (the client leaves)."""
        import socket
        import urllib.error
        import urllib.request
        http = os.environ["SOAK_HTTP"]
        host, port = http.rsplit(":", 1)
        case = n % 6

        def post(path, body, headers=None):
            req = urllib.request.Request(f"http://{http}{path}", data=body, headers=headers or {})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, r.read(), r.headers
            except urllib.error.HTTPError as e:
                return e.code, e.read(), e.headers

        q = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
        k = rng.standard_normal((1, 2, 12, 16)).astype(np.float32)
        v = rng.standard_normal((1, 2, 12, 16)).astype(np.float32)
        arrays = (("query", q), ("key", k), ("value", v))
        if case in (0, 1):
            if case == 0:
                body = json.dumps({"inputs": [{"name": name, "shape": list(a.shape),
                                               "datatype": "FP32", "data": a.ravel().tolist()}
                                              for name, a in arrays]}).encode()
                status, out, _ = post("/v2/models/sdpa/infer", body)
                got = np.array(json.loads(out)["outputs"][0]["data"], np.float32) \
                    if status == 200 else None
            else:
                header = json.dumps({
                    "inputs": [{"name": name, "shape": list(a.shape), "datatype": "FP32",
                                "parameters": {"binary_data_size": a.nbytes}}
                               for name, a in arrays],
                    "parameters": {"binary_data_output": True}}).encode()
                status, out, headers = post(
                    "/v2/models/sdpa/infer", header + b"".join(a.tobytes() for _, a in arrays),
                    {"Inference-Header-Content-Length": str(len(header))})
                got = None
                if status == 200:
                    split = int(headers["Inference-Header-Content-Length"])
                    got = np.frombuffer(out[split:], np.float32)
            if status != 200:
                raise AssertionError(f"HTTP infer answered {status}: {out[:200]!r}")
            if n % 10 == 0 and not np.allclose(got.reshape(1, 2, 8, 16), reference(q, k, v),
                                                rtol=1e-4, atol=1e-5):
                raise AssertionError("HTTP output differs from the NumPy reference")
        elif case == 2:
            status, out, _ = post("/v2/models/sdpa/infer", b'{"inputs": [{"name": ')
            if status != 400 or b"malformed JSON" not in out:
                raise AssertionError(f"malformed JSON answered {status}: {out[:200]!r}")
        elif case == 3:
            status, out, _ = post("/v2/models/no-such-model/infer", b'{"inputs": []}')
            if status != 404:
                raise AssertionError(f"unknown model answered {status}: {out[:200]!r}")
        elif case == 4:
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(b"POST /v2/models/sdpa/infer HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: 1099511627776\r\n\r\n")
                answer = sock.recv(4096)
            if not answer.startswith(b"HTTP/1.1 413"):
                raise AssertionError(f"oversize Content-Length answered {answer[:100]!r}")
        else:
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(b"POST /v2/models/sdpa/infer HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: 5000\r\n\r\n{\"inputs\"")
        self.record("http", C.OK, ALLOWED["http"])

    def do_model(self, client, raw, stream, rng, n):
        """Model control under load: SOAK_MODEL (nn.MultiheadAttention,
        embed 256) inferred over gRPC -- OK, or UNAVAILABLE naming it while
        unloaded -- and every 4th draw unloaded or loaded again over HTTP
        (each 200): its weights come and go while the rest of the mix runs."""
        import urllib.request
        model = os.environ["SOAK_MODEL"]
        if n % 4 == 0:
            action = "unload" if (n // 4) % 2 else "load"
            req = urllib.request.Request(
                f"http://{os.environ['SOAK_HTTP']}/v2/repository/models/{model}/{action}",
                data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=60) as r:
                if r.status != 200:
                    raise AssertionError(f"{action} answered {r.status}")
            self.record("model", C.OK, ALLOWED["model"])
            return
        x = rng.standard_normal((1, 16, 256)).astype(np.float32)
        try:
            out = client.attend(x, model=model).output
        except grpc.RpcError as e:
            if e.code() == C.UNAVAILABLE and f"'{model}'" in (e.details() or ""):
                self.record("model", C.UNAVAILABLE, ALLOWED["model"])
                return
            raise
        if out.shape != (1, 16, 256) or not np.isfinite(out).all():
            raise AssertionError(f"bad {model} output {out.shape}")
        self.record("model", C.OK, ALLOWED["model"])

    def do_invalid(self, client, raw, stream, rng, n):
        """Each case has the one code the API documents for it."""
        case = n % 5
        expected = (C.INVALID_ARGUMENT, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.NOT_FOUND,
                    C.INVALID_ARGUMENT)[case]
        try:
            if case == 0:  # key head dim differs
                q = np.zeros((1, 2, 4, 8), np.float32)
                r = client.build_request(q, np.zeros((1, 2, 4, 9), np.float32),
                                         np.zeros((1, 2, 4, 8), np.float32), model="sdpa")
                client.attend_request(r)
            elif case == 1:  # NaN
                r, (q, _, _) = self._small(client, rng)
                q[0, 0, 0, 0] = np.nan
                r.query.data = q.tobytes()
                client.attend_request(r)
            elif case == 2:  # 2^29 scores from 320 KB: over --max-attention-scores
                q = np.zeros((1, 1, 1 << 14, 1), np.float32)
                kv = np.zeros((1, 1, 1 << 15, 1), np.float32)
                client.attend_request(client.build_request(q, kv, kv, model="sdpa"))
            elif case == 3:
                r, _ = self._small(client, rng)
                r.model = "no-such-model"
                client.attend_request(r)
            else:  # unparseable, on each RPC in turn
                method = ("Attend", "ListModels", "GetModel")[(n // 5) % 3]
                raw[method](b"\xff\xff\xff", timeout=30)
        except grpc.RpcError as e:
            self.record("invalid", e.code(), {expected}, f"case {case}: {e.details()}")
            return
        self.record("invalid", C.OK, {expected}, f"case {case} was answered OK")

    def do_stream(self, client, raw, stream, rng, n):
        """Ten messages, valid and not; each answered with its own code."""
        msgs, want = [], {}
        for i in range(10):
            kind = (n + i) % 4
            if kind == 3:
                msgs.append(b"\xff\xff")
                want.setdefault("", []).append(3)
                continue
            r, (q, _, _) = self._small(client, rng, ident=f"m{i}")
            if kind == 2:
                q[0, 1, 2, 3] = np.inf
                r.query.data = q.tobytes()
            want[r.id] = [3 if kind == 2 else 0]
            msgs.append(r.SerializeToString())
        call = stream(iter(msgs), timeout=60)
        got = {}
        for b in call:
            a = pb.AttendStreamResponse.FromString(b)
            got.setdefault(a.id, []).append(a.code)
        if {k: sorted(v) for k, v in got.items()} != {k: sorted(v) for k, v in want.items()}:
            raise AssertionError(f"stream answers {got} != {want}")
        self.record("stream", call.code(), ALLOWED["stream"])

    def do_cancel(self, client, raw, stream, rng, n):
        if n % 2:
            fut = client.stub.Attend.future(self._large(client, rng), timeout=60)
            time.sleep(rng.uniform(0, 0.01))
            fut.cancel()
            try:
                fut.result()
                self.record("cancel", C.OK, ALLOWED["cancel"])
            except grpc.FutureCancelledError:
                self.record("cancel", C.CANCELLED, ALLOWED["cancel"])
        else:  # a stream cancelled mid-way
            msgs = [self._large(client, rng).SerializeToString() for _ in range(3)]
            call = stream(iter(msgs), timeout=60)
            time.sleep(rng.uniform(0, 0.01))
            call.cancel()
            try:
                for _ in call:
                    pass
                self.record("cancel", call.code(), ALLOWED["cancel"])
            except grpc.RpcError as e:
                self.record("cancel", e.code(), ALLOWED["cancel"])

    def do_deadline(self, client, raw, stream, rng, n):
        client.stub.Attend(self._large(client, rng), timeout=0.001)
        self.record("deadline", C.OK, ALLOWED["deadline"])


WEIGHTS = {"small": 10, "large": 2, "invalid": 5, "stream": 2, "cancel": 2, "deadline": 2}
if os.environ.get("SOAK_HTTP"):  # the KServe HTTP endpoint's host:port
    WEIGHTS["http"] = 4
if os.environ.get("SOAK_MODEL") and os.environ.get("SOAK_HTTP"):
    WEIGHTS["model"] = 2
ALLOWED = {
    # UNAVAILABLE only while the model is unloaded (do_model checks it names it).
    "model": {C.OK, C.UNAVAILABLE},
    # do_http checks each case's own status; OK means it got it.
    "http": {C.OK},
    "small": {C.OK},
    "large": {C.OK},
    # Each case is checked against its own code in do_invalid; these are the
    # codes any of them may have.
    "invalid": {C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.NOT_FOUND},
    "stream": {C.OK},
    "cancel": {C.OK, C.CANCELLED},
    "deadline": {C.OK, C.DEADLINE_EXCEEDED},
}


def worker(target, seed, end, out):
    """One client process: draws requests until `end` (time.time()),
    writing its counts to `out` every 2 s (so a client that dies keeps what
    it counted)."""
    load = Load(target)

    def save():
        with load.lock:
            data = {"counts": [[k, c, n] for (k, c), n in load.counts.items()],
                    "unexpected": load.unexpected, "unexpected_n": load.unexpected_n}
        with open(out + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(out + ".tmp", out)

    t = threading.Thread(target=load.run_thread, args=(seed,), daemon=True)
    t.start()
    parent = os.getppid()
    # Stops early when the soak itself is gone (no orphaned load).
    while time.time() < end and t.is_alive() and os.getppid() == parent:
        time.sleep(min(2.0, max(0.0, end - time.time())))
        save()
    load.stop.set()
    t.join(120)
    save()


def main():
    if sys.argv[1] == "--worker":
        return worker(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
    target, pid, duration = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    bound_mb = float(os.environ.get("SOAK_RSS_BOUND_MB", "10"))
    threads = int(os.environ.get("SOAK_THREADS", "4"))
    warmup = float(os.environ.get("SOAK_WARMUP_S", max(30.0, duration / 4)))
    interval = min(5.0, max(1.0, duration / 120))

    # Each client is its own process: grpcio 1.51's Python client can
    # abort (absl "Mutex unlocked when destroyed") under heavy cancelling;
    # a client that dies is counted and replaced, and its connections
    # closing abruptly is one more thing the server has to survive.
    import subprocess
    import tempfile
    scratch = tempfile.mkdtemp(prefix="attnserve-soak-")
    end = time.time() + duration
    files, procs, client_aborts = [], {}, []

    def spawn(slot):
        out = os.path.join(scratch, f"w{slot}-{len(files)}.json")
        files.append(out)
        procs[slot] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", target,
             str(1000 + len(files)), str(end), out])

    import atexit
    atexit.register(lambda: [p.kill() for p in procs.values() if p.poll() is None])
    for i in range(threads):
        spawn(i)
    start = time.monotonic()
    samples = []  # (t, rss_mb, fds, requests so far)
    next_report = start + 60

    def requests_so_far():
        n = 0
        for path in files:
            try:
                with open(path) as f:
                    n += sum(c[2] for c in json.load(f)["counts"])
            except (OSError, ValueError):
                pass
        return n

    while True:
        now = time.monotonic()
        if now - start >= duration:
            break
        for slot, proc in list(procs.items()):
            if proc.poll() is not None and time.time() < end - 5:
                client_aborts.append(proc.returncode)
                spawn(slot)
        rss, fds = rss_and_fds(pid)
        samples.append((now - start, rss, fds, requests_so_far()))
        if now >= next_report:
            print(f"soak: {now - start:6.0f} s  rss {rss:7.1f} MB  fds {fds:4d}  "
                  f"requests {samples[-1][3]}  client aborts {len(client_aborts)}", flush=True)
            next_report += 60
        time.sleep(interval)
    for proc in procs.values():
        try:
            proc.wait(150)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0:
            client_aborts.append(proc.returncode)
    load = Load(target)
    for path in files:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        for k, c, n in data["counts"]:
            load.counts[(k, c)] += n
        load.unexpected.extend(tuple(u) for u in data["unexpected"])
        load.unexpected_n += data["unexpected_n"]
    time.sleep(2)  # answers and connections settle
    rss_end, fds_end = rss_and_fds(pid)

    after = [s for s in samples if s[0] >= warmup]
    if len(after) < 10:
        sys.exit(f"soak: only {len(after)} samples after the {warmup:.0f} s warm-up; run longer")
    tenth = max(1, len(after) // 10)
    start_mb = statistics.median(s[1] for s in after[:tenth])
    end_mb = statistics.median(s[1] for s in after[-tenth:])
    growth = end_mb - start_mb
    after_growth = rss_end - start_mb  # what stays once the load is gone
    peak = max(s[1] for s in after) - after[0][1]
    fds_warm = after[0][2]
    unexpected = load.unexpected_n
    total = sum(load.counts.values())
    summary = {
        "duration_s": duration, "warmup_s": warmup, "threads": threads, "requests": total,
        "rate_rps": total / duration, "rss_at_warmup_mb": start_mb, "rss_end_mb": end_mb,
        "rss_growth_mb": growth, "rss_growth_after_load_mb": after_growth,
        "rss_peak_over_warmup_mb": peak,
        "rss_max_mb": max(s[1] for s in samples), "rss_bound_mb": bound_mb,
        "fds_at_warmup": fds_warm, "fds_max": max(s[2] for s in samples),
        "fds_after_load": fds_end, "rss_after_load_mb": rss_end,
        "unexpected": unexpected, "client_aborts": client_aborts,
        "counts": {f"{k}:{c}": n for (k, c), n in sorted(load.counts.items())},
    }
    if os.environ.get("SOAK_SAMPLES"):
        with open(os.environ["SOAK_SAMPLES"], "w") as f:
            f.write("t_s,rss_mb,fds,requests\n")
            for s in samples:
                f.write(f"{s[0]:.1f},{s[1]:.2f},{s[2]},{s[3]}\n")
    if os.environ.get("SOAK_JSON"):
        with open(os.environ["SOAK_JSON"], "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    failures = []
    if unexpected:
        failures.append(f"{unexpected} answers with a status their kind does not allow, e.g. "
                        f"{load.unexpected[:5]}")
    if growth > bound_mb and after_growth > bound_mb:
        failures.append(f"RSS grew {growth:.1f} MB after warm-up, and {after_growth:.1f} MB "
                        f"stayed after the load (bound {bound_mb} MB)")
    # Connections of the soak's clients are closed by now: what is left open
    # beyond the warm-up count (which had them all open) is a leak.
    if fds_end > fds_warm:
        failures.append(f"{fds_end} descriptors open after the load vs {fds_warm} during warm-up")
    if total == 0 or load.counts[("small", "OK")] == 0:
        failures.append("no request succeeded")
    if failures:
        sys.exit("soak: FAILED: " + "; ".join(failures))
    print(f"soak: PASSED: {total} requests in {duration:.0f} s, RSS growth after warm-up "
          f"{growth:+.1f} MB, {after_growth:+.1f} MB after the load (bound {bound_mb} MB), "
          f"peak {peak:+.1f} MB, fds {fds_warm} -> "
          f"{fds_end}, no unexpected status"
          + (f" ({len(client_aborts)} client processes aborted and were replaced)"
             if client_aborts else ""))


if __name__ == "__main__":
    main()
