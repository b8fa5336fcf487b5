"""AttentionClient: the blocking client. numpy arrays in, numpy arrays out
(fp32, fp16, bf16 and bool tensors), errors as AttnServeError, plus sessions,
AttendStream in request order, health and model listing."""

import types
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc

from . import _common, _wire
from ._common import AttendResult, Metadata, PemSource, build_request, decode_response
from ._stubs import attention_pb2, attention_pb2_grpc, health_pb2, health_pb2_grpc
from .errors import NotFoundError, from_rpc_error
from .tensors import DTypeLike

# The generated modules, for callers that build requests by hand.
stubs = types.SimpleNamespace(attention_pb2=attention_pb2, attention_pb2_grpc=attention_pb2_grpc,
                              health_pb2=health_pb2, health_pb2_grpc=health_pb2_grpc)


class Session:
    """A server-side KV-cache session (OpenSession), bound to one model.

    Each attend() appends the request's key/value rows (projection models: the
    new hidden states) to the server's cache and attends over everything cached.
    Use it as a context manager, or call close(); an idle session expires after
    `ttl` seconds on the server.
    """

    def __init__(self, client: "AttentionClient", resp: "attention_pb2.OpenSessionResponse"):
        self._client = client
        self.id: str = resp.session_id
        self.model: str = resp.model
        self.ttl: float = resp.ttl.seconds + resp.ttl.nanos * 1e-9
        self.max_tokens: int = resp.max_tokens
        self.block_tokens: int = resp.block_tokens
        self.length: int = 0  # tokens cached, as of the last attend()
        self.closed: bool = False

    def attend(self, query: Any, key: Any = None, value: Any = None, **kwargs: Any) -> AttendResult:
        """AttentionClient.attend within this session (same arguments, no model)."""
        result = self._client.attend(query, key, value, session=self, **kwargs)
        self.length = result.session_length
        return result

    def close(self, timeout: Optional[float] = None) -> int:
        """Closes the session; returns the tokens it released. Idempotent."""
        if self.closed:
            return 0
        released = self._client.close_session(self, timeout=timeout)
        self.closed = True
        return released

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.close()
        except NotFoundError:
            pass  # already expired on the server: nothing left to release

    def __repr__(self) -> str:
        return f"Session(id={self.id!r}, model={self.model!r}, length={self.length})"


