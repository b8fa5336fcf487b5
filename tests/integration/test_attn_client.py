"""End-to-end tests of the attn_client binary against a real attnserve: random
and .npy inputs, --output-npy files checked with NumPy against a float64
reference, the health/models commands, and its exit codes (1 = usage error,
2 = RPC failed)."""

import os
import re
import subprocess

import numpy as np
import pytest

import harness


def run_client(*args, target=None, timeout=120):
    cmd = [harness.client_bin(), *args]
    if target:
        cmd += ["--target", target]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _shape(stdout, what="output"):
    m = re.search(rf"^{what}: (\w+) \[([\d, ]*)\]$", stdout, re.M)
    assert m, stdout
    return m.group(1), tuple(int(d) for d in m.group(2).split(", ") if d)


def _checksum(stdout):
    m = re.search(r"^checksum: sum=(\S+) abs_sum=(\S+)$", stdout, re.M)
    assert m, stdout
    return float(m.group(1)), float(m.group(2))


def test_demo_mha_random(server):
    r = run_client("--model", "demo-mha", "--batch", "2", "--seq", "16", target=server.target)
    assert r.returncode == 0, r.stderr
    assert _shape(r.stdout) == ("FLOAT32", (2, 16, 512))
    s, a = _checksum(r.stdout)
    assert np.isfinite(s) and a > 0
    assert re.search(r"^latency: [\d.]+ ms round trip", r.stdout, re.M), r.stdout


def test_default_model_is_demo_mha(server):
    r = run_client("--seq", "4", target=server.target)
    assert r.returncode == 0, r.stderr
    assert _shape(r.stdout) == ("FLOAT32", (1, 4, 512))
    assert "demo-mha" in r.stdout


def test_same_seed_same_checksum(server):
    args = ("--model", "sdpa", "--batch", "1", "--seq", "8", "--head-dim", "16", "--seed", "42")
    a, b = run_client(*args, target=server.target), run_client(*args, target=server.target)
    c = run_client(*args[:-1], "43", target=server.target)
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert _checksum(a.stdout) == _checksum(b.stdout)
    assert _checksum(a.stdout) != _checksum(c.stdout)


@pytest.mark.parametrize("dtype,wire", [("fp32", "FLOAT32"), ("fp16", "FLOAT16"), ("bf16", "BFLOAT16")])
def test_sdpa_random_gqa_cross_weights(server, dtype, wire):
    r = run_client("--model", "sdpa", "--batch", "2", "--seq", "8", "--kv-seq", "12", "--heads", "4",
                   "--kv-heads", "2", "--head-dim", "16", "--value-dim", "24", "--causal", "--need-weights",
                   "--dtype", dtype, target=server.target)
    assert r.returncode == 0, r.stderr
    assert _shape(r.stdout) == (wire, (2, 4, 8, 24))
    assert _shape(r.stdout, "weights")[1] == (2, 4, 8, 12)


def test_health_command(server):
    r = run_client("health", target=server.target)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "SERVING"


def test_models_command(server):
    r = run_client("models", target=server.target)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:] if line.strip()}
    assert {"sdpa", "demo-mha"} <= rows.keys(), r.stdout
    assert "[default]" in rows["demo-mha"] and "embed_dim=512" in rows["demo-mha"]


def test_unknown_model_is_not_found(server):
    r = run_client("--model", "nope", target=server.target)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "NOT_FOUND" in r.stderr


def test_invalid_argument_from_server(server, tmp_path):
    # A rank-3 query for the sdpa model: the server must refuse it.
    np.save(tmp_path / "q.npy", np.zeros((2, 4, 8), np.float32))
    np.save(tmp_path / "k.npy", np.zeros((2, 4, 5, 8), np.float32))
    np.save(tmp_path / "v.npy", np.zeros((2, 4, 5, 8), np.float32))
    r = run_client("--model", "sdpa", *_npy_args(tmp_path), target=server.target)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "INVALID_ARGUMENT" in r.stderr and "query" in r.stderr


