"""AttentionClient: wraps the generated AttentionService stub with numpy
conversions (fp32, fp16, bf16 and bool tensors) plus health and model listing."""

import dataclasses
import types
from typing import Optional

import grpc
import numpy as np

from . import codegen

codegen.ensure_stubs()
from attnserve.v1 import attention_pb2, attention_pb2_grpc  # noqa: E402  (generated)
from attnserve.grpc_ext.health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

# The generated modules, for callers that build requests by hand.
stubs = types.SimpleNamespace(attention_pb2=attention_pb2, attention_pb2_grpc=attention_pb2_grpc,
                              health_pb2=health_pb2, health_pb2_grpc=health_pb2_grpc)

_DTYPE_NAMES = {
    "fp32": attention_pb2.FLOAT32, "float32": attention_pb2.FLOAT32,
    "fp16": attention_pb2.FLOAT16, "float16": attention_pb2.FLOAT16,
    "bf16": attention_pb2.BFLOAT16, "bfloat16": attention_pb2.BFLOAT16,
}


def _dtype_enum(dtype):
    if dtype is None:
        return None
    if isinstance(dtype, int):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    np_dtype = np.dtype(dtype)
    if np_dtype == np.float32:
        return attention_pb2.FLOAT32
    if np_dtype == np.float16:
        return attention_pb2.FLOAT16
    raise ValueError(f"dtype must be fp32, fp16 or bf16, got {dtype!r}")


