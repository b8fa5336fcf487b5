"""PyTorch side of the client: RemoteMultiheadAttention, a drop-in for
torch.nn.MultiheadAttention whose attention (projections included) runs on an
attnserve model, and helpers that export a model's attention layers into a
model repository and swap them for remote ones.

    from attnserve_client import AttentionClient
    from attnserve_client.torch import export_attention_layers, replace_attention_layers

    names = export_attention_layers(encoder, "models")   # then: attnserve --model-repository models
    client = AttentionClient("127.0.0.1:50051")
    replace_attention_layers(encoder, client, names)     # encoder(x) now calls the server

Inference only: no autograd through the server, no dropout.
"""

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from torch import nn

from . import export as _export

__all__ = ["RemoteMultiheadAttention", "export_mha", "export_attention_layers",
           "replace_attention_layers"]


def _to_numpy(t: torch.Tensor) -> Tuple[np.ndarray, Optional[str]]:
    """(array, wire dtype) of a float tensor: fp32 and fp16 travel as they are,
    bf16 as bf16 (rounded back from float32 exactly)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy(), "bf16"
    if t.dtype == torch.float16:
        return t.numpy(), None
    return t.float().numpy(), None


def _mask_to_numpy(mask: torch.Tensor) -> np.ndarray:
    mask = mask.detach().cpu()
    if mask.dtype == torch.bool:
        return mask.numpy()
    return mask.float().numpy()


def _merge_masks(masks):
    """Combines broadcastable masks: all bool (True = may attend) stay bool;
    otherwise everything becomes an additive float mask (-inf = masked)."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    if all(m.dtype == np.bool_ for m in masks):
        out = masks[0]
        for m in masks[1:]:
            out = out & m
        return out
    out = None
    for m in masks:
        f = np.where(m, np.float32(0), np.float32(-np.inf)) if m.dtype == np.bool_ else m.astype(np.float32)
        out = f if out is None else out + f
    return out


