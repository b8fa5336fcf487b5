"""Values of the built-in default model, demo-mha, against torch.nn.MultiheadAttention:
the real server, a request that names no model, and a PyTorch layer whose weights are
rebuilt here from the seeds engine/model/builtin_models.h documents (splitmix64 written
again in NumPy from its published definition, not read from the server).

Oracle: nn.MultiheadAttention(512, 8, bias=True, batch_first=True) in float64 on the
same fp32 inputs and fp32 weights, so that only the server's arithmetic is measured.
Tolerance: |got - want| <= 1e-5 * |want| + 1e-5 * max(1, max|want|), the project's fp32
contract (tests/python/test_parity.py). The largest term is three fp32 matmuls with a
512-long dot product: fp32 accumulation gives a relative error of about sqrt(512) * 2^-24
~ 1.3e-6 per matmul on inputs and weights of this size (|x| ~ 1, |w| <= 1/sqrt(512)).
Measured on 2x7 tokens (outputs up to 0.47): the cpu engine 2.4e-7, the reference
engine 1.5e-8, torch's own fp32 layer 2.5e-7 from the float64 one; a wrong weight,
bias, head split or mask moves outputs by 1e-2 or more.
"""

import numpy as np
import pytest
import torch

import harness

EMBED, HEADS = 512, 8
SEED = 0xA77E5E4F  # kSeed in engine/model/builtin_models.cc
RTOL = ATOL = 1e-5
MASK64 = (1 << 64) - 1


def splitmix64(seed, n):
    """The first n outputs of splitmix64(seed) (Steele, Lea, Flood 2014) as uint64.
    Output k (from 1) mixes state seed + k * 0x9E3779B97F4A7C15 mod 2^64."""
    gamma = 0x9E3779B97F4A7C15
    base = np.uint64(seed & MASK64)
    with np.errstate(over="ignore"):
        z = base + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(gamma)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeded_uniform(shape, seed, bound):
    """float32 uniform in [-bound, bound): the top 24 bits of each draw as u in
    [0, 1), then (2u - 1) * bound in float64, rounded once to float32."""
    u = (splitmix64(seed, int(np.prod(shape))) >> np.uint64(40)).astype(np.float64) * 2.0**-24
    return ((2.0 * u - 1.0) * np.float64(bound)).astype(np.float32).reshape(shape)


def demo_mha_weights():
    # nn.Linear's init range 1/sqrt(fan_in), rounded to float32 as the C++ does.
    bound = np.float32(1.0 / np.sqrt(np.float64(EMBED)))
    names = ["wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo"]
    return {name: seeded_uniform((EMBED, EMBED) if name[0] == "w" else (EMBED,), SEED + 1 + i, bound)
            for i, name in enumerate(names)}


def torch_demo_mha():
    w = demo_mha_weights()
    mha = torch.nn.MultiheadAttention(EMBED, HEADS, bias=True, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.from_numpy(np.concatenate([w["wq"], w["wk"], w["wv"]])))
        mha.in_proj_bias.copy_(torch.from_numpy(np.concatenate([w["bq"], w["bk"], w["bv"]])))
        mha.out_proj.weight.copy_(torch.from_numpy(w["wo"]))
        mha.out_proj.bias.copy_(torch.from_numpy(w["bo"]))
    return mha.eval()


@pytest.fixture(scope="module")
def mha():
    return torch_demo_mha()


# The default backend (what a user gets) and the reference engine (the oracle
# of the other engine tests, checked here against an oracle of its own).
@pytest.fixture(scope="module", params=[(), ("--backend", "reference")], ids=["default", "reference"])
def backend_client(request):
    from attnserve_client import AttentionClient
    server = harness.ServerProcess(*request.param)
    try:
        with AttentionClient(server.target, timeout=60) as c:
            yield c
    finally:
        code = server.stop()
    assert code == 0, f"attnserve exited with {code} after SIGTERM:\n{server.log()}"


def assert_fp32_close(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    err = np.abs(got.astype(np.float64) - want) - RTOL * np.abs(want)
    assert err.max() <= ATOL * max(1.0, float(np.abs(want).max())), float(np.abs(got - want).max())


def causal_mask(lq, lk):
    # nn.MultiheadAttention's bool mask is True where attention is NOT allowed;
    # the server's causal is bottom-right aligned: i sees j iff j <= i + (lk - lq).
    return torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq).logical_not()


def test_seeded_weights_match_the_pinned_cpp_values():
    # The bit patterns builtin_models_test pins for the C++ generator: this
    # re-implementation draws the same numbers.
    w = demo_mha_weights()
    assert list(w["wq"].reshape(-1)[:3].view(np.uint32)) == [0xBA82722E, 0x3D29D31F, 0x3CF99D29]
    assert list(w["bo"][:3].view(np.uint32)) == [0x3BF5832F, 0x3C1FFA7A, 0x3C549104]
    assert splitmix64(0, 1)[0] == np.uint64(0xE220A8397B1DCDAF)  # the published first output


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_default_model_self_attention_matches_torch(backend_client, mha, causal):
    x = np.random.default_rng(11 + causal).standard_normal((2, 7, EMBED)).astype(np.float32)
    res = backend_client.attend(x, causal=causal, need_weights=True)  # no model: the default
    xt = torch.from_numpy(x).double()
    with torch.no_grad():
        want, want_w = mha(xt, xt, xt, need_weights=True, average_attn_weights=False,
                           attn_mask=causal_mask(7, 7) if causal else None)
    assert_fp32_close(res.output, want.numpy())
    np.testing.assert_allclose(res.weights, want_w.numpy(), rtol=RTOL, atol=1e-6)
    if causal:
        assert (res.weights[..., np.triu_indices(7, 1)[0], np.triu_indices(7, 1)[1]] == 0).all()


def test_default_model_cross_attention_with_padding_matches_torch(backend_client, mha):
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 3, EMBED)).astype(np.float32)
    k = rng.standard_normal((2, 6, EMBED)).astype(np.float32)
    v = rng.standard_normal((2, 6, EMBED)).astype(np.float32)
    lengths = [6, 2]
    res = backend_client.attend(q, k, v, causal=True, key_lengths=lengths, average_weights=True)
    padding = torch.arange(6)[None, :] >= torch.tensor(lengths)[:, None]  # True = padded
    with torch.no_grad():
        want, want_w = mha(torch.from_numpy(q).double(), torch.from_numpy(k).double(),
                           torch.from_numpy(v).double(), key_padding_mask=padding,
                           attn_mask=causal_mask(3, 6), need_weights=True, average_attn_weights=True)
    assert_fp32_close(res.output, want.numpy())
    np.testing.assert_allclose(res.weights, want_w.numpy(), rtol=RTOL, atol=1e-6)
