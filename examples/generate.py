#!/usr/bin/env python3
"""Greedy text generation with every attention layer served by attnserve.

A small decoder-only transformer (GPT-style: token + position embeddings,
pre-LayerNorm blocks of causal self-attention and an MLP; fixed-seed random
weights, nothing downloaded) is built in PyTorch, its attention layers are
exported into a model repository, attnserve is started on it (or an already
running server is used), and the same prompt is continued three ways:

  local       PyTorch only, the whole sequence recomputed every step
  stateless   attention on the server, every step re-sending all hidden
              states (the server re-projects K/V for the whole prefix)
  session     attention on the server through KV-cache sessions (one per
              layer): the prompt once (prefill), then one token per step

The tokens must be identical; tokens/s are printed for each mode.

    pip install ./client/python[torch]
    python3 examples/generate.py                         # starts build/server/attnserve
    python3 examples/generate.py --target 127.0.0.1:50051 --repository models
        # (that server must serve --model-repository models, written by a first run
        #  with --export-only)
"""

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
from torch import nn

from attnserve_client import AttentionClient, UnimplementedError
from attnserve_client.torch import export_attention_layers, replace_attention_layers


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, session=None) -> torch.Tensor:
        h = self.ln1(x)
        if session is not None:  # the new positions only; the server holds the prefix
            a = self.attn(h, h, h, need_weights=False, session=session)[0]
        else:
            n = x.shape[1]
            future = torch.ones(n, n, dtype=torch.bool).triu(1)  # True = masked, as PyTorch wants
            a = self.attn(h, h, h, need_weights=False, attn_mask=future)[0]
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = 256, d_model: int = 64, heads: int = 4, layers: int = 2,
                 max_len: int = 256):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor, start: int = 0, sessions=None) -> torch.Tensor:
        """Logits [B, L, vocab] of tokens `ids` at positions start.. (start > 0
        only with sessions, which hold the earlier positions)."""
        pos = torch.arange(start, start + ids.shape[1])
        x = self.tok(ids) + self.pos(pos)[None]
        for i, block in enumerate(self.blocks):
            x = block(x, sessions[i] if sessions is not None else None)
        return self.head(self.ln_f(x))


def build_model(seed: int = 0, **dims) -> TinyDecoder:
    torch.manual_seed(seed)
    return TinyDecoder(**dims).eval()


def export(model: TinyDecoder, repository: str) -> Dict[str, str]:
    """Writes one model folder per attention layer (causal: a decoder);
    returns {module path: model name}."""
    return export_attention_layers(model, repository, prefix="tiny-", causal=True)


@torch.no_grad()
def generate_full(model: nn.Module, prompt: List[int], new_tokens: int) -> List[int]:
    """Greedy decoding, recomputing the whole sequence each step (local, or
    remote stateless when the attention layers are remote)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        logits = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def generate_sessions(model: nn.Module, client: AttentionClient, names: Dict[str, str],
                      prompt: List[int], new_tokens: int) -> List[int]:
    """Greedy decoding through one server-side KV-cache session per layer:
    prefill the prompt, then send one token per step."""
    with contextlib.ExitStack() as stack:
        sessions = [stack.enter_context(client.open_session(names[f"blocks.{i}.attn"]))
                    for i in range(len(model.blocks))]
        logits = model(torch.tensor([prompt]), 0, sessions)
        out = [int(logits[0, -1].argmax())]
        while len(out) < new_tokens:
            logits = model(torch.tensor([[out[-1]]]), len(prompt) + len(out) - 1, sessions)
            out.append(int(logits[0, -1].argmax()))
        return out


def find_attnserve(explicit: Optional[str]) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (explicit, os.environ.get("ATTNSERVE_BIN"), shutil.which("attnserve"),
                      os.path.join(here, "..", "build", "server", "attnserve")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    sys.exit("generate.py: no attnserve binary: build it (scripts/build.sh), pass --attnserve PATH, "
             "or use --target HOST:PORT")


@contextlib.contextmanager
def start_server(binary: str, repository: str, timeout: float = 60.0):
    """attnserve on an ephemeral loopback port; yields its target."""
    proc = subprocess.Popen([binary, "--model-repository", repository, "--address", "127.0.0.1:0",
                             "--metrics-address", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"attnserve listening on (127\.0\.0\.1:\d+)", line)
            if m:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("attnserve did not start:\n" + "".join(lines))
        else:
            raise RuntimeError(f"attnserve exited with {proc.wait()}:\n" + "".join(lines))
        # keep draining its log so it never blocks on a full pipe
        import threading
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(30)


def run(client: AttentionClient, model: TinyDecoder, names: Dict[str, str], prompt: List[int],
        new_tokens: int, modes=("local", "stateless", "session"), report=print):
    """Generates with each mode; returns {mode: (tokens, tokens/s)}, a mode
    the server cannot do (sessions refused with UNIMPLEMENTED) mapped to None."""
    import copy
    remote = replace_attention_layers(copy.deepcopy(model), client, names)
    results = {}
    for mode in modes:
        start = time.perf_counter()
        try:
            if mode == "local":
                tokens = generate_full(model, prompt, new_tokens)
            elif mode == "stateless":
                tokens = generate_full(remote, prompt, new_tokens)
            else:
                tokens = generate_sessions(remote, client, names, prompt, new_tokens)
        except UnimplementedError:
            report(f"{mode:>9}: this server does not serve sessions (UNIMPLEMENTED)")
            results[mode] = None
            continue
        rate = new_tokens / (time.perf_counter() - start)
        results[mode] = (tokens, rate)
        report(f"{mode:>9}: {rate:8.1f} tokens/s  {tokens}")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="a running attnserve (serving --repository); default: start one")
    p.add_argument("--attnserve", help="the attnserve binary to start (default: $ATTNSERVE_BIN, PATH, build/)")
    p.add_argument("--repository", help="model repository to write (default: a temporary directory)")
    p.add_argument("--export-only", action="store_true", help="write the repository and exit")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model = build_model(args.seed, vocab=args.vocab, d_model=args.d_model, heads=args.heads,
                        layers=args.layers, max_len=args.prompt_len + args.new_tokens)
    prompt = torch.randint(0, args.vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with contextlib.ExitStack() as stack:
        repo = args.repository or stack.enter_context(tempfile.TemporaryDirectory(prefix="attnserve-gen-"))
        names = export(model, repo)
        print(f"exported {len(names)} attention layers to {repo}: {sorted(names.values())}")
        if args.export_only:
            return 0
        target = args.target or stack.enter_context(start_server(find_attnserve(args.attnserve), repo))
        client = stack.enter_context(AttentionClient(target))
        print(f"prompt: {prompt}")
        results = run(client, model, names, prompt, args.new_tokens)
    local = results["local"][0]
    ok = all(r is None or r[0] == local for r in results.values())
    print("tokens identical to local PyTorch" if ok else "MISMATCH: remote tokens differ from local")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
