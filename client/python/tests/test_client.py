"""AttentionClient against a real server: the installed package itself (stubs
built in, version), numpy in/out in fp32/fp16/bf16 against a NumPy float64
oracle, errors as AttnServeError, attend_stream ordering, models and health."""

import os
import re
import sys

import grpc
import numpy as np
import pytest

import attnserve_client
from attnserve_client import (AttendResult, AttentionClient, AttnServeError, InvalidArgumentError,
                              NotFoundError, UnavailableError, bf16_bits_to_float, float_to_bf16_bits)
from harness import reference_attention

INSTALLED = os.environ.get("ATTNSERVE_EXPECT_INSTALLED") == "1"


@pytest.mark.skipif(not INSTALLED, reason="checks the installed wheel; run through run_suite.py")
def test_installed_package_has_built_in_stubs_and_the_project_version():
    from attnserve_client import _stubs
    assert _stubs.BUILT_IN, "the wheel must carry its generated stubs"
    source = os.environ.get("ATTNSERVE_SOURCE_DIR", "")
    where = os.path.abspath(attnserve_client.__file__)
    assert where.startswith(os.path.abspath(sys.prefix) + os.sep), f"imported from {where}, not the venv"
    assert not where.startswith(os.path.join(os.path.abspath(source), "client", "python") + os.sep)
    with open(os.path.join(source, "CMakeLists.txt")) as f:
        want = re.search(r"project\(\s*attnserve\s+VERSION\s+([0-9.]+)", f.read()).group(1)
    assert attnserve_client.__version__ == want
    from importlib.metadata import version
    assert version("attnserve-client") == want


def _qkv(rng, b=2, hq=4, hkv=2, lq=8, lk=8, d=16):
    return (rng.standard_normal((b, hq, lq, d)).astype(np.float32),
            rng.standard_normal((b, hkv, lk, d)).astype(np.float32),
            rng.standard_normal((b, hkv, lk, d)).astype(np.float32))


def test_attend_fp32_matches_the_oracle_with_masks_and_weights(client):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, lq=5, lk=9)
    mask = rng.random((1, 1, 5, 9)) > 0.3
    res = client.attend(q, k, v, model="sdpa", causal=True, key_lengths=[9, 6], attn_mask=mask,
                        need_weights=True)
    want, want_w = reference_attention(q, k, v, causal=True, key_lengths=[9, 6], mask=mask)
    assert isinstance(res, AttendResult)
    assert res.output.dtype == np.float32 and res.output.shape == (2, 4, 5, 16)
    np.testing.assert_allclose(res.output, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(res.weights, want_w, atol=1e-5)
    assert res.timing.total_us >= res.timing.compute_us >= 0


def test_fp16_in_fp16_out_and_bf16_on_the_wire(client):
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng)
    want, _ = reference_attention(q, k, v)
    r16 = client.attend(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), model="sdpa")
    assert r16.output.dtype == np.float16
    np.testing.assert_allclose(r16.output.astype(np.float32), want, atol=2e-2)
    rbf = client.attend(q, k, v, model="sdpa", input_dtype="bf16")
    assert rbf.output.dtype == np.float32  # bf16 comes back widened, exactly
    np.testing.assert_allclose(rbf.output, want, atol=6e-2)
    bits = client.attend(q, k, v, model="sdpa", input_dtype="bf16", bf16_bits=True).output
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bf16_bits_to_float(bits), rbf.output)
    out32 = client.attend(q, k, v, model="sdpa", input_dtype="bf16", output_dtype="fp32").output
    assert out32.dtype == np.float32


def test_bf16_rounding_is_round_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf], dtype=np.float32)
    np.testing.assert_array_equal(bf16_bits_to_float(float_to_bf16_bits(x)),
                                  np.array([1.0, 1.0, 1.015625, -2.5, np.inf], dtype=np.float32))
    assert np.isnan(bf16_bits_to_float(float_to_bf16_bits(np.float32(np.nan))))


