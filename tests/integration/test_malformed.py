"""Messages that are not a valid AttendRequest, sent as raw bytes to the real
server (identity serializers): a unary Attend is answered INVALID_ARGUMENT
with a message, an AttendStream answers the message in its place and goes on,
each is counted in attnserve_requests_total{model="(unknown)"} (and, like
unparseable ListModels/GetModel requests, in
attnserve_unparseable_messages_total{method}), and none
writes a line to the server's log (protobuf's complaint goes to the client)."""

import time

import grpc
import numpy as np
import pytest

import serving_util as su
from attnserve_client import stubs

pb = stubs.attention_pb2

ATTEND = "/attnserve.v1.AttentionService/Attend"
ATTEND_STREAM = "/attnserve.v1.AttentionService/AttendStream"
GET_MODEL = "/attnserve.v1.AttentionService/GetModel"
PARSE_ERROR = "could not be parsed as attnserve.v1.AttendRequest: "


def _identity(x):
    return x


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def _unary(channel, payload):
    call = channel.unary_unary(ATTEND, request_serializer=_identity,
                               response_deserializer=_identity)
    return call(payload, timeout=30)


def _stream(channel, payloads):
    """(answers as AttendStreamResponse, final code, final details)."""
    call = channel.stream_stream(ATTEND_STREAM, request_serializer=_identity,
                                 response_deserializer=_identity)(iter(payloads), timeout=60)
    answers = [pb.AttendStreamResponse.FromString(b) for b in call]
    return answers, call.code(), call.details()


def _valid(client, ident, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    request = client.build_request(q, k, v, model="sdpa")
    request.id = ident
    return request.SerializeToString()


def _bad_utf8(field):
    """A valid AttendRequest but for one byte: `field` holds invalid UTF-8."""
    request = pb.AttendRequest(model="sdpa", id="bad-utf8")
    raw = request.SerializeToString()
    text = {"model": b"sdpa", "id": b"bad-utf8"}[field]
    assert raw.count(text) == 1
    return raw.replace(text, text[:2] + b"\xff" + text[3:])


def _invalid_count(server):
    return su.metric(su.scrape(server), "attnserve_requests_total", model="(unknown)",
                     code="INVALID_ARGUMENT")


def _log_lines_after(server, action):
    """Lines the server logged while `action` ran (plus a moment to drain)."""
    before = len(server.lines)
    action()
    time.sleep(0.5)
    return server.lines[before:]


@pytest.mark.parametrize("payload, words", [
    (b"\xff\xff\xff", ["not a valid protobuf encoding", "3 bytes"]),
    (_bad_utf8("model"), ["'attnserve.v1.AttendRequest.model'", "invalid UTF-8"]),
    (_bad_utf8("id"), ["'attnserve.v1.AttendRequest.id'", "invalid UTF-8"]),
], ids=["garbage", "utf8-model", "utf8-id"])
def test_unary_unparseable_is_invalid_argument_and_counted(channel, server, payload, words):
    before = _invalid_count(server)
    with pytest.raises(grpc.RpcError) as err:
        _unary(channel, payload)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    details = err.value.details()
    assert details.startswith("request " + PARSE_ERROR), details
    for w in words:
        assert w in details, details
    assert "Use the 'bytes' type" not in details  # advice for the proto's author
    assert _invalid_count(server) == before + 1


def test_unary_valid_encodings_still_parse(client, channel):
    # No bytes at all is a valid (empty) AttendRequest: validation answers it.
    with pytest.raises(grpc.RpcError) as err:
        _unary(channel, b"")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert PARSE_ERROR not in err.value.details() and "query" in err.value.details()
    # Unknown fields are kept and ignored, as gRPC's own parse did (field 99, varint 1).
    raw = _unary(channel, _valid(client, "u1") + b"\x98\x06\x01")
    response = pb.AttendResponse.FromString(raw)
    assert response.id == "u1" and len(response.output.data) == 1 * 2 * 4 * 8 * 4


def test_stream_unparseable_message_is_answered_in_place_and_stream_goes_on(client, channel,
                                                                              server):
    """The probe's case: a valid message, the same bytes cut short by 7, two
    valid ones. Four answers (matched by id: they come in completion order)."""
    before = _invalid_count(server)
    cut = _valid(client, "m2", seed=2)[:-7]
    answers, code, details = _stream(
        channel, [_valid(client, "m1", 1), cut, _valid(client, "m3", 3), _valid(client, "m4", 4)])
    assert code == grpc.StatusCode.OK, details
    assert len(answers) == 4, answers
    by_id = {a.id: a for a in answers}
    assert by_id.keys() == {"m1", "", "m3", "m4"}, [a.id for a in answers]
    for ident in ("m1", "m3", "m4"):
        assert by_id[ident].code == 0, by_id[ident].message
        assert len(by_id[ident].response.output.data) == 1 * 2 * 4 * 8 * 4
    bad = by_id[""]
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], bad
    assert bad.message.startswith("AttendStream message 2 " + PARSE_ERROR), bad.message
    assert not bad.HasField("response")
    assert _invalid_count(server) == before + 1


