"""Latency of KServe v2 ModelInfer through Triton's own Python client
(tritonclient.grpc), closed loop at concurrency 1, for an sdpa request of
L query rows of 64 fp32 (L * 256 bytes in, as many out) and 8 keys.

  build/kserve-venv/bin/python bench/kserve_latency.py HOST:PORT [L] [REQUESTS]

(build/kserve-venv is the venv that the tests/kserve ctest entries create;
the server needs --max-message-bytes above 2 * L * 256.) Prints p50 and the
minimum; the output is checked against NumPy for the first request."""

import sys
import time

import numpy as np
import tritonclient.grpc as tc


def main():
    url = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    requests = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    client = tc.InferenceServerClient(url)
    rng = np.random.default_rng(0)
    q = rng.random((1, 1, rows, 64), dtype=np.float32)
    k = rng.random((1, 1, 8, 64), dtype=np.float32)
    v = rng.random((1, 1, 8, 64), dtype=np.float32)
    inputs = []
    for name, a in (("query", q), ("key", k), ("value", v)):
        t = tc.InferInput(name, a.shape, "FP32")
        t.set_data_from_numpy(a)
        inputs.append(t)
    s = q[0, 0] @ k[0, 0].T / 8.0
    p = np.exp(s - s.max(axis=1, keepdims=True))
    expected = (p / p.sum(axis=1, keepdims=True)) @ v[0, 0]
    got = client.infer("sdpa", inputs).as_numpy("output")[0, 0]
    if not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
        sys.exit("kserve_latency.py: the output differs from NumPy's")
    latencies = []
    for i in range(requests + requests // 10):
        start = time.perf_counter()
        client.infer("sdpa", inputs)
        if i >= requests // 10:  # the first tenth warms up
            latencies.append(time.perf_counter() - start)
    latencies.sort()
    print(f"L={rows} ({q.nbytes / 2**20:.0f} MiB each way): p50 {latencies[len(latencies) // 2] * 1e3:.2f} ms,"
          f" min {latencies[0] * 1e3:.2f} ms over {len(latencies)} requests")


if __name__ == "__main__":
    main()