class RemoteMultiheadAttention(nn.Module):
    """nn.MultiheadAttention whose weights live on an attnserve model.

    forward() takes nn.MultiheadAttention's arguments and returns
    (attn_output, attn_weights or None) in the same shapes and dtype; the
    request goes to `model` through `client` (an AttentionClient). Masks follow
    PyTorch: key_padding_mask True = pad, bool attn_mask True = masked, float
    masks are added to the scores. Self-attention (query is key is value)
    sends the hidden states once and the server projects them.

    It reports `_qkv_same_embed_dim = False` and no `in_proj_*` tensors, so
    PyTorch's fused encoder fast paths (which read the weights themselves) are
    never taken.
    """

    def __init__(self, client: Any, model: str, embed_dim: int, num_heads: int, *,
                 batch_first: bool = False, kdim: Optional[int] = None, vdim: Optional[int] = None,
                 timeout: Optional[float] = None):
        super().__init__()
        self.client = client
        self.model = model
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.kdim = kdim or embed_dim
        self.vdim = vdim or embed_dim
        self.batch_first = batch_first
        self.timeout = timeout
        self.head_dim = embed_dim // num_heads
        self._qkv_same_embed_dim = False
        self.in_proj_weight = None
        self.in_proj_bias = None
        self.dropout = 0.0

    @classmethod
    def from_module(cls, mha: nn.MultiheadAttention, client: Any, model: str,
                    timeout: Optional[float] = None) -> "RemoteMultiheadAttention":
        """The remote twin of `mha` (served as `model`, e.g. by export_mha)."""
        return cls(client, model, mha.embed_dim, mha.num_heads, batch_first=mha.batch_first,
                   kdim=mha.kdim, vdim=mha.vdim, timeout=timeout)

    def extra_repr(self) -> str:
        return (f"model={self.model!r}, embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"batch_first={self.batch_first}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, session: Any = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """As nn.MultiheadAttention.forward. `session` (a client Session):
        query/key/value are the new tokens' hidden states (self-attention);
        the server appends them to the session's cache and attends causally
        over everything cached."""
        self_attn = key is query and value is query
        unbatched = query.dim() == 2
        if unbatched:  # [L, E]: batch of one, whatever batch_first says
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        b, lq, lk = query.shape[0], query.shape[1], key.shape[1]

        masks = []
        if key_padding_mask is not None:
            kpm = _mask_to_numpy(key_padding_mask)
            if kpm.shape != (b, lk):
                raise ValueError(f"key_padding_mask: expected shape {(b, lk)}, got {tuple(kpm.shape)}")
            masks.append((~kpm if kpm.dtype == np.bool_ else kpm)[:, None, None, :])
        if attn_mask is not None:
            am = _mask_to_numpy(attn_mask)
            if am.ndim == 3:  # [B * H, Lq, Lk]
                if am.shape[0] != b * self.num_heads:
                    raise ValueError(f"attn_mask: 3-D masks are [batch * num_heads, Lq, Lk] = "
                                     f"{(b * self.num_heads, lq, lk)}, got {tuple(am.shape)}")
                am = am.reshape(b, self.num_heads, lq, lk)
            elif am.ndim != 2:
                raise ValueError(f"attn_mask: expected [Lq, Lk] or [batch * num_heads, Lq, Lk], got {tuple(am.shape)}")
            masks.append(~am if am.dtype == np.bool_ else am)
        mask = _merge_masks(masks)

        q, wire = _to_numpy(query)
        kwargs: Dict[str, Any] = dict(
            model=getattr(session, "model", self.model) if session is not None else self.model, attn_mask=mask, input_dtype=wire,
            causal=bool(is_causal and attn_mask is None), need_weights=need_weights,
            average_weights=need_weights and average_attn_weights)
        if self.timeout:
            kwargs["timeout"] = self.timeout
        if session is not None:
            if not self_attn:
                raise ValueError("session attention is self-attention: pass the same tensor as query, key and value")
            result = session.attend(q, **kwargs)
        elif self_attn:
            result = self.client.attend(q, **kwargs)
        else:
            result = self.client.attend(q, _to_numpy(key)[0], _to_numpy(value)[0], **kwargs)

        out = torch.from_numpy(np.asarray(result.output, dtype=np.float32)).to(query.dtype)
        out = out.to(query.device)
        weights = None
        if need_weights and result.weights is not None:
            weights = torch.from_numpy(np.asarray(result.weights, dtype=np.float32)).to(query.dtype)
            weights = weights.to(query.device)
        if unbatched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights


def export_mha(mha: nn.Module, folder: str, *, name: Optional[str] = None, causal: bool = False,
               precision: str = "fp32", **kwargs: Any) -> Dict[str, Any]:
    """Writes `mha` (an nn.MultiheadAttention, or any module attnserve_client.export
    recognises: Hugging Face q/k/v/o_proj, GPT-NeoX query_key_value, ...) as a
    model folder (config.pbtxt + weights.safetensors). Returns the config."""
    return _export.export_module(mha, folder, name=name, causal=causal, precision=precision, **kwargs)


def export_attention_layers(model: nn.Module, repository: str, *, prefix: str = "",
                            causal: Optional[bool] = None, precision: str = "fp32") -> Dict[str, str]:
    """Exports every nn.MultiheadAttention inside `model` into `repository`, one
    folder per layer named `prefix` + its dotted path with '.' -> '-'
    ("layers-0-self_attn"). Returns {dotted path: model name}."""
    names = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            name = prefix + path.replace(".", "-")
            export_mha(module, f"{repository}/{name}", name=name, causal=bool(causal), precision=precision)
            names[path] = name
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.MultiheadAttention to export")
    return names


def replace_attention_layers(model: nn.Module, client: Any, names: Dict[str, str],
                             timeout: Optional[float] = None) -> nn.Module:
    """Swaps each submodule named in `names` ({dotted path: served model}) for a
    RemoteMultiheadAttention; returns `model` (changed in place)."""
    for path, served in names.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        local = getattr(parent, attr)
        setattr(parent, attr, RemoteMultiheadAttention.from_module(local, client, served, timeout=timeout))
    return model