def test_stream_names_each_bad_message_by_position(client, channel, server):
    before = _invalid_count(server)
    answers, code, details = _stream(
        channel, [b"\xff\xff\xff", _valid(client, "ok"), _bad_utf8("id"), _bad_utf8("model")])
    assert code == grpc.StatusCode.OK, details
    assert sorted(a.id for a in answers) == ["", "", "", "ok"]
    errors = sorted(a.message for a in answers if a.id == "")
    assert [e.split(" could not")[0] for e in errors] == [
        "AttendStream message 1", "AttendStream message 3", "AttendStream message 4"]
    assert "'attnserve.v1.AttendRequest.id'" in errors[1], errors[1]
    assert "'attnserve.v1.AttendRequest.model'" in errors[2], errors[2]
    assert all(a.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for a in answers if a.id == "")
    assert _invalid_count(server) == before + 3


def test_unparseable_messages_do_not_flood_the_log(client, channel, server):
    """Each of these wrote a libprotobuf ERROR line before: 200 now write none."""
    before = _invalid_count(server)

    def send():
        for i in range(100):
            with pytest.raises(grpc.RpcError):
                _unary(channel, _bad_utf8("model" if i % 2 else "id"))
        answers, code, _ = _stream(channel, [_bad_utf8("id")] * 100)
        assert code == grpc.StatusCode.OK and len(answers) == 100

    lines = _log_lines_after(server, send)
    assert lines == [], "".join(lines[:5])
    assert _invalid_count(server) == before + 200
    # And the server still serves.
    raw = _unary(channel, _valid(client, "after"))
    assert pb.AttendResponse.FromString(raw).id == "after"


SERVICE = "/attnserve.v1.AttentionService/"
LIST_MODELS = SERVICE + "ListModels"


def _unparseable_count(server, method):
    return su.metric(su.scrape(server), "attnserve_unparseable_messages_total", method=method)


@pytest.mark.parametrize("method, type_name, payload, words", [
    (GET_MODEL, "GetModelRequest", b"\xff\xff\xff", ["not a valid protobuf encoding", "3 bytes"]),
    (GET_MODEL, "GetModelRequest",
     pb.GetModelRequest(name="sdpa").SerializeToString().replace(b"sdpa", b"sd\xffa"),
     ["'attnserve.v1.GetModelRequest.name'", "invalid UTF-8"]),
    (LIST_MODELS, "ListModelsRequest", b"\x0a\x05ab", ["not a valid protobuf encoding"]),
    (SERVICE + "OpenSession", "OpenSessionRequest", b"\xff\xff\xff",
     ["not a valid protobuf encoding"]),
    (SERVICE + "CloseSession", "CloseSessionRequest",
     pb.CloseSessionRequest(session_id="abcd").SerializeToString().replace(b"abcd", b"ab\xffd"),
     ["'attnserve.v1.CloseSessionRequest.session_id'", "invalid UTF-8"]),
], ids=["getmodel-garbage", "getmodel-utf8", "listmodels-truncated", "opensession-garbage",
        "closesession-utf8"])
def test_model_rpcs_unparseable_is_invalid_argument_counted_and_not_logged(
        channel, server, method, type_name, payload, words):
    """ListModels/GetModel (and the session RPCs) answered UNIMPLEMENTED with an
    empty message (gRPC's own parse) and logged a libprotobuf ERROR line per call."""
    rpc = channel.unary_unary(method, request_serializer=_identity,
                              response_deserializer=_identity)
    name = method.rsplit("/", 1)[1]
    before = _unparseable_count(server, name)

    def send():
        for _ in range(50):
            with pytest.raises(grpc.RpcError) as err:
                rpc(payload, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            details = err.value.details()
            assert details.startswith(
                f"request could not be parsed as attnserve.v1.{type_name}: "), details
            for w in words:
                assert w in details, details

    assert _log_lines_after(server, send) == []
    assert _unparseable_count(server, name) == before + 50


def test_model_rpcs_still_answer_valid_bytes(channel):
    get_model = channel.unary_unary(GET_MODEL, request_serializer=_identity,
                                    response_deserializer=_identity)
    status = pb.ModelStatus.FromString(
        get_model(pb.GetModelRequest(name="sdpa").SerializeToString(), timeout=30))
    assert status.name == "sdpa" and status.state == pb.ModelStatus.READY
    with pytest.raises(grpc.RpcError) as err:
        get_model(pb.GetModelRequest(name="nope").SerializeToString(), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    list_models = channel.unary_unary(LIST_MODELS, request_serializer=_identity,
                                      response_deserializer=_identity)
    listed = pb.ListModelsResponse.FromString(list_models(b"", timeout=30))
    assert "sdpa" in [m.name for m in listed.models]


def test_attend_unparseable_counted_by_method(client, channel, server):
    before = (_unparseable_count(server, "Attend"), _unparseable_count(server, "AttendStream"))
    with pytest.raises(grpc.RpcError):
        _unary(channel, b"\xff\xff\xff")
    _stream(channel, [b"\xff\xff\xff", b"\xff", _valid(client, "fine")])
    assert _unparseable_count(server, "Attend") == before[0] + 1
    assert _unparseable_count(server, "AttendStream") == before[1] + 2