def test_unreachable_server_is_unavailable():
    # Port 1 on loopback: nothing listens there without root.
    r = run_client("health", "--timeout-ms", "2000", target="127.0.0.1:1")
    assert r.returncode == 2
    assert "UNAVAILABLE" in r.stderr


@pytest.mark.parametrize("args", [
    ("--dtype", "fp64"),
    ("frobnicate",),
    ("health", "models"),
    ("--key-npy", "/nonexistent.npy"),
    ("--query-npy", "/nonexistent.npy"),
    ("--key-lengths", "3,x"),
    ("--no-such-flag",),
    ("--batch", "two"),
])
def test_usage_errors_exit_1(server, args):
    r = run_client(*args, target=server.target)
    assert r.returncode == 1, (args, r.returncode, r.stdout, r.stderr)


def _save_inputs(tmp_path, rng, dtype=np.float32, b=2, hq=4, hkv=2, lq=6, lk=9, dk=16, dv=8):
    q = rng.standard_normal((b, hq, lq, dk)).astype(dtype)
    k = rng.standard_normal((b, hkv, lk, dk)).astype(dtype)
    v = rng.standard_normal((b, hkv, lk, dv)).astype(dtype)
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", a)
    return q, k, v


def _npy_args(tmp_path):
    return ["--query-npy", str(tmp_path / "q.npy"), "--key-npy", str(tmp_path / "k.npy"),
            "--value-npy", str(tmp_path / "v.npy")]


def test_npy_inputs_and_outputs_match_numpy(server, tmp_path):
    rng = np.random.default_rng(21)
    q, k, v = _save_inputs(tmp_path, rng)
    mask = rng.random((2, 1, 6, 9)) < 0.8
    np.save(tmp_path / "mask.npy", mask)
    out_path, w_path = tmp_path / "out.npy", tmp_path / "w.npy"
    r = run_client("--model", "sdpa", *_npy_args(tmp_path), "--mask-npy", str(tmp_path / "mask.npy"),
                   "--key-lengths", "9,5", "--causal", "--need-weights", "--scale", "0.2",
                   "--output-npy", str(out_path), "--weights-npy", str(w_path), target=server.target)
    assert r.returncode == 0, r.stderr
    out, w = np.load(out_path), np.load(w_path)
    want, want_w = harness.reference_attention(q, k, v, causal=True, key_lengths=[9, 5], mask=mask, scale=0.2)
    assert out.dtype == np.float32 and out.shape == (2, 4, 6, 8)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))
    np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6)
    s, a = _checksum(r.stdout)
    assert s == pytest.approx(out.astype(np.float64).sum(), rel=1e-6, abs=1e-6)
    assert a == pytest.approx(np.abs(out.astype(np.float64)).sum(), rel=1e-6)


def test_window_softcap_and_sinks_flags_match_numpy(server, tmp_path):
    rng = np.random.default_rng(22)
    q, k, v = _save_inputs(tmp_path, rng)
    out_path = tmp_path / "out.npy"
    r = run_client("--model", "sdpa", *_npy_args(tmp_path), "--causal", "--window", "3",
                   "--softcap", "1.5", "--sinks", "0.5,-1,2,0", "--output-npy", str(out_path),
                   target=server.target)
    assert r.returncode == 0, r.stderr
    want, _ = harness.reference_attention(q, k, v, causal=True, window=3, softcap=1.5,
                                          sinks=[0.5, -1, 2, 0])
    np.testing.assert_allclose(np.load(out_path), want, rtol=1e-5, atol=1e-5)
    # Without --causal the window is two-sided (keys within 2 positions).
    r = run_client("--model", "sdpa", *_npy_args(tmp_path), "--window", "3", "--output-npy",
                   str(out_path), target=server.target)
    assert r.returncode == 0, r.stderr
    want, _ = harness.reference_attention(q, k, v, window=3)
    np.testing.assert_allclose(np.load(out_path), want, rtol=1e-5, atol=1e-5)
    one_sided, _ = harness.reference_attention(q, k, v, causal=True, window=3)
    assert np.abs(np.load(out_path) - one_sided).max() > 1e-3
    r = run_client("--model", "sdpa", *_npy_args(tmp_path), "--sinks", "1,x", target=server.target)
    assert r.returncode == 1 and "--sinks: 'x' is not a number" in r.stderr


