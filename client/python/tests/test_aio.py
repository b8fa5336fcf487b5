"""AsyncAttentionClient on grpc.aio against a real server: the same answers as
the blocking client, many requests in flight from one task, async streaming
with async request sources, errors as AttnServeError."""

import asyncio

import numpy as np
import pytest

from attnserve_client import AsyncAttentionClient, AttendResult, InvalidArgumentError, NotFoundError
from harness import reference_attention


def _run(coro):
    return asyncio.run(coro)


def test_attend_gather_and_model_calls(server):
    rng = np.random.default_rng(10)
    inputs = [tuple(rng.standard_normal((1, 2, n, 8)).astype(np.float32) for _ in range(3))
              for n in range(1, 17)]

    async def main():
        async with AsyncAttentionClient(server.target) as c:
            assert await c.health() == "SERVING"
            assert "sdpa" in {m.name for m in await c.list_models()}
            assert (await c.get_model("sdpa")).name == "sdpa"
            return await asyncio.gather(*[c.attend(q, k, v, model="sdpa", causal=True) for q, k, v in inputs])

    results = _run(main())
    for (q, k, v), res in zip(inputs, results):
        np.testing.assert_allclose(res.output, reference_attention(q, k, v, causal=True)[0], atol=1e-5)


def test_compressed_requests_over_asyncio(server):
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((1, 2, 32, 8)).astype(np.float32) for _ in range(3))

    async def main():
        async with AsyncAttentionClient(server.target, compression="gzip") as c:
            return await c.attend(q, k, v, model="sdpa")

    np.testing.assert_allclose(_run(main()).output, reference_attention(q, k, v)[0], atol=1e-5)


def test_errors_raise_attnserve_errors(server):
    async def main():
        async with AsyncAttentionClient(server.target) as c:
            q = np.zeros((1, 2, 3, 8), np.float32)
            with pytest.raises(InvalidArgumentError) as e:
                await c.attend(q, q[..., :4], q, model="sdpa")
            assert "key" in e.value.message
            with pytest.raises(NotFoundError):
                await c.get_model("nope")

    _run(main())


def test_attend_stream_from_an_async_source_in_order(server):
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 20, size=16)
    inputs = [tuple(rng.standard_normal((1, 2, int(n), 8)).astype(np.float32) for _ in range(3))
              for n in lengths]
    bad_at = 7

    async def source():
        for i, (q, k, v) in enumerate(inputs):
            await asyncio.sleep(0)
            yield {"query": q, "key": k[..., :4] if i == bad_at else k, "value": v, "model": "sdpa"}

    async def main():
        async with AsyncAttentionClient(server.target) as c:
            return [r async for r in c.attend_stream(source(), return_exceptions=True)]

    out = _run(main())
    assert len(out) == len(inputs)
    for i, ((q, k, v), res) in enumerate(zip(inputs, out)):
        if i == bad_at:
            assert isinstance(res, InvalidArgumentError)
        else:
            assert isinstance(res, AttendResult)
            np.testing.assert_allclose(res.output, reference_attention(q, k, v)[0], atol=1e-5)
