"""bench/serve_split.py reads the lines the CUDA engine prints with
ATTNSERVE_CUDA_PROFILE=1 (engine/cuda/staging.cc): a line formatted with the
engine's own format string is parsed back to the values that went in, and the
per-request split is the sums divided by the requests. The format is taken
from the C++ source, so a change on either side fails here, not on a GPU."""

import importlib.util
import json
import os
import re
import tempfile
import unittest

SOURCE_DIR = os.environ.get("ATTNSERVE_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_serve_split():
    spec = importlib.util.spec_from_file_location(
        "serve_split", os.path.join(SOURCE_DIR, "bench", "serve_split.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_format():
    """The printf format of Call::PrintProfile, its adjacent literals joined."""
    with open(os.path.join(SOURCE_DIR, "engine", "cuda", "staging.cc"), encoding="utf-8") as f:
        source = f.read()
    call = source[source.index('"attnserve: cuda call:'):]
    call = call[:call.index(");")]
    literals = re.findall(r'"((?:[^"\\]|\\.)*)"', call)
    return "".join(literals).replace("\\n", "\n")


class ServeSplitTest(unittest.TestCase):
    def test_engine_lines_parse_back_to_their_values(self):
        split = load_serve_split()
        fmt = engine_format()
        # C's %d / %.4f are Python's too.
        calls = [(3, 0.2, 0.05, 0.3, 1.5), (5, 0.4, 0.1, 0.5, 2.5)]
        lines = ["attnserve listening on 127.0.0.1:1\n"] + [fmt % c for c in calls]
        result = split.summarize(lines, {"server_timing": {"total_us_mean": 900.0}})
        self.assertEqual(result["calls"], 2)
        self.assertEqual(result["requests"], 8)
        self.assertAlmostEqual(result["upload_us"], 600.0 / 8 * 1.0, places=6)   # (0.2 + 0.4) ms
        self.assertAlmostEqual(result["download_us"], 150.0 / 8, places=6)
        self.assertAlmostEqual(result["kernels_us"], 800.0 / 8, places=6)
        self.assertAlmostEqual(result["engine_call_us"], 4000.0 / 8, places=6)
        self.assertAlmostEqual(result["rest_us"], 900.0 - (750.0 + 800.0) / 8, places=6)

    def test_a_log_without_profile_lines_is_named(self):
        split = load_serve_split()
        self.assertIsNone(split.summarize(["attnserve listening on x\n"], {}))


if __name__ == "__main__":
    unittest.main()