def test_errors_are_attnserve_errors_with_code_and_message(client):
    q = np.zeros((1, 2, 3, 8), np.float32)
    with pytest.raises(InvalidArgumentError) as e:
        client.attend(q, q[:, :, :, :4], q, model="sdpa")
    err = e.value
    assert isinstance(err, AttnServeError) and isinstance(err, grpc.RpcError)
    assert err.status_code == grpc.StatusCode.INVALID_ARGUMENT == err.code()
    assert "key" in err.message and err.message == err.details()
    assert str(err).startswith("INVALID_ARGUMENT: ")
    with pytest.raises(NotFoundError) as e:
        client.attend(q, q, q, model="no-such-model")
    assert "no-such-model" in e.value.message
    with pytest.raises(NotFoundError):
        client.get_model("no-such-model")


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_compressed_requests_give_the_same_answers(server, compression):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, lq=64, lk=64, d=32)
    with AttentionClient(server.target, compression=compression) as c:
        res = c.attend(q, k, v, model="sdpa", causal=True)
        streamed = list(c.attend_stream([{"query": q, "key": k, "value": v, "model": "sdpa"}]))
    want, _ = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(res.output, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(streamed[0].output, reference_attention(q, k, v)[0], atol=1e-5,
                               rtol=1e-5)


def test_compression_is_checked_and_never_silently_dropped(server):
    with pytest.raises(ValueError, match="compression must be None, 'gzip' or 'deflate', got 'br'"):
        AttentionClient(server.target, compression="br")
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(ValueError, match="give it to the channel you pass"):
            AttentionClient(server.target, channel=channel, compression="gzip")


def test_unreachable_server_is_unavailable():
    with AttentionClient("127.0.0.1:1", timeout=5) as c:
        with pytest.raises(UnavailableError):
            c.health()


def test_models_and_health(client):
    names = {m.name for m in client.list_models()}
    assert {"sdpa", "demo-mha"} <= names
    assert client.get_model("sdpa").config.kind == "sdpa"
    assert client.health() == "SERVING"


def test_attend_stream_returns_results_in_request_order(client):
    rng = np.random.default_rng(3)
    inputs = [_qkv(rng, b=1, lq=int(rng.integers(1, 12)), lk=int(rng.integers(1, 40))) for _ in range(24)]
    requests = ({"query": q, "key": k, "value": v, "model": "sdpa"} for q, k, v in inputs)
    results = list(client.attend_stream(requests))
    assert len(results) == len(inputs)
    for (q, k, v), res in zip(inputs, results):
        np.testing.assert_allclose(res.output, reference_attention(q, k, v)[0], atol=1e-5)
    assert len({r.id for r in results}) == len(results)


def test_attend_stream_keeps_ids_and_reports_failures_in_place(client):
    rng = np.random.default_rng(4)
    good = _qkv(rng, b=1)
    bad = (good[0], good[1][:, :, :, :4], good[2])
    items = [client.build_request(*good, model="sdpa", request_id="a"),
             {"query": bad[0], "key": bad[1], "value": bad[2], "model": "sdpa", "id": "b"},
             {"query": good[0], "key": good[1], "value": good[2], "model": "sdpa", "id": "c"}]
    out = list(client.attend_stream(items, return_exceptions=True))
    assert [type(x) for x in out] == [AttendResult, InvalidArgumentError, AttendResult]
    assert out[0].id == "a" and out[2].id == "c" and out[1].request_id == "b"
    seen = []
    with pytest.raises(InvalidArgumentError) as e:
        for r in client.attend_stream(items):
            seen.append(r.id)
    assert seen == ["a"] and e.value.request_id == "b"


def test_attend_stream_refuses_duplicate_ids(client):
    q = np.zeros((1, 1, 1, 4), np.float32)
    item = {"query": q, "key": q, "value": q, "model": "sdpa", "id": "same"}
    with pytest.raises(ValueError, match="'same' appears twice"):
        list(client.attend_stream(iter([item, item])))
