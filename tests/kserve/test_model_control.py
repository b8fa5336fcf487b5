"""Model control (Triton's --model-control-mode) against the real server, with
Triton's own clients (tritonclient.grpc and tritonclient.http) and curl: poll
mode reloading a model whose weights change under load without a failed
request, a broken new version leaving the old one serving (reason in the
repository index, a failure in attnserve_model_loads_total); explicit mode's
RepositoryModelLoad/Unload over gRPC and HTTP, with the codes of every
refusal; unload under load; the default mode refusing load/unload; tokens
restricted to some models refused repository control.

Every answer is checked against an independent NumPy float64 oracle of
torch.nn.MultiheadAttention(16, 2, bias=False, batch_first=True) self-attention
computed from the weights this file wrote, never from the server's answers."""

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

ROOT = os.path.abspath(os.environ.get("ATTNSERVE_SOURCE_DIR") or
                       os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import harness  # noqa: E402

EMBED = 16
HEADS = 2
# The queries every test sends (self-attention: key and value omitted), a few
# lengths so that batches mix shapes.
QUERIES = [np.random.default_rng(100 + n).standard_normal((1, n, EMBED)).astype(np.float32)
           for n in (3, 5, 8)]
ATOL = 1e-4
UNAVAILABLE = "StatusCode.UNAVAILABLE"


# ---------------------------------------------------------------- model files

def make_weights(seed):
    """(in_proj_weight [3E, E], out_proj.weight [E, E]) of one version."""
    rng = np.random.default_rng(seed)
    w_in = (rng.standard_normal((3 * EMBED, EMBED)) * 0.4).astype(np.float32)
    w_out = (rng.standard_normal((EMBED, EMBED)) * 0.4).astype(np.float32)
    return w_in, w_out


def oracle(x, weights):
    """nn.MultiheadAttention self-attention, bias=False, batch_first, in float64:
    q, k, v = x Wq^T, x Wk^T, x Wv^T split into HEADS heads, softmax(q k^T /
    sqrt(head_dim)) v, heads concatenated, then x Wo^T."""
    w_in, w_out = (np.asarray(w, np.float64) for w in weights)
    x = np.asarray(x, np.float64)
    b, n, e = x.shape
    hd = e // HEADS
    wq, wk, wv = w_in[:e], w_in[e:2 * e], w_in[2 * e:]

    def heads(t):  # [B, L, E] -> [B, H, L, hd]
        return t.reshape(b, n, HEADS, hd).transpose(0, 2, 1, 3)
    q, k, v = heads(x @ wq.T), heads(x @ wk.T), heads(x @ wv.T)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    merged = (p @ v).transpose(0, 2, 1, 3).reshape(b, n, e)
    return merged @ w_out.T


def expected(weights):
    """The oracle's answer to each of QUERIES."""
    return [oracle(q, weights) for q in QUERIES]


def safetensors_bytes(weights):
    w_in, w_out = weights
    header, data = {}, b""
    for name, t in (("in_proj_weight", w_in), ("out_proj.weight", w_out)):
        raw = np.ascontiguousarray(t, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + data


def publish(path, content):
    """Written beside and renamed into place, as an operator publishes files."""
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(content if isinstance(content, bytes) else content.encode())
    os.replace(tmp, path)


def write_model(repo, name, weights, config=None):
    folder = os.path.join(repo, name)
    os.makedirs(folder, exist_ok=True)
    publish(os.path.join(folder, "weights.safetensors"), safetensors_bytes(weights))
    publish(os.path.join(folder, "config.pbtxt"),
            config if config is not None else f"embed_dim: {EMBED}\nnum_heads: {HEADS}\n")


# ------------------------------------------------------------------- helpers

@pytest.fixture
def start_server():
    """Starts servers; each must exit 0 on SIGTERM at teardown."""
    servers = []

    def start(*args):
        s = harness.ServerProcess("--backend=cpu", *args)
        servers.append(s)
        return s
    yield start
    for s in servers:
        code = s.stop()
        assert code == 0, f"attnserve exited with {code} after SIGTERM:\n{s.log()}"


def grpc_query(i):
    t = tg.InferInput("query", list(QUERIES[i].shape), "FP32")
    t.set_data_from_numpy(QUERIES[i])
    return [t]


def http_query(i):
    t = th.InferInput("query", list(QUERIES[i].shape), "FP32")
    t.set_data_from_numpy(QUERIES[i], binary_data=True)
    return [t]


def infer_grpc(client, model, i):
    """(status, output or message): "OK" with the output, else the error's
    status and message."""
    try:
        r = client.infer(model, grpc_query(i), client_timeout=30)
        return "OK", r.as_numpy("output")
    except InferenceServerException as e:
        return e.status(), e.message()


def matches(out, want):
    return out is not None and out.shape == want.shape and np.allclose(out, want, rtol=0, atol=ATOL)


def which_version(out, i, versions):
    """Index of the version whose oracle `out` (the answer to QUERIES[i]) is,
    else -1."""
    for v, answers in enumerate(versions):
        if matches(out, answers[i]):
            return v
    return -1


def metrics_text(server):
    address = re.search(r"metrics on (127\.0\.0\.1:\d+)", server.log()).group(1)
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()


def metric(server, name, **labels):
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in metrics_text(server).splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


def index_of(client):
    """{name: (state, reason)} of the repository index (gRPC)."""
    models = client.get_model_repository_index(as_json=True).get("models", [])
    return {m["name"]: (m.get("state", ""), m.get("reason", "")) for m in models}


def versions_differ(versions):
    for a in range(len(versions)):
        for b in range(a + 1, len(versions)):
            assert not all(np.allclose(x, y, atol=ATOL) for x, y in zip(versions[a], versions[b])), \
                f"versions {a} and {b} must differ for the test to mean anything"


class Clients:
    """`n` threads, each with its own gRPC client, inferring `model` without
    pause until stop(); each request's (start time, query index, status,
    output or message, end time) is kept."""

    def __init__(self, server, model, n=4):
        self.results = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(server.target, model, c),
                                          daemon=True) for c in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, target, model, c):
        client = tg.InferenceServerClient(target)
        n = c
        try:
            while not self._stop.is_set():
                i = n % len(QUERIES)
                n += 1
                start = time.monotonic()
                try:
                    status, out = infer_grpc(client, model, i)
                except Exception as e:  # anything but a KServe error is a failure too
                    status, out = f"exception {type(e).__name__}", str(e)
                with self._lock:
                    self.results.append((start, i, status, out, time.monotonic()))
        finally:
            client.close()

    def count(self):
        with self._lock:
            return len(self.results)

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(60)
            assert not t.is_alive(), "a client thread hung"
        return list(self.results)


