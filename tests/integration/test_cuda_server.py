"""The whole server on a GPU: `attnserve --backend cuda` serving `sdpa` and a
projection model, called by the Python client and compared with PyTorch on the
same GPU (float64 oracles), plus batch invariance under real batching and
sessions (the paged KV cache in GPU memory) against stateless requests.

Skips without a CUDA build of PyTorch and a GPU (CI has neither). Where a GPU
must be used (bench/gpu_session.sh on the device machine), ATTNSERVE_REQUIRE_GPU=1
turns every skip into a failure.
"""

import os
import threading

import numpy as np
import pytest

import harness

REQUIRE_GPU = os.environ.get("ATTNSERVE_REQUIRE_GPU") == "1"


def _skip(reason):
    if REQUIRE_GPU:
        pytest.fail(f"ATTNSERVE_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


def _torch_cuda():
    try:
        import torch
    except ImportError:
        _skip("PyTorch is not installed")
    if not torch.cuda.is_available():
        _skip(f"no GPU visible to PyTorch {torch.__version__}")
    return torch


@pytest.fixture(scope="module")
def torch_cuda():
    return _torch_cuda()


@pytest.fixture(scope="module")
def repo(tmp_path_factory, torch_cuda):
    """A repository with nn.MultiheadAttention layers exported in fp32 and bf16."""
    from attnserve_client.export import export_module
    torch = torch_cuda
    root = tmp_path_factory.mktemp("cuda_repo")
    torch.manual_seed(7)
    mha = torch.nn.MultiheadAttention(256, 8, batch_first=True)
    export_module(mha, str(root / "mha-fp32"), precision="fp32")
    export_module(mha, str(root / "mha-bf16"), precision="bf16")
    return root, mha


@pytest.fixture(scope="module")
def server(repo):
    root, _ = repo
    # A queue delay so that concurrent requests really share batches.
    proc = harness.ServerProcess("--backend", "cuda", "--model-repository", str(root),
                                 "--max-queue-delay-us", "20000", "--max-batch-requests", "16",
                                 startup_timeout=120)
    yield proc
    code = proc.stop()
    assert code == 0, f"attnserve exited with {code} after SIGTERM:\n{proc.log()}"


@pytest.fixture(scope="module")
def client(server):
    from attnserve_client import AttentionClient
    with AttentionClient(server.target, timeout=120) as c:
        yield c


def _rel(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the server's answer"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _sdpa_oracle(torch, q, k, v, *, causal=False, mask=None, key_lengths=None):
    """torch SDPA on the GPU in float64 (GQA by repeating K/V heads)."""
    dev = "cuda"
    q, k, v = (torch.as_tensor(np.asarray(x, dtype=np.float64), device=dev) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    lq, lk = q.shape[2], k.shape[2]
    allowed = torch.ones(q.shape[0], 1, lq, lk, dtype=torch.bool, device=dev)
    if causal:
        allowed = allowed & torch.ones(lq, lk, dtype=torch.bool, device=dev).tril(lk - lq)
    if key_lengths is not None:
        kl = torch.as_tensor(np.asarray(key_lengths), device=dev)
        allowed = allowed & (torch.arange(lk, device=dev)[None, :] < kl[:, None])[:, None, None, :]
    if mask is not None:
        allowed = allowed & torch.as_tensor(mask, device=dev)
    scores = (q @ k.transpose(-1, -2)) / np.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key: zeros
    return (w @ v).cpu().numpy()


# (dtype, tolerance on the relative error): fp32 runs the general kernel in
# fp32; fp16/bf16 with D in {64, 128} run the fused tensor-core kernel.
DTYPES = [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 1.5e-2)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("shape", [(2, 8, 8, 200, 300, 64), (1, 4, 2, 128, 128, 128),
                                   (3, 2, 2, 17, 33, 80)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_torch_on_the_gpu(client, torch_cuda, dtype, tol, shape, causal):
    b, hq, hkv, lq, lk, d = shape
    rng = np.random.default_rng(hash((dtype, shape, causal)) & 0xFFFF)
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, lk, d)).astype(np.float32)
    key_lengths = rng.integers(1, lk + 1, size=b).astype(np.int32)
    res = client.attend(q, k, v, model="sdpa", causal=causal, key_lengths=key_lengths,
                        input_dtype=dtype)
    # The oracle sees what the server saw: the inputs rounded to `dtype`.
    rounded = [torch_cuda.as_tensor(x).to(getattr(torch_cuda, dtype)).double().numpy()
               for x in (q, k, v)]
    ref = _sdpa_oracle(torch_cuda, *rounded, causal=causal, key_lengths=key_lengths)
    assert res.output.shape == ref.shape
    assert _rel(res.output, ref) < tol


def test_bool_mask_and_fully_masked_rows_on_the_gpu(client, torch_cuda):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 64, 128)).astype(np.float16)
    k = rng.standard_normal((2, 4, 96, 128)).astype(np.float16)
    v = rng.standard_normal((2, 4, 96, 128)).astype(np.float16)
    mask = rng.random((2, 1, 64, 96)) < 0.7
    mask[:, :, 5, :] = False  # a row that sees no key: zeros, as documented
    res = client.attend(q, k, v, model="sdpa", attn_mask=mask)
    ref = _sdpa_oracle(torch_cuda, q, k, v, mask=mask)
    assert _rel(res.output, ref) < 2e-3
    assert np.all(res.output[:, :, 5, :] == 0)


@pytest.mark.parametrize("model,tol", [("mha-fp32", 1e-5), ("mha-bf16", 2e-2)])
def test_projection_model_matches_torch_module_on_the_gpu(client, repo, torch_cuda, model, tol):
    torch = torch_cuda
    _, mha = repo
    ref_mod = mha.to("cuda", torch.float64)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 40, 256)).astype(np.float32)
    mem = rng.standard_normal((3, 56, 256)).astype(np.float32)
    res = client.attend(x, mem, mem, model=model)
    xt = torch.as_tensor(x, dtype=torch.float64, device="cuda")
    mt = torch.as_tensor(mem, dtype=torch.float64, device="cuda")
    with torch.no_grad():
        ref, _ = ref_mod(xt, mt, mt, need_weights=False)
    assert _rel(res.output, ref.cpu().numpy()) < tol


