"""Errors of attnserve_client: every failed RPC raises an AttnServeError that
carries the gRPC status code and the server's message, with one subclass per
code a caller typically handles differently (as openai's and tritonclient's
exceptions do)."""

from typing import Dict, Optional, Type

import grpc


class AttnServeError(grpc.RpcError):
    """A failed call. `status_code` (grpc.StatusCode) and `message` (the
    server's text); `code()` and `details()` too, as on grpc.RpcError, so code
    written against the raw stubs keeps working."""

    def __init__(self, status_code: grpc.StatusCode, message: str, *, request_id: str = ""):
        super().__init__(f"{status_code.name}: {message}")
        self.status_code = status_code
        self.message = message
        self.request_id = request_id  # AttendStream: the id of the failed request

    def code(self) -> grpc.StatusCode:
        return self.status_code

    def details(self) -> str:
        return self.message

    def __str__(self) -> str:
        prefix = f"request {self.request_id!r}: " if self.request_id else ""
        return f"{prefix}{self.status_code.name}: {self.message}"


class InvalidArgumentError(AttnServeError):
    """INVALID_ARGUMENT: the request breaks a rule; the message names the field."""


class NotFoundError(AttnServeError):
    """NOT_FOUND: unknown model, or unknown / closed / expired session."""


class SessionAbortedError(AttnServeError):
    """ABORTED: the session's cache was evicted; resend the prefix in a new session."""


class ResourceExhaustedError(AttnServeError):
    """RESOURCE_EXHAUSTED: queue full, message too large, or a work limit."""


class UnavailableError(AttnServeError):
    """UNAVAILABLE: server not reachable, shutting down, or model not ready."""


class DeadlineExceededError(AttnServeError):
    """DEADLINE_EXCEEDED: the call's timeout passed."""


class UnauthenticatedError(AttnServeError):
    """UNAUTHENTICATED: missing or wrong token."""


class PermissionDeniedError(AttnServeError):
    """PERMISSION_DENIED: the token may not do this."""


class UnimplementedError(AttnServeError):
    """UNIMPLEMENTED: the server does not offer this RPC (e.g. an older server)."""


_BY_CODE: Dict[grpc.StatusCode, Type[AttnServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ABORTED: SessionAbortedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
}

_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def error_for(status_code: grpc.StatusCode, message: str, *, request_id: str = "") -> AttnServeError:
    """The AttnServeError subclass for a status code."""
    return _BY_CODE.get(status_code, AttnServeError)(status_code, message, request_id=request_id)


def from_rpc_error(err: grpc.RpcError) -> AttnServeError:
    """Converts what grpc raised (a grpc.Call / grpc.aio.AioRpcError)."""
    if isinstance(err, AttnServeError):
        return err
    code: Optional[grpc.StatusCode] = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "")


def from_status_value(value: int, message: str, *, request_id: str = "") -> AttnServeError:
    """From a google.rpc.Code number (AttendStreamResponse.code)."""
    return error_for(_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN), message, request_id=request_id)
