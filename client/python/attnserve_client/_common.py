"""What AttentionClient and AsyncAttentionClient share: request building,
response decoding, channel security (TLS, bearer token) and the bookkeeping
that returns AttendStream results in request order."""

import collections
import dataclasses
import os
import threading
from typing import Any, AsyncIterator, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from ._stubs import attention_pb2
from .errors import AttnServeError, from_status_value
from ._wire import PreparedRequest
from .tensors import DTypeLike, decode_tensor, dtype_enum, tensor_payload

PemSource = Union[bytes, str, "os.PathLike[str]", None]
Metadata = Sequence[Tuple[str, str]]

DEFAULT_TARGET = "127.0.0.1:50051"


@dataclasses.dataclass
class AttendResult:
    """One Attend answer, decoded."""
    output: np.ndarray
    weights: Optional[np.ndarray]  # None unless need_weights
    timing: "attention_pb2.Timing"  # queue_us, compute_us, total_us, batch_requests
    id: str
    response: "attention_pb2.AttendResponse"  # the raw message (wire dtypes)
    session_length: int = 0  # session requests: tokens cached after this one


def prepare_request(query: Any, key: Any = None, value: Any = None, *, model: str = "",
                    causal: bool = False, key_lengths: Any = None, attn_mask: Any = None,
                    scale: float = 0.0, need_weights: bool = False, average_weights: bool = False,
                    output_dtype: DTypeLike = None, input_dtype: DTypeLike = None,
                    request_id: str = "", session_id: str = "", positions: Any = None,
                    window: int = 0, softcap: float = 0.0, sinks: Any = None) -> PreparedRequest:
    """What attend() sends, with the tensors' data still in numpy arrays (the
    callers' own where no conversion is needed). build_request's arguments."""
    req = attention_pb2.AttendRequest(
        model=model, id=request_id, causal=causal, scale=scale,
        need_weights=need_weights or average_weights, average_weights=average_weights,
        session_id=session_id, window=int(window), softcap=float(softcap))
    tensors = {}  # field name -> (DataType, shape, data)
    if positions is not None:
        req.positions.extend(int(p) for p in np.asarray(positions).reshape(-1))
    if sinks is not None:
        req.sinks.extend(float(x) for x in np.asarray(sinks, dtype=np.float32).reshape(-1))
    tensors["query"] = tensor_payload(query, input_dtype)
    if key is not None:
        tensors["key"] = tensor_payload(key, input_dtype)
    if value is not None:
        tensors["value"] = tensor_payload(value, input_dtype)
    if key_lengths is not None:
        req.key_lengths.extend(int(n) for n in np.asarray(key_lengths).reshape(-1))
    if attn_mask is not None:
        tensors["attn_mask"] = tensor_payload(attn_mask)
    if output_dtype is not None:
        req.output_dtype = dtype_enum(output_dtype)
    return PreparedRequest(req, tensors)


def build_request(query: Any, key: Any = None, value: Any = None, *, model: str = "",
                  causal: bool = False, key_lengths: Any = None, attn_mask: Any = None,
                  scale: float = 0.0, need_weights: bool = False, average_weights: bool = False,
                  output_dtype: DTypeLike = None, input_dtype: DTypeLike = None,
                  request_id: str = "", session_id: str = "", positions: Any = None,
                  window: int = 0, softcap: float = 0.0,
                  sinks: Any = None) -> "attention_pb2.AttendRequest":
    """The AttendRequest that attend() sends. `input_dtype` converts float
    query/key/value (e.g. "bf16"); masks keep their own dtype. positions:
    integers [B, Lk] (RoPE models); window, softcap, sinks [Hq]: per request
    on models without projections."""
    return prepare_request(
        query, key, value, model=model, causal=causal, key_lengths=key_lengths,
        attn_mask=attn_mask, scale=scale, need_weights=need_weights,
        average_weights=average_weights, output_dtype=output_dtype, input_dtype=input_dtype,
        request_id=request_id, session_id=session_id, positions=positions, window=window,
        softcap=softcap, sinks=sinks).to_message()


