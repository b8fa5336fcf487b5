"""The bytes attend() sends (attnserve_client._wire: the tensors' data joined
in from the numpy arrays, without protobuf's copies), against the oracle of
protobuf itself: they must parse to the AttendRequest built field by field
with protobuf's own API, for every dtype rule, layout and optional field.
No server needed."""

import numpy as np
import pytest

from attnserve_client import AttentionClient, _common, _wire, float_to_bf16_bits
from attnserve_client._stubs import attention_pb2 as pb


def _tensor(dtype, array):
    """The Tensor protobuf's API makes: data as little-endian C-order bytes."""
    return pb.Tensor(dtype=dtype, shape=list(array.shape), data=array.tobytes())


def _sent(*args, **kwargs):
    """What attend() would put on the wire, parsed back by protobuf."""
    return pb.AttendRequest.FromString(_common.prepare_request(*args, **kwargs).serialize())


RNG = np.random.default_rng(7)
Q = RNG.standard_normal((2, 4, 3, 8)).astype(np.float32)
K = RNG.standard_normal((2, 2, 5, 8)).astype(np.float32)
V = RNG.standard_normal((2, 2, 5, 6)).astype(np.float32)


def test_fp32_with_every_scalar_field_parses_to_protobufs_message():
    mask = RNG.random((1, 1, 3, 5)) > 0.5
    got = _sent(Q, K, V, model="m", causal=True, key_lengths=[5, 2], attn_mask=mask, scale=0.25,
                need_weights=True, average_weights=True, output_dtype="fp16", request_id="r1",
                session_id="s1", positions=[[0, 1, 2, 3, 4]] * 2, window=3, softcap=30.0,
                sinks=[0.5, -1.0, 0.0, 2.0])
    want = pb.AttendRequest(
        model="m", id="r1", causal=True, key_lengths=[5, 2], scale=0.25, need_weights=True,
        average_weights=True, output_dtype=pb.FLOAT16, session_id="s1",
        positions=[0, 1, 2, 3, 4] * 2, window=3, softcap=30.0, sinks=[0.5, -1.0, 0.0, 2.0],
        query=_tensor(pb.FLOAT32, Q), key=_tensor(pb.FLOAT32, K), value=_tensor(pb.FLOAT32, V),
        attn_mask=_tensor(pb.BOOL, mask.astype(np.uint8)))
    assert got == want


@pytest.mark.parametrize("array, dtype, wire, data", [
    (Q.astype(np.float64), None, pb.FLOAT32, Q),                      # float64 -> FLOAT32
    (Q.astype(np.float16), None, pb.FLOAT16, Q.astype(np.float16)),
    (Q, "fp16", pb.FLOAT16, Q.astype(np.float16)),
    (Q, "bf16", pb.BFLOAT16, float_to_bf16_bits(Q)),
    (float_to_bf16_bits(Q), None, pb.BFLOAT16, float_to_bf16_bits(Q)),  # raw bits
    (Q.astype(">f4"), None, pb.FLOAT32, Q),                           # big-endian input
    (np.asfortranarray(Q), None, pb.FLOAT32, Q),                      # not C-contiguous
    (Q.transpose(0, 2, 1, 3), None, pb.FLOAT32, np.ascontiguousarray(Q.transpose(0, 2, 1, 3))),
    (Q[:, :, ::2], None, pb.FLOAT32, np.ascontiguousarray(Q[:, :, ::2])),  # strided view
    (Q.tolist(), None, pb.FLOAT32, Q),                                # nested lists
])
def test_each_dtype_rule_and_layout_puts_protobufs_bytes_on_the_wire(array, dtype, wire, data):
    got = _sent(array, array, array, input_dtype=dtype)
    want = _tensor(wire, data)
    assert got.query == want and got.key == want and got.value == want


def test_masks_keep_their_dtype_and_empty_tensors_have_no_data_field():
    float_mask = RNG.standard_normal((2, 1, 3, 5)).astype(np.float32)
    got = _sent(Q, K, V, attn_mask=float_mask, input_dtype="bf16")
    assert got.attn_mask == _tensor(pb.FLOAT32, float_mask)
    empty = np.zeros((1, 1, 0, 8), np.float32)
    got = _sent(empty, K, V)
    assert got.HasField("query") and list(got.query.shape) == [1, 1, 0, 8]
    assert got.query == pb.Tensor(dtype=pb.FLOAT32, shape=[1, 1, 0, 8])


def test_self_attention_leaves_key_and_value_out():
    got = _sent(Q, model="proj")
    assert got.HasField("query") and not got.HasField("key") and not got.HasField("value")
    assert not got.HasField("attn_mask")


def test_build_request_returns_the_same_message_as_the_wire_bytes():
    kwargs = dict(model="m", causal=True, key_lengths=[5, 4], request_id="x")
    assert AttentionClient.build_request(Q, K, V, **kwargs) == _sent(Q, K, V, **kwargs)


def test_the_callers_contiguous_arrays_are_sent_from_where_they_are():
    prepared = _common.prepare_request(Q, K, V)
    for name, array in (("query", Q), ("key", K), ("value", V)):
        assert np.shares_memory(prepared.tensors[name][2], array), name
    # A conversion makes its own array; the caller's is never written.
    before = Q.copy()
    converted = _common.prepare_request(Q, input_dtype="fp16")
    assert not np.shares_memory(converted.tensors["query"][2], Q)
    assert np.array_equal(Q, before)


def test_a_stream_items_assigned_id_leaves_the_callers_request_alone():
    order = _common.StreamOrder(return_exceptions=False)
    message = AttentionClient.build_request(Q, K, V, model="sdpa")
    sent_message = order.sent(message)
    sent_dict = order.sent({"query": Q, "key": K, "value": V, "model": "sdpa"})
    assert message.id == ""  # the caller's message, unchanged
    assert sent_message.id and sent_dict.id and sent_message.id != sent_dict.id
    parsed = pb.AttendRequest.FromString(_wire.serialize(sent_dict))
    assert parsed.id == sent_dict.id
    assert parsed.query == _tensor(pb.FLOAT32, Q) and parsed.model == "sdpa"
    assert pb.AttendRequest.FromString(_wire.serialize(sent_message)).query == message.query
