"""KServe v2 over HTTP/REST against the same protocol over gRPC, on one
server, with Triton's own clients (tritonclient.http and tritonclient.grpc):
sequential requests, one at a time, alternating rounds, so that both see the
same machine load. Prints p50/p90 latency per protocol and the ratios the
issue asks for: a 1 MiB binary request's HTTP/gRPC p50 ratio, and a tiny
request's HTTP - gRPC p50 difference.

    bench/http_vs_grpc.sh [BUILD_DIR]      (starts the server, runs this)
"""

import argparse
import statistics
import time

import numpy as np
import tritonclient.grpc as tg
import tritonclient.http as th


def inputs(module, arrays, binary=True):
    out = []
    for name, a in arrays:
        t = module.InferInput(name, list(a.shape), "FP32")
        if module is th:
            t.set_data_from_numpy(a, binary_data=binary)
        else:
            t.set_data_from_numpy(a)
        out.append(t)
    return out


def measure(call, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.9)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grpc", required=True)
    p.add_argument("--http", required=True)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    g = tg.InferenceServerClient(args.grpc)
    h = th.InferenceServerClient(args.http)
    rng = np.random.default_rng(0)
    # 1 MiB of inputs: query [1, 8, 64, 64] + key/value [1, 8, 224, 64] fp32.
    big = [("query", rng.standard_normal((1, 8, 64, 64), dtype=np.float32)),
           ("key", rng.standard_normal((1, 8, 224, 64), dtype=np.float32)),
           ("value", rng.standard_normal((1, 8, 224, 64), dtype=np.float32))]
    size = sum(a.nbytes for _, a in big)
    tiny = [(n, rng.standard_normal((1, 1, 1, 8), dtype=np.float32))
            for n in ("query", "key", "value")]
    cases = {
        f"{size / 2**20:.2f} MiB binary": big,
        "tiny (3 x 32 B)": tiny,
    }
    results = {}
    for r in range(args.rounds):
        for label, arrays in cases.items():
            gi, hi = inputs(tg, arrays), inputs(th, arrays)
            ho = [th.InferRequestedOutput("output", binary_data=True)]
            for proto, call in (("grpc", lambda: g.infer("sdpa", gi)),
                                ("http", lambda: h.infer("sdpa", hi, outputs=ho))):
                for _ in range(10):
                    call()  # warm-up
                p50, p90 = measure(call, args.requests)
                results.setdefault((label, proto), []).append((p50, p90))
                print(f"round {r + 1} {label:>16} {proto}: p50 {p50 * 1e6:8.0f} us  "
                      f"p90 {p90 * 1e6:8.0f} us", flush=True)
    print()
    for label in cases:
        gp = statistics.median(x[0] for x in results[(label, "grpc")])
        hp = statistics.median(x[0] for x in results[(label, "http")])
        print(f"{label}: p50 gRPC {gp * 1e6:.0f} us, HTTP {hp * 1e6:.0f} us, "
              f"HTTP/gRPC {hp / gp:.2f}x, HTTP - gRPC {(hp - gp) * 1e6:+.0f} us")


if __name__ == "__main__":
    main()
