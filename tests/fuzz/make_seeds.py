"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/): small
valid inputs of each kind a target takes, plus a few near-misses, so that
fuzzing starts from the interesting parts of each format. The files are
checked in; rerun this after changing a format, then commit what changed.

    /usr/bin/python3 tests/fuzz/make_seeds.py
"""

import json
import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
from attnserve_client import AttentionClient  # noqa: E402
from attnserve_client import stubs  # noqa: E402

pb = stubs.attention_pb2
CORPUS = os.path.join(HERE, "corpus")


def write(target, name, data):
    folder = os.path.join(CORPUS, target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


# ------------------------------------------------------------- AttendRequest

def attend_requests():
    rng = np.random.default_rng(7)
    c = AttentionClient.__new__(AttentionClient)  # build_request needs no channel
    n = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    seeds = {
        "sdpa_basic": c.build_request(n(1, 2, 3, 4), n(1, 2, 5, 4), n(1, 2, 5, 4)),
        "sdpa_named": c.build_request(n(1, 1, 2, 2), n(1, 1, 2, 2), n(1, 1, 2, 2), model="sdpa"),
        "sdpa_gqa_dv": c.build_request(n(2, 4, 3, 4), n(2, 2, 5, 4), n(2, 2, 5, 3), model="sdpa"),
        "sdpa_causal_lengths": c.build_request(n(2, 2, 4, 4), n(2, 2, 4, 4), n(2, 2, 4, 4),
                                               causal=True, key_lengths=[4, 2]),
        "sdpa_bool_mask": c.build_request(n(1, 2, 3, 4), n(1, 2, 5, 4), n(1, 2, 5, 4),
                                          attn_mask=rng.random((3, 5)) > 0.3),
        "sdpa_float_mask_inf": c.build_request(
            n(1, 2, 3, 4), n(1, 2, 5, 4), n(1, 2, 5, 4),
            attn_mask=np.where(rng.random((1, 2, 3, 5)) > 0.5, 0, -np.inf).astype(np.float32)),
        "sdpa_weights": c.build_request(n(1, 2, 3, 4), n(1, 2, 5, 4), n(1, 2, 5, 4),
                                        need_weights=True),
        "sdpa_avg_weights": c.build_request(n(1, 2, 3, 4), n(1, 2, 5, 4), n(1, 2, 5, 4),
                                            average_weights=True, scale=0.3),
        "sdpa_bf16_in_out": c.build_request(n(1, 2, 3, 4), n(1, 2, 5, 4), n(1, 2, 5, 4),
                                            input_dtype="bf16", output_dtype="bf16"),
        "sdpa_fp16_in": c.build_request(n(1, 2, 3, 4), n(1, 2, 5, 4), n(1, 2, 5, 4),
                                        input_dtype="fp16", need_weights=True),
        "mha_self": c.build_request(n(1, 3, 6) / 2, model="mha-self"),
        "mha_cross": c.build_request(n(2, 3, 6) / 2, n(2, 4, 5) / 2, n(2, 4, 3), model="mha",
                                     need_weights=True, key_lengths=[4, 1]),
        "mha_self_needs_kv": c.build_request(n(1, 3, 6), model="mha"),
        "mha_causal_mask": c.build_request(n(1, 4, 6) / 2, model="mha-self", causal=True,
                                           attn_mask=rng.random((4, 4)) > 0.2),
        "mha_bf16": c.build_request(n(1, 3, 6) / 2, model="mha-bf16", average_weights=True),
        "mha_fp16_out": c.build_request(n(1, 3, 6) / 2, n(1, 2, 6) / 2, n(1, 2, 6),
                                        model="mha-bf16", output_dtype="fp16"),
        "bad_shape": c.build_request(n(1, 2, 3, 4), n(1, 2, 5, 3), n(1, 2, 5, 4)),
        "bad_nan": c.build_request(np.full((1, 1, 1, 2), np.nan, np.float32), n(1, 1, 1, 2),
                                   n(1, 1, 1, 2)),
        "empty": pb.AttendRequest(),
    }
    for name, request in seeds.items():
        request.id = name
        write("attend_request_fuzzer", name, request.SerializeToString())
    write("attend_request_fuzzer", "cut_short", seeds["sdpa_basic"].SerializeToString()[:-7])


# ------------------------------------------------ KServe ModelInferRequest
# Written by hand (protobuf's encoding, field numbers of
# proto/inference/grpc_service.proto): the KServe stubs are not in Python here.

def _varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _field(number, value):
    """A length-delimited field (string, bytes, message, packed)."""
    if isinstance(value, str):
        value = value.encode()
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _param(key, kind, value):
    """A map<string, InferParameter> entry: kind 1 bool, 2 int64, 3 string."""
    inner = _field(3, value) if kind == 3 else _varint(kind << 3) + _varint(value)
    return _field(1, key) + _field(2, inner)


def _input(name, datatype, shape, contents=None):
    t = _field(1, name) + _field(2, datatype) + _field(3, b"".join(_varint(d) for d in shape))
    if contents is not None:
        t += _field(5, _field(6, np.asarray(contents, "<f4").tobytes()))  # fp32_contents
    return _field(5, t)


def kserve_grpc_requests():
    rng = np.random.default_rng(8)
    f32 = lambda *shape: rng.standard_normal(shape).astype("<f4").tobytes()  # noqa: E731
    raw = lambda b: _field(7, b)  # noqa: E731
    qkv = (_input("query", "FP32", [1, 2, 3, 4]) + _input("key", "FP32", [1, 2, 5, 4]) +
           _input("value", "FP32", [1, 2, 5, 4]))
    seeds = {
        "sdpa_raw": _field(1, "sdpa") + qkv + raw(f32(1, 2, 3, 4)) + raw(f32(1, 2, 5, 4)) +
                    raw(f32(1, 2, 5, 4)),
        "sdpa_raw_interleaved": raw(f32(1, 2, 3, 4)) + _field(1, "sdpa") +
                                _input("query", "FP32", [1, 2, 3, 4]) + raw(f32(1, 2, 5, 4)) +
                                _input("key", "FP32", [1, 2, 5, 4]) +
                                _input("value", "FP32", [1, 2, 5, 4]) + raw(f32(1, 2, 5, 4)),
        "sdpa_typed": _field(1, "sdpa") + _input("query", "FP32", [1, 1, 2, 2], range(4)) +
                      _input("key", "FP32", [1, 1, 2, 2], range(4)) +
                      _input("value", "FP32", [1, 1, 2, 2], range(4)),
        "sdpa_params_outputs": _field(1, "sdpa") + _field(2, "1") + _field(3, "id-7") +
                               _field(4, _param("causal", 1, 1)) +
                               _field(4, _param("timeout", 2, 5000)) + qkv +
                               _field(6, _field(1, "weights")) + raw(f32(1, 2, 3, 4)) +
                               raw(f32(1, 2, 5, 4)) + raw(f32(1, 2, 5, 4)),
        "mask_and_lengths": _field(1, "sdpa") + qkv + _input("attn_mask", "BOOL", [3, 5]) +
                            _input("key_lengths", "INT32", [1]) + raw(f32(1, 2, 3, 4)) +
                            raw(f32(1, 2, 5, 4)) + raw(f32(1, 2, 5, 4)) + raw(bytes(15)) +
                            raw(np.array([4], "<i4").tobytes()),
        "demo_session": _field(1, "demo-mha") + _field(4, _param("session_id", 3, "s1")) +
                        _input("query", "BF16", [1, 2, 512]) + raw(bytes(2 * 2 * 512)),
        # Inputs and an output in shared memory (tensor parameters, field 4 of
        # an input, field 2 of a requested output): raw entries only for the
        # others.
        "shared_memory": _field(1, "sdpa") +
                         _field(5, _field(1, "query") + _field(2, "FP32") +
                                _field(3, b"".join(_varint(d) for d in [1, 2, 3, 4])) +
                                _field(4, _param("shared_memory_region", 3, "in")) +
                                _field(4, _param("shared_memory_byte_size", 2, 96))) +
                         _input("key", "FP32", [1, 2, 5, 4]) +
                         _input("value", "FP32", [1, 2, 5, 4]) +
                         _field(6, _field(1, "output") +
                                _field(2, _param("shared_memory_region", 3, "out")) +
                                _field(2, _param("shared_memory_byte_size", 2, 96))) +
                         raw(bytes(160)) + raw(bytes(160)),
        "too_many_raw": _field(1, "sdpa") + _input("query", "FP32", [1]) + raw(f32(1)) +
                        raw(b"extra"),
        "raw_wrong_wire_type": _field(1, "sdpa") + _varint(7 << 3 | 0) + _varint(5),
        "empty": b"",
    }
    for name, data in seeds.items():
        write("kserve_grpc_request_fuzzer", name, data)
    write("kserve_grpc_request_fuzzer", "cut_short", seeds["sdpa_raw"][:-9])


# ------------------------------------------------------------- safetensors

def safetensors(tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, array) in tensors.items():
        raw = array.tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def weights_files():
    rng = np.random.default_rng(3)
    f = lambda *shape: ("F32", rng.uniform(-0.5, 0.5, shape).astype(np.float32))  # noqa: E731
    h = lambda *shape: ("F16", rng.uniform(-0.5, 0.5, shape).astype(np.float16))  # noqa: E731
    # E = 4, 2 heads of 2 (the fuzzers' small layer); GQA: 1 kv head.
    torch_mha = {"in_proj_weight": f(12, 4), "in_proj_bias": f(12),
                 "out_proj.weight": f(4, 4), "out_proj.bias": f(4)}
    separate = {"q_proj.weight": f(4, 4), "q_proj.bias": f(4), "k_proj.weight": f(2, 4),
                "k_proj.bias": f(2), "v_proj.weight": f(2, 4), "v_proj.bias": f(2),
                "o_proj.weight": f(4, 4), "o_proj.bias": f(4)}
    separate_mha = dict(separate, **{"k_proj.weight": f(4, 4), "k_proj.bias": f(4),
                                     "v_proj.weight": f(4, 4), "v_proj.bias": f(4)})
    fused = {"qkv.weight": f(12, 4), "qkv.bias": f(12), "out_proj.weight": f(4, 4),
             "out_proj.bias": f(4)}
    keras = {"query/kernel": f(4, 2, 2), "query/bias": f(2, 2), "key/kernel": f(4, 4),
             "key/bias": f(4), "value/kernel": f(4, 4), "value/bias": f(4),
             "attention_output/kernel": f(2, 2, 4), "attention_output/bias": f(4)}
    half = {"in_proj_weight": h(12, 4), "in_proj_bias": h(12),
            "out_proj.weight": h(4, 4), "out_proj.bias": h(4)}
    # OLMo-2's QK-norm over the whole projection: Q's 4 features, K's 2.
    olmo = dict(separate, **{"q_norm.weight": f(4), "k_norm.weight": f(2)})
    files = {
        "torch_mha": safetensors(torch_mha, {"format": "pt"}),
        "separate_gqa": safetensors(separate),
        "separate_mha": safetensors(separate_mha),
        "fused_qkv": safetensors(fused),
        "keras_dense": safetensors(keras),
        "torch_mha_f16": safetensors(half),
        "separate_olmo": safetensors(olmo),
        "empty_header": safetensors({}),
    }
    for name, data in files.items():
        write("safetensors_fuzzer", name, data)
    write("safetensors_fuzzer", "truncated", files["torch_mha"][:40])
    return files


# ------------------------------------------------------------- config.pbtxt

def model_configs(files):
    sep = b"\n#--weights--\n"
    configs = {
        "torch_mha": (b'embed_dim: 4\nnum_heads: 2\nq_bias: true\nk_bias: true\nv_bias: true\n'
                      b'out_bias: true\n', files["torch_mha"]),
        "separate_gqa": (b'name: "gqa"\nembed_dim: 4\nnum_heads: 2\nnum_kv_heads: 1\n'
                         b'weight_layout: SEPARATE_QKV\nq_bias: true\nk_bias: true\n'
                         b'v_bias: true\nout_bias: true\ncausal: true\nprecision: "bf16"\n',
                         files["separate_gqa"]),
        "fused_qkv": (b'embed_dim: 4\nnum_heads: 2\nweight_layout: FUSED_QKV_PER_HEAD\n'
                      b'q_bias: true\nk_bias: true\nv_bias: true\nout_bias: true\n'
                      b'scale: 0.5\nbatching { max_batch_requests: 4 max_queue_delay_us: 100 }\n',
                      files["fused_qkv"]),
        "keras_dense": (b'embed_dim: 4\nnum_heads: 2\nweight_layout: KERAS_DENSE\n'
                        b'q_bias: true\nk_bias: true\nv_bias: true\nout_bias: true\n'
                        b'precision: "fp16"\ninstances: 2\nbackend: "cpu"\n',
                        files["keras_dense"]),
        "prefix_names": (b'embed_dim: 4\nnum_heads: 2\ntensor_prefix: "layer."\n'
                         b'tensor_names { key: "out_weight" value: "o.w" }\n', files["torch_mha"]),
        # LongRoPE (one pair per head: one factor per set) and QK-norm over
        # the whole projection.
        "longrope_olmo": (b'embed_dim: 4\nnum_heads: 2\nnum_kv_heads: 1\n'
                          b'weight_layout: SEPARATE_QKV\nq_bias: true\nk_bias: true\n'
                          b'v_bias: true\nout_bias: true\ncausal: true\n'
                          b'rope { type: "longrope" factor: 32 '
                          b'original_max_position_embeddings: 4 short_factor: [1.5] '
                          b'long_factor: [6] }\nqk_norm { whole_projection: true }\n',
                          files["separate_olmo"]),
        "sdpa_kind": (b'kind: "sdpa"\n', None),
        "no_weights": (b'embed_dim: 4\nnum_heads: 2\n', None),
        "unknown_field": (b'embed_dim: 4\nnum_layers: 3\n', None),
        "syntax_error": (b'embed_dim: {\n', None),
    }
    for name, (text, weights) in configs.items():
        write("model_config_fuzzer", name, text if weights is None else text + sep + weights)


# ------------------------------------------------------------- .npy

def npy_files():
    import io
    rng = np.random.default_rng(5)
    arrays = {
        "f4": rng.standard_normal((2, 3)).astype(np.float32),
        "f2": rng.standard_normal((4,)).astype(np.float16),
        "b1": rng.random((2, 2, 2)) > 0.5,
        "u2": rng.integers(0, 65535, (3, 1), dtype=np.uint16),
        "scalar": np.array(1.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    for name, a in arrays.items():
        buf = io.BytesIO()
        np.save(buf, a)
        write("npy_fuzzer", name, buf.getvalue())
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arrays["f4"], version=(2, 0))
    write("npy_fuzzer", "f4_v2", buf.getvalue())
    buf = io.BytesIO()
    np.save(buf, np.asfortranarray(rng.standard_normal((2, 3)).astype(np.float32)))
    write("npy_fuzzer", "fortran", buf.getvalue())
    buf = io.BytesIO()
    np.save(buf, arrays["f4"].astype(">f4"))
    write("npy_fuzzer", "big_endian", buf.getvalue())


if __name__ == "__main__":
    attend_requests()
    kserve_grpc_requests()
    npy_files()
    model_configs(weights_files())
    for target in sorted(os.listdir(CORPUS)):
        print(target, len(os.listdir(os.path.join(CORPUS, target))), "seeds")
