"""attnserve's /metrics as a real Prometheus sees it: a Prometheus server
(Debian package, /usr/bin/prometheus) started on loopback with a temporary
config and TSDB scrapes attnserve every second while attn_bench loads it; its
HTTP API must then agree with what attn_bench measured (request count exactly,
p99 within a stated factor). Everything runs on 127.0.0.1 and stops by itself."""

import json
import subprocess

import harness
import serving_util as su
from prometheus_util import Prometheus, have_prometheus

# histogram_quantile interpolates linearly inside a bucket (ours grow 1.78x
# per bucket), and the server's duration excludes the client and network
# share of the round trip: agreement within this factor either way.
P99_FACTOR = 3.0


@have_prometheus
def test_prometheus_agrees_with_attn_bench(tmp_path):
    srv = harness.ServerProcess()
    prom = None
    try:
        prom = Prometheus(tmp_path, f"127.0.0.1:{su.metrics_port(srv)}")
        su.wait_for(lambda: prom.query('up{job="attnserve"}') == 1, 30, "the first scrape of attnserve",
                    interval=0.2)

        bench = subprocess.run(
            [su.attn_bench_bin(), f"--target={srv.target}", "--model=demo-mha", "--batch=1", "--seq=16",
             "--concurrency=8", "--duration=4", "--json"],
            capture_output=True, text=True, timeout=60)
        assert bench.returncode == 0, bench.stderr
        result = json.loads(bench.stdout)
        sent = result["requests"]
        assert sent > 0 and result["ok"] == sent, result

        # Every request attn_bench sent, counted once, all OK.
        model = 'model="demo-mha"'
        su.wait_for(lambda: prom.query(f"sum(attnserve_requests_total{{{model}}})") == sent, 20,
                    f"Prometheus to see {sent} requests", interval=0.25)
        assert prom.query(f'attnserve_requests_total{{{model},code="OK"}}') == sent
        assert prom.query(f"attnserve_request_duration_seconds_count{{{model}}}") == sent
        assert prom.query(f"attnserve_batch_requests_sum{{{model}}}") == sent
        assert prom.query(f"attnserve_tokens_total{{{model}}}") == 16 * sent
        assert prom.query(f"attnserve_inflight_requests{{{model}}}") == 0
        assert prom.query('count(attnserve_build_info{job="attnserve"} == 1)') == 1

        # The server started fresh, so the cumulative buckets are exactly the
        # run that attn_bench measured.
        p99 = prom.query("histogram_quantile(0.99, sum by (le) "
                         f"(attnserve_request_duration_seconds_bucket{{{model}}}))")
        bench_p99 = result["latency_us"]["p99"] / 1e6
        print(f"p99: Prometheus {p99 * 1e3:.3f} ms, attn_bench {bench_p99 * 1e3:.3f} ms, {sent} requests")
        assert p99 is not None and p99 > 0
        assert bench_p99 / P99_FACTOR <= p99 <= bench_p99 * P99_FACTOR, \
            f"Prometheus p99 {p99:.6f}s vs attn_bench p99 {bench_p99:.6f}s (factor {P99_FACTOR})"
    finally:
        if prom is not None:
            prom.stop()
        code = srv.stop()
    assert code == 0, srv.log()
