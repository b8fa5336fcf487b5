"""Server-side attention sessions (issue 17) against the real binary: a sequence
run step by step through a session equals one causal stateless request over the
whole sequence (sdpa and a projection model), prefill then decode, expiry,
eviction, close, unknown ids, a restarted server, serialized concurrent appends,
and the refusals. Oracles: the same server's stateless path and NumPy float64
(harness.reference_attention)."""

import concurrent.futures
import time

import grpc
import numpy as np
import pytest

import harness
import serving_util
from attnserve_client import AttentionClient, encode_tensor, stubs

pb = stubs.attention_pb2


def _open(client, model="sdpa", **kw):
    return client.stub.OpenSession(pb.OpenSessionRequest(model=model, **kw), timeout=30)


def _close(client, sid):
    return client.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=30)


def _step(client, sid, q, k=None, v=None, model="", **kw):
    req = client.build_request(q, k, v, model=model, **kw)
    req.session_id = sid
    return client.attend_request(req)


def _error(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value


def _sdpa_seq(rng, hq=4, hkv=2, length=40, dk=16, dv=8):
    return (rng.standard_normal((1, hq, length, dk)).astype(np.float32),
            rng.standard_normal((1, hkv, length, dk)).astype(np.float32),
            rng.standard_normal((1, hkv, length, dv)).astype(np.float32))


def _assert_close(got, want, what):
    err = float(np.abs(got - want).max())
    assert err <= 1e-6 * max(1.0, float(np.abs(want).max())), f"{what}: max abs error {err}"
    return err


@pytest.fixture(scope="module")
def server():
    s = harness.ServerProcess("--kv-block-tokens", "16")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    with AttentionClient(server.target, timeout=60) as c:
        yield c


@pytest.mark.parametrize("prefill", [1, 13, 16, 33])
def test_sdpa_session_equals_one_causal_request(client, prefill):
    """Prefill `prefill` tokens, then decode one token a step across block
    boundaries (16 tokens a block); every step's output equals the matching
    rows of one causal stateless request over the whole sequence."""
    rng = np.random.default_rng(prefill)
    q, k, v = _sdpa_seq(rng)
    length = q.shape[2]
    full = client.attend(q, k, v, model="sdpa", causal=True).output
    want64, _ = harness.reference_attention(q, k, v, causal=True)
    _assert_close(full, want64, "stateless vs numpy")
    opened = _open(client)
    assert opened.model == "sdpa" and opened.block_tokens == 16 and opened.max_tokens > 0
    sid = opened.session_id
    r = _step(client, sid, q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill])
    assert r.response.session_length == prefill
    worst = _assert_close(r.output, full[:, :, :prefill], "prefill")
    bitwise = np.array_equal(r.output, full[:, :, :prefill])
    for t in range(prefill, length):
        r = _step(client, sid, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert r.response.session_length == t + 1
        worst = max(worst, _assert_close(r.output, full[:, :, t:t + 1], f"decode step {t}"))
        bitwise &= np.array_equal(r.output, full[:, :, t:t + 1])
    print(f"prefill {prefill}: bitwise equal to the stateless request: {bitwise}, "
          f"max abs error {worst:.3g}")
    assert _close(client, sid).released_tokens == length


def test_projection_session_equals_one_causal_request(client):
    """demo-mha (self-attention, K/V projected server-side): prefill 5 tokens,
    then decode 1 token a step (key/value omitted: the hidden states are
    projected to K and V on the server)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 24, 512)).astype(np.float32)
    full = client.attend(x, model="demo-mha", causal=True).output
    sid = _open(client, model="demo-mha").session_id
    r = _step(client, sid, x[:, :5])
    worst = _assert_close(r.output, full[:, :5], "prefill")
    bitwise = np.array_equal(r.output, full[:, :5])
    for t in range(5, 24):
        r = _step(client, sid, x[:, t:t + 1])
        assert r.response.session_length == t + 1
        worst = max(worst, _assert_close(r.output, full[:, t:t + 1], f"decode step {t}"))
        bitwise &= np.array_equal(r.output, full[:, t:t + 1])
    print(f"demo-mha: bitwise equal to the stateless request: {bitwise}, max abs error {worst:.3g}")
    _close(client, sid)


def test_request_without_model_runs_on_the_sessions_model(client):
    rng = np.random.default_rng(3)
    q, k, v = _sdpa_seq(rng, length=4)
    sid = _open(client, model="sdpa").session_id  # the default model is demo-mha
    r = _step(client, sid, q, k, v)  # model left empty
    want, _ = harness.reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(r.output, want, rtol=1e-5, atol=1e-5)
    _close(client, sid)


def test_refusals_name_the_field(client):
    rng = np.random.default_rng(4)
    q, k, v = _sdpa_seq(rng, length=3)
    sid = _open(client).session_id
    _step(client, sid, q, k, v)
    e = _error(lambda: _step(client, sid, q[:, :2], k[:, :1], v[:, :1]))  # Hq 2 != 4
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "Hq=4" in e.details(), e.details()
    e = _error(lambda: _step(client, sid, q, k, v, input_dtype="fp16"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "FLOAT32" in e.details(), e.details()
    qb, kb, vb = (np.concatenate([x, x]) for x in (q, k, v))
    e = _error(lambda: _step(client, sid, qb, kb, vb))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "batch" in e.details(), e.details()
    e = _error(lambda: _step(client, sid, q, k, v, attn_mask=np.ones((3, 3), bool)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "attn_mask" in e.details()
    e = _error(lambda: _step(client, sid, q, k, v, need_weights=True))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "need_weights" in e.details()
    x = np.zeros((1, 3, 512), np.float32)  # valid for demo-mha, but the session is sdpa's
    e = _error(lambda: _step(client, sid, x, model="demo-mha"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "bound to model 'sdpa'" in e.details()
    # None of the refused requests appended anything.
    assert _step(client, sid, q[:, :, :1], k[:, :, :1], v[:, :, :1]).response.session_length == 4
    e = _error(lambda: _open(client, max_tokens=1 << 40))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.details()
    e = _error(lambda: _open(client, model="nope"))
    assert e.code() == grpc.StatusCode.NOT_FOUND
    _close(client, sid)


def test_token_limit(client):
    rng = np.random.default_rng(5)
    q, k, v = _sdpa_seq(rng, length=6)
    sid = _open(client, max_tokens=5).session_id
    _step(client, sid, q[:, :, :4], k[:, :, :4], v[:, :, :4])
    e = _error(lambda: _step(client, sid, q[:, :, 4:], k[:, :, 4:], v[:, :, 4:]))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 5" in e.details()
    # The session is intact: one more token fits.
    r = _step(client, sid, q[:, :, 4:5], k[:, :, 4:5], v[:, :, 4:5])
    want, _ = harness.reference_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], causal=True)
    np.testing.assert_allclose(r.output, want[:, :, 4:5], rtol=1e-5, atol=1e-5)
    _close(client, sid)


def test_close_and_unknown(client):
    rng = np.random.default_rng(6)
    q, k, v = _sdpa_seq(rng, length=3)
    sid = _open(client).session_id
    _step(client, sid, q, k, v)
    assert _close(client, sid).released_tokens == 3
    e = _error(lambda: _step(client, sid, q, k, v))
    assert e.code() == grpc.StatusCode.NOT_FOUND and sid in e.details() and "closed" in e.details()
    e = _error(lambda: _close(client, sid))
    assert e.code() == grpc.StatusCode.NOT_FOUND
    e = _error(lambda: _step(client, "no-such-session", q, k, v))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "no-such-session" in e.details()


def test_concurrent_appends_are_serialized_in_order(client):
    """Decode steps of one session sent at once on one AttendStream (arrival
    order = stream order) and from 8 threads (arrival order unknown): each
    runs alone over the tokens before it. Every answer's session_length says
    where its token went; its output must be the causal attention of that
    position over the sequence in that order."""
    rng = np.random.default_rng(8)
    n = 24
    q, k, v = _sdpa_seq(rng, length=n)
    # Stream: in order.
    sid = _open(client).session_id
    reqs = []
    for t in range(n):
        req = client.build_request(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                   request_id=str(t))
        req.session_id = sid
        reqs.append(req)
    answers = list(client.stub.AttendStream(iter(reqs), timeout=60))
    want, _ = harness.reference_attention(q, k, v, causal=True)
    assert [a.code for a in answers] == [0] * n, [a.message for a in answers if a.code]
    for a in answers:
        t = int(a.id)
        assert a.response.session_length == t + 1
        got = np.frombuffer(a.response.output.data, np.float32).reshape(1, 4, 1, 8)
        np.testing.assert_allclose(got, want[:, :, t:t + 1], rtol=1e-5, atol=1e-5)
    _close(client, sid)
    # Threads: whatever order they arrive in, each token's output matches
    # its position.
    sid = _open(client).session_id
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_step, client, sid, q[:, :, t:t + 1], k[:, :, t:t + 1],
                               v[:, :, t:t + 1]) for t in range(n)]
        results = [f.result() for f in futures]
    lengths = [r.response.session_length for r in results]
    assert sorted(lengths) == list(range(1, n + 1)), lengths
    order = np.argsort(lengths)  # order[p] = the token appended at position p
    want, _ = harness.reference_attention(q[:, :, order], k[:, :, order], v[:, :, order],
                                          causal=True)
    for t, r in enumerate(results):
        p = lengths[t] - 1
        np.testing.assert_allclose(r.output, want[:, :, p:p + 1], rtol=1e-5, atol=1e-5)
    _close(client, sid)


def test_metrics(server, client):
    rng = np.random.default_rng(9)
    q, k, v = _sdpa_seq(rng, length=20)
    sid = _open(client).session_id
    _step(client, sid, q, k, v)
    samples = serving_util.scrape(server)
    assert serving_util.metric(samples, "attnserve_sessions_open", model="sdpa") >= 1
    assert serving_util.metric(samples, "attnserve_kv_cache_blocks", model="sdpa",
                               state="used") >= 2
    assert serving_util.metric(samples, "attnserve_session_appends_total", model="sdpa") >= 1
    _close(client, sid)


def test_expiry():
    s = harness.ServerProcess("--session-ttl", "1s")
    try:
        with AttentionClient(s.target, timeout=30) as c:
            rng = np.random.default_rng(10)
            q, k, v = _sdpa_seq(rng, length=2)
            sid = _open(c).session_id
            _step(c, sid, q, k, v)
            long_lived = _open(c, ttl={"seconds": 60}).session_id
            assert _open(c, ttl={"seconds": 60}).ttl.seconds == 60
            time.sleep(2.5)
            e = _error(lambda: _step(c, sid, q, k, v))
            assert e.code() == grpc.StatusCode.NOT_FOUND and "expired" in e.details(), e.details()
            _step(c, long_lived, q, k, v)
            samples = serving_util.scrape(s)
            assert serving_util.metric(samples, "attnserve_session_expiries_total",
                                       model="sdpa") >= 1
    finally:
        assert s.stop() == 0, s.log()


def test_eviction_under_memory_pressure():
    # sdpa Hkv=2, Dk=16, Dv=8, fp32, 16-token blocks: 16*2*24*4 = 3072 bytes
    # a block; the cache holds two.
    s = harness.ServerProcess("--kv-cache-bytes", "6144")
    try:
        with AttentionClient(s.target, timeout=30) as c:
            rng = np.random.default_rng(11)
            q, k, v = _sdpa_seq(rng, length=16)
            a, b, d = (_open(c).session_id for _ in range(3))
            _step(c, a, q, k, v)
            _step(c, b, q, k, v)
            _step(c, d, q, k, v)  # evicts a, the least recently used
            e = _error(lambda: _step(c, a, q, k, v))
            assert e.code() == grpc.StatusCode.ABORTED, e.details()
            assert "resend the prefix" in e.details() and a in e.details()
            # b was used after a: still there.
            r = _step(c, b, q[:, :, :1], k[:, :, :1], v[:, :, :1])
            assert r.response.session_length == 17  # took a new block: evicted d
            e = _error(lambda: _step(c, d, q[:, :, :1], k[:, :, :1], v[:, :, :1]))
            assert e.code() == grpc.StatusCode.ABORTED
            samples = serving_util.scrape(s)
            assert serving_util.metric(samples, "attnserve_session_evictions_total",
                                       model="sdpa") == 2
            # One session alone larger than the cache: refused, nothing evicted
            # that it could not use.
            big = _open(c).session_id
            q3, k3, v3 = _sdpa_seq(rng, length=48)
            e = _error(lambda: _step(c, big, q3, k3, v3))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            assert "--kv-cache-bytes" in e.details()
    finally:
        assert s.stop() == 0, s.log()


def test_restarted_server_says_sessions_do_not_survive():
    rng = np.random.default_rng(12)
    q, k, v = _sdpa_seq(rng, length=2)
    first = harness.ServerProcess()
    try:
        with AttentionClient(first.target, timeout=30) as c:
            sid = _open(c).session_id
            _step(c, sid, q, k, v)
    finally:
        assert first.stop() == 0, first.log()
    second = harness.ServerProcess()
    try:
        with AttentionClient(second.target, timeout=30) as c:
            e = _error(lambda: _step(c, sid, q, k, v))
            assert e.code() == grpc.StatusCode.NOT_FOUND, e.details()
            assert sid in e.details() and "do not survive a server restart" in e.details()
    finally:
        assert second.stop() == 0, second.log()


def test_chunked_attention_session_holds_about_one_chunk(tmp_path):
    """A session of a model with chunked attention (Llama 4's rule, chunks of
    96): 1200 tokens, 40 at a time, every step equal to the NumPy oracle over
    the whole sequence with transformers' chunked mask (a query sees its own
    chunk up to itself), while the blocks the session holds stay about one
    chunk + 256 tokens plus a block."""
    (tmp_path / "sdpa-chunk").mkdir()
    (tmp_path / "sdpa-chunk" / "config.pbtxt").write_text(
        'kind: "sdpa"\ncausal: true\nattention_chunk: 96\n')
    s = harness.ServerProcess("--model-repository", str(tmp_path), "--kv-block-tokens", "16",
                              "--session-max-tokens", "512")
    try:
        with AttentionClient(s.target, timeout=60) as c:
            rng = np.random.default_rng(14)
            q, k, v = _sdpa_seq(rng, length=1200)
            sid = _open(c, model="sdpa-chunk").session_id
            most = 0
            for t in range(0, 1200, 40):
                r = _step(c, sid, q[:, :, t:t + 40], k[:, :, t:t + 40], v[:, :, t:t + 40])
                rows = np.arange(t, t + 40)[:, None]
                keys = np.arange(t + 40)[None, :]
                chunk_mask = (keys <= rows) & (keys // 96 == rows // 96)
                want, _ = harness.reference_attention(q[:, :, t:t + 40], k[:, :, :t + 40],
                                                      v[:, :, :t + 40], mask=chunk_mask)
                _assert_close(r.output, want, f"tokens {t}..{t + 39}")
                used = serving_util.metric(serving_util.scrape(s), "attnserve_kv_cache_blocks",
                                           model="sdpa-chunk", state="used")
                most = max(most, used)
            # 1200 tokens would be 75 blocks; a chunk keeps about (96 + 256) / 16 + 2,
            # plus the 40 tokens the step appends.
            assert 4 <= most <= (96 + 256 + 40) // 16 + 2, most
            assert _close(c, sid).released_tokens == 1200
    finally:
        assert s.stop() == 0, s.log()


def test_sliding_window_session_holds_about_the_window(tmp_path):
    """A session of a model with a sliding window of 64: 1500 tokens, one step
    at a time, every step equal to the NumPy oracle over the whole sequence,
    while the blocks the session holds (attnserve_kv_cache_blocks) stay about
    the window + 256 tokens plus a block, and its token limit counts those."""
    (tmp_path / "sdpa-window").mkdir()
    (tmp_path / "sdpa-window" / "config.pbtxt").write_text(
        'kind: "sdpa"\ncausal: true\nsliding_window: 64\n')
    s = harness.ServerProcess("--model-repository", str(tmp_path), "--kv-block-tokens", "16",
                              "--session-max-tokens", "512")
    try:
        with AttentionClient(s.target, timeout=60) as c:
            rng = np.random.default_rng(13)
            q, k, v = _sdpa_seq(rng, length=1500)
            sid = _open(c, model="sdpa-window").session_id
            most = 0
            for t in range(0, 1500, 50):
                r = _step(c, sid, q[:, :, t:t + 50], k[:, :, t:t + 50], v[:, :, t:t + 50])
                assert r.response.session_length == t + 50
                want, _ = harness.reference_attention(q[:, :, t:t + 50], k[:, :, :t + 50],
                                                      v[:, :, :t + 50], causal=True, window=64)
                _assert_close(r.output, want, f"tokens {t}..{t + 49}")
                used = serving_util.metric(serving_util.scrape(s), "attnserve_kv_cache_blocks",
                                           model="sdpa-window", state="used")
                most = max(most, used)
            # 1500 tokens would be 94 blocks; the window keeps (64 + 256) / 16 + 2.
            assert 4 <= most <= (64 + 256) // 16 + 2 + 4, most
            # Past --session-max-tokens 512 in length: the limit counts held tokens.
            assert _close(c, sid).released_tokens == 1500
    finally:
        assert s.stop() == 0, s.log()
