"""Every family of issue 24 against current transformers (5.x) with PyTorch 2
from PyPI: the real attention classes (not the suite's stand-ins), random
weights, exported with attnserve_client.export, served by the real server,
called over the KServe HTTP endpoint, and compared with the module's own
forward in float64 (eager attention, the position embeddings of the
family's own rotary class, the causal or sliding mask transformers' rule
gives the layer). A family attnserve cannot compute must be refused at
export, naming what is missing.

About 6 GB of wheels (torch's CUDA build and its nvidia-* packages); not part
of the suite. Run with tests/hf/current_transformers.sh, which makes the
venv; docs/MODELS.md records the result.
"""

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    "attnserve_export", os.path.join(ROOT, "client", "python", "attnserve_client", "export.py"))
export = importlib.util.module_from_spec(spec)
spec.loader.exec_module(export)

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              num_hidden_layers=2, head_dim=16)
WINDOW = 16
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, rope_theta=150000.0)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=256, rope_theta=500000.0)
# Phi-4-mini's attention: LongRoPE over three quarters of each head (6 of its
# 8 pairs here), its training context shrunk to 32 tokens, a window wider
# than its positions.
PHI4_MINI = dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                      partial_rotary_factor=0.75,
                                      original_max_position_embeddings=32,
                                      short_factor=[1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
                                      long_factor=[1.0, 1.5, 3.0, 6.0, 12.0, 20.0]),
                 partial_rotary_factor=0.75, original_max_position_embeddings=32,
                 max_position_embeddings=4096, sliding_window=8192)
LLAMA4 = dict(num_hidden_layers=4, attention_chunk_size=16, floor_scale=4,
              rope_parameters=dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0,
                                   high_freq_factor=1.0, original_max_position_embeddings=64,
                                   rope_theta=500000.0))
# Multi-head latent attention (DeepSeek-V2/V3 and the models that copy
# DeepseekV3Attention): 4 heads of 16 nope + 8 rotary query/key features and
# 12 value features, a key/value latent of 32, a query latent of 24.
# head_dim: what transformers' rotary classes rotate (DeepSeek's configs set
# it to qk_rope_head_dim; Mistral 4's is the whole head, with a partial factor).
MLA = dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=12, head_dim=8)
# DeepSeek's YaRN (V2: mscale = mscale_all_dim = 0.707; V3: both 1), the
# training context shrunk to 32 tokens.
DEEPSEEK_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                     beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                     rope_theta=10000.0)
# MiniCPM3's LongRoPE over its 8 rotary features (4 pairs).
MINICPM3_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0,
                         original_max_position_embeddings=32, short_factor=[1.0, 1.1, 1.5, 2.0],
                         long_factor=[1.0, 2.0, 6.0, 16.0])
# Classes whose name is not {prefix}Attention / {prefix}RotaryEmbedding
# (None: the model has no rotary class).
ATTENTION_CLASSES = {"longcat_flash": "LongcatFlashMLA", "distilbert": "DistilBertSelfAttention",
                     "longt5-local": "LongT5LocalAttention",
                     "minimax-lightning": "MiniMaxLightningAttention"}
ROTARY_CLASSES = {"kimi_linear": None, "glm5_next": None, "mpt": None, "bloom": None,
                  "longt5": None,
                  "nemotron_h": None,
                  "bert": None, "xlm_roberta": None, "distilbert": None,
                  "jamba": None, "zamba": None}
# QKV clipping small enough that about half the projected features here lie
# beyond it (more of OLMoE's normalised ones); the real clip_qkv, 8, clamps
# none at these scales.
CLIP = 0.25
# DBRX: Wqkv of rows [q | k | v] with grouped-query widths, its theta (in
# attn_config, as its checkpoints keep it and its module reads it, and in
# rope_parameters, which 5.x's rotary class reads).
DBRX = dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0))
DBRX_ATTN = dict(kv_n_heads=2, rope_theta=500000.0)
# Gemma 3n: ten layers (four sliding, then one full, twice, by its pattern),
# the last four reusing the keys and values of the last of each type before
# them (KV sharing: layers 4, full, and 5, sliding, store theirs).
GEMMA3N = dict(sliding_window=WINDOW, num_hidden_layers=10, num_kv_shared_layers=4)
# Gemma 4: five sliding layers, then a full one with a head_dim of its own
# (global_head_dim 32 against 16) and proportional RoPE on a quarter of it
# (its defaults: partial_rotary_factor 0.25, theta 1e6); with
# attention_k_eq_v its full layer takes its values from k_proj, with KV
# heads of its own (num_global_key_value_heads).
GEMMA4 = dict(sliding_window=WINDOW, num_hidden_layers=6, global_head_dim=32)
EMBEDDING_GEMMA2 = dict(sliding_window=8, num_hidden_layers=6, global_head_dim=32,
                        num_global_key_value_heads=1)
# ModernBERT: a global layer, then two local ones of 16 (8 each way).
MODERNBERT = dict(local_attention=16, global_attn_every_n_layers=3, num_hidden_layers=3)
# Families exported with the layer whose keys and values theirs are.
KV_SHARED = {"gemma3n-kv-shared", "gemma4-kv-shared-sliding", "gemma4-kv-shared-full"}
# Tokens per request: 48 unless a family says (LongRoPE's short factors).
LENGTHS = {"phi4-mini-short": 24}

