"""numpy <-> attnserve.v1.Tensor: float32, float16, bfloat16 (as uint16 bits or
rounded from float32) and bool, little-endian, C order."""

from typing import Any, Optional, Tuple, Union

import numpy as np

from ._stubs import attention_pb2

DTypeLike = Union[str, int, np.dtype, type, None]

_DTYPE_NAMES = {
    "fp32": attention_pb2.FLOAT32, "float32": attention_pb2.FLOAT32,
    "fp16": attention_pb2.FLOAT16, "float16": attention_pb2.FLOAT16,
    "bf16": attention_pb2.BFLOAT16, "bfloat16": attention_pb2.BFLOAT16,
}


def dtype_enum(dtype: DTypeLike) -> Optional[int]:
    """"fp32"/"fp16"/"bf16" (or numpy float32/float16, or the enum) -> DataType."""
    if dtype is None:
        return None
    if isinstance(dtype, int):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    if np_dtype == np.float32:
        return attention_pb2.FLOAT32
    if np_dtype == np.float16:
        return attention_pb2.FLOAT16
    raise ValueError(f"dtype must be fp32, fp16 or bf16, got {dtype!r}")


def float_to_bf16_bits(x: Any) -> np.ndarray:
    """float array -> uint16 bfloat16 bits, rounded to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = np.where(nan, (u >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16)


def bf16_bits_to_float(bits: Any) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def tensor_payload(array: Any, dtype: DTypeLike = None) -> Tuple[int, Tuple[int, ...], np.ndarray]:
    """numpy array (or anything np.asarray takes) -> (wire DataType, shape,
    the data as a C-contiguous little-endian array), by encode_tensor's
    rules. The array is `array` itself where it already is that (no copy)."""
    a = np.asarray(array)
    want = dtype_enum(dtype)
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
            data = a.astype("<f4", copy=False)
        elif want == attention_pb2.FLOAT16:
            data = a.astype("<f2", copy=False)
        else:
            data = float_to_bf16_bits(a)
    else:
        raise TypeError(f"cannot send a {a.dtype} array (want float32, float16, bool or uint16 bf16 bits)")
    return wire, a.shape, np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<"))


def encode_tensor(array: Any, dtype: DTypeLike = None) -> "attention_pb2.Tensor":
    """numpy array (or anything np.asarray takes) -> attnserve.v1.Tensor.

    The wire dtype follows the array unless `dtype` ("fp32", "fp16", "bf16")
    says otherwise: float32 -> FLOAT32, float16 -> FLOAT16, bool -> BOOL,
    uint16 -> BFLOAT16 (raw bits), float64 -> FLOAT32.
    """
    wire, shape, data = tensor_payload(array, dtype)
    return attention_pb2.Tensor(dtype=wire, shape=list(shape), data=data.tobytes())


def decode_tensor(tensor: "attention_pb2.Tensor", bf16_bits: bool = False) -> np.ndarray:
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