def test_need_weights_on_the_gpu(client, torch_cuda):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 16, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, 24, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 24, 32)).astype(np.float32)
    res = client.attend(q, k, v, model="sdpa", need_weights=True)
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(32)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    assert _rel(res.weights, w) < 1e-5
    assert _rel(res.output, w @ v.astype(np.float64)) < 1e-5


def test_batch_invariance_on_the_gpu(client, server, torch_cuda):
    """A request's answer is bitwise the same alone and inside a batch of
    different requests (the CUDA engine gives each request its own launches)."""
    rng = np.random.default_rng(17)
    reqs = []
    for i in range(12):
        lq, lk = int(rng.integers(1, 130)), int(rng.integers(1, 300))
        reqs.append([rng.standard_normal(s).astype(np.float16)
                     for s in ((1, 8, lq, 64), (1, 8, lk, 64), (1, 8, lk, 64))])
    alone = [client.attend(*r, model="sdpa").output for r in reqs]
    together = [None] * len(reqs)
    batch_sizes = [0] * len(reqs)
    barrier = threading.Barrier(len(reqs))

    def send(i):
        barrier.wait()
        res = client.attend(*reqs[i], model="sdpa")
        together[i] = res.output
        batch_sizes[i] = res.timing.batch_requests

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(batch_sizes) > 1, f"no request shared a batch: {batch_sizes}"
    for i, (a, b) in enumerate(zip(alone, together)):
        assert np.array_equal(a, b), f"request {i} differs inside a batch of {batch_sizes[i]}"


