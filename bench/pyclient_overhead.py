"""The Python client's own cost per call, as a ratio to gRPC Python's floor,
against bench/echo_server (no compute; the answer's output is the query):

- client: AttentionClient.attend(q, k, v) with numpy arrays in, numpy out;
- floor:  the same request's bytes, serialized once beforehand, through a
          raw gRPC multicallable on the same channel, the answer left as
          bytes: what any Python caller pays for the transfer alone.

Sequential calls, alternating rounds, so both see the same machine load.
Prints p50 per case and client/floor. The client is whichever
attnserve_client the interpreter imports (PYTHONPATH=client/python for the
checkout's).

    bench/pyclient_overhead.sh [BUILD_DIR]   (starts echo_server, runs this)
"""

import argparse
import statistics
import time

import numpy as np

from attnserve_client import AttentionClient

METHOD = "/attnserve.v1.AttentionService/Attend"


def p50(call, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--requests", type=int, default=200, help="per case and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cases", default="", help="only the cases whose name starts with this")
    args = p.parse_args()
    client = AttentionClient(args.target, timeout=60)
    raw = client.channel.unary_unary(METHOD)  # bytes in, bytes out
    rng = np.random.default_rng(0)

    def qkv(heads, seq, dtype=np.float32):
        return [rng.standard_normal((1, heads, seq, 64)).astype(dtype) for _ in range(3)]

    cases = {  # name: (query, key, value)
        "tiny fp32 [1,1,1,8]": [rng.standard_normal((1, 1, 1, 8)).astype(np.float32)] * 3,
        "1.5 MiB fp16 (q,k,v [1,16,256,64])": qkv(16, 256, np.float16),
        "3 MiB fp32 (q,k,v [1,16,256,64])": qkv(16, 256),
        "24 MiB fp32 (q,k,v [1,32,1024,64])": qkv(32, 1024),
    }
    cases = {name: arrays for name, arrays in cases.items() if name.startswith(args.cases)}
    results = {name: {"client": [], "floor": []} for name in cases}
    for name, (q, k, v) in cases.items():
        body = client.build_request(q, k, v, model="sdpa").SerializeToString()
        got = client.attend(q, k, v, model="sdpa").output  # echo: the query comes back
        if got.shape != q.shape or not np.array_equal(got, q):
            raise SystemExit(f"{name}: the echo server did not return the query")
        for _ in range(max(5, args.requests // 10)):  # warm-up, both paths
            client.attend(q, k, v, model="sdpa")
            raw(body, timeout=60)
    for _ in range(args.rounds):
        for name, (q, k, v) in cases.items():
            body = client.build_request(q, k, v, model="sdpa").SerializeToString()
            n = max(10, args.requests // (1 + q.nbytes // (4 << 20)))
            results[name]["client"].append(p50(lambda: client.attend(q, k, v, model="sdpa"), n))
            results[name]["floor"].append(p50(lambda: raw(body, timeout=60), n))
    print(f"{'case':<38} {'client p50 us':>14} {'floor p50 us':>13} {'client/floor':>13}")
    for name, r in results.items():
        c, f = statistics.median(r["client"]), statistics.median(r["floor"])
        print(f"{name:<38} {c * 1e6:>14.0f} {f * 1e6:>13.0f} {c / f:>13.2f}")
    client.close()


if __name__ == "__main__":
    main()
