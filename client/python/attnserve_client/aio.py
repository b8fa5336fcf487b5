"""AsyncAttentionClient: AttentionClient's methods as coroutines on grpc.aio,
for asyncio servers and pipelines (many requests in flight from one task)."""

from typing import Any, AsyncIterator, List, Optional, Sequence, Tuple

import grpc
import grpc.aio

from . import _common, _wire
from ._common import AttendResult, Metadata, PemSource, build_request, decode_response
from ._stubs import attention_pb2, attention_pb2_grpc, health_pb2, health_pb2_grpc
from .errors import NotFoundError, from_rpc_error
from .tensors import DTypeLike


class AsyncSession:
    """Session for AsyncAttentionClient: `async with` closes it."""

    def __init__(self, client: "AsyncAttentionClient", resp: "attention_pb2.OpenSessionResponse"):
        self._client = client
        self.id: str = resp.session_id
        self.model: str = resp.model
        self.ttl: float = resp.ttl.seconds + resp.ttl.nanos * 1e-9
        self.max_tokens: int = resp.max_tokens
        self.block_tokens: int = resp.block_tokens
        self.length: int = 0
        self.closed: bool = False

    async def attend(self, query: Any, key: Any = None, value: Any = None, **kwargs: Any) -> AttendResult:
        result = await self._client.attend(query, key, value, session=self, **kwargs)
        self.length = result.session_length
        return result

    async def close(self, timeout: Optional[float] = None) -> int:
        if self.closed:
            return 0
        released = await self._client.close_session(self, timeout=timeout)
        self.closed = True
        return released

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.close()
        except NotFoundError:
            pass

    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id!r}, model={self.model!r}, length={self.length})"


class AsyncAttentionClient:
    """AttentionClient on grpc.aio: the same constructor options and methods,
    each a coroutine (attend_stream an async generator). Create it inside a
    running event loop; `async with` closes the channel."""

    def __init__(self, target: str = _common.DEFAULT_TARGET, *, timeout: float = 60.0,
                 max_message_bytes: int = 1 << 30, tls: Optional[bool] = None,
                 root_certificates: PemSource = None, private_key: PemSource = None,
                 certificate_chain: PemSource = None, token: Optional[str] = None,
                 server_name_override: Optional[str] = None,
                 options: Sequence[Tuple[str, Any]] = (), channel: Optional[grpc.aio.Channel] = None,
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
            channel = (grpc.aio.secure_channel(target, creds, options=opts, compression=algorithm)
                       if creds else grpc.aio.insecure_channel(target, options=opts,
                                                         compression=algorithm))
        self._channel = channel
        self.stub = attention_pb2_grpc.AttentionServiceStub(channel)
        self.health_stub = health_pb2_grpc.HealthStub(channel)
        self._methods = _wire.AttendMethods(channel)  # sends attend()'s arrays without copies

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncAttentionClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    async def _call(self, method: Any, request: Any, timeout: Optional[float],
                    metadata: Optional[Metadata]) -> Any:
        try:
            return await method(request, timeout=timeout or self.timeout,
                                metadata=_common.merge_metadata(self.metadata, metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    build_request = staticmethod(build_request)

    async def attend_request(self, request: "attention_pb2.AttendRequest", *,
                             timeout: Optional[float] = None, bf16_bits: bool = False,
                             metadata: Optional[Metadata] = None) -> AttendResult:
        """See AttentionClient.attend_request."""
        return decode_response(await self._call(self._methods.attend, request, timeout, metadata), bf16_bits)

    async def attend(self, query: Any, key: Any = None, value: Any = None, *, model: str = "",
                     causal: bool = False, key_lengths: Any = None, attn_mask: Any = None,
                     scale: float = 0.0, need_weights: bool = False, average_weights: bool = False,
                     output_dtype: DTypeLike = None, input_dtype: DTypeLike = None,
                     request_id: str = "", session: Any = None, timeout: Optional[float] = None,
                     bf16_bits: bool = False, metadata: Optional[Metadata] = None,
                     positions: Any = None, window: int = 0, softcap: float = 0.0,
                     sinks: Any = None) -> AttendResult:
        """See AttentionClient.attend."""
        req = _common.prepare_request(
            query, key, value, model=model, causal=causal, key_lengths=key_lengths,
            attn_mask=attn_mask, scale=scale, need_weights=need_weights,
            average_weights=average_weights, output_dtype=output_dtype, input_dtype=input_dtype,
            request_id=request_id, session_id=_common.session_id_of(session), positions=positions,
            window=window, softcap=softcap, sinks=sinks)
        return await self.attend_request(req, timeout=timeout, bf16_bits=bf16_bits,
                                         metadata=_common.session_metadata(req.session_id, metadata))

    async def attend_stream(self, requests: Any, *, timeout: Optional[float] = None,
                            bf16_bits: bool = False, return_exceptions: bool = False,
                            metadata: Optional[Metadata] = None) -> AsyncIterator[Any]:
        """See AttentionClient.attend_stream; `requests` may also be an async iterable."""
        order = _common.StreamOrder(return_exceptions)
        call = self._methods.attend_stream(order.wrap_async(requests), timeout=timeout,
                                           metadata=_common.merge_metadata(self.metadata, metadata))
        try:
            async for msg in call:
                order.received(msg, bf16_bits)
                for result in order.ready():
                    yield order.emit(result)
        except grpc.RpcError as e:
            if order.send_error is not None:
                raise order.send_error from None
            raise from_rpc_error(e) from None
        finally:
            call.cancel()
        if order.outstanding():
            raise _common.unanswered(order.outstanding())

    async def open_session(self, model: str = "", *, ttl: Optional[float] = None, max_tokens: int = 0,
                           timeout: Optional[float] = None,
                           metadata: Optional[Metadata] = None) -> AsyncSession:
        """See AttentionClient.open_session."""
        sid = _common.new_session_id()
        req = attention_pb2.OpenSessionRequest(model=model, max_tokens=max_tokens, session_id=sid)
        if ttl is not None:
            req.ttl.FromNanoseconds(int(round(ttl * 1e9)))
        return AsyncSession(self, await self._call(self.stub.OpenSession, req, timeout,
                                                   _common.session_metadata(sid, metadata)))

    async def close_session(self, session: Any, *, timeout: Optional[float] = None,
                            metadata: Optional[Metadata] = None) -> int:
        sid = _common.session_id_of(session)
        req = attention_pb2.CloseSessionRequest(session_id=sid)
        resp = await self._call(self.stub.CloseSession, req, timeout,
                                _common.session_metadata(sid, metadata))
        if isinstance(session, AsyncSession):
            session.closed = True
        return resp.released_tokens

    async def list_models(self, timeout: Optional[float] = None,
                          metadata: Optional[Metadata] = None) -> List["attention_pb2.ModelStatus"]:
        resp = await self._call(self.stub.ListModels, attention_pb2.ListModelsRequest(), timeout, metadata)
        return list(resp.models)

    async def get_model(self, name: str = "", timeout: Optional[float] = None,
                        metadata: Optional[Metadata] = None) -> "attention_pb2.ModelStatus":
        return await self._call(self.stub.GetModel, attention_pb2.GetModelRequest(name=name), timeout, metadata)

    async def health(self, service: str = "", timeout: Optional[float] = None,
                     metadata: Optional[Metadata] = None) -> str:
        resp = await self._call(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service),
                                timeout, metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