def as_request(item: Any) -> Union["attention_pb2.AttendRequest", PreparedRequest]:
    """A stream item: an AttendRequest as it is, or a dict of attend()'s
    arguments as the PreparedRequest it makes."""
    if isinstance(item, attention_pb2.AttendRequest):
        return item
    if isinstance(item, Mapping):
        kwargs = dict(item)
        if "id" in kwargs:
            kwargs["request_id"] = kwargs.pop("id")
        session = kwargs.pop("session", None)
        if session is not None:
            kwargs["session_id"] = session_id_of(session)
        return prepare_request(**kwargs)
    raise TypeError(f"stream items are AttendRequest messages or dicts of attend() arguments, "
                    f"got {type(item).__name__}")


def session_id_of(session: Any) -> str:
    """A Session object or a session id string -> the id."""
    if session is None:
        return ""
    if isinstance(session, str):
        return session
    sid = getattr(session, "id", None)
    if not isinstance(sid, str) or not sid:
        raise TypeError(f"session must be a Session or a session id string, got {type(session).__name__}")
    return sid


# The gRPC metadata (and HTTP header) that carries a session's id on every
# call of the session, OpenSession included: a load balancer that hashes on
# it keeps a session on one replica (deploy/loadbalancer/nginx.conf).
SESSION_HEADER = "x-attnserve-session"


def new_session_id() -> str:
    """A random session id (128 bits) for OpenSessionRequest.session_id."""
    import secrets
    return "c" + secrets.token_hex(16)


def session_metadata(session_id: str, extra: Optional[Metadata]) -> Optional[Metadata]:
    """`extra` plus the session's routing header (none without a session)."""
    if not session_id:
        return extra
    return [*(extra or ()), (SESSION_HEADER, session_id)]


def decode_response(resp: "attention_pb2.AttendResponse", bf16_bits: bool = False) -> AttendResult:
    weights = decode_tensor(resp.weights, bf16_bits) if resp.HasField("weights") else None
    return AttendResult(output=decode_tensor(resp.output, bf16_bits), weights=weights,
                        timing=resp.timing, id=resp.id, response=resp,
                        session_length=resp.session_length)


# ---------------------------------------------------------------------------
# Channel security

def read_pem(source: PemSource, what: str) -> Optional[bytes]:
    """PEM bytes as given, or read from a file path."""
    if source is None:
        return None
    if isinstance(source, bytes):
        return source
    path = os.fspath(source)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from e


def channel_credentials(*, tls: Optional[bool], root_certificates: PemSource,
                        private_key: PemSource, certificate_chain: PemSource
                        ) -> Optional[grpc.ChannelCredentials]:
    """grpc.ssl_channel_credentials for TLS, None for plaintext.

    tls=None turns TLS on when any certificate is given; tls=True with no root
    certificates trusts the system roots. A client certificate (mutual TLS)
    needs both private_key and certificate_chain.
    """
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("mutual TLS needs both private_key and certificate_chain")
    any_cert = root_certificates is not None or private_key is not None
    if tls is None:
        tls = any_cert
    if not tls:
        if any_cert:
            raise ValueError("certificates were given with tls=False")
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(root_certificates, "root_certificates"),
        private_key=read_pem(private_key, "private_key"),
        certificate_chain=read_pem(certificate_chain, "certificate_chain"))


def auth_metadata(token: Optional[str]) -> List[Tuple[str, str]]:
    """The per-call metadata a bearer token becomes."""
    if token is None:
        return []
    if not isinstance(token, str) or not token or any(c in token for c in "\r\n"):
        raise ValueError("token must be a non-empty string without line breaks")
    return [("authorization", f"Bearer {token}")]


def compression_algorithm(name: Optional[str]) -> Optional["grpc.Compression"]:
    """compression= of the clients: None (or "none"), "gzip" or "deflate"."""
    algorithms = {None: None, "none": None, "gzip": grpc.Compression.Gzip,
                  "deflate": grpc.Compression.Deflate}
    if name not in algorithms:
        raise ValueError(f"compression must be None, 'gzip' or 'deflate', got {name!r}")
    return algorithms[name]