def test_npy_fp16_stays_fp16(server, tmp_path):
    q, k, v = _save_inputs(tmp_path, np.random.default_rng(22), dtype=np.float16)
    r = run_client("--model", "sdpa", *_npy_args(tmp_path), "--output-npy", str(tmp_path / "o.npy"),
                   target=server.target)
    assert r.returncode == 0, r.stderr
    assert _shape(r.stdout, "query")[0] == "FLOAT16"
    out = np.load(tmp_path / "o.npy")
    assert out.dtype == np.float16
    # fp16 output: one rounding (2^-11 relative) plus fp32 accumulation.
    want = harness.reference_attention(q, k, v)[0]
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_npy_bf16_written_as_float32(server, tmp_path):
    q, k, v = _save_inputs(tmp_path, np.random.default_rng(23))
    r = run_client("--model", "sdpa", *_npy_args(tmp_path), "--dtype", "bf16",
                   "--output-npy", str(tmp_path / "o.npy"), target=server.target)
    assert r.returncode == 0, r.stderr
    assert _shape(r.stdout) == ("BFLOAT16", (2, 4, 6, 8))
    out = np.load(tmp_path / "o.npy")
    assert out.dtype == np.float32
    assert (out.view(np.uint32) & 0xFFFF == 0).all(), "values are not bfloat16-representable"
    # The oracle sees the same bf16-rounded inputs the client sent.
    from attnserve_client import bf16_bits_to_float, float_to_bf16_bits
    qb, kb, vb = (bf16_bits_to_float(float_to_bf16_bits(x)) for x in (q, k, v))
    want = harness.reference_attention(qb, kb, vb)[0]
    np.testing.assert_allclose(out, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_npy_version2_header_is_read(server, tmp_path):
    q, k, v = _save_inputs(tmp_path, np.random.default_rng(24))
    with open(tmp_path / "q.npy", "wb") as f:
        np.lib.format.write_array(f, q, version=(2, 0))
    r = run_client("--model", "sdpa", *_npy_args(tmp_path), "--output-npy", str(tmp_path / "o.npy"),
                   target=server.target)
    assert r.returncode == 0, r.stderr
    want = harness.reference_attention(q, k, v)[0]
    np.testing.assert_allclose(np.load(tmp_path / "o.npy"), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("bad", ["fortran", "float64", "truncated", "not_npy"])
def test_bad_npy_is_a_usage_error(server, tmp_path, bad):
    path = tmp_path / "q.npy"
    q = np.zeros((2, 4, 6, 16), np.float32)
    if bad == "fortran":
        np.save(path, np.asfortranarray(q))
    elif bad == "float64":
        np.save(path, q.astype(np.float64))
    elif bad == "truncated":
        np.save(path, q)
        path.write_bytes(path.read_bytes()[:-10])
    else:
        path.write_text("hello")
    r = run_client("--model", "sdpa", "--query-npy", str(path), target=server.target)
    assert r.returncode == 1, (bad, r.returncode, r.stderr)
    assert str(path) in r.stderr


def test_self_attention_npy_for_demo_mha(server, tmp_path):
    x = np.random.default_rng(25).standard_normal((1, 5, 512)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    r = run_client("--model", "demo-mha", "--query-npy", str(tmp_path / "x.npy"),
                   "--output-npy", str(tmp_path / "o.npy"), target=server.target)
    assert r.returncode == 0, r.stderr
    assert np.load(tmp_path / "o.npy").shape == (1, 5, 512)
    assert os.path.getsize(tmp_path / "o.npy") > 5 * 512 * 4
