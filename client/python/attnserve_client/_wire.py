"""AttendRequest's bytes written without protobuf's copies of the tensors.

protobuf's Python API copies a bytes field at every step: the array into
bytes, the bytes into a Tensor, the Tensor into the request, the request into
its serialized bytes. For a request of megabytes those copies (and the page
faults of the fresh memory each lands in) cost more than the call's transfer
itself. A PreparedRequest keeps each tensor's data in its numpy array until
gRPC asks for the bytes, and writes them with one copy: the join into the
bytes gRPC sends. The bytes parse to the same AttendRequest that protobuf
would have serialized; only the order of the fields differs (the tensors
come last), which every protobuf parser accepts.
"""

from typing import Any, Dict, Tuple, Union

import numpy as np

from ._stubs import attention_pb2

# AttendRequest's Tensor fields, in field-number order.
TENSOR_FIELDS = ("query", "key", "value", "attn_mask")
_FIELD_NUMBER = {name: attention_pb2.AttendRequest.DESCRIPTOR.fields_by_name[name].number
                 for name in TENSOR_FIELDS}
_DATA_NUMBER = attention_pb2.Tensor.DESCRIPTOR.fields_by_name["data"].number
_LENGTH_DELIMITED = 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field_number: int) -> bytes:
    return _varint(field_number << 3 | _LENGTH_DELIMITED)


class PreparedRequest:
    """An AttendRequest whose tensors' data stays in numpy arrays until sent.

    `head` is the request without its tensor fields; `tensors` maps a tensor
    field's name to (DataType, shape, data): data a C-contiguous
    little-endian array whose bytes are the tensor's data (the caller's own
    array where it already was that: it is read when the request is
    serialized).
    """

    __slots__ = ("head", "tensors")

    def __init__(self, head: "attention_pb2.AttendRequest",
                 tensors: Dict[str, Tuple[int, Tuple[int, ...], np.ndarray]]):
        self.head = head
        self.tensors = tensors

    @property
    def id(self) -> str:
        return self.head.id

    @property
    def session_id(self) -> str:
        return self.head.session_id

    def with_id(self, request_id: str) -> "PreparedRequest":
        """The same request under another id (the arrays are shared)."""
        head = attention_pb2.AttendRequest()
        head.CopyFrom(self.head)
        head.id = request_id
        return PreparedRequest(head, self.tensors)

    def serialize(self) -> bytes:
        """The request's bytes: the head as protobuf writes it, then each
        tensor field (dtype, shape, then data) in field-number order."""
        parts = [self.head.SerializeToString()]
        for name in TENSOR_FIELDS:
            if name not in self.tensors:
                continue
            dtype, shape, data = self.tensors[name]
            meta = attention_pb2.Tensor(dtype=dtype, shape=shape).SerializeToString()
            # proto3 leaves an empty bytes field out; so does protobuf's serializer.
            size = data.nbytes
            data_key = _key(_DATA_NUMBER) + _varint(size) if size else b""
            parts += [_key(_FIELD_NUMBER[name]), _varint(len(meta) + len(data_key) + size), meta,
                      data_key]
            if size:
                parts.append(memoryview(data).cast("B"))
        return b"".join(parts)

    def to_message(self) -> "attention_pb2.AttendRequest":
        """The AttendRequest these bytes are (its data copied in)."""
        return attention_pb2.AttendRequest.FromString(self.serialize())


def serialize(request: Union[PreparedRequest, "attention_pb2.AttendRequest"]) -> bytes:
    """gRPC's request serializer for Attend and AttendStream: a PreparedRequest
    or an ordinary AttendRequest."""
    if isinstance(request, PreparedRequest):
        return request.serialize()
    return request.SerializeToString()


class AttendMethods:
    """Attend and AttendStream on `channel` (sync or grpc.aio), taking a
    PreparedRequest as well as an AttendRequest."""

    _SERVICE = "/" + attention_pb2.DESCRIPTOR.services_by_name["AttentionService"].full_name

    def __init__(self, channel: Any):
        self.attend = channel.unary_unary(
            self._SERVICE + "/Attend", request_serializer=serialize,
            response_deserializer=attention_pb2.AttendResponse.FromString)
        self.attend_stream = channel.stream_stream(
            self._SERVICE + "/AttendStream", request_serializer=serialize,
            response_deserializer=attention_pb2.AttendStreamResponse.FromString)
