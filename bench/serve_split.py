#!/usr/bin/env python3
"""Splits the server's time per request on the GPU into transfers, kernels
and the rest, for one attn_bench run against `attnserve --backend cuda`
started with ATTNSERVE_CUDA_PROFILE=1.

Reads, on stdin, the server log lines of the run (the engine's
`attnserve: cuda call: requests N upload_ms U download_ms D compute_ms C
call_ms T` lines, engine/cuda/staging.h), and attn_bench's --json output of
the same run. Prints, per request: the copies' device time (upload and
download), the compute stream's work, the engine call's host time, and the
server's time from receipt to answer (attn_bench's server_timing); "rest" is
the server's time outside transfers and kernels, which the GPU issue wants
at most half the transfers' time.

  tail -n +K server.log | python3 bench/serve_split.py --bench-json run.json [--label TEXT]
"""

import argparse
import json
import re
import sys

LINE = re.compile(r"attnserve: cuda call: requests (\d+) upload_ms ([\d.]+) download_ms ([\d.]+) "
                  r"compute_ms ([\d.]+) call_ms ([\d.]+)")


def summarize(lines, bench):
    calls = requests = 0
    upload = download = compute = call = 0.0
    for line in lines:
        m = LINE.search(line)
        if not m:
            continue
        calls += 1
        requests += int(m.group(1))
        upload += float(m.group(2))
        download += float(m.group(3))
        compute += float(m.group(4))
        call += float(m.group(5))
    if requests == 0:
        return None
    per = lambda ms: ms * 1000.0 / requests  # µs per request
    timing = bench.get("server_timing", {})
    server_us = float(timing.get("total_us_mean", 0.0))
    transfers = per(upload) + per(download)
    kernels = per(compute)
    return {
        "calls": calls,
        "requests": requests,
        "upload_us": per(upload),
        "download_us": per(download),
        "transfers_us": transfers,
        "kernels_us": kernels,
        "engine_call_us": per(call),
        "server_us": server_us,
        # A batch's requests share its transfers and kernels; the server's
        # time per request counts each request's whole stay.
        "rest_us": server_us - transfers - kernels,
        "rest_over_transfers": (server_us - transfers - kernels) / transfers if transfers else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-json", required=True)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    with open(args.bench_json) as f:
        bench = json.load(f)
    s = summarize(sys.stdin, bench)
    if s is None:
        print(f"{args.label}: no profile lines "
              "(was the server started with ATTNSERVE_CUDA_PROFILE=1?)")
        return 1
    print(f"{args.label}: {s['requests']} requests in {s['calls']} engine calls; per request: "
          f"upload {s['upload_us']:.1f} us, download {s['download_us']:.1f} us, "
          f"kernels {s['kernels_us']:.1f} us, engine call {s['engine_call_us']:.1f} us, "
          f"server {s['server_us']:.1f} us, rest {s['rest_us']:.1f} us "
          f"({s['rest_over_transfers']:.2f}x the transfers; the issue's bound 0.5x)")
    print(json.dumps({"label": args.label, **s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