class AttentionClient:
    """One channel to an attnserve server. Thread-safe, like the gRPC stub it wraps.

    target: "host:port". TLS: give root_certificates (PEM bytes or a file path;
    tls=True alone trusts the system roots), and for mutual TLS private_key and
    certificate_chain. token: sent as `authorization: Bearer <token>` on every
    call. timeout: default seconds per call. compression: "gzip" or "deflate"
    compresses every request (the server decompresses them; it compresses its
    answers when started with --grpc-response-compression-level). Failed calls
    raise AttnServeError (.status_code, .message; subclasses such as
    InvalidArgumentError).
    """

    def __init__(self, target: str = _common.DEFAULT_TARGET, *, timeout: float = 60.0,
                 max_message_bytes: int = 1 << 30, tls: Optional[bool] = None,
                 root_certificates: PemSource = None, private_key: PemSource = None,
                 certificate_chain: PemSource = None, token: Optional[str] = None,
                 server_name_override: Optional[str] = None,
                 options: Sequence[Tuple[str, Any]] = (), channel: Optional[grpc.Channel] = None,
                 compression: Optional[str] = None):
        self.target = target
        self.timeout = timeout
        self.metadata: List[Tuple[str, str]] = _common.auth_metadata(token)
        creds = _common.channel_credentials(tls=tls, root_certificates=root_certificates,
                                            private_key=private_key, certificate_chain=certificate_chain)
        self.tls = creds is not None
        algorithm = _common.compression_algorithm(compression)
        if channel is not None and algorithm is not None:
            raise ValueError("compression= applies to the channel the client makes; "
                             "give it to the channel you pass instead")
        if channel is None:
            opts = _common.channel_options(max_message_bytes, server_name_override, options)
            channel = (grpc.secure_channel(target, creds, options=opts, compression=algorithm)
                       if creds else grpc.insecure_channel(target, options=opts,
                                                         compression=algorithm))
        self._channel = channel
        self.stub = attention_pb2_grpc.AttentionServiceStub(channel)
        self.health_stub = health_pb2_grpc.HealthStub(channel)
        self._methods = _wire.AttendMethods(channel)  # sends attend()'s arrays without copies

    # -- lifecycle --------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "AttentionClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def channel(self) -> grpc.Channel:
        return self._channel

    def _kw(self, timeout: Optional[float], metadata: Optional[Metadata]) -> dict:
        return {"timeout": timeout or self.timeout,
                "metadata": _common.merge_metadata(self.metadata, metadata)}

    def _call(self, method: Any, request: Any, timeout: Optional[float],
              metadata: Optional[Metadata]) -> Any:
        try:
            return method(request, **self._kw(timeout, metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # -- Attend -----------------------------------------------------------

    @staticmethod
    def build_request(query: Any, key: Any = None, value: Any = None, **kwargs: Any
                      ) -> "attention_pb2.AttendRequest":
        """The AttendRequest attend() would send (same keyword arguments, plus
        session_id)."""
        return build_request(query, key, value, **kwargs)

    def attend_request(self, request: "attention_pb2.AttendRequest", *, timeout: Optional[float] = None,
                       bf16_bits: bool = False, metadata: Optional[Metadata] = None) -> AttendResult:
        """Sends a prepared AttendRequest (or the PreparedRequest that attend()
        makes); returns an AttendResult."""
        return decode_response(self._call(self._methods.attend, request, timeout, metadata), bf16_bits)

    def attend(self, query: Any, key: Any = None, value: Any = None, *, model: str = "",
               causal: bool = False, key_lengths: Any = None, attn_mask: Any = None,
               scale: float = 0.0, need_weights: bool = False, average_weights: bool = False,
               output_dtype: DTypeLike = None, input_dtype: DTypeLike = None, request_id: str = "",
               session: Any = None, timeout: Optional[float] = None, bf16_bits: bool = False,
               metadata: Optional[Metadata] = None, positions: Any = None, window: int = 0,
               softcap: float = 0.0, sinks: Any = None) -> AttendResult:
        """softmax(Q K^T * scale + mask) V on the server.

        Layouts: model "sdpa": query [B, Hq, Lq, Dk], key [B, Hkv, Lk, Dk],
        value [B, Hkv, Lk, Dv]. Projection models: query [B, Lq, query_dim];
        key/value may be omitted for self-attention. attn_mask: bool (True =
        may attend) or float (added to the scores), broadcastable to
        [B, Hq, Lq, Lk]. session: a Session (or its id) whose cache the
        request appends to and attends over. BFLOAT16 outputs come back as
        float32, or as uint16 bits when bf16_bits. positions: the rotary
        position of every key token [B, Lk] (RoPE models; left padding,
        chunked prefill). window, softcap, sinks ([Hq] logits): sliding
        window, logit softcapping and attention sinks per request, on
        models without projections.
        """
        req = _common.prepare_request(
            query, key, value, model=model, causal=causal, key_lengths=key_lengths,
            attn_mask=attn_mask, scale=scale, need_weights=need_weights,
            average_weights=average_weights, output_dtype=output_dtype, input_dtype=input_dtype,
            request_id=request_id, session_id=_common.session_id_of(session), positions=positions,
            window=window, softcap=softcap, sinks=sinks)
        return self.attend_request(req, timeout=timeout, bf16_bits=bf16_bits,
                                   metadata=_common.session_metadata(req.session_id, metadata))

    def attend_stream(self, requests: Iterable[Any], *, timeout: Optional[float] = None,
                      bf16_bits: bool = False, return_exceptions: bool = False,
                      metadata: Optional[Metadata] = None) -> Iterator[Any]:
        """AttendStream: an iterable of requests in (AttendRequest messages, or
        dicts of attend()'s keyword arguments plus query/key/value), one
        AttendResult per request out, in request order, while later requests
        are still being sent. Requests without an id get a unique one.

        A failed request raises its AttnServeError (with .request_id) at its
        place in the order, ending the stream; with return_exceptions=True it
        is yielded instead and the stream goes on. `timeout` bounds the whole
        stream (default: none).
        """
        order = _common.StreamOrder(return_exceptions)
        call = self._methods.attend_stream(order.wrap(requests), timeout=timeout,
                                           metadata=_common.merge_metadata(self.metadata, metadata))
        try:
            for msg in call:
                order.received(msg, bf16_bits)
                for result in order.ready():
                    yield order.emit(result)
        except grpc.RpcError as e:
            if order.send_error is not None:  # a bad request item ended the stream
                raise order.send_error from None
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once finished; stops the stream if the caller stops early
        if order.outstanding():
            raise _common.unanswered(order.outstanding())

    # -- sessions ---------------------------------------------------------

    def open_session(self, model: str = "", *, ttl: Optional[float] = None, max_tokens: int = 0,
                     timeout: Optional[float] = None, metadata: Optional[Metadata] = None) -> Session:
        """Opens a KV-cache session on `model` (empty = the default model).
        ttl: idle seconds before the server closes it (None = the server's
        --session-ttl); max_tokens: cache limit (0 = the server's)."""
        sid = _common.new_session_id()
        req = attention_pb2.OpenSessionRequest(model=model, max_tokens=max_tokens, session_id=sid)
        if ttl is not None:
            req.ttl.FromNanoseconds(int(round(ttl * 1e9)))
        return Session(self, self._call(self.stub.OpenSession, req, timeout,
                                        _common.session_metadata(sid, metadata)))

    def close_session(self, session: Any, *, timeout: Optional[float] = None,
                      metadata: Optional[Metadata] = None) -> int:
        """Closes a session (a Session or its id); returns the tokens it released."""
        sid = _common.session_id_of(session)
        req = attention_pb2.CloseSessionRequest(session_id=sid)
        resp = self._call(self.stub.CloseSession, req, timeout, _common.session_metadata(sid, metadata))
        if isinstance(session, Session):
            session.closed = True
        return resp.released_tokens

    # -- models and health ------------------------------------------------

    def list_models(self, timeout: Optional[float] = None,
                    metadata: Optional[Metadata] = None) -> List["attention_pb2.ModelStatus"]:
        """[attnserve.v1.ModelStatus] of every served model."""
        return list(self._call(self.stub.ListModels, attention_pb2.ListModelsRequest(),
                               timeout, metadata).models)

    def get_model(self, name: str = "", timeout: Optional[float] = None,
                  metadata: Optional[Metadata] = None) -> "attention_pb2.ModelStatus":
        """attnserve.v1.ModelStatus of one model (NotFoundError if unknown)."""
        return self._call(self.stub.GetModel, attention_pb2.GetModelRequest(name=name), timeout, metadata)

    def health(self, service: str = "", timeout: Optional[float] = None,
               metadata: Optional[Metadata] = None) -> str:
        """grpc.health.v1 status name: "SERVING", "NOT_SERVING", ..."""
        resp = self._call(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service),
                          timeout, metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

