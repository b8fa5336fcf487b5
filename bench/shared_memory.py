"""bench/shared_memory.sh's client: the same sdpa request sent with its tensors in the message
and with them in registered system shared memory (inputs read, output written in place), over
KServe v2 gRPC and HTTP, in alternating rounds of N sequential calls. Prints per round and way:
req/s, client p50, and the server's own mean time per request from ModelStatistics deltas.
Exits non-zero if the two ways' answers differ in any bit."""

import argparse
import time
import uuid

import numpy as np
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm

# name: (B, H, L, D) of query, key and value; fp32.
CASES = {"small": (1, 8, 16, 64), "3mib": (1, 16, 256, 64), "24mib": (1, 32, 1024, 64)}


def server_ns(client, grpc):
    s = (client.get_inference_statistics("sdpa", as_json=True) if grpc
         else client.get_inference_statistics("sdpa"))["model_stats"][0]
    i = s["inference_stats"]["success"]
    return int(i.get("count", 0)), int(i.get("ns", 0))


class Way:
    def __init__(self, module, client, arrays, use_shm):
        self.module, self.client = module, client
        self.shape = arrays[0][1].shape
        self.regions = []
        out_bytes = arrays[0][1].nbytes
        if not use_shm:
            self.inputs = []
            for name, a in arrays:
                t = module.InferInput(name, list(a.shape), "FP32")
                if module is th:
                    t.set_data_from_numpy(a, binary_data=True)
                else:
                    t.set_data_from_numpy(a)
                self.inputs.append(t)
            self.outputs = [module.InferRequestedOutput("output", binary_data=True)
                            if module is th else module.InferRequestedOutput("output")]
            return
        total = sum(a.nbytes for _, a in arrays)
        for size in (total, out_bytes):
            name, key = "b-" + uuid.uuid4().hex[:8], "/attnserve-bench-" + uuid.uuid4().hex[:8]
            handle = shm.create_shared_memory_region(name, key, size)
            client.register_system_shared_memory(name, key, size)
            self.regions.append((name, handle))
        shm.set_shared_memory_region(self.regions[0][1], [a for _, a in arrays])
        self.inputs, offset = [], 0
        for name, a in arrays:
            t = module.InferInput(name, list(a.shape), "FP32")
            t.set_shared_memory(self.regions[0][0], a.nbytes, offset=offset)
            self.inputs.append(t)
            offset += a.nbytes
        out = module.InferRequestedOutput("output")
        out.set_shared_memory(self.regions[1][0], out_bytes)
        self.outputs = [out]

    def call(self):
        """One call; the output as an array (read from the region when it is
        there)."""
        r = self.client.infer("sdpa", self.inputs, outputs=self.outputs)
        if not self.regions:
            return r.as_numpy("output")
        return shm.get_contents_as_numpy(self.regions[1][1], np.float32, self.shape)

    def close(self):
        for name, handle in self.regions:
            self.client.unregister_system_shared_memory(name)
            shm.destroy_shared_memory_region(handle)


def measure(way, stats_client, grpc, n):
    for _ in range(5):
        way.call()
    c0, ns0 = server_ns(stats_client, grpc)
    lat = []
    start = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        way.call()
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    c1, ns1 = server_ns(stats_client, grpc)
    return n / wall, np.percentile(lat, 50) * 1e6, (ns1 - ns0) / max(c1 - c0, 1) / 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grpc", required=True)
    p.add_argument("--http", required=True)
    p.add_argument("--cases", default="small,3mib,24mib")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    clients = {"grpc": (tg, tg.InferenceServerClient(a.grpc)),
               "http": (th, th.InferenceServerClient(a.http))}
    for case in a.cases.split(","):
        shape = CASES[case]
        arrays = [(n, rng.standard_normal(shape, dtype=np.float32))
                  for n in ("query", "key", "value")]
        mib = sum(x.nbytes for _, x in arrays) / 2**20
        n = max(a.requests // (8 if case == "24mib" else 1), 10)
        print(f"== {case}: sdpa fp32 [{','.join(map(str, shape))}] x3, {mib:.2f} MiB in, "
              f"{arrays[0][1].nbytes / 2**20:.2f} MiB out; {n} calls per round")
        for proto, (module, client) in clients.items():
            ways = {"message": Way(module, client, arrays, False),
                    "shared memory": Way(module, client, arrays, True)}
            # Both ways compute the same answer, bit for bit.
            if ways["message"].call().tobytes() != ways["shared memory"].call().tobytes():
                raise SystemExit(f"{case} {proto}: the answer in shared memory differs from "
                                 "the answer in the message")
            ratios = []
            for rnd in range(a.rounds):
                got = {}
                for label, way in ways.items():
                    got[label] = measure(way, client, proto == "grpc", n)
                    rps, p50, server_us = got[label]
                    print(f"  {proto:4} round {rnd + 1} {label:13} req/s {rps:7.1f}  "
                          f"client p50 {p50:8.0f} us  server {server_us:7.0f} us")
                ratios.append(got["shared memory"][0] / got["message"][0])
            print(f"  {proto:4} shared memory / message req/s: "
                  + ", ".join(f"{r:.2f}x" for r in ratios))
            for way in ways.values():
                way.close()


if __name__ == "__main__":
    main()
