"""bench/cuda_bench.py turns attnserve_cuda_bench's JSON lines into the tables a
GPU lease commits (docs/gpu-runs/). A lease is 15 minutes, so a table that
breaks on a row kind or field costs a whole run: here a stand-in for the
binary prints lines made with the C++ bench's own printf formats (taken from
engine/cuda/cuda_bench.cc, so a renamed field on either side fails here, not
on a GPU), and the tables must carry the figures that went in."""

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import unittest

SOURCE_DIR = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_formats():
    """Each row kind's printf format in cuda_bench.cc, adjacent literals joined."""
    with open(os.path.join(SOURCE_DIR, "engine", "cuda", "cuda_bench.cc"), encoding="utf-8") as f:
        source = f.read()
    formats = {}
    literal = re.compile(r'\s*"((?:[^"\\]|\\.)*)"')
    for m in re.finditer(r'"\{\\"kind\\": \\"(\w+)\\"', source):
        parts, pos = [], m.start()
        while (lit := literal.match(source, pos)) is not None:  # until the argument list
            parts.append(lit.group(1))
            pos = lit.end()
        formats[m.group(1)] = "".join(parts).replace('\\"', '"').replace("\\n", "")
    return formats


class CudaBenchTableTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.formats = bench_formats()

    def tearDown(self):
        self.tmp.cleanup()

    def line(self, kind, *values):
        # C's %ld, %d, %s and %.Nf read the same in Python.
        text = self.formats[kind] % values
        json.loads(text)  # the C++ side prints JSON
        return text

    def run_table(self, lines):
        fake = os.path.join(self.tmp.name, "attnserve_cuda_bench")
        with open(fake, "w", encoding="utf-8") as f:
            f.write("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
        os.chmod(fake, os.stat(fake).st_mode | stat.S_IEXEC)
        out_json = os.path.join(self.tmp.name, "rows.json")
        done = subprocess.run(
            [sys.executable, os.path.join(SOURCE_DIR, "bench", "cuda_bench.py"), "--bench", fake,
             "--quick", "--json", out_json],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        return done.stdout

    def test_every_row_kind_reaches_its_table(self):
        self.assertEqual(set(self.formats),
                         {"attention", "layer_feature", "projection", "gemm_ceiling", "device",
                          "paged"})
        lines = [
            self.line("device", "NVIDIA Test", 9, 0),
            # kernel, dtype, batch, heads, seq, bucket, head_dim, causal, ms, first, tflops
            self.line("attention", "cudnn", "bf16", 8, 16, 2000, 2048, 128, "true", 1.5, 36.5,
                      512.0),
            self.line("attention", "flash", "bf16", 8, 16, 2000, 2000, 128, "true", 4.0, 0.0,
                      190.0),
            self.line("attention", "unfused", "fp32", 4, 16, 2048, 2048, 128, "true", 9.0, 0.0,
                      19.1),
            self.line("attention", "unfused-fp32", "fp32", 4, 16, 2048, 2048, 128, "true", 11.0,
                      0.0, 15.6),
            self.line("attention", "flash-fp32", "fp32", 4, 16, 2048, 2048, 128, "true", 4.5,
                      0.0, 38.2),
            # feature, kernel, batch, heads, seq, head_dim, window, softcap, ms, tflops
            self.line("layer_feature", "softcap 50", "flash", 4, 16, 2048, 128, 0, 50.0, 1.25,
                      110.0),
            self.line("layer_feature", "softcap 50", "unfused", 4, 16, 2048, 128, 0, 50.0, 5.0,
                      27.5),
            self.line("layer_feature", "window 4096", "flash", 1, 16, 16384, 128, 4096, 0.0, 4.0,
                      120.0),
            self.line("layer_feature", "window 4096", "general", 1, 16, 16384, 128, 4096, 0.0,
                      900.0, 0.53),
            self.line("gemm_ceiling", "bf16", 700.0),
            # dtype, rows, in, out, ms, tflops, cublas same shape
            self.line("projection", "bf16", 4096, 4096, 4096, 0.25, 550.0, 560.0),
        ]
        table = self.run_table(lines)
        self.assertIn("Device: NVIDIA Test (sm_90)", table)
        # The padded bf16 row: cuDNN's path, its bucket and first call, our kernel beside it.
        self.assertRegex(table, r"\| bf16 \| 8 \| 16 \| 2000 \| 128 \| True \| cudnn \(bucket 2048\) "
                                r"\| 512\.0 \| 190\.0 \| 36\.5 \|")
        # fp32: 3xTF32, full fp32 and the fused kernel on one line.
        self.assertIn("3xTF32 19.1, full fp32 15.6, fused 38.2", table)
        # The layer features against the default route: the unfused path where it
        # fits, the general kernel where it does not; speedup = default ms / fused ms.
        self.assertRegex(table, r"\| softcap 50 \| 4 \| 16 \| 2048 \| 1\.250 \| 110\.0 \| unfused "
                                r"\| 5\.000 \| 27\.5 \| 4\.00 \|")
        self.assertRegex(table, r"\| window 4096 \| 1 \| 16 \| 16384 \| 4\.000 \| 120\.0 \| general "
                                r"\| 900\.000 \| 0\.5 \| 225\.00 \|")
        self.assertRegex(table, r"\| bf16 \| 4096 x 4096 -> 4096 \| 550\.0 \| 560\.0 \| 700\.0 "
                                r"\| 0\.98 \| 0\.79 \|")
        with open(os.path.join(self.tmp.name, "rows.json"), encoding="utf-8") as f:
            rows = json.load(f)
        self.assertEqual(len(rows), len(lines))


if __name__ == "__main__":
    unittest.main()
