"""TLS and token options: what the options build (credentials, metadata,
refusals), then real handshakes against an in-process gRPC server with a
self-signed CA (openssl): server-authenticated TLS, mutual TLS, and the token
arriving as `authorization: Bearer <token>` on every call, sync and asyncio."""

import asyncio
import subprocess
from concurrent import futures

import grpc
import pytest

from attnserve_client import AsyncAttentionClient, AttentionClient, UnavailableError, _common
from attnserve_client._stubs import health_pb2, health_pb2_grpc


def test_token_becomes_bearer_metadata_and_bad_tokens_are_refused():
    assert _common.auth_metadata("s3cret") == [("authorization", "Bearer s3cret")]
    assert _common.auth_metadata(None) == []
    for bad in ("", "a\nb"):
        with pytest.raises(ValueError, match="token"):
            _common.auth_metadata(bad)
    c = AttentionClient("127.0.0.1:1", token="t")
    assert c.metadata == [("authorization", "Bearer t")] and not c.tls
    assert _common.merge_metadata(c.metadata, [("x-trace", "1")]) == [("authorization", "Bearer t"),
                                                                       ("x-trace", "1")]
    c.close()


def test_credentials_options():
    assert _common.channel_credentials(tls=None, root_certificates=None, private_key=None,
                                       certificate_chain=None) is None
    creds = _common.channel_credentials(tls=True, root_certificates=None, private_key=None,
                                        certificate_chain=None)
    assert isinstance(creds, grpc.ChannelCredentials)  # system roots
    with pytest.raises(ValueError, match="both private_key and certificate_chain"):
        _common.channel_credentials(tls=None, root_certificates=b"x", private_key=b"k",
                                    certificate_chain=None)
    with pytest.raises(ValueError, match="tls=False"):
        _common.channel_credentials(tls=False, root_certificates=b"x", private_key=None,
                                    certificate_chain=None)
    with pytest.raises(ValueError, match="root_certificates: cannot read /nonexistent.pem"):
        AttentionClient("localhost:1", root_certificates="/nonexistent.pem")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost, a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, extra in (("server", ["-extfile", "san.cnf"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", *extra, cwd=d)
    return d


class _Health(health_pb2_grpc.HealthServicer):
    def __init__(self):
        self.metadata = []

    def Check(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _tls_server(pki, require_client_auth):
    servicer = _Health()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    creds = grpc.ssl_server_credentials(
        [((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())],
        root_certificates=(pki / "ca.pem").read_bytes() if require_client_auth else None,
        require_client_auth=require_client_auth)
    port = srv.add_secure_port("127.0.0.1:0", creds)
    srv.start()
    return srv, servicer, f"localhost:{port}"


def test_tls_with_root_certificate_path_and_token(pki):
    srv, servicer, target = _tls_server(pki, require_client_auth=False)
    try:
        with AttentionClient(target, root_certificates=str(pki / "ca.pem"), token="tok-1", timeout=10) as c:
            assert c.tls and c.health() == "SERVING"
        assert servicer.metadata[-1]["authorization"] == "Bearer tok-1"

        async def main():
            async with AsyncAttentionClient(target, root_certificates=(pki / "ca.pem").read_bytes(),
                                            token="tok-2", timeout=10) as c:
                return await c.health()
        assert asyncio.run(main()) == "SERVING"
        assert servicer.metadata[-1]["authorization"] == "Bearer tok-2"
        # A client that does not trust the CA, or speaks plaintext, never gets through.
        with AttentionClient(target, tls=True, timeout=5) as c:
            with pytest.raises(UnavailableError):
                c.health()
        with AttentionClient(target, timeout=5) as c:
            with pytest.raises(UnavailableError):
                c.health()
    finally:
        srv.stop(None)


def test_mutual_tls_needs_the_client_certificate(pki):
    srv, servicer, target = _tls_server(pki, require_client_auth=True)
    try:
        with AttentionClient(target, root_certificates=pki / "ca.pem", private_key=pki / "client.key",
                             certificate_chain=pki / "client.pem", timeout=10) as c:
            assert c.health() == "SERVING"
        assert "authorization" not in servicer.metadata[-1]
        with AttentionClient(target, root_certificates=pki / "ca.pem", timeout=5) as c:
            with pytest.raises(UnavailableError):
                c.health()
    finally:
        srv.stop(None)