def channel_options(max_message_bytes: int, server_name_override: Optional[str],
                    options: Iterable[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
    # gRPC's 4 MiB default receive limit would refuse ordinary outputs.
    opts = [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]
    if server_name_override:
        opts.append(("grpc.ssl_target_name_override", server_name_override))
    return opts + list(options)


def merge_metadata(base: Metadata, extra: Optional[Metadata]) -> Optional[List[Tuple[str, str]]]:
    md = list(base) + list(extra or ())
    return md or None


# ---------------------------------------------------------------------------
# AttendStream ordering

class StreamOrder:
    """Gives each outgoing request a unique id (its own when it has one; a
    user id may appear once per stream) and
    releases the answers in the order the requests were sent.

    The request side (gRPC's sender thread, or a task) calls `sent`; the
    response side calls `received` and then drains `ready`.
    """

    def __init__(self, return_exceptions: bool):
        self._lock = threading.Lock()
        self._order: "collections.deque[str]" = collections.deque()
        self._pending: Dict[str, Any] = {}
        self._in_flight = set()
        self._seen = set()  # every id sent: answers are matched by id
        self._auto = 0
        self.return_exceptions = return_exceptions
        self.send_error: Optional[BaseException] = None

    def wrap(self, requests: Iterable[Any]) -> Iterator[Any]:
        """The request iterator gRPC consumes; keeps the error of a bad item."""
        try:
            for item in requests:
                yield self.sent(item)
        except Exception as e:
            self.send_error = e
            raise

    async def wrap_async(self, requests: Any) -> AsyncIterator[Any]:
        """wrap() for an iterable or an async iterable."""
        try:
            if hasattr(requests, "__aiter__"):
                async for item in requests:
                    yield self.sent(item)
            else:
                for item in requests:
                    yield self.sent(item)
        except Exception as e:
            self.send_error = e
            raise

    def sent(self, item: Any) -> Union["attention_pb2.AttendRequest", PreparedRequest]:
        req = as_request(item)
        with self._lock:
            if not req.id:
                while True:
                    self._auto += 1
                    auto_id = f"attnserve-client-{self._auto}"
                    if auto_id not in self._seen:
                        break
                if isinstance(req, PreparedRequest):
                    req = req.with_id(auto_id)
                else:  # the caller's message stays as it was
                    clone = attention_pb2.AttendRequest()
                    clone.CopyFrom(req)
                    clone.id = auto_id
                    req = clone
            elif req.id in self._seen:
                raise ValueError(f"AttendStream request id {req.id!r} appears twice in this stream; "
                                 "ids must be unique (leave id empty to have one assigned)")
            self._seen.add(req.id)
            self._in_flight.add(req.id)
            self._order.append(req.id)
        return req

    def received(self, msg: "attention_pb2.AttendStreamResponse", bf16_bits: bool) -> None:
        if msg.code != 0:
            result: Any = from_status_value(msg.code, msg.message, request_id=msg.id)
        else:
            result = decode_response(msg.response, bf16_bits)
            result.id = msg.id
        with self._lock:
            if msg.id not in self._in_flight:
                raise AttnServeError(grpc.StatusCode.INTERNAL,
                                     f"AttendStream answered id {msg.id!r}, which was not sent")
            self._pending[msg.id] = result

    def ready(self) -> List[Any]:
        """The answers that can go out now, in request order (AttendResult, or
        AttnServeError for a failed request)."""
        out = []
        with self._lock:
            while self._order and self._order[0] in self._pending:
                rid = self._order.popleft()
                self._in_flight.discard(rid)
                out.append(self._pending.pop(rid))
        return out

    def emit(self, result: Any) -> Any:
        """What the caller yields for one answer: a failure is raised unless
        return_exceptions."""
        if isinstance(result, AttnServeError) and not self.return_exceptions:
            raise result
        return result

    def outstanding(self) -> int:
        with self._lock:
            return len(self._order)



def unanswered(n: int) -> AttnServeError:
    """The stream ended cleanly but some requests got no answer."""
    return AttnServeError(grpc.StatusCode.INTERNAL, f"AttendStream ended with {n} request(s) unanswered")
