"""Dynamic batching through the real attnserve binary: batch invariance with
random co-tenants, AttendStream (per-message id and status, flow control),
queue policy (full, deadline, cancellation) and graceful SIGTERM.

Queue-policy tests hold requests in the queue deterministically with a very
long --max-queue-delay-us and a large --max-batch-requests: nothing runs until
the test lets it (or the server drains on shutdown), so no test depends on
how fast this machine computes."""

import concurrent.futures
import signal
import threading
import time

import grpc
import numpy as np
import pytest

import harness
import serving_util as su
from attnserve_client import AttentionClient, stubs

pb = stubs.attention_pb2

HOLD = ["--max-batch-requests", "64", "--max-batch-tokens", "0", "--max-queue-delay-us", "60000000"]  # 60 s


def _server(*args):
    return harness.ServerProcess(*args)


def _stop_ok(srv):
    code = srv.stop(timeout=120)
    assert code == 0, f"attnserve exited with {code}:\n{srv.log()}"


def _kill(srv):
    """Cleanup after a failed test: never leave a server behind."""
    if srv.alive():
        srv.proc.kill()
        srv.proc.wait()


def _wait_for_count(srv, code, n):
    """Scrapes until attnserve_requests_total{model=sdpa,code} == n; returns the scrape."""
    def ready():
        samples = su.scrape(srv)
        hit = su.metric(samples, "attnserve_requests_total", model="sdpa", code=code) == n
        return samples if hit else None
    return su.wait_for(ready, 30, f"{n} {code} answers")


def _sdpa_request(client, rng, b, hq, hkv, lq, lk, d, **kw):
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, lk, d)).astype(np.float32)
    return client.build_request(q, k, v, model="sdpa", **kw)


def _mha_request(client, rng, b, l, **kw):
    q = rng.standard_normal((b, l, 512)).astype(np.float32)
    return client.build_request(q, model="demo-mha", **kw)


def _co_tenant(client, rng, model):
    """A random request of other lengths and options for `model`."""
    b = int(rng.integers(1, 4))
    causal = bool(rng.integers(0, 2))
    if model == "demo-mha":
        l = int(rng.integers(1, 48))
        kw = {}
        if rng.integers(0, 2):
            kw["key_lengths"] = rng.integers(0, l + 1, size=b)
        return _mha_request(client, rng, b, l, causal=causal, **kw)
    hkv = int(rng.choice([1, 2]))
    hq = hkv * int(rng.integers(1, 4))
    lq, lk = int(rng.integers(1, 30)), int(rng.integers(1, 30))
    kw = {}
    if rng.integers(0, 2):
        kw["attn_mask"] = rng.random((lq, lk)) < 0.8
    return _sdpa_request(client, rng, b, hq, hkv, lq, lk, 32, causal=causal, **kw)


# ------------------------------------------------------------- invariance

@pytest.fixture(scope="module")
def batching_server():
    # 5 ms of delay so that concurrent requests reliably share batches.
    srv = _server("--max-batch-requests", "16", "--max-queue-delay-us", "5000")
    yield srv
    _stop_ok(srv)