def test_server_serves_every_model_on_the_cuda_backend(client, server):
    # --backend cuda is explicit: a server that could not load the CUDA engine
    # exits at start (UNAVAILABLE) instead of falling back to the cpu engine.
    names = {m.name for m in client.list_models()}
    assert {"sdpa", "mha-fp32", "mha-bf16"} <= names


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_sdpa_session_on_the_gpu_equals_one_causal_request(client, torch_cuda, dtype, tol):
    """A session on the cuda backend (its KV blocks in GPU memory): a prefill
    of 37 tokens, 20 decode steps and a 5-token append, each step equal to
    the matching rows of one causal request over the whole sequence (torch,
    float64) and close to the server's own stateless answer."""
    rng = np.random.default_rng(29)
    steps = [37] + [1] * 20 + [5]
    length = sum(steps)
    q = rng.standard_normal((1, 8, length, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, length, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, length, 64)).astype(np.float32)
    rounded = [torch_cuda.as_tensor(x).to(getattr(torch_cuda, dtype)).double().numpy()
               for x in (q, k, v)]
    ref = _sdpa_oracle(torch_cuda, *rounded, causal=True)
    stateless = client.attend(q, k, v, model="sdpa", causal=True, input_dtype=dtype).output
    assert _rel(stateless, ref) < tol
    with client.open_session("sdpa") as session:
        t = 0
        for n in steps:
            res = session.attend(q[:, :, t:t + n], k[:, :, t:t + n], v[:, :, t:t + n],
                                 causal=True, input_dtype=dtype)
            assert res.session_length == t + n
            assert _rel(res.output, ref[:, :, t:t + n]) < tol, f"step of {n} at {t}"
            assert _rel(res.output, stateless[:, :, t:t + n]) < 2 * tol, f"step of {n} at {t}"
            t += n


@pytest.mark.parametrize("model,tol", [("mha-fp32", 1e-5), ("mha-bf16", 2e-2)])
def test_projection_session_on_the_gpu_equals_one_causal_request(client, repo, torch_cuda,
                                                                  model, tol):
    """Self-attention through a projection model's session (K/V projected on
    the GPU, cached in FLOAT32 there) equals the module over the whole
    sequence with a causal mask, step by step."""
    torch = torch_cuda
    _, mha = repo
    ref_mod = mha.to("cuda", torch.float64)
    rng = np.random.default_rng(31)
    steps = [37] + [1] * 20 + [5]
    length = sum(steps)
    x = rng.standard_normal((1, length, 256)).astype(np.float32)
    xt = torch.as_tensor(x, dtype=torch.float64, device="cuda")
    future = torch.ones(length, length, dtype=torch.bool, device="cuda").triu(1)
    with torch.no_grad():
        ref, _ = ref_mod(xt, xt, xt, attn_mask=future, need_weights=False)
    ref = ref.cpu().numpy()
    with client.open_session(model) as session:
        t = 0
        for n in steps:
            res = session.attend(x[:, t:t + n], causal=True)
            assert res.session_length == t + n
            assert _rel(res.output, ref[:, t:t + n]) < tol, f"step of {n} at {t}"
            t += n


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_sdpa_session_with_window_softcap_sinks_on_the_gpu(client, torch_cuda, dtype, tol):
    """A session's requests may carry a sliding window, softcapping and sinks
    (the split-KV decode computes them; the stateless GPU path does not yet):
    step by step equal to NumPy's float64 oracle over the whole sequence."""
    rng = np.random.default_rng(37)
    steps = [37] + [1] * 10 + [5]
    length = sum(steps)
    q = rng.standard_normal((1, 8, length, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, length, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, length, 64)).astype(np.float32)
    sinks = rng.standard_normal(8).astype(np.float32)
    rounded = [torch_cuda.as_tensor(x).to(getattr(torch_cuda, dtype)).double().numpy()
               for x in (q, k, v)]
    ref, _ = harness.reference_attention(*rounded, causal=True, window=16, softcap=5.0,
                                         sinks=sinks)
    with client.open_session("sdpa") as session:
        t = 0
        for n in steps:
            res = session.attend(q[:, :, t:t + n], k[:, :, t:t + n], v[:, :, t:t + n],
                                 causal=True, input_dtype=dtype, window=16, softcap=5.0,
                                 sinks=sinks)
            assert _rel(res.output, ref[:, :, t:t + n]) < tol, f"step of {n} at {t}"
            t += n
