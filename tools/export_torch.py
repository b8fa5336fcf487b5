#!/usr/bin/python3
"""Command-line entry of the PyTorch exporter, which lives in the Python client
(client/python/attnserve_client/export.py; `pip install ./client/python[torch]`
gives `attnserve_client.export` and `attnserve_client.torch.export_mha`).

    tools/export_torch.py repo/my-layer --checkpoint model.pt --module encoder.layers.0.self_attn

Importing this file (`import export_torch`) re-exports that module's functions.
"""

import os
import sys

_CLIENT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client", "python"))
if _CLIENT not in sys.path:
    sys.path.insert(0, _CLIENT)

from attnserve_client.export import *  # noqa: E402,F401,F403
from attnserve_client.export import __all__, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