def float_to_bf16_bits(x):
    """float array -> uint16 bfloat16 bits, rounded to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = np.where(nan, (u >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16)


def bf16_bits_to_float(bits):
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def encode_tensor(array, dtype=None):
    """numpy array -> attnserve.v1.Tensor.

    The wire dtype follows the array unless `dtype` ("fp32", "fp16", "bf16")
    says otherwise: float32 -> FLOAT32, float16 -> FLOAT16, bool -> BOOL,
    uint16 -> BFLOAT16 (raw bits), float64 -> FLOAT32.
    """
    a = np.asarray(array)
    want = _dtype_enum(dtype)
    if a.dtype == np.bool_:
        if want is not None:
            raise ValueError("a bool array cannot be sent as a float dtype")
        wire, data = attention_pb2.BOOL, a.astype(np.uint8)
    elif a.dtype == np.uint16:
        if want not in (None, attention_pb2.BFLOAT16):
            raise ValueError("uint16 arrays are bfloat16 bits; convert them yourself for another dtype")
        wire, data = attention_pb2.BFLOAT16, a
    elif a.dtype.kind == "f":
        if want is None:
            want = attention_pb2.FLOAT16 if a.dtype == np.float16 else attention_pb2.FLOAT32
        wire = want
        if want == attention_pb2.FLOAT32:
            data = a.astype("<f4")
        elif want == attention_pb2.FLOAT16:
            data = a.astype("<f2")
        else:
            data = float_to_bf16_bits(a)
    else:
        raise TypeError(f"cannot send a {a.dtype} array (want float32, float16, bool or uint16 bf16 bits)")
    return attention_pb2.Tensor(dtype=wire, shape=list(a.shape),
                                data=np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes())


def decode_tensor(tensor, bf16_bits=False):
    """attnserve.v1.Tensor -> numpy array. BFLOAT16 becomes float32 (exact), or
    the raw uint16 bits when bf16_bits."""
    shape = tuple(tensor.shape)
    if tensor.dtype == attention_pb2.FLOAT32:
        return np.frombuffer(tensor.data, dtype="<f4").reshape(shape).astype(np.float32)
    if tensor.dtype == attention_pb2.FLOAT16:
        return np.frombuffer(tensor.data, dtype="<f2").reshape(shape).astype(np.float16)
    if tensor.dtype == attention_pb2.BFLOAT16:
        bits = np.frombuffer(tensor.data, dtype="<u2").reshape(shape).astype(np.uint16)
        return bits if bf16_bits else bf16_bits_to_float(bits)
    if tensor.dtype == attention_pb2.BOOL:
        return np.frombuffer(tensor.data, dtype=np.uint8).reshape(shape) != 0
    raise ValueError(f"tensor has unknown dtype {tensor.dtype}")


@dataclasses.dataclass
class AttendResult:
    output: np.ndarray
    weights: Optional[np.ndarray]  # None unless need_weights
    timing: "attention_pb2.Timing"
    id: str
    response: "attention_pb2.AttendResponse"  # the raw message (wire dtypes)


class AttentionClient:
    """One channel to an attnserve server. Thread-safe like the gRPC stub it wraps.

    RPC failures raise grpc.RpcError (e.code(), e.details()).
    """

    def __init__(self, target="127.0.0.1:50051", *, timeout=60.0, max_message_bytes=1 << 30,
                 channel=None):
        # gRPC's 4 MiB default receive limit would refuse ordinary outputs.
        self._channel = channel or grpc.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ])
        self.timeout = timeout
        self.stub = attention_pb2_grpc.AttentionServiceStub(self._channel)
        self.health_stub = health_pb2_grpc.HealthStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def channel(self):
        return self._channel

    def build_request(self, query, key=None, value=None, *, model="", causal=False, key_lengths=None,
                      attn_mask=None, scale=0.0, need_weights=False, average_weights=False,
                      output_dtype=None, input_dtype=None, request_id=""):
        """The AttendRequest attend() would send. `input_dtype` converts float
        query/key/value (e.g. "bf16"); masks keep their own dtype."""
        req = attention_pb2.AttendRequest(
            model=model, id=request_id, causal=causal, scale=scale,
            need_weights=need_weights or average_weights, average_weights=average_weights)
        req.query.CopyFrom(encode_tensor(query, input_dtype))
        if key is not None:
            req.key.CopyFrom(encode_tensor(key, input_dtype))
        if value is not None:
            req.value.CopyFrom(encode_tensor(value, input_dtype))
        if key_lengths is not None:
            req.key_lengths.extend(int(n) for n in np.asarray(key_lengths).reshape(-1))
        if attn_mask is not None:
            req.attn_mask.CopyFrom(encode_tensor(attn_mask))
        if output_dtype is not None:
            req.output_dtype = _dtype_enum(output_dtype)
        return req

    def attend_request(self, request, *, timeout=None, bf16_bits=False):
        """Sends a prepared AttendRequest; returns an AttendResult."""
        resp = self.stub.Attend(request, timeout=timeout or self.timeout)
        weights = decode_tensor(resp.weights, bf16_bits) if resp.HasField("weights") else None
        return AttendResult(output=decode_tensor(resp.output, bf16_bits), weights=weights,
                            timing=resp.timing, id=resp.id, response=resp)

    def attend(self, query, key=None, value=None, *, model="", causal=False, key_lengths=None,
               attn_mask=None, scale=0.0, need_weights=False, average_weights=False,
               output_dtype=None, input_dtype=None, request_id="", timeout=None, bf16_bits=False):
        """softmax(Q K^T * scale + mask) V on the server.

        Layouts: model "sdpa": query [B, Hq, Lq, Dk], key [B, Hkv, Lk, Dk],
        value [B, Hkv, Lk, Dv]. Projection models: query [B, Lq, query_dim];
        key/value may be omitted for self-attention. attn_mask: bool (True =
        may attend) or float (added to the scores). BFLOAT16 outputs come back
        as float32, or as uint16 bits when bf16_bits.
        """
        req = self.build_request(query, key, value, model=model, causal=causal, key_lengths=key_lengths,
                                 attn_mask=attn_mask, scale=scale, need_weights=need_weights,
                                 average_weights=average_weights, output_dtype=output_dtype,
                                 input_dtype=input_dtype, request_id=request_id)
        return self.attend_request(req, timeout=timeout, bf16_bits=bf16_bits)

    def list_models(self, timeout=None):
        """[attnserve.v1.ModelStatus] of every served model."""
        return list(self.stub.ListModels(attention_pb2.ListModelsRequest(),
                                         timeout=timeout or self.timeout).models)

    def get_model(self, name="", timeout=None):
        """attnserve.v1.ModelStatus of one model (NOT_FOUND if unknown)."""
        return self.stub.GetModel(attention_pb2.GetModelRequest(name=name), timeout=timeout or self.timeout)

    def health(self, service="", timeout=None):
        """grpc.health.v1 status name: "SERVING", "NOT_SERVING", ..."""
        resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                      timeout=timeout or self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