# name: (model module, class prefix, config overrides, layer index, expected outcome)
# outcome: "served", or a word the ExportError must contain.
FAMILIES = {
    "llama": ("llama", "Llama", {}, 0, "served"),
    "llama3": ("llama", "Llama", dict(rope_parameters=LLAMA3, max_position_embeddings=4096), 0,
               "served"),
    "llama-yarn": ("llama", "Llama", dict(rope_parameters=YARN, max_position_embeddings=512), 0,
                   "served"),
    "mistral": ("mistral", "Mistral", dict(sliding_window=WINDOW), 0, "served"),
    "qwen2": ("qwen2", "Qwen2", {}, 0, "served"),
    "qwen3": ("qwen3", "Qwen3", {}, 0, "served"),
    # Qwen2 with use_sliding_window: 5.x's layer_types (sliding from
    # max_window_layers on) say each module's window.
    "qwen2-window-full": ("qwen2", "Qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                 max_window_layers=1), 0, "served"),
    "qwen2-window": ("qwen2", "Qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                            max_window_layers=1), 1, "served"),
    "gemma2-sliding": ("gemma2", "Gemma2", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                 attn_logit_softcapping=5.0), 0, "served"),
    "gemma2-full": ("gemma2", "Gemma2", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                              attn_logit_softcapping=5.0), 1, "served"),
    # Layer types from the default pattern (five sliding, then one full),
    # each with its own RoPE parameters.
    "gemma3-sliding": ("gemma3", "Gemma3Text", dict(sliding_window=WINDOW, num_hidden_layers=6),
                       0, "served"),
    "gemma3-full": ("gemma3", "Gemma3Text", dict(sliding_window=WINDOW, num_hidden_layers=6), 5,
                    "served"),
    # BERT-style encoders (sentence embeddings): the attention through
    # output.dense (BertSelfOutput's residual and LayerNorm are the
    # caller's); DistilBERT's whole attention module.
    "bert": ("bert", "Bert", {}, 0, "served"),
    "xlm-roberta": ("xlm_roberta", "XLMRoberta", {}, 0, "served"),
    "distilbert": ("distilbert", "DistilBert", dict(dim=64, n_heads=4, hidden_dim=128), 0,
                   "served"),
    # Encoders with rotate-half RoPE over the whole head, not causal:
    # EuroBERT (grouped queries), NomicBERT.
    "eurobert": ("eurobert", "EuroBert", {}, 0, "served"),
    "nomic-bert": ("nomic_bert", "NomicBert", {}, 0, "served"),
    # ModernBERT (an encoder): Wqkv and Wo, RoPE per layer type; its local
    # layers see local_attention // 2 positions both ways.
    "modernbert-global": ("modernbert", "ModernBert", MODERNBERT, 0, "served"),
    "modernbert-local": ("modernbert", "ModernBert", dict(MODERNBERT, attention_bias=True), 1,
                         "served"),
    # EmbeddingGemma 2 (Gemma 4's layers as an encoder): |i - j| <= 8 on its
    # sliding layers, every key on its full one (a head_dim of 32 and one KV
    # head of its own).
    "embeddinggemma2-sliding": ("embedding_gemma2", "EmbeddingGemma2Text", EMBEDDING_GEMMA2, 0,
                                "served"),
    "embeddinggemma2-full": ("embedding_gemma2", "EmbeddingGemma2Text", EMBEDDING_GEMMA2, 5,
                             "served"),
    # EmbeddingGemma (use_bidirectional_attention): full layers not causal,
    # sliding ones a window both ways.
    "embeddinggemma-sliding": ("gemma3", "Gemma3Text", dict(
        sliding_window=WINDOW, num_hidden_layers=6, use_bidirectional_attention=True), 0,
        "served"),
    "embeddinggemma-full": ("gemma3", "Gemma3Text", dict(
        sliding_window=WINDOW, num_hidden_layers=6, use_bidirectional_attention=True), 5,
        "served"),
    "phi3": ("phi3", "Phi3", {}, 0, "served"),
    "phi4-mini-short": ("phi3", "Phi3", PHI4_MINI, 0, "served"),
    "phi4-mini-long": ("phi3", "Phi3", PHI4_MINI, 0, "served"),
    # Phi-3-mini-4k: a window narrower than its positions (its 2047; WINDOW
    # here), which 5.x applies in every attention path.
    "phi3-mini-4k-window": ("phi3", "Phi3", dict(sliding_window=WINDOW), 0, "served"),
    "gpt-neox": ("gpt_neox", "GPTNeoX", dict(rotary_pct=0.5), 0, "served"),
    # QK-norm over the whole projection.
    "olmo2": ("olmo2", "Olmo2", dict(rope_theta=500000.0), 0, "served"),
    # OLMo-3: the same norm, sliding windows on three layers of four.
    "olmo3-sliding": ("olmo3", "Olmo3", dict(sliding_window=WINDOW, num_hidden_layers=4), 0,
                      "served"),
    "olmo3-full": ("olmo3", "Olmo3", dict(sliding_window=WINDOW, num_hidden_layers=4), 3,
                   "served"),
    # Variants of the attention above, MoE models among them.
    "qwen3-moe": ("qwen3_moe", "Qwen3Moe", {}, 0, "served"),
    "qwen3-moe-window": ("qwen3_moe", "Qwen3Moe", dict(use_sliding_window=True,
                                                       sliding_window=WINDOW), 0, "served"),
    "qwen2-moe": ("qwen2_moe", "Qwen2Moe", {}, 0, "served"),
    "olmoe": ("olmoe", "Olmoe", {}, 0, "served"),
    "flex-olmo": ("flex_olmo", "FlexOlmo", {}, 0, "served"),
    "granite": ("granite", "Granite", dict(attention_multiplier=0.2), 0, "served"),
    "granitemoe": ("granitemoe", "GraniteMoe", dict(attention_multiplier=0.2), 0, "served"),
    "glm4-moe": ("glm4_moe", "Glm4Moe", dict(use_qk_norm=True), 0, "served"),
    "glm4": ("glm4", "Glm4", {}, 0, "served"),
    "glm": ("glm", "Glm", {}, 0, "served"),
    "ernie4.5": ("ernie4_5", "Ernie4_5", {}, 0, "served"),
    "ernie4.5-moe": ("ernie4_5_moe", "Ernie4_5_Moe", {}, 0, "served"),
    "seed-oss": ("seed_oss", "SeedOss", {}, 0, "served"),
    "arcee": ("arcee", "Arcee", {}, 0, "served"),
    "helium": ("helium", "Helium", {}, 0, "served"),
    "apertus": ("apertus", "Apertus", {}, 0, "served"),
    "nemotron": ("nemotron", "Nemotron", {}, 0, "served"),
    "cohere": ("cohere", "Cohere", {}, 0, "served"),
    # Command R+'s use_qk_norm: LayerNorm without a bias over each head, weights per head.
    "cohere-qk-layernorm": ("cohere", "Cohere", dict(use_qk_norm=True), 0, "served"),
    # StableLM (2): rotate-half over a quarter of each head; with qk_layernorm
    # (StableLM 2 12B) the same LayerNorm per head, one nn.LayerNorm each.
    "stablelm": ("stablelm", "StableLm", dict(use_qkv_bias=True), 0, "served"),
    "stablelm-qk-layernorm": ("stablelm", "StableLm", dict(use_qkv_bias=True, qk_layernorm=True),
                              0, "served"),
    # Chameleon: LayerNorm per head with weights and a bias per head.
    "chameleon": ("chameleon", "Chameleon", {}, 0, "with a bias"),
    "dots1-sliding": ("dots1", "Dots1", dict(sliding_window=WINDOW, layer_types=[
        "sliding_attention", "full_attention"]), 0, "served"),
    "dots1-full": ("dots1", "Dots1", dict(sliding_window=WINDOW, layer_types=[
        "sliding_attention", "full_attention"]), 1, "served"),
    "ministral-sliding": ("ministral", "Ministral", dict(sliding_window=WINDOW), 0, "served"),
    # Ministral 3: YaRN and its queries scaled by position (llama_4_scaling_beta) over a
    # training context shrunk to 16 tokens, so that 48 cross three bands.
    "ministral3": ("ministral3", "Ministral3", dict(rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=1e6,
        llama_4_scaling_beta=0.1, beta_fast=32.0, beta_slow=1.0)), 0, "served"),
    "vaultgemma-sliding": ("vaultgemma", "VaultGemma", dict(
        sliding_window=WINDOW, attn_logit_softcapping=5.0, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"]), 0, "served"),
    "vaultgemma-full": ("vaultgemma", "VaultGemma", dict(
        sliding_window=WINDOW, attn_logit_softcapping=5.0, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"]), 1, "served"),
    # RoPE on some layers only: Cohere2's and EXAONE 4's sliding layers
    # (windowed), their full layers without; SmolLM3 without on every fourth.
    "cohere2-sliding": ("cohere2", "Cohere2", dict(sliding_window=WINDOW, num_hidden_layers=4),
                        0, "served"),
    "cohere2-full": ("cohere2", "Cohere2", dict(sliding_window=WINDOW, num_hidden_layers=4), 3,
                     "served"),
    "exaone4-sliding": ("exaone4", "Exaone4", dict(sliding_window=WINDOW, num_hidden_layers=4),
                        0, "served"),
    "exaone4-full": ("exaone4", "Exaone4", dict(sliding_window=WINDOW, num_hidden_layers=4), 3,
                     "served"),
    "smollm3-rope": ("smollm3", "SmolLM3", dict(num_hidden_layers=4), 0, "served"),
    "smollm3-nope": ("smollm3", "SmolLM3", dict(num_hidden_layers=4), 3, "served"),
    # Multi-head latent attention: DeepSeek-V2 (complex rotary: pairs (2i,
    # 2i+1)), its Lite form (one q_proj), DeepSeek-V3 (interleaved, or
    # rotate-half with rope_interleave false), YaRN with mscale folded into the
    # scale, and the models that copy DeepseekV3Attention.
    "deepseek-v2": ("deepseek_v2", "DeepseekV2", dict(MLA, rope_parameters=dict(
        DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=0.707), max_position_embeddings=128), 0,
                    "served"),
    "deepseek-v2-lite": ("deepseek_v2", "DeepseekV2", dict(MLA, q_lora_rank=None), 0, "served"),
    "deepseek-v3": ("deepseek_v3", "DeepseekV3", dict(MLA, rope_parameters=DEEPSEEK_YARN,
                                                      max_position_embeddings=128), 0, "served"),
    "deepseek-v3-rotate-half": ("deepseek_v3", "DeepseekV3", dict(
        MLA, q_lora_rank=None, attention_bias=True, rope_interleave=False,
        rope_parameters=dict(DEEPSEEK_YARN, mscale_all_dim=0.8), max_position_embeddings=128), 0,
                                "served"),
    "glm4-moe-lite": ("glm4_moe_lite", "Glm4MoeLite", MLA, 0, "served"),
    "youtu": ("youtu", "Youtu", MLA, 0, "served"),
    "axk1": ("axk1", "AXK1", MLA, 0, "served"),
    "minicpm3": ("minicpm3", "MiniCPM3", MLA, 0, "served"),
    "minicpm3-longrope": ("minicpm3", "MiniCPM3", dict(MLA, rope_parameters=MINICPM3_LONGROPE,
                                                       max_position_embeddings=4096), 0, "served"),
    # LongCat-Flash: query and latent times sqrt(hidden / rank), folded in.
    "longcat-flash": ("longcat_flash", "LongcatFlash", MLA, 0, "served"),
    # Kimi Linear's latent layers: no RoPE.
    "kimi-linear": ("kimi_linear", "KimiLinear", dict(MLA, q_lora_rank=None), 0, "served"),
    # Mistral 4: DeepSeek-V3's attention with YaRN on part of the head, and
    # every query feature scaled by its position's band (llama_4_scaling_beta
    # over the 32-token training context: 48 tokens cross two bands).
    "mistral4": ("mistral4", "Mistral4", dict(MLA, head_dim=24, rope_parameters=dict(
        DEEPSEEK_YARN, llama_4_scaling_beta=0.1), max_position_embeddings=128), 0, "served"),
    "mistral4-no-scaling": ("mistral4", "Mistral4", dict(MLA, head_dim=24, rope_parameters=dict(
        DEEPSEEK_YARN, llama_4_scaling_beta=0.0), max_position_embeddings=128), 0, "served"),
    # Latent attention with what attnserve does not compute: a per-head gate
    # (Ling 3), DSA's sparse indexer with more (GLM-5-Next's pooled top-k,
    # Hunyuan V4, A.X K2's gate, dots3, Mistral Large 4's query scaling).
    "bailing-hybrid": ("bailing_hybrid", "BailingHybrid", dict(MLA, q_lora_rank=None), 0,
                       "g_proj"),
    # DeepSeek-V3.2: DSA's indexer keeps every key up to index_topk (48 here,
    # the request's keys): dense attention, served with sparse_index_topk.
    "deepseek-v3.2": ("deepseek_v32", "DeepseekV32", dict(MLA, index_topk=48), 0, "served"),
    "glm-moe-dsa": ("glm_moe_dsa", "GlmMoeDsa", dict(MLA, index_topk=48), 0, "served"),
    "glm5-next": ("glm5_next", "Glm5NextText", dict(MLA, qk_rope_head_dim=0), 0, "indexer"),
    "hy-v4": ("hy_v4", "HYV4", MLA, 0, "indexer"),
    "axk2": ("axk2", "AXK2", MLA, 0, "indexer"),
    "dots3-note": ("dots3_note", "Dots3NoteText", MLA, 0, "indexer"),
    "mistral-large4": ("mistral_large4", "MistralLarge4Text", dict(MLA, q_lora_rank=None), 0,
                       "indexer"),
    # Llama 4: chunked attention, interleaved llama3 RoPE (Scout's equal low
    # and high factors) and a weightless L2 norm on three layers of four;
    # temperature tuning without RoPE on the fourth. Chunks of 16 and a floor
    # scale of 4 so that 48 tokens cross both.
    "llama4-chunked": ("llama4", "Llama4Text", LLAMA4, 0, "served"),
    "llama4-nope": ("llama4", "Llama4Text", LLAMA4, 3, "served"),
    "phimoe": ("phimoe", "Phimoe", {}, 0, "never applies"),
    # QK-norm after RoPE, NTK-alpha RoPE.
    "hunyuan": ("hunyuan_v1_dense", "HunYuanDenseV1", dict(rope_parameters=dict(
        rope_type="dynamic", alpha=1000.0, factor=1.0, rope_theta=10000.0)), 0, "served"),
    "hunyuan-moe": ("hunyuan_v1_moe", "HunYuanMoEV1", dict(rope_parameters=dict(
        rope_type="dynamic", alpha=1000.0, factor=1.0, rope_theta=10000.0)), 0, "served"),
    # Gated attention: sigmoid of a projection of the input times the
    # attention output; the gate inside q_proj (Qwen3-Next, Qwen3.5: their
    # full-attention layers, QK-norm (1 + w), RoPE on a quarter of each
    # head) or a gate_proj of its own (AFMoE: QK-norm, RoPE and a window on
    # its local layers, neither on its global ones).
    "qwen3-next": ("qwen3_next", "Qwen3Next", dict(num_hidden_layers=4), 3, "served"),
    "qwen3.5": ("qwen3_5", "Qwen3_5Text", dict(num_hidden_layers=4), 3, "served"),
    "qwen3.5-moe": ("qwen3_5_moe", "Qwen3_5MoeText", dict(num_hidden_layers=4), 3, "served"),
    "afmoe-local": ("afmoe", "Afmoe", dict(sliding_window=WINDOW, num_hidden_layers=4), 0,
                    "served"),
    "afmoe-global": ("afmoe", "Afmoe", dict(sliding_window=WINDOW, num_hidden_layers=4), 3,
                     "served"),
    # QKV clipping: Q, K and V clamped after the projections (OLMoE: after
    # its QK-norm), before RoPE; OLMo-7B-0424's and DBRX's 8, and CLIP.
    "olmo-clip-qkv": ("olmo", "Olmo", dict(clip_qkv=8.0), 0, "served"),
    "olmo-clip-qkv-small": ("olmo", "Olmo", dict(clip_qkv=CLIP), 0, "served"),
    "olmoe-clip-qkv-small": ("olmoe", "Olmoe", dict(clip_qkv=CLIP), 0, "served"),
    "dbrx": ("dbrx", "Dbrx", dict(DBRX, attn_config=dict(DBRX_ATTN, clip_qkv=8)), 0, "served"),
    "dbrx-clip-qkv-small": ("dbrx", "Dbrx", dict(DBRX, attn_config=dict(DBRX_ATTN, clip_qkv=CLIP)),
                            0, "served"),
    # ALiBi: BLOOM's slopes; MPT's (DBRX's Wqkv and clamp, its slopes from
    # attn_config.alibi_bias_max: its module keeps no config, so it is
    # exported from a model around it); Falcon's, rounded to bfloat16.
    "bloom": ("bloom", "Bloom", {}, 0, "served"),
    "mpt": ("mpt", "Mpt", dict(attn_config=dict(clip_qkv=8.0, alibi_bias_max=6)), 0, "served"),
    "falcon-alibi": ("falcon", "Falcon", dict(alibi=True, multi_query=False,
                                              new_decoder_architecture=False), 0, "bfloat16"),
    # LongT5's local attention: T5's relative bias within blocks of keys, not
    # the bias attnserve computes (T5's own layers: WHOLE_MODELS).
    "longt5-local": ("longt5", "LongT5", dict(d_model=64, d_kv=16, num_heads=4), 0,
                     "position bias its caller passes in"),
    # Falcon with RoPE, each layout of its query_key_value: Falcon-7B's
    # multi-query, Falcon-40B's and 180B's groups (new_decoder_architecture),
    # per head with biases.
    "falcon-7b": ("falcon", "Falcon", dict(multi_query=True, new_decoder_architecture=False,
                                           rope_theta=1000.0), 0, "served"),
    "falcon-40b": ("falcon", "Falcon", dict(new_decoder_architecture=True, num_kv_heads=2),
                   0, "served"),
    "falcon-per-head": ("falcon", "Falcon", dict(multi_query=False, new_decoder_architecture=False,
                                                 bias=True), 0, "served"),
    "gpt-oss-sliding": ("gpt_oss", "GptOss", dict(sliding_window=WINDOW, rope_parameters=YARN,
                                                   num_local_experts=2, num_experts_per_tok=1), 0,
                        "served"),
    "gpt-oss-full": ("gpt_oss", "GptOss", dict(sliding_window=WINDOW, rope_parameters=YARN,
                                                num_local_experts=2, num_experts_per_tok=1), 1,
                     "served"),
    # Gemma 3n and Gemma 4: QK-norm x * w and a weightless RMSNorm of each
    # value head (v_norm), scale 1, RoPE per layer type. A layer that reuses
    # an earlier layer's keys and values (KV_SHARED) is exported with that
    # layer (its source) and served with its input as key and value; alone,
    # it is refused.
    "gemma3n-sliding": ("gemma3n", "Gemma3nText", GEMMA3N, 0, "served"),
    "gemma3n-full": ("gemma3n", "Gemma3nText", GEMMA3N, 4, "served"),
    "gemma3n-kv-shared": ("gemma3n", "Gemma3nText", GEMMA3N, 9, "served"),
    "gemma3n-kv-shared-alone": ("gemma3n", "Gemma3nText", GEMMA3N, 9, "KV sharing"),
    "gemma4-sliding": ("gemma4", "Gemma4Text", GEMMA4, 0, "served"),
    "gemma4-full": ("gemma4", "Gemma4Text", GEMMA4, 5, "served"),
    # Proportional RoPE on half of each head, with a factor (served as linear).
    "gemma4-full-factor": ("gemma4", "Gemma4Text", dict(GEMMA4, rope_parameters=dict(
        sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        full_attention=dict(rope_type="proportional", partial_rotary_factor=0.5,
                            rope_theta=10000.0, factor=2.0))), 5, "served"),
    "gemma4-full-k-eq-v": ("gemma4", "Gemma4Text", dict(GEMMA4, attention_k_eq_v=True,
                                                        num_global_key_value_heads=1), 5,
                           "served"),
    "gemma4-kv-shared": ("gemma4", "Gemma4Text", dict(GEMMA4, num_hidden_layers=8,
                                                      num_kv_shared_layers=2), 6, "KV sharing"),
    "gemma4-kv-shared-sliding": ("gemma4", "Gemma4Text", dict(GEMMA4, num_hidden_layers=8,
                                                              num_kv_shared_layers=2), 6,
                                 "served"),
    # A full layer reusing one with attention_k_eq_v (layer 5's).
    "gemma4-kv-shared-full": ("gemma4", "Gemma4Text", dict(
        GEMMA4, num_hidden_layers=12, num_kv_shared_layers=6, attention_k_eq_v=True,
        num_global_key_value_heads=1), 11, "served"),
    # use_bidirectional_attention "all": a full layer without the causal
    # mask; a sliding one sees both ways.
    "gemma4-all-full": ("gemma4", "Gemma4Text", dict(GEMMA4, use_bidirectional_attention="all"),
                        5, "served"),
    "gemma4-all-sliding": ("gemma4", "Gemma4Text", dict(GEMMA4,
                                                        use_bidirectional_attention="all"), 0,
                           "served"),
    # Hybrid families (state-space or linear-attention layers between
    # attention layers): their attention layers.
    "nemotron-h": ("nemotron_h", "NemotronH", dict(layers_block_type=["mlp", "full_attention"]),
                   1, "served"),
    "granitemoehybrid-nope": ("granitemoehybrid", "GraniteMoeHybrid",
                              dict(attention_multiplier=0.2), 0, "served"),
    "granitemoehybrid-rope": ("granitemoehybrid", "GraniteMoeHybrid", dict(
        attention_multiplier=0.2, position_embedding_type="rope"), 0, "served"),
    "falcon-h1": ("falcon_h1", "FalconH1", dict(key_multiplier=0.7), 0, "served"),
    "bamba": ("bamba", "Bamba", dict(attn_layer_indices=[1]), 1, "served"),
    "jamba": ("jamba", "Jamba", dict(attn_layer_period=2, attn_layer_offset=1), 1, "served"),
    # Zamba: attention over [hidden, embeddings] (attention_hidden_size, twice
    # the hidden size: the module's input), scale (head_dim / 2)^-0.5.
    "zamba": ("zamba", "Zamba", dict(hidden_size=32, attention_hidden_size=64,
                                     layers_block_type=["linear_attention", "hybrid"]), 1,
              "served"),
    # Zamba2's shared blocks: rotary parameters on every config (its RoPE and
    # per-layer LoRA adapters on Q, K, V not checked): refused.
    "zamba2": ("zamba2", "Zamba2", dict(hidden_size=32, attention_hidden_size=64,
                                       layers_block_type=["linear_attention", "hybrid"]), 1,
               "zamba2"),
    "lfm2": ("lfm2", "Lfm2", dict(full_attn_idxs=[1]), 1, "served"),
    "lfm2-moe": ("lfm2_moe", "Lfm2Moe", dict(full_attn_idxs=[1]), 1, "served"),
    # MiniMax(-Text-01): full attention on layer 0 (windowed on every full
    # layer with sliding_window), lightning attention (linear, with decay) on 1.
    "minimax-full": ("minimax", "MiniMax", dict(num_local_experts=2, num_experts_per_tok=1), 0,
                     "served"),
    "minimax-full-window": ("minimax", "MiniMax", dict(num_local_experts=2, num_experts_per_tok=1,
                                                       sliding_window=WINDOW), 0, "served"),
    "minimax-lightning": ("minimax", "MiniMax", dict(num_local_experts=2, num_experts_per_tok=1),
                          1, "lightning"),
    "minimax-m2": ("minimax_m2", "MiniMaxM2", dict(num_local_experts=2, num_experts_per_tok=1), 0,
                   "served"),
    "olmo-hybrid": ("olmo_hybrid", "OlmoHybrid", {}, 1, "served"),
}


# Layers whose relative position bias is another module's (T5's later
# layers take their stack's first layer's, MPNet's its encoder's), or none
# (T5's cross-attention): exported from a whole two-layer model, compared
# with what the layer computes inside it.
# name: (model module, model class prefix, config overrides, layer's submodule)
T5_LIKE = dict(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, num_decoder_layers=2,
               vocab_size=64, dropout_rate=0.0)
DEBERTA_LIKE = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=512, relative_attention=True,
                    position_biased_input=False, norm_rel_ebd="layer_norm",
                    pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
WHOLE_MODELS = {
    "t5-encoder": ("t5", "T5", T5_LIKE, "encoder.block.1.layer.0.SelfAttention"),
    "t5-decoder": ("t5", "T5", T5_LIKE, "decoder.block.1.layer.0.SelfAttention"),
    "t5-cross": ("t5", "T5", T5_LIKE, "decoder.block.1.layer.1.EncDecAttention"),
    "mt5-encoder": ("mt5", "MT5", T5_LIKE, "encoder.block.1.layer.0.SelfAttention"),
    "umt5-encoder": ("umt5", "UMT5", T5_LIKE, "encoder.block.1.layer.0.SelfAttention"),
    "umt5-decoder": ("umt5", "UMT5", T5_LIKE, "decoder.block.1.layer.0.SelfAttention"),
    "switch-transformers-decoder": (
        "switch_transformers", "SwitchTransformers",
        dict(T5_LIKE, num_experts=2, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
             expert_capacity=128), "decoder.block.1.layer.0.SelfAttention"),
    "mpnet": ("mpnet", "MPNet", dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                     num_hidden_layers=2, vocab_size=64),
              "encoder.layer.1.attention"),
    # DeBERTa v3's form (log buckets reaching 128 positions, the layer's own
    # projections for the positions) and v2's (plain distances,
    # pos_key_proj and pos_query_proj): relative position embeddings.
    "deberta-v3": ("deberta_v2", "DebertaV2", dict(DEBERTA_LIKE, position_buckets=32,
                                                   max_relative_positions=128,
                                                   share_att_key=True),
                   "encoder.layer.1.attention"),
    "deberta-v2": ("deberta_v2", "DebertaV2", dict(DEBERTA_LIKE, position_buckets=-1,
                                                   max_relative_positions=64,
                                                   share_att_key=False),
                   "encoder.layer.1.attention"),
    # DeBERTa v1: in_proj per head with q_bias and v_bias, pos_proj and
    # pos_q_proj over 128 relative positions.
    "deberta-v1": ("deberta", "Deberta", dict(DEBERTA_LIKE, norm_rel_ebd="none",
                                              max_position_embeddings=128,
                                              max_relative_positions=-1),
                   "encoder.layer.1.attention"),
}


def build_model(family):
    """The whole model of a WHOLE_MODELS family, random weights (its bias
    table N(0, 1), so that it moves the scores), in eval mode."""
    module_name, prefix, overrides, _ = WHOLE_MODELS[family]
    mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    cfg_mod = importlib.import_module(
        f"transformers.models.{module_name}.configuration_{module_name}")
    config = getattr(cfg_mod, f"{prefix}Config")(**overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(sum(map(ord, family)))
    model = getattr(mod, f"{prefix}Model")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.normal_()
            else:
                p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def model_layer_forward(model, submodule, x):
    """(query input, key/value input or None, output) of the layer at
    `submodule` while `model` runs in float64 on x [B, L, 64] (its decoder
    on the same x): the layer as its model calls it, with the bias the model
    gives it. MPNetAttention's output is after its LayerNorm: its attn's;
    DebertaV2Attention's too: its DisentangledSelfAttention's through
    output.dense."""
    dense = None
    if submodule.endswith(".attention"):
        holder = model.get_submodule(submodule)
        if hasattr(getattr(holder, "self", None), "pos_att_type"):
            submodule, dense = submodule + ".self", holder.output.dense
        else:
            submodule += ".attn"
    layer = model.get_submodule(submodule)
    calls = []
    forward = layer.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append((args[0] if args else kwargs["hidden_states"],
                      kwargs.get("key_value_states"), out[0] if isinstance(out, tuple) else out))
        return out
    layer.forward = spy
    model.double()
    xt = torch.from_numpy(x).double()
    try:
        with torch.no_grad():
            if hasattr(model, "decoder"):
                model(inputs_embeds=xt, decoder_inputs_embeds=xt, use_cache=False)
            else:
                model(inputs_embeds=xt)
            (hidden, kv, out), = calls
            if dense is not None:
                out = dense(out)
    finally:
        del layer.forward
        model.float()
    return (hidden.float().numpy(), None if kv is None else kv.float().numpy(),
            out.double().numpy())


def build(family):
    module_name, prefix, overrides, layer, outcome = FAMILIES[family]
    mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    cfg_mod = importlib.import_module(
        f"transformers.models.{module_name}.configuration_{module_name}")
    config_class = getattr(cfg_mod, f"{prefix}Config")
    kwargs = dict(COMMON)
    if family == "gpt-neox" or module_name in ("modernbert", "bert", "xlm_roberta", "nomic_bert"):
        kwargs = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                      num_hidden_layers=2)
    if module_name == "falcon":  # its head_dim is a property of hidden_size and heads
        kwargs.pop("head_dim")
    kwargs.update(overrides)
    config = config_class(**kwargs)
    config._attn_implementation = "eager"
    attention_name = ATTENTION_CLASSES.get(family) or \
        ATTENTION_CLASSES.get(module_name, f"{prefix}Attention")
    attention = getattr(mod, attention_name, None) or \
        getattr(mod, f"{prefix.replace('Text', '')}Attention")
    try:
        m = attention(config, layer_idx=layer)
    except TypeError:  # DistilBERT's takes the config alone
        m = attention(config)
    rotary = None
    if ROTARY_CLASSES.get(module_name, "") is not None:
        rotary_class = getattr(mod, f"{prefix}RotaryEmbedding", None) or \
            getattr(mod, f"{prefix.replace('Text', '')}RotaryEmbedding")
        rotary = rotary_class(config=config)
    if module_name == "granitemoehybrid" and config.position_embedding_type != "rope":
        rotary = None  # its model passes no position embeddings then
    torch.manual_seed(sum(map(ord, family)))
    source = None
    if family in KV_SHARED:  # the layer whose keys and values m reuses, by transformers
        types = config.layer_types
        store = [i for i, mode in enumerate(config.kv_sharing_modes)
                 if mode == "store" and types[i] == types[layer]]
        source = attention(config, layer_idx=store[0])
        assert m.is_kv_shared_layer and not source.is_kv_shared_layer and len(store) == 1
    with torch.no_grad():  # biases and norm weights away from their defaults, so they count
        for module in (m, source):
            for p in module.parameters() if module is not None else ():
                p.add_(torch.randn_like(p) * 0.02)
    if source is not None:
        source.eval()
    return m.eval(), rotary, config, layer, outcome, source


def module_name_of(family):
    return FAMILIES[family][0]


def chunk_of(config, layer):
    """Llama 4's chunked layers (config.layer_types): the chunk size."""
    types = getattr(config, "layer_types", None)
    if types and types[layer] == "chunked_attention":
        return config.attention_chunk_size
    return None


def window_of(config, layer):
    """transformers' rule: the layer's type from config.layer_types when
    the family mixes them, else every layer slides when sliding_window is
    set (Mistral); None = full attention."""
    types = getattr(config, "layer_types", None)
    if types and getattr(config, "model_type", None) == "minimax":  # every full layer slides
        return getattr(config, "sliding_window", None) if types[layer] == "full_attention" else None
    if types:
        return config.sliding_window if types[layer] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


def two_sided_rule(config):
    """transformers' own predicate (batch, head, q_idx, kv_idx) -> visible
    of a bidirectional model's sliding layers."""
    if config.model_type == "gemma3_text":  # EmbeddingGemma: |i - j| < window
        from transformers.models.gemma3.modeling_gemma3 import _bidirectional_window_overlay
        return _bidirectional_window_overlay(config.sliding_window)
    from transformers.masking_utils import sliding_window_bidirectional_overlay
    # Gemma 4, ModernBERT, EmbeddingGemma 2: |i - j| <= w
    return sliding_window_bidirectional_overlay(config.sliding_window)


def module_forward(m, rotary, config, layer, x, source=None, xs=None):
    """m's forward in float64 on x; a KV-shared m's keys and values are
    those source's forward on xs stores (transformers' shared_kv_states).
    BERT's attention: its self-attention, then output.dense."""
    b, length, _ = x.shape
    if (hasattr(m, "self") and hasattr(m, "output")) or hasattr(m, "q_lin"):
        m, xt = m.double(), torch.from_numpy(x).double()
        with torch.no_grad():
            if hasattr(m, "q_lin"):
                return m(hidden_states=xt, attention_mask=None)[0].numpy()
            return m.output.dense(m.self(hidden_states=xt, attention_mask=None)[0]).numpy()
    model_type = getattr(config, "model_type", None)
    if model_type in ("bloom", "mpt"):  # ALiBi: the model's own bias tensor, causal
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor
        m, xt = m.double(), torch.from_numpy(x).double()
        future = torch.ones(length, length, dtype=torch.bool).triu(1).expand(b, 1, length, length)
        with torch.no_grad():
            if model_type == "bloom":  # BloomAttention adds `residual`: the caller's, zero
                alibi = build_alibi_tensor(torch.ones(b, length, dtype=torch.long), m.num_heads,
                                           torch.float64)
                mask = torch.zeros(future.shape, dtype=torch.float64).masked_fill(
                    future, torch.finfo(torch.float64).min)
                return m(xt, torch.zeros_like(xt), alibi, mask)[0].numpy()
            bias = build_mpt_alibi_tensor(m.n_heads, config.max_seq_len,
                                          config.attn_config.alibi_bias_max).double()
            return m(xt, bias, attention_mask=future)[0].numpy()
    mask = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    if not getattr(m, "is_causal", True):  # use_bidirectional_attention
        mask = torch.zeros((length, length), dtype=torch.float64)
    window = window_of(config, layer)
    if window and not getattr(m, "is_causal", True):
        rule = two_sided_rule(config)
        visible = torch.tensor([[bool(rule(0, 0, i, j)) for j in range(length)]
                                for i in range(length)])
        mask = mask.masked_fill(~visible, float("-inf"))
    elif window:
        mask = mask.masked_fill(torch.ones(length, length, dtype=torch.bool).tril(-window),
                                float("-inf"))
    chunk = chunk_of(config, layer)
    if chunk:  # transformers' chunked mask: the query's own chunk
        i = torch.arange(length)
        mask = mask.masked_fill((i[None, :] // chunk) != (i[:, None] // chunk), float("-inf"))
    mask = mask.expand(b, 1, length, length)
    positions = torch.arange(length)[None].expand(b, length)
    m = m.double()
    xt = torch.from_numpy(x).double()
    kwargs = {}
    shared_kv = {}
    if "position_ids" in inspect.signature(m.forward).parameters:  # Mistral 4
        kwargs["position_ids"] = positions
    if "alibi" in inspect.signature(m.forward).parameters:  # Falcon with RoPE: no ALiBi
        kwargs["alibi"] = None
    if "layer_idx" in inspect.signature(m.forward).parameters:  # Zamba's shared blocks
        kwargs["layer_idx"] = layer
    if "shared_kv_states" in inspect.signature(m.forward).parameters:
        kwargs["shared_kv_states"] = shared_kv  # Gemma 3n, 4: a layer's stored keys, values
    with torch.no_grad():
        if rotary is None:  # Kimi Linear's latent layers: no RoPE
            pass
        elif getattr(config, "model_type", None) == "llama4_text":
            # one complex tensor, freqs_cis
            kwargs["position_embeddings"] = rotary.double()(xt, positions)
        else:
            rotary = rotary.double()
            try:
                kwargs["position_embeddings"] = rotary(xt, positions)
            except TypeError:  # families whose rotary class takes a layer type
                kwargs["position_embeddings"] = rotary(xt, positions, config.layer_types[layer])
        if source is not None:
            assert source.store_full_length_kv
            source.double()(hidden_states=torch.from_numpy(xs).double(), attention_mask=mask,
                            **kwargs)
            assert shared_kv, "the source stored no keys and values"
        out = m(hidden_states=xt, attention_mask=mask, **kwargs)[0]
    return out.numpy()


def infer(http, model, x, causal=True, kv=None):
    """The model's output for query x (and key = value = kv when given)."""
    tensors = [("query", x)] + ([("key", kv), ("value", kv)] if kv is not None else [])
    header = json.dumps({"parameters": {"causal": causal, "binary_data_output": True},
                         "inputs": [{"name": name, "shape": list(t.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": t.nbytes}}
                                    for name, t in tensors]}).encode()
    body = header + b"".join(t.tobytes() for _, t in tensors)
    req = urllib.request.Request(f"http://{http}/v2/models/{model}/infer", data=body,
                                 headers={"Inference-Header-Content-Length": str(len(header))})
    with urllib.request.urlopen(req, timeout=120) as r:
        body = r.read()
        json_length = int(r.headers["Inference-Header-Content-Length"])
    answer = json.loads(body[:json_length])
    shape = answer["outputs"][0]["shape"]
    return np.frombuffer(body[json_length:], np.float32).reshape(shape)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--server", default=os.path.join(ROOT, "build", "server", "attnserve"))
    p.add_argument("families", nargs="*", help="only these (default: all)")
    args = p.parse_args()
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    repo = tempfile.mkdtemp(prefix="attnserve-hf5-")
    built, results = {}, {}
    families = args.families or list(FAMILIES) + list(WHOLE_MODELS)
    for family in families:
        if family in WHOLE_MODELS:
            try:
                model = build_model(family)
                exported = export.export_module(model, os.path.join(repo, family),
                                                submodule=WHOLE_MODELS[family][3])
                built[family] = (model, None, None, None, exported["causal"], None)
            except Exception as e:  # refused, or a model this transformers lacks
                results[family] = f"FAIL: {type(e).__name__}: {e}"
            continue
        try:
            m, rotary, config, layer, outcome, source = build(family)
        except Exception as e:  # a family this transformers lacks
            results[family] = f"NOT BUILT ({type(e).__name__}: {e})"
            continue
        try:
            if getattr(m, "config", None) is None and module_name_of(family) == "mpt":
                # MPT's module keeps no config: its model's says alibi_bias_max.
                holder = torch.nn.Module()
                holder.attn, holder.config = m, config
                exported = export.export_module(holder, os.path.join(repo, family),
                                                submodule="attn")
            else:
                exported = export.export_module(m, os.path.join(repo, family), kv_source=source)
            built[family] = (m, rotary, config, layer, exported["causal"], source)
            if outcome != "served":
                results[family] = f"FAIL: exported, expected a refusal naming {outcome!r}"
        except export.ExportError as e:
            if outcome != "served" and outcome in str(e):
                results[family] = f"refused as expected: {e}"
            else:
                results[family] = f"FAIL: refused: {e}"
    server = subprocess.Popen([args.server, "--address", "127.0.0.1:0", "--metrics-address",
                               "127.0.0.1:0", "--http-address", "127.0.0.1:0", "--backend", "cpu",
                               "--model-repository", repo],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    http = None
    deadline = time.monotonic() + 120
    for line in server.stdout:
        m = re.search(r"attnserve http on (\S+)", line)
        if m:
            http = m.group(1)
        if "listening on" in line or time.monotonic() > deadline:
            break
    try:
        rng = np.random.default_rng(1)
        for family, (m, rotary, config, layer, causal, source) in built.items():
            x = rng.uniform(-1, 1, (2, LENGTHS.get(family, 48), 64)).astype(np.float32)
            if family in WHOLE_MODELS:  # 300 tokens: past the buckets' 128 both ways
                x = rng.uniform(-1, 1, (2, 300, 64)).astype(np.float32)
                x, kv, want = model_layer_forward(m, WHOLE_MODELS[family][3], x)
                got = infer(http, family, x, causal, kv)
            else:
                xs = None if source is None else rng.uniform(-1, 1, x.shape).astype(np.float32)
                want = module_forward(m, rotary, config, layer, x, source, xs)
                got = infer(http, family, x, causal, xs)
            rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            ok = rel < 2e-5
            results[family] = f"{'ok' if ok else 'FAIL'}: relative error {rel:.2e}"
    finally:
        server.terminate()
        server.wait(30)
    width = max(map(len, results))
    for family in families:
        print(f"{family:<{width}}  {results.get(family, 'FAIL: not run')}")
    return 0 if all(not r.startswith(("FAIL", "NOT")) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