# --------------------------------------------------------------------- tests

def test_poll_mode_reloads_under_load_without_a_failed_request(tmp_path, start_server):
    repo = str(tmp_path)
    weights = [make_weights(1)]
    write_model(repo, "a", weights[0])
    server = start_server("--model-repository", repo, "--model-control-mode=poll",
                          "--repository-poll-secs=1")
    # Versions published so far, each as the oracle's answers to QUERIES. A
    # version is added here before its file is renamed into place, so any
    # answer it gives is already known when a client checks it.
    versions = [expected(weights[0])]
    client = tg.InferenceServerClient(server.target)
    status, out = infer_grpc(client, "a", 0)
    assert status == "OK" and which_version(out, 0, versions) == 0, (status, out)

    clients = Clients(server, "a")
    checked = []  # the main thread's own requests
    try:
        while clients.count() < 20:
            time.sleep(0.01)
        for seed in (2, 3, 4):
            w = make_weights(seed)
            versions.append(expected(w))
            publish(os.path.join(repo, "a", "weights.safetensors"), safetensors_bytes(w))
            published = time.monotonic()
            while True:
                status, out = infer_grpc(client, "a", 1)
                checked.append((1, status, out))
                if status == "OK" and which_version(out, 1, versions) == len(versions) - 1:
                    break
                assert time.monotonic() - published < 10, \
                    f"version {len(versions) - 1} not served 10 s after it was published:\n" \
                    f"{server.log()}"
                time.sleep(0.05)
        time.sleep(0.3)
    finally:
        results = clients.stop()
    versions_differ(versions)

    all_answers = [(i, status, out) for _, i, status, out, _ in results] + checked
    failed = [(status, out) for _, status, out in all_answers if status != "OK"]
    assert not failed, f"{len(failed)} failed requests, e.g. {failed[:3]}"
    seen = [which_version(out, i, versions) for i, _, out in all_answers]
    assert -1 not in seen, "an answer that is no published version's"
    assert len(results) > 40, len(results)
    last = len(versions) - 1
    assert sum(1 for _, i, _, out, _ in results if which_version(out, i, versions) == last) > 0, \
        "the client threads never saw the last version"

    # A broken new version: the last good one keeps serving, the index says why.
    publish(os.path.join(repo, "a", "config.pbtxt"), f"embed_dim: {EMBED}\nnum_heads: 3\n")
    time.sleep(3)
    state, reason = index_of(client)["a"]
    assert state == "READY", (state, reason)
    assert "previous one is serving" in reason and "num_heads" in reason, reason
    assert client.is_model_ready("a")
    for i in range(len(QUERIES)):
        status, out = infer_grpc(client, "a", i)
        assert status == "OK" and which_version(out, i, versions) == last, (status, out)
    assert metric(server, "attnserve_model_loads_total", model="a", result="failure") >= 1
    assert metric(server, "attnserve_model_loads_total", model="a", result="success") >= 3
    client.close()


