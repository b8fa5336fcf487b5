"""Triton's system shared-memory extension, driven by Triton's own clients
(tritonclient.grpc, tritonclient.http and tritonclient.utils.shared_memory)
against a real attnserve started with --allow-client-shm: inputs read from
and outputs written into the client's POSIX shared memory, on both
protocols, equal bit for bit to the same request sent in the message and
within float tolerance of the NumPy float64 oracle; registration, status and
unregistration as Triton answers them; and the refusals, each naming what is
wrong: the extension off (the default), a restricted token, an unknown
region, a range outside it, a result that does not fit, an output over an
input's bytes, CUDA shared memory."""

import os
import sys
import tempfile
import uuid

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402

rng = np.random.default_rng(11)
TOKEN_ALL = "shm-token-all-0123456789"
TOKEN_SDPA = "shm-token-sdpa-0123456789"


@pytest.fixture(scope="module")
def token_dir():
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "tokens"), "w") as f:
            f.write(f"{TOKEN_ALL}\n{TOKEN_SDPA} sdpa\n")
        yield d


@pytest.fixture(scope="module")
def server(token_dir):
    s = harness.ServerProcess("--allow-client-shm",
                              "--auth-token-file", os.path.join(token_dir, "tokens"))
    assert s.http_target, s.log()
    yield s
    assert s.stop() == 0, s.log()


def auth():
    """A fresh headers dict each call: tritonclient.http adds its own headers
    (an int Inference-Header-Content-Length) to the dict it is given."""
    return {"authorization": f"Bearer {TOKEN_ALL}"}


@pytest.fixture(scope="module")
def grpc_client(server):
    c = tg.InferenceServerClient(server.target)
    yield c
    c.unregister_system_shared_memory(headers=auth())
    c.close()


@pytest.fixture(scope="module")
def http_client(server):
    c = th.InferenceServerClient(server.http_target)
    yield c
    c.close()


class Region:
    """A POSIX shared-memory object made with tritonclient's own helper."""

    def __init__(self, byte_size):
        self.name = "r-" + uuid.uuid4().hex[:8]
        self.key = "/attnserve-shm-test-" + uuid.uuid4().hex[:8]
        self.byte_size = byte_size
        self.handle = shm.create_shared_memory_region(self.name, self.key, byte_size)

    def put(self, array, offset=0):
        shm.set_shared_memory_region(self.handle, [np.ascontiguousarray(array)], offset=offset)

    def get(self, dtype, shape, offset=0):
        return shm.get_contents_as_numpy(self.handle, dtype, shape, offset=offset).copy()

    def close(self):
        shm.destroy_shared_memory_region(self.handle)


@pytest.fixture
def regions():
    made = []

    def make(byte_size):
        r = Region(byte_size)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


