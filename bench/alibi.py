#!/usr/bin/python3
"""ALiBi's cost on the cpu attention core, and PyTorch's on the same shapes:
bench/position_bias.py --bias alibi (the command docs/PERFORMANCE.md records).

  /usr/bin/python3 bench/alibi.py --engine-bench build/bench/engine_bench \\
      --torch2-python build/torch2-venv/bin/python [--threads 1,2] [--min-time 0.3]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import position_bias  # noqa: E402

if __name__ == "__main__":
    sys.exit(position_bias.main(["--bias", "alibi"] + sys.argv[1:]))
