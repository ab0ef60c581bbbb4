"""PyTorch reference for the Llama family as Hugging Face stores it.

A plain PyTorch forward of transformers' LlamaForCausalLM (and of
Qwen2ForCausalLM's q/k/v biases), written from the model's published
definition, not from shardtrain's code: RMSNorm computed in fp32, rotary
position embeddings in the rotate-half convention with rope_theta and Llama
3's frequency scaling (rope_scaling.rope_type = "llama3"), grouped-query
attention (each key/value head serves num_attention_heads /
num_key_value_heads query heads), a SwiGLU MLP (down_proj(silu(gate_proj(x))
* up_proj(x))), a tied or untied head. It reads a directory of config.json
and model.safetensors (or model.safetensors.index.json and its shards) with
safetensors_reader.py, written from the format's specification, so
no transformers or safetensors package is needed: Debian's python3-torch is
enough (run it with /usr/bin/python3).

  /usr/bin/python3 bench/reference/llama_reference.py --loss --hf DIR \\
      --tokens tokens.txt [--logits-out logits.f32]
      The mean cross-entropy of the sequences in tokens.txt (one per line,
      T + 1 ids: inputs are the first T, targets the last T), printed as
      JSON; optionally the logits as raw fp32 [B, T, vocab_size].

  /usr/bin/python3 bench/reference/llama_reference.py --train --hf DIR \\
      --data train.bin --steps N --batch-size B --seq-len T --lr LR \\
      [--weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8 --grad-clip 1]
      Trains N steps from the directory's weights on a token file (llm.c's
      16-bit layout or the 32-bit Llama 3 one), windows in file order (T + 1
      tokens starting at multiples of T, B per step), with torch.optim.AdamW
      at a constant learning rate (weight decay on matrices only) and the
      global gradient norm clipped; prints each step's loss and gradient
      norm as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_reader import read_safetensors  # noqa: E402

# ----------------------------------------------------------------------------
# The weights.


def read_tensors(path: str) -> Dict[str, torch.Tensor]:
    arrays, _ = read_safetensors(path)
    return {name: torch.from_numpy(a.copy()) for name, a in arrays.items()}


def read_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_tensors(os.path.join(hf_dir, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    tensors: Dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(read_tensors(os.path.join(hf_dir, shard)))
    missing = set(weight_map) - set(tensors)
    if missing:
        raise ValueError(f"the shards lack {sorted(missing)}")
    return tensors


# ----------------------------------------------------------------------------
# The model.


class LlamaReference:
    """LlamaForCausalLM's forward over a dict of named tensors (Hugging
    Face's names) that require grad when trained."""

    def __init__(self, config: dict, weights: Dict[str, torch.Tensor]):
        if config.get("model_type") not in ("llama", "qwen2"):
            raise ValueError(f"model_type {config.get('model_type')!r} is not "
                             "llama or qwen2")
        self.hidden = config["hidden_size"]
        self.layers = config["num_hidden_layers"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads", self.heads)
        self.head_dim = config.get("head_dim") or self.hidden // self.heads
        self.eps = config.get("rms_norm_eps", 1e-6)  # LlamaConfig's default
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not "
                             "silu, the only activation modelled")
        self.vocab = config["vocab_size"]
        self.tied = config.get("tie_word_embeddings", False)
        self.w = weights
        self.inv_freq = self._inverse_frequencies(config)

    def _inverse_frequencies(self, config: dict) -> torch.Tensor:
        d = self.head_dim
        base = float(config.get("rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float()
                              / d))
        scaling = config.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            return inv
        if kind != "llama3":
            raise ValueError(f"rope_scaling type {kind!r} is not modelled")
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv
        # Long wavelengths (beyond context / low) are slowed by `factor`,
        # short ones (below context / high) kept; between, a linear blend in
        # context / wavelength.
        slowed = torch.where(wavelength > context / low, inv / factor, inv)
        blend = (context / wavelength - low) / (high - low)
        mixed = (1 - blend) * slowed / factor + blend * slowed
        between = (wavelength >= context / high) & (wavelength <= context / low)
        return torch.where(between, mixed, slowed)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w.get(name + ".bias")
        return F.linear(x, self.w[name + ".weight"], bias)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = F.embedding(idx, self.w["model.embed_tokens.weight"])
        positions = torch.arange(t, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()  # [T, head_dim]
        group = self.heads // self.kv_heads
        mask = torch.full((t, t), float("-inf")).triu_(1)
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            h = self._rms_norm(x, self.w[p + "input_layernorm.weight"])
            q = self._linear(h, p + "self_attn.q_proj").view(
                b, t, self.heads, self.head_dim).transpose(1, 2)
            k = self._linear(h, p + "self_attn.k_proj").view(
                b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = self._linear(h, p + "self_attn.v_proj").view(
                b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            # Query head i reads key/value head i // group.
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + mask
            attention = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            y = (attention @ v).transpose(1, 2).reshape(b, t, -1)
            x = x + self._linear(y, p + "self_attn.o_proj")
            h = self._rms_norm(x, self.w[p + "post_attention_layernorm.weight"])
            gated = F.silu(self._linear(h, p + "mlp.gate_proj"))
            x = x + self._linear(gated * self._linear(h, p + "mlp.up_proj"),
                                 p + "mlp.down_proj")
        x = self._rms_norm(x, self.w["model.norm.weight"])
        head = (self.w["model.embed_tokens.weight"] if self.tied else
                self.w["lm_head.weight"])
        return F.linear(x, head)


def load(hf_dir: str) -> Tuple[LlamaReference, dict]:
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    weights = read_weights(hf_dir)
    model = LlamaReference(config, weights)
    embed = weights["model.embed_tokens.weight"]
    if embed.shape != (model.vocab, model.hidden):
        raise ValueError(f"model.embed_tokens.weight is {tuple(embed.shape)}, "
                         f"config.json says ({model.vocab}, {model.hidden})")
    return model, config


def loss_of(model: LlamaReference, tokens: torch.Tensor) -> torch.Tensor:
    logits = model.forward(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           tokens[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------
# Data.


def read_tokens_txt(path: str) -> torch.Tensor:
    with open(path) as f:
        rows = [[int(v) for v in line.split()] for line in f if line.strip()]
    return torch.tensor(rows, dtype=torch.long)


def read_token_file(path: str) -> np.ndarray:
    """llm.c's token files: 256 int32 header (magic, version, count), then
    uint16 tokens (magic 20240520) or uint32 ones (magic 20240801)."""
    header = np.fromfile(path, dtype="<i4", count=256)
    if header.size != 256:
        raise ValueError(f"{path}: truncated header")
    magic, count = int(header[0]), int(header[2])
    dtype = {20240520: "<u2", 20240801: "<u4"}.get(magic)
    if dtype is None:
        raise ValueError(f"{path}: magic {magic} is not a token file's")
    tokens = np.fromfile(path, dtype=dtype, offset=256 * 4)
    if tokens.size != count:
        raise ValueError(f"{path}: {tokens.size} tokens, the header says "
                         f"{count}")
    return tokens.astype(np.int64)


def train(model: LlamaReference, tokens: np.ndarray, args) -> List[dict]:
    params = {name: t.requires_grad_(True) for name, t in model.w.items()}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)
    t = args.seq_len
    steps = []
    for step in range(args.steps):
        rows = []
        for i in range(args.batch_size):
            start = (step * args.batch_size + i) * t
            rows.append(tokens[start:start + t + 1])
        batch = torch.from_numpy(np.stack(rows))
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, batch)
        loss.backward()
        grads = [p.grad for p in params.values() if p.grad is not None]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        if args.grad_clip > 0:
            coef = args.grad_clip / (norm + 1e-6)
            if coef < 1:
                for g in grads:
                    g.mul_(coef)
        optimizer.step()
        steps.append({"step": step + 1, "loss": loss.item(),
                      "grad_norm": norm})
    return steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--loss", action="store_true")
    mode.add_argument("--train", action="store_true")
    p.add_argument("--hf", required=True)
    p.add_argument("--tokens")
    p.add_argument("--logits-out")
    p.add_argument("--data")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=1.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    try:
        model, config = load(args.hf)
        out = {"torch_version": torch.__version__,
               "model_type": config["model_type"]}
        if args.loss:
            tokens = read_tokens_txt(args.tokens)
            with torch.no_grad():
                logits = model.forward(tokens[:, :-1])
                out["loss"] = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    tokens[:, 1:].reshape(-1)).item()
            if args.logits_out:
                logits.numpy().astype("<f4").tofile(args.logits_out)
        else:
            out["steps"] = train(model, read_token_file(args.data), args)
    except (ValueError, KeyError) as e:
        print(f"llama_reference: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