def qkv(b=2, h=4, lq=5, lk=7, d=8, dtype=np.float32):
    return tuple(rng.standard_normal(shape).astype(dtype)
                 for shape in ((b, h, lq, d), (b, h // 2, lk, d), (b, h // 2, lk, d)))


def in_message(module, arrays):
    out = []
    for name, a in arrays:
        t = module.InferInput(name, list(a.shape), module.np_to_triton_dtype(a.dtype))
        if module is th:
            t.set_data_from_numpy(a, binary_data=True)
        else:
            t.set_data_from_numpy(a)
        out.append(t)
    return out


def in_region(module, region, arrays):
    """Every array into `region` one after another; inputs naming them."""
    out, offset = [], 0
    for name, a in arrays:
        region.put(a, offset)
        t = module.InferInput(name, list(a.shape), module.np_to_triton_dtype(a.dtype))
        t.set_shared_memory(region.name, a.nbytes, offset=offset)
        out.append(t)
        offset += a.nbytes
    return out


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_tensors_in_shared_memory_equal_the_same_request_in_the_message(
        protocol, dtype, grpc_client, http_client, regions):
    module, client = (tg, grpc_client) if protocol == "grpc" else (th, http_client)
    q, k, v = qkv(dtype=dtype)
    arrays = [("query", q), ("key", k), ("value", v)]
    inputs_region = regions(sum(a.nbytes for _, a in arrays) + 64)
    out_shape, w_shape = (2, 4, 5, 8), (2, 4, 5, 7)
    out_bytes = int(np.prod(out_shape)) * np.dtype(dtype).itemsize
    w_bytes = int(np.prod(w_shape)) * np.dtype(dtype).itemsize
    results_region = regions(100 + out_bytes + w_bytes)
    results_region.put(np.full(results_region.byte_size, 0xEE, np.uint8))
    for r in (inputs_region, results_region):
        client.register_system_shared_memory(r.name, r.key, r.byte_size, headers=auth())
    try:
        outputs = [module.InferRequestedOutput("output"), module.InferRequestedOutput("weights")]
        outputs[0].set_shared_memory(results_region.name, out_bytes, offset=100)
        outputs[1].set_shared_memory(results_region.name, w_bytes, offset=100 + out_bytes)
        result = client.infer("sdpa", in_region(module, inputs_region, arrays), outputs=outputs,
                              headers=auth())
        # The answer names the region and carries no bytes.
        o = result.get_output("output")
        params = o["parameters"] if protocol == "http" else {
            k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in o.parameters.items()}
        assert params["shared_memory_region"] == results_region.name
        assert params["shared_memory_byte_size"] == out_bytes
        assert params["shared_memory_offset"] == 100
        got_out = results_region.get(dtype, out_shape, offset=100)
        got_w = results_region.get(dtype, w_shape, offset=100 + out_bytes)
        # Bytes before the output were not touched.
        assert np.all(results_region.get(np.uint8, (100,)) == 0xEE)

        sent = client.infer("sdpa", in_message(module, arrays),
                            outputs=[module.InferRequestedOutput("output"),
                                     module.InferRequestedOutput("weights")], headers=auth())
        assert got_out.tobytes() == sent.as_numpy("output").tobytes()
        assert got_w.tobytes() == sent.as_numpy("weights").tobytes()
        ref_out, ref_w = harness.reference_attention(q, k, v)
        tol = 1e-5 if dtype == np.float32 else 3e-3
        np.testing.assert_allclose(got_out.astype(np.float64), ref_out, rtol=tol, atol=tol)
        np.testing.assert_allclose(got_w.astype(np.float64), ref_w, rtol=tol, atol=tol)
    finally:
        for r in (inputs_region, results_region):
            client.unregister_system_shared_memory(r.name, headers=auth())


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_some_tensors_in_shared_memory_and_some_in_the_message(
        protocol, grpc_client, http_client, regions):
    """Raw entries go to the inputs not in shared memory (as Triton); the
    key lengths come from shared memory; the output comes back in the
    message."""
    module, client = (tg, grpc_client) if protocol == "grpc" else (th, http_client)
    q, k, v = qkv()
    lengths = np.array([3, 7], dtype=np.int32)
    region = regions(k.nbytes + lengths.nbytes)
    client.register_system_shared_memory(region.name, region.key, region.byte_size,
                                         headers=auth())
    try:
        shared = in_region(module, region, [("key", k), ("key_lengths", lengths)])
        plain = in_message(module, [("query", q), ("value", v)])
        result = client.infer("sdpa", [plain[0], shared[0], plain[1], shared[1]], headers=auth())
        ref, _ = harness.reference_attention(q, k, v, key_lengths=lengths)
        np.testing.assert_allclose(result.as_numpy("output"), ref, rtol=1e-5, atol=1e-5)
    finally:
        client.unregister_system_shared_memory(region.name, headers=auth())


def test_status_register_and_unregister_as_triton_answers(grpc_client, http_client, regions):
    a, b = regions(4096), regions(256)
    grpc_client.register_system_shared_memory(a.name, a.key, 1000, offset=96, headers=auth())
    http_client.register_system_shared_memory(b.name, b.key, 256, headers=auth())
    # Both protocols see one table.
    status = grpc_client.get_system_shared_memory_status(headers=auth(), as_json=True)
    by_name = status["regions"]
    assert by_name[a.name]["key"] == a.key
    assert int(by_name[a.name]["offset"]) == 96 and int(by_name[a.name]["byte_size"]) == 1000
    http_status = http_client.get_system_shared_memory_status(headers=auth())
    assert [r["name"] for r in http_status] == sorted([a.name, b.name])
    assert {r["name"]: (r["key"], r["offset"], r["byte_size"]) for r in http_status} == {
        a.name: (a.key, 96, 1000), b.name: (b.key, 0, 256)}
    one = http_client.get_system_shared_memory_status(region_name=b.name, headers=auth())
    assert one == [{"name": b.name, "key": b.key, "offset": 0, "byte_size": 256}]

    with pytest.raises(InferenceServerException, match="already registered"):
        grpc_client.register_system_shared_memory(a.name, a.key, 10, headers=auth())
    with pytest.raises(InferenceServerException, match="already registered"):
        http_client.register_system_shared_memory(a.name, a.key, 10, headers=auth())
    http_client.unregister_system_shared_memory(a.name, headers=auth())
    with pytest.raises(InferenceServerException, match="is not registered"):
        grpc_client.get_system_shared_memory_status(region_name=a.name, headers=auth())
    http_client.unregister_system_shared_memory(headers=auth())  # every region
    assert http_client.get_system_shared_memory_status(headers=auth()) == []
    assert grpc_client.get_system_shared_memory_status(headers=auth(), as_json=True) == {}
    meta = grpc_client.get_server_metadata(headers=auth(), as_json=True)
    assert "system_shared_memory" in meta["extensions"]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_registrations_and_requests_are_refused_naming_what_is_wrong(
        protocol, grpc_client, http_client, regions, server):
    module, client = (tg, grpc_client) if protocol == "grpc" else (th, http_client)
    r = regions(1024)

    def refused(match, call):
        with pytest.raises(InferenceServerException, match=match):
            call()

    refused("cannot open key '/attnserve-no-such-key'",
            lambda: client.register_system_shared_memory(
                "x", "/attnserve-no-such-key", 16, headers=auth()))
    refused(r"runs past the end of key .* \(1024 bytes\)",
            lambda: client.register_system_shared_memory(
                "x", r.key, 1000, offset=100, headers=auth()))
    client.register_system_shared_memory(r.name, r.key, 1024, headers=auth())
    try:
        q, k, v = qkv(b=1, h=2, lq=2, lk=2, d=4)
        ok_inputs = in_region(module, r, [("query", q), ("key", k), ("value", v)])

        def infer(inputs, outputs=None):
            return client.infer("sdpa", inputs, outputs=outputs, headers=auth())

        bad = module.InferInput("query", list(q.shape), "FP32")
        bad.set_shared_memory("never-registered", q.nbytes)
        refused("input 'query': shared memory region 'never-registered' is not registered",
                lambda: infer([bad] + ok_inputs[1:]))
        bad.set_shared_memory(r.name, q.nbytes, offset=1000)
        refused("input 'query': shared_memory_offset 1000 .* is outside shared memory region",
                lambda: infer([bad] + ok_inputs[1:]))
        bad.set_shared_memory(r.name, q.nbytes - 4)
        refused("query", lambda: infer([bad] + ok_inputs[1:]))  # validation: size vs shape
        out = module.InferRequestedOutput("output")
        out.set_shared_memory(r.name, 8, offset=512)
        refused(r"requested output 'output': shared_memory_byte_size 8 is too small for the "
                r"result \(64 bytes\)", lambda: infer(ok_inputs, [out]))
        out.set_shared_memory(r.name, 64, offset=16)  # over the query's bytes
        refused("requested output 'output': its shared memory overlaps the bytes of an input",
                lambda: infer(ok_inputs, [out]))
        # The server is fine and the region still works.
        out.set_shared_memory(r.name, 64, offset=512)
        infer(ok_inputs, [out])
        ref, _ = harness.reference_attention(q, k, v)
        np.testing.assert_allclose(r.get(np.float32, ref.shape, offset=512), ref,
                                   rtol=1e-5, atol=1e-5)
    finally:
        client.unregister_system_shared_memory(r.name, headers=auth())
    assert server.alive()


def test_a_token_restricted_to_models_may_not_use_shared_memory(grpc_client, regions):
    """Regions are one table for every caller: only tokens without a model
    list register them or name them in a request."""
    r = regions(256)
    restricted = {"authorization": f"Bearer {TOKEN_SDPA}"}
    with pytest.raises(InferenceServerException, match="restricted to some models") as e:
        grpc_client.register_system_shared_memory(r.name, r.key, 256, headers=restricted)
    assert e.value.status() == "StatusCode.PERMISSION_DENIED"
    grpc_client.register_system_shared_memory(r.name, r.key, 256, headers=auth())
    try:
        q, k, v = qkv(b=1, h=2, lq=2, lk=2, d=4)
        inputs = in_region(tg, r, [("query", q), ("key", k), ("value", v)])
        with pytest.raises(InferenceServerException,
                           match="input 'query': shared_memory_region: the caller's credentials"):
            grpc_client.infer("sdpa", inputs, headers=restricted)
        with pytest.raises(InferenceServerException, match="restricted to some models"):
            grpc_client.get_system_shared_memory_status(headers=restricted)
    finally:
        grpc_client.unregister_system_shared_memory(r.name, headers=auth())


def test_off_by_default_with_the_flag_named(regions):
    s = harness.ServerProcess()
    try:
        r = regions(256)
        g = tg.InferenceServerClient(s.target)
        h = th.InferenceServerClient(s.http_target)
        for client in (g, h):
            with pytest.raises(InferenceServerException, match="--allow-client-shm"):
                client.register_system_shared_memory(r.name, r.key, 256)
            with pytest.raises(InferenceServerException, match="--allow-client-shm"):
                client.get_system_shared_memory_status()
        q, k, v = qkv(b=1, h=2, lq=2, lk=2, d=4)
        t = tg.InferInput("query", list(q.shape), "FP32")
        t.set_shared_memory(r.name, q.nbytes)
        with pytest.raises(InferenceServerException,
                           match="input 'query': shared_memory_region: .*--allow-client-shm"):
            g.infer("sdpa", [t] + in_message(tg, [("key", k), ("value", v)]))
        assert "system_shared_memory" not in g.get_server_metadata(as_json=True)["extensions"]
        # CUDA shared memory is not offered at all.
        with pytest.raises(InferenceServerException, match="no CUDA shared memory"):
            g.get_cuda_shared_memory_status()
        g.close()
        h.close()
    finally:
        assert s.stop() == 0, s.log()
