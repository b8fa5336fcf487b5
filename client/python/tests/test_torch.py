"""attnserve_client.torch against a real server: the attention layers of small
nn.TransformerEncoders exported into a model repository and replaced by
RemoteMultiheadAttention give the local model's outputs within 1e-5; the
drop-in follows nn.MultiheadAttention's masks, layouts and weights."""

import pytest

torch = pytest.importorskip("torch")  # run_suite.py runs this in a venv that sees Debian's torch
from torch import nn  # noqa: E402

import harness  # noqa: E402
from attnserve_client import AttentionClient  # noqa: E402
from attnserve_client.torch import (RemoteMultiheadAttention, export_attention_layers,  # noqa: E402
                                    export_mha, replace_attention_layers)

TOL = dict(atol=1e-5, rtol=1e-5)


def _encoder(batch_first, layers=2, seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                       batch_first=batch_first)
    kwargs = {"enable_nested_tensor": False} if "enable_nested_tensor" in \
        nn.TransformerEncoder.__init__.__code__.co_varnames else {}
    return nn.TransformerEncoder(layer, num_layers=layers, **kwargs).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    repo = tmp_path_factory.mktemp("models")
    torch.manual_seed(5)
    models = {"bf": _encoder(True), "sf": _encoder(False, layers=1, seed=1),
              "cross": nn.MultiheadAttention(32, 4, kdim=24, vdim=20, batch_first=True).eval()}
    names = {key: export_attention_layers(models[key], str(repo), prefix=key + "-")
             for key in ("bf", "sf")}
    export_mha(models["cross"], str(repo / "cross"))
    server = harness.ServerProcess("--model-repository", str(repo))
    client = AttentionClient(server.target, timeout=60)
    yield models, names, client
    client.close()
    assert server.stop() == 0, server.log()


def _remote_copy(model, client, names):
    import copy
    return replace_attention_layers(copy.deepcopy(model), client, names)


def test_encoder_with_remote_attention_matches_pytorch(setup):
    models, names, client = setup
    local = models["bf"]
    remote = _remote_copy(local, client, names["bf"])
    assert isinstance(remote.layers[0].self_attn, RemoteMultiheadAttention)
    assert sorted(names["bf"]) == ["layers.0.self_attn", "layers.1.self_attn"]
    torch.manual_seed(1)
    x = torch.randn(3, 10, 32)
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 7:] = True
    pad[2, 4:] = True
    want = local(x, src_key_padding_mask=pad)
    got = remote(x, src_key_padding_mask=pad)
    keep = ~pad  # padded positions are not compared (PyTorch may zero them in fast paths)
    torch.testing.assert_close(got[keep], want[keep], **TOL)
    torch.testing.assert_close(remote(x), local(x), **TOL)


def test_sequence_first_encoder_with_a_causal_float_mask(setup):
    models, names, client = setup
    local = models["sf"]
    remote = _remote_copy(local, client, names["sf"])
    x = torch.randn(9, 2, 32)  # [L, B, E]
    mask = nn.Transformer.generate_square_subsequent_mask(9)  # float, -inf above the diagonal
    torch.testing.assert_close(remote(x, mask=mask), local(x, mask=mask), **TOL)


def test_drop_in_masks_weights_and_cross_attention(setup):
    models, _, client = setup
    mha = models["cross"]
    remote = RemoteMultiheadAttention.from_module(mha, client, "cross")
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 5, 32), torch.randn(2, 7, 24), torch.randn(2, 7, 20)
    kpm = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    bool_mask = torch.rand(5, 7) > 0.7
    bool_mask[:, 0] = False  # every row keeps a key
    for kwargs in ({}, {"key_padding_mask": kpm}, {"attn_mask": bool_mask},
                   {"attn_mask": torch.randn(5, 7)}, {"attn_mask": torch.randn(8, 5, 7)},
                   {"key_padding_mask": kpm, "attn_mask": torch.randn(5, 7)},
                   {"average_attn_weights": False}, {"need_weights": False}):
        want_out, want_w = mha(q, k, v, **kwargs)
        got_out, got_w = remote(q, k, v, **kwargs)
        torch.testing.assert_close(got_out, want_out, **TOL)
        if want_w is None:
            assert got_w is None
        else:
            torch.testing.assert_close(got_w, want_w, **TOL)
    # unbatched [L, E] inputs, as nn.MultiheadAttention takes them
    want_out, want_w = mha(q[0], k[0], v[0])
    got_out, got_w = remote(q[0], k[0], v[0])
    torch.testing.assert_close(got_out, want_out, **TOL)
    torch.testing.assert_close(got_w, want_w, **TOL)
    with pytest.raises(ValueError, match="key_padding_mask"):
        remote(q, k, v, key_padding_mask=kpm[:, :3])
