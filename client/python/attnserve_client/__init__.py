"""Python client for attnserve: numpy arrays in, numpy arrays out.

    from attnserve_client import AttentionClient
    with AttentionClient("127.0.0.1:50051") as c:
        out = c.attend(q, k, v, model="sdpa", causal=True).output

Importing AttentionClient generates the gRPC stubs on first use (see codegen.py).
"""

__all__ = ["AttentionClient", "AttendResult", "encode_tensor", "decode_tensor",
           "float_to_bf16_bits", "bf16_bits_to_float", "stubs"]


def __getattr__(name):
    # Lazy, so that `python3 -m attnserve_client.codegen` runs without first
    # generating stubs into the cache.
    if name in __all__:
        from . import client
        return getattr(client, name)
    raise AttributeError(name)