@pytest.mark.parametrize("model", ["demo-mha", "sdpa"])
def test_batch_invariance_with_random_co_tenants(batching_server, model):
    """The same request alone and inside mixed batches (any position, other
    lengths, masks, causal) gives bitwise the same output."""
    rng = np.random.default_rng(2024)
    with AttentionClient(batching_server.target, timeout=120) as c:
        if model == "demo-mha":
            targets = [_mha_request(c, rng, 1, 13),
                       _mha_request(c, rng, 2, 9, causal=True, key_lengths=[9, 4])]
        else:
            targets = [_sdpa_request(c, rng, 2, 4, 2, 7, 11, 32),
                       _sdpa_request(c, rng, 1, 2, 1, 5, 17, 32, causal=True,
                                     attn_mask=rng.random((1, 1, 5, 17)) < 0.7)]
        alone = []
        for t in targets:
            r = c.attend_request(t)
            assert r.timing.batch_requests == 1, "a lone request should run alone"
            alone.append(r.response.output.data)

        jobs = []
        for i in range(72):
            if i % 3 == 0:
                jobs.append((i // 3 % len(targets), targets[i // 3 % len(targets)]))
            else:
                jobs.append((None, _co_tenant(c, rng, model)))
        order = rng.permutation(len(jobs))
        shared = 0
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            futures = [(jobs[j][0], pool.submit(c.attend_request, jobs[j][1])) for j in order]
            for which, f in futures:
                r = f.result()
                if which is None:
                    continue
                assert r.response.output.data == alone[which], \
                    f"target {which} differs inside a batch of {r.timing.batch_requests}"
                shared = max(shared, r.timing.batch_requests)
        assert shared > 1, "no target request ever shared a batch: the test proved nothing"


# -------------------------------------------------------------- streaming

def test_stream_interleaved_good_and_bad(batching_server):
    rng = np.random.default_rng(7)
    with AttentionClient(batching_server.target, timeout=120) as c:
        good = _sdpa_request(c, rng, 1, 2, 2, 4, 6, 16)
        want_good = c.attend_request(good).response.output.data
        bad_dtype = pb.AttendRequest()
        bad_dtype.CopyFrom(good)
        bad_dtype.key.dtype = pb.DATA_TYPE_UNSPECIFIED
        bad_shape = pb.AttendRequest()
        bad_shape.CopyFrom(good)
        bad_shape.value.shape[2] = 5  # value length != key length (and byte size)
        unknown = pb.AttendRequest()
        unknown.CopyFrom(good)
        unknown.model = "no-such-model"
        kinds = [(good, "OK"), (bad_dtype, "INVALID_ARGUMENT"), (good, "OK"),
                 (bad_shape, "INVALID_ARGUMENT"), (unknown, "NOT_FOUND")]
        requests, want = [], {}
        for i in range(40):
            base, code = kinds[i % len(kinds)]
            r = pb.AttendRequest()
            r.CopyFrom(base)
            r.id = f"msg-{i}"
            requests.append(r)
            want[r.id] = code
        got = {}
        for resp in c.stub.AttendStream(iter(requests), timeout=120):
            assert resp.id not in got, f"two answers for {resp.id}"
            got[resp.id] = grpc.StatusCode(
                next(s for s in grpc.StatusCode if s.value[0] == resp.code)).name
            if resp.code == 0:
                assert resp.response.id == resp.id
                assert resp.response.output.data == want_good
            else:
                assert resp.message, f"{resp.id}: error without a message"
                assert not resp.HasField("response")
        assert got == want


def test_stream_stops_reading_when_client_stops_reading(batching_server):
    """With the client not reading responses, the server's backlog fills and
    it stops reading requests; the client's sends stall well short of the
    total. Once the client reads, every message is answered."""
    total = 400
    rng = np.random.default_rng(3)
    with AttentionClient(batching_server.target, timeout=300) as c:
        # 256 KiB of query (and of output) per message, tiny keys: cheap to
        # compute, heavy on the wire.
        base = _sdpa_request(c, rng, 1, 1, 1, 1024, 8, 64)
        pulled = [0]

        def messages():
            for i in range(total):
                r = pb.AttendRequest()
                r.CopyFrom(base)
                r.id = str(i)
                pulled[0] += 1
                yield r

        responses = c.stub.AttendStream(messages(), timeout=300)
        # Wait until the client's sending has stalled (no progress for 1 s).
        last, stable_since = -1, time.monotonic()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.25)
            if pulled[0] != last:
                last, stable_since = pulled[0], time.monotonic()
            elif time.monotonic() - stable_since >= 1.0:
                break
        stalled_at = pulled[0]
        assert stalled_at < total, "the server kept reading although nobody read its responses"
        ids = [r.id for r in responses if r.code == 0]
        assert sorted(ids, key=int) == [str(i) for i in range(total)]
        print(f"client sends stalled after {stalled_at} of {total} messages")


# ----------------------------------------------------------- queue policy

def _held_request(client, rng, rid="held"):
    return _sdpa_request(client, rng, 1, 1, 1, 4, 4, 8, request_id=rid)


def test_queue_full_is_resource_exhausted_at_once():
    srv = _server(*HOLD, "--max-queue-size", "3")
    try:
        rng = np.random.default_rng(1)
        with AttentionClient(srv.target, timeout=120) as c:
            held = [c.stub.Attend.future(_held_request(c, rng, f"h{i}"), timeout=120) for i in range(3)]
            su.wait_for(lambda: su.metric(su.scrape(srv), "attnserve_queue_depth", model="sdpa") == 3,
                        30, "3 queued requests")
            for _ in range(2):
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    c.attend_request(_held_request(c, rng), timeout=30)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "queue of model sdpa is full (3 requests)" in e.value.details(), e.value.details()
                assert time.monotonic() - t0 < 5, "refusal should be immediate"
            samples = su.scrape(srv)
            assert su.metric(samples, "attnserve_requests_total", model="sdpa",
                             code="RESOURCE_EXHAUSTED") == 2
            # The held ones are still queued; shutdown drains them as one batch.
            assert not any(f.done() for f in held)
            _stop_ok(srv)
            for f in held:
                assert f.result(timeout=60).timing.batch_requests == 3
    finally:
        _kill(srv)


def test_deadline_in_queue_is_deadline_exceeded_and_never_computed():
    srv = _server(*HOLD)
    try:
        rng = np.random.default_rng(2)
        with AttentionClient(srv.target, timeout=120) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.attend_request(_held_request(c, rng), timeout=1.0)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The server itself answered DEADLINE_EXCEEDED and computed nothing.
            samples = _wait_for_count(srv, "DEADLINE_EXCEEDED", 1)
            assert su.metric(samples, "attnserve_batch_requests_count", model="sdpa") == 0
            assert su.metric(samples, "attnserve_tokens_total", model="sdpa") == 0
            assert su.metric(samples, "attnserve_queue_depth", model="sdpa") == 0
        _stop_ok(srv)
    finally:
        _kill(srv)


def test_cancelled_request_leaves_the_queue():
    srv = _server(*HOLD)
    try:
        rng = np.random.default_rng(3)
        with AttentionClient(srv.target, timeout=120) as c:
            f = c.stub.Attend.future(_held_request(c, rng), timeout=120)
            su.wait_for(lambda: su.metric(su.scrape(srv), "attnserve_queue_depth", model="sdpa") == 1,
                        30, "the request to be queued")
            assert f.cancel()
            samples = _wait_for_count(srv, "CANCELLED", 1)
            assert su.metric(samples, "attnserve_queue_depth", model="sdpa") == 0
            assert su.metric(samples, "attnserve_inflight_requests", model="sdpa") == 0
            assert su.metric(samples, "attnserve_batch_requests_count", model="sdpa") == 0
        _stop_ok(srv)
    finally:
        _kill(srv)


def _health(client):
    try:
        return client.health(timeout=5)
    except grpc.RpcError as e:
        return e.code().name


def test_sigterm_completes_every_accepted_request_and_exits_zero():
    """K unary requests and a stream of M messages are accepted and held in the
    queue; the stream's client does not read. On SIGTERM: health turns
    NOT_SERVING, a new request gets UNAVAILABLE (the server keeps serving
    refusals while the stream's answers wait for its reader), every accepted
    request completes correctly, the stream ends UNAVAILABLE once answered,
    and the process exits 0."""
    unary, streamed = 20, 48
    # Room for all 68 in one held batch: with HOLD's 64, a full batch would
    # close and complete before the in-flight gauge could read 68.
    srv = _server(*HOLD, "--max-batch-requests", "128", "--shutdown-grace", "60s")
    release = threading.Event()
    try:
        rng = np.random.default_rng(4)
        with AttentionClient(srv.target, timeout=120) as c:
            reqs = [_sdpa_request(c, rng, 1, 2, 1, int(rng.integers(1, 20)), int(rng.integers(1, 20)), 16,
                                  request_id=f"r{i}") for i in range(unary)]
            futures = [c.stub.Attend.future(r, timeout=120) for r in reqs]
            # 1 MiB answers: far more than HTTP/2 windows hold unread.
            big = _sdpa_request(c, rng, 1, 1, 1, 4096, 8, 64)

            def messages():
                for i in range(streamed):
                    m = pb.AttendRequest()
                    m.CopyFrom(big)
                    m.id = f"s{i}"
                    yield m
                release.wait(120)  # keep the stream open, not half-closed

            stream = c.stub.AttendStream(messages(), timeout=120)
            su.wait_for(lambda: su.metric(su.scrape(srv), "attnserve_inflight_requests", model="sdpa")
                        == unary + streamed, 30, f"{unary + streamed} accepted requests")
            srv.proc.send_signal(signal.SIGTERM)
            su.wait_for(lambda: _health(c) == "NOT_SERVING", 30, "health NOT_SERVING")
            with pytest.raises(grpc.RpcError) as e:
                c.attend_request(reqs[0], timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
            assert "shutting down" in e.value.details()
            for r, f in zip(reqs, futures):
                resp = f.result(timeout=120)
                assert resp.id == r.id
                q, k, v = (np.frombuffer(t.data, np.float32).reshape(t.shape)
                           for t in (r.query, r.key, r.value))
                want = harness.reference_attention(q, k, v)[0]
                got = np.frombuffer(resp.output.data, np.float32).reshape(want.shape)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            # Now read the stream: every accepted message answered OK, then
            # the server ends the stream because it is shutting down.
            ids = []
            with pytest.raises(grpc.RpcError) as e:
                for resp in stream:
                    assert resp.code == 0, resp.message
                    ids.append(resp.id)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
            assert sorted(ids) == sorted(f"s{i}" for i in range(streamed))
            code = srv.wait(timeout=120)
            assert code == 0, f"exit code {code}:\n{srv.log()}"
    finally:
        release.set()
        _kill(srv)