def test_explicit_mode_load_and_unload_over_grpc_http_and_curl(tmp_path, start_server):
    repo = str(tmp_path)
    wa, wb = make_weights(11), make_weights(12)
    write_model(repo, "a", wa)
    write_model(repo, "b", wb)
    want_a, want_b = expected(wa), expected(wb)
    versions_differ([want_a, want_b])
    server = start_server("--model-repository", repo, "--model-control-mode=explicit",
                          "--load-model", "a")
    assert server.http_target, server.log()
    g = tg.InferenceServerClient(server.target)
    h = th.InferenceServerClient(server.http_target)

    index = index_of(g)
    assert index["a"][0] == "READY", index
    assert index["b"][0] == "UNAVAILABLE" and "not loaded" in index["b"][1], index
    assert index["sdpa"][0] == "READY" and index["demo-mha"][0] == "READY", index
    status, out = infer_grpc(g, "a", 0)
    assert status == "OK" and matches(out, want_a[0]), (status, out)
    status, message = infer_grpc(g, "b", 0)
    assert status == UNAVAILABLE and "'b' is not ready" in message, (status, message)
    assert not g.is_model_ready("b")

    # A folder added after startup is listed (not loaded) and loads by name.
    wc = make_weights(13)
    write_model(repo, "c", wc)
    index = index_of(g)
    assert index["c"][0] == "UNAVAILABLE" and "not loaded" in index["c"][1], index
    g.load_model("c")
    status, out = infer_grpc(g, "c", 0)
    assert status == "OK" and matches(out, expected(wc)[0]), (status, out)

    # gRPC load: b serves, correctly.
    g.load_model("b")
    assert g.is_model_ready("b") and index_of(g)["b"] == ("READY", ""), index_of(g)["b"]
    for i in range(len(QUERIES)):
        status, out = infer_grpc(g, "b", i)
        assert status == "OK" and matches(out, want_b[i]), (i, status, out)

    # HTTP unload and load of b.
    h.unload_model("b")
    assert not h.is_model_ready("b")
    state, reason = index_of(g)["b"]
    assert state == "UNAVAILABLE" and "unloaded" in reason, (state, reason)
    status, message = infer_grpc(g, "b", 1)
    assert status == UNAVAILABLE and "'b' is not ready" in message, (status, message)
    h.load_model("b")
    assert h.is_model_ready("b")
    r = h.infer("b", http_query(2))
    assert matches(r.as_numpy("output"), want_b[2])

    # gRPC unload of a: refused UNAVAILABLE over gRPC, 503 over HTTP.
    g.unload_model("a")
    status, message = infer_grpc(g, "a", 0)
    assert status == UNAVAILABLE and "'a' is not ready" in message, (status, message)
    with pytest.raises(InferenceServerException) as e:
        h.infer("a", http_query(0))
    assert e.value.status() == "503" and "'a' is not ready" in e.value.message(), \
        (e.value.status(), e.value.message())
    state, reason = index_of(g)["a"]
    assert state == "UNAVAILABLE" and "unloaded" in reason, (state, reason)
    status, out = infer_grpc(g, "b", 0)  # b is untouched
    assert status == "OK" and matches(out, want_b[0]), (status, out)

    # Refusals: an unknown name, a built-in (both protocols).
    with pytest.raises(InferenceServerException) as e:
        g.load_model("no-such-model")
    assert e.value.status() == "StatusCode.NOT_FOUND" and "no model 'no-such-model'" in \
        e.value.message(), e.value.message()
    with pytest.raises(InferenceServerException) as e:
        h.load_model("no-such-model")
    assert e.value.status() == "404" and "no model 'no-such-model'" in e.value.message()
    for builtin in ("sdpa", "demo-mha"):
        for op in (g.load_model, g.unload_model):
            with pytest.raises(InferenceServerException) as e:
                op(builtin)
            assert e.value.status() == "StatusCode.FAILED_PRECONDITION", \
                (builtin, op.__name__, e.value.message())
        with pytest.raises(InferenceServerException) as e:
            h.load_model(builtin)
        assert e.value.status() == "400", (builtin, e.value.status(), e.value.message())
    assert g.is_model_ready("sdpa") and g.is_model_ready("demo-mha")

    # curl, as an operator would: a serves again.
    host, port = server.http_target.rsplit(":", 1)
    done = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                           f"http://{host}:{port}/v2/repository/models/a/load"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout == "200", (done.returncode, done.stdout,
                                                           done.stderr)
    assert index_of(g)["a"] == ("READY", ""), index_of(g)["a"]
    for i in range(len(QUERIES)):
        status, out = infer_grpc(g, "a", i)
        assert status == "OK" and matches(out, want_a[i]), (i, status, out)
    r = h.infer("a", http_query(1))
    assert matches(r.as_numpy("output"), want_a[1])

    assert metric(server, "attnserve_model_loads_total", model="b", result="success") >= 2
    assert metric(server, "attnserve_model_loads_total", model="a", result="success") >= 1
    assert metric(server, "attnserve_model_unloads_total", model="a") >= 1
    assert metric(server, "attnserve_model_unloads_total", model="b") >= 1
    g.close()
    h.close()


