#!/usr/bin/env python3
"""An independent reference for the Gemma 3 test: greedy decoding in plain f32 numpy, following
Hugging Face transformers' modeling_gemma3, on the dequantized weights of the GGUF.

    python3 -m pip install gguf numpy
    scripts/gemma3-reference.py models/gemma-3-270m-q4_k_m.gguf "[2, 818, 5279, 529, 7001, 563]" 12

prints each step's greedy token and the margin of its logit over the runner-up (here above 0.25
at every step). cascade quantizes activations to 8 bits, which moves Gemma's logits by a few
tenths, so tests/real_models.rs feeds these tokens and asks only that each rank first or within
0.5 logit of first. The prompt ids are cascade's own ("<bos>The capital of France is"; the
tokenizer is checked separately against transformers').
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

path, ids, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
reader = GGUFReader(path)
tensors = {t.name: t for t in reader.tensors}
meta = lambda key: reader.fields[key].contents()


def weight(name):
    t = tensors[name]
    return dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])


d = meta("gemma3.embedding_length")
heads, kv_heads = meta("gemma3.attention.head_count"), meta("gemma3.attention.head_count_kv")
hd, layers = meta("gemma3.attention.key_length"), meta("gemma3.block_count")
window, eps = meta("gemma3.attention.sliding_window"), meta("gemma3.attention.layer_norm_rms_epsilon")
global_base = meta("gemma3.rope.freq_base")
names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
         "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]
blocks = [{n: weight(f"blk.{i}.{n}.weight") for n in names} for i in range(layers)]
embeddings, out_norm = weight("token_embd.weight"), weight("output_norm.weight")


def rms(x, w):  # the GGUF's norm weights already hold transformers' 1 + w
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, base):  # halves of each head, as transformers' rotate_half
    half = hd // 2
    angles = np.outer(pos, 1.0 / base ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def logits(ids):
    n, pos = len(ids), np.arange(len(ids))
    x = embeddings[ids] * np.float32(np.sqrt(d))
    for i, l in enumerate(blocks):
        sliding = (i + 1) % 6 != 0  # every sixth layer attends to everything
        h = rms(x, l["attn_norm"])
        q = rms((h @ l["attn_q"].T).reshape(n, heads, hd), l["attn_q_norm"])
        k = rms((h @ l["attn_k"].T).reshape(n, kv_heads, hd), l["attn_k_norm"])
        v = (h @ l["attn_v"].T).reshape(n, kv_heads, hd)
        base = 10_000.0 if sliding else global_base
        q, k = rope(q, pos, base), rope(k, pos, base)
        visible = pos[:, None] >= pos[None, :]
        if sliding:
            visible &= pos[:, None] - pos[None, :] < window
        out = np.zeros((n, heads, hd), np.float32)
        for j in range(heads):
            g = j // (heads // kv_heads)
            s = np.where(visible, q[:, j] @ k[:, g].T / np.sqrt(hd), -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, j] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
        x = x + rms(out.reshape(n, -1) @ l["attn_output"].T, l["post_attention_norm"])
        h = rms(x, l["ffn_norm"])
        gate, up = h @ l["ffn_gate"].T, h @ l["ffn_up"].T
        gate = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        x = x + rms((gate * up) @ l["ffn_down"].T, l["post_ffw_norm"])
    return rms(x[-1], out_norm) @ embeddings.T


tokens = list(ids)
for _ in range(steps):
    row = logits(tokens)
    best, runner_up = np.sort(row)[::-1][:2]
    tokens.append(int(row.argmax()))
    print(json.dumps({"token": tokens[-1], "margin": round(float(best - runner_up), 3)}))
