"""Parts of bench/compression_cost.sh in Python:

    compression_cost.py zlib          zlib (the library both protocols use) on
                                      1 MiB of random float32: ms to compress at
                                      levels 1 and 6, the ratio, ms to inflate
    compression_cost.py http HOST:PORT
                                      tritonclient.http against attnserve's REST
                                      port, sdpa fp32 q = k = v [1,16,256,64]:
                                      p50 ms plain, with gzip answers, with gzip
                                      requests, two rounds
"""

import statistics
import sys
import time
import zlib

import numpy as np


def p50_ms(call, n):
    call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def zlib_cost():
    data = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32).tobytes()
    for level in (1, 6):
        packed = zlib.compress(data, level)
        ms = p50_ms(lambda: zlib.compress(data, level), 5)
        print(f"zlib level {level}: {ms:.1f} ms per MiB, "
              f"{len(packed) / len(data):.3f} of the bytes")
    print(f"inflate: {p50_ms(lambda: zlib.decompress(packed), 5):.1f} ms per MiB")


def http_cost(target):
    import tritonclient.http as th
    q = np.random.default_rng(0).standard_normal((1, 16, 256, 64)).astype(np.float32)
    client = th.InferenceServerClient(target)

    def infer(**kw):
        inputs = []
        for name in ("query", "key", "value"):
            t = th.InferInput(name, list(q.shape), "FP32")
            t.set_data_from_numpy(q, binary_data=True)
            inputs.append(t)
        outputs = [th.InferRequestedOutput("output", binary_data=True)]
        client.infer("sdpa", inputs, outputs=outputs, **kw)

    for _ in range(2):
        plain = p50_ms(infer, 20)
        answers = p50_ms(lambda: infer(response_compression_algorithm="gzip"), 20)
        requests = p50_ms(lambda: infer(request_compression_algorithm="gzip"), 20)
        print(f"REST plain {plain:.1f} ms, gzip answers {answers:.1f} ms, "
              f"gzip requests {requests:.1f} ms")


if __name__ == "__main__":
    if sys.argv[1:] == ["zlib"]:
        zlib_cost()
    elif len(sys.argv) == 3 and sys.argv[1] == "http":
        http_cost(sys.argv[2])
    else:
        sys.exit(__doc__)
