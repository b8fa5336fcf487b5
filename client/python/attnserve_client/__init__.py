"""Python client for attnserve, multi-head attention as a gRPC service.

    import numpy as np
    from attnserve_client import AttentionClient

    with AttentionClient("127.0.0.1:50051") as c:
        q = np.random.randn(1, 8, 16, 64).astype(np.float32)
        out = c.attend(q, q, q, model="sdpa", causal=True).output

AsyncAttentionClient is the same on asyncio; attnserve_client.torch has
RemoteMultiheadAttention (a drop-in for nn.MultiheadAttention) and the
exporter; failed calls raise AttnServeError. See client/README.md.
"""

try:
    from ._version import __version__  # written by setup.py into the wheel
except ImportError:  # a source checkout
    __version__ = "0+checkout"

# Imported lazily: `attnserve_client.export` (and python3 -m
# attnserve_client.codegen) must not need grpc or the generated stubs.
_EXPORTS = {
    "AttentionClient": "client", "Session": "client", "stubs": "client",
    "AsyncAttentionClient": "aio", "AsyncSession": "aio",
    "AttendResult": "_common",
    "encode_tensor": "tensors", "decode_tensor": "tensors",
    "float_to_bf16_bits": "tensors", "bf16_bits_to_float": "tensors",
    "AttnServeError": "errors", "InvalidArgumentError": "errors", "NotFoundError": "errors",
    "SessionAbortedError": "errors", "ResourceExhaustedError": "errors",
    "UnavailableError": "errors", "DeadlineExceededError": "errors",
    "UnauthenticatedError": "errors", "PermissionDeniedError": "errors",
    "UnimplementedError": "errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attnserve_client' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return __all__