def test_mode_none_refuses_load_and_unload(tmp_path, start_server):
    repo = str(tmp_path)
    w = make_weights(21)
    write_model(repo, "a", w)
    server = start_server("--model-repository", repo)
    g = tg.InferenceServerClient(server.target)
    h = th.InferenceServerClient(server.http_target)
    for op in (g.load_model, g.unload_model):
        with pytest.raises(InferenceServerException) as e:
            op("a")
        assert e.value.status() == "StatusCode.FAILED_PRECONDITION", e.value.message()
        assert "--model-control-mode=explicit" in e.value.message(), e.value.message()
    for op in (h.load_model, h.unload_model):
        with pytest.raises(InferenceServerException) as e:
            op("a")
        assert e.value.status() == "400", (e.value.status(), e.value.message())
        assert "--model-control-mode=explicit" in e.value.message(), e.value.message()
    # Nothing changed: a still serves the files it read at startup.
    status, out = infer_grpc(g, "a", 0)
    assert status == "OK" and matches(out, expected(w)[0]), (status, out)
    g.close()
    h.close()


def test_unload_under_load_answers_every_request(tmp_path, start_server):
    repo = str(tmp_path)
    w = make_weights(31)
    write_model(repo, "a", w)
    want = expected(w)
    server = start_server("--model-repository", repo, "--model-control-mode=explicit",
                          "--load-model", "a")
    clients = Clients(server, "a")
    try:
        deadline = time.monotonic() + 10
        while clients.count() < 40:
            assert time.monotonic() < deadline, "the clients got no answers"
            time.sleep(0.01)
        g = tg.InferenceServerClient(server.target)
        g.unload_model("a")
        unloaded = time.monotonic()
        time.sleep(0.3)
    finally:
        results = clients.stop()
    ok = [r for r in results if r[2] == "OK"]
    refused = [r for r in results if r[2] == UNAVAILABLE and "'a'" in r[3]]
    other = [(r[2], r[3]) for r in results if r[2] != "OK" and r not in refused]
    assert not other, f"{len(other)} answers neither OK nor UNAVAILABLE naming 'a': {other[:3]}"
    wrong = [r for r in ok if not matches(r[3], want[r[1]])]
    assert not wrong, f"{len(wrong)} wrong answers"
    assert ok and refused, (len(ok), len(refused))
    late = [r for r in ok if r[0] > unloaded]
    assert not late, f"{len(late)} requests sent after unload_model returned were answered"
    assert all("'a' is not ready" in r[3] for r in refused if r[0] > unloaded)
    assert not g.is_model_ready("a")
    g.close()


def test_tokens_restricted_to_models_cannot_load_or_unload(tmp_path, start_server):
    repo = str(tmp_path)
    write_model(repo, "a", make_weights(41))
    full, restricted = "mc-full-0123456789abcdef0123456789", "mc-some-0123456789abcdef0123456789"
    tokens = os.path.join(repo, "..", "tokens")
    with open(tokens, "w") as f:
        f.write(f"{full}\n{restricted} a sdpa\n")
    server = start_server("--model-repository", repo, "--model-control-mode=explicit",
                          "--load-model", "a", "--auth-token-file", tokens)
    auth = lambda token: {"authorization": f"Bearer {token}"}  # noqa: E731
    g = tg.InferenceServerClient(server.target)
    h = th.InferenceServerClient(server.http_target)
    for op in (g.load_model, g.unload_model):
        with pytest.raises(InferenceServerException) as e:
            op("a", headers=auth(restricted))
        assert e.value.status() == "StatusCode.PERMISSION_DENIED", e.value.message()
    for op in (h.load_model, h.unload_model):
        with pytest.raises(InferenceServerException) as e:
            op("a", headers={"Authorization": f"Bearer {restricted}"})
        assert e.value.status() == "403", (e.value.status(), e.value.message())
    assert g.is_model_ready("a", headers=auth(restricted))
    g.unload_model("a", headers=auth(full))
    assert not g.is_model_ready("a", headers=auth(full))
    g.load_model("a", headers=auth(full))
    assert g.is_model_ready("a", headers=auth(full))
    g.close()
    h.close()
