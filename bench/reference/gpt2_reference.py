"""PyTorch reference for shardtrain's GPT-2 model and llm.c checkpoint I/O.

A nanoGPT-style GPT-2 that matches worker/engine/model/gpt2.{h,cc} operation
for operation: the same module and parameter names (wte, wpe, h.<i>.ln_1,
h.<i>.attn.c_attn, h.<i>.attn.c_proj, h.<i>.ln_2, h.<i>.mlp.c_fc,
h.<i>.mlp.c_proj, ln_f), the same seeded initialisation (so a given seed gives
the same bits on both sides), the LM head tied to wte and narrowed to the real
vocabulary, the same attention (fused scaled-dot-product attention on PyTorch
2.x, an additive-mask softmax before), tanh GELU and no dropout.

Also reads and writes llm.c's GPT-2 model file (magic 20240326, version 3,
fp32), the format shardtrain imports and exports.

Importable (the training-loop benchmark builds on it) and runnable: with Debian's
python3-torch, run it with /usr/bin/python3.

  /usr/bin/python3 bench/reference/gpt2_reference.py --check-parity \\
      --model-bin model.bin --tokens tokens.txt [--logits-out logits.f32] \\
      [--grads-out grads.bin]
      Loads model.bin, runs the sequences of tokens.txt (one per line, T + 1
      token ids: inputs are the first T, targets the last T) and prints the
      loss and logits statistics as JSON; optionally writes the logits (raw
      fp32, [B, T, vocab_size]) and the gradients (llm.c layout).

  /usr/bin/python3 bench/reference/gpt2_reference.py --init \\
      --model gpt2-tiny --seed 1337 --out model.bin
      Writes a freshly initialised model in llm.c format.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------
# Config: mirrors core/model/model_config.{h,cc}.

GPT2_VOCAB_SIZE = 50257
VOCAB_PAD_MULTIPLE = 64

# name -> (block_size, n_layer, n_head, n_embd); smallest first.
PRESETS: Dict[str, tuple] = {
    "gpt2-tiny": (256, 2, 4, 128),
    "gpt2-mini": (512, 4, 4, 256),
    "gpt2": (1024, 12, 12, 768),
    "gpt2-medium": (1024, 24, 16, 1024),
    "gpt2-large": (1024, 36, 20, 1280),
    "gpt2-xl": (1024, 48, 25, 1600),
}


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    name: str = "custom"
    block_size: int = 1024
    vocab_size: int = GPT2_VOCAB_SIZE
    padded_vocab_size: int = _round_up(GPT2_VOCAB_SIZE, VOCAB_PAD_MULTIPLE)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    @staticmethod
    def from_preset(name: str) -> "GPTConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; allowed: "
                             f"{', '.join(PRESETS)}")
        block_size, n_layer, n_head, n_embd = PRESETS[name]
        return GPTConfig(name, block_size, GPT2_VOCAB_SIZE,
                         _round_up(GPT2_VOCAB_SIZE, VOCAB_PAD_MULTIPLE),
                         n_layer, n_head, n_embd)

    @staticmethod
    def parse(spec: str) -> "GPTConfig":
        """A preset name or custom:n_layer=..,n_head=..,n_embd=..[,...]."""
        spec = spec.strip()
        if not spec.startswith("custom:"):
            return GPTConfig.from_preset(spec)
        fields = {"block_size": 1024, "vocab_size": GPT2_VOCAB_SIZE}
        allowed = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size",
                   "padded_vocab_size")
        for item in spec[len("custom:"):].split(","):
            key, _, value = (s.strip() for s in item.partition("="))
            if key not in allowed:
                raise ValueError(f"model spec: unknown field {key!r}; "
                                 f"allowed fields: {', '.join(allowed)}")
            fields[key] = int(value)
        fields.setdefault("padded_vocab_size",
                          _round_up(fields["vocab_size"], VOCAB_PAD_MULTIPLE))
        config = GPTConfig(name="custom", **fields)
        config.validate()
        return config

    def validate(self) -> None:
        for field in ("block_size", "vocab_size", "padded_vocab_size",
                      "n_layer", "n_head", "n_embd"):
            if getattr(self, field) < 1:
                raise ValueError(f"model field {field} must be positive")
        if self.n_embd % self.n_head:
            raise ValueError("model field n_embd must be a multiple of n_head")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError("model field padded_vocab_size must be at least "
                             "vocab_size")

    def same_shape(self, other: "GPTConfig") -> bool:
        return (dataclasses.replace(self, name="") ==
                dataclasses.replace(other, name=""))

    def num_parameters(self) -> int:
        c = self.n_embd
        return (self.padded_vocab_size * c + self.block_size * c +
                self.n_layer * (12 * c * c + 13 * c) + 2 * c)

    def flops_per_token(self, seq_len: int) -> float:
        """nanoGPT's estimate_mfu(): 6*N + 12*L*H*Q*T, N without wpe."""
        n = self.num_parameters() - self.block_size * self.n_embd
        head_size = self.n_embd // self.n_head
        return 6.0 * n + 12.0 * self.n_layer * self.n_head * head_size * seq_len


# ----------------------------------------------------------------------------
# Model: mirrors worker/engine/model/gpt2.{h,cc}.

INIT_STD = 0.02
LAYER_NORM_EPS = 1e-5
HAS_SDPA = hasattr(F, "scaled_dot_product_attention")  # PyTorch >= 2.0


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        # Additive causal mask for PyTorch 1.x, cached per device and dtype.
        # A plain attribute, not a buffer: it is not state (see gpt2.h).
        self._block_size = config.block_size
        self._mask: Optional[torch.Tensor] = None

    def _causal_mask(self, t: int, like: torch.Tensor) -> torch.Tensor:
        if (self._mask is None or self._mask.device != like.device or
                self._mask.dtype != like.dtype):
            n = self._block_size
            self._mask = torch.full((n, n), float("-inf"), dtype=like.dtype,
                                    device=like.device).triu_(1)
        return self._mask[:t, :t]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hs = c // self.n_head
        qkv = (self.c_attn(x.reshape(b * t, c))
               .view(b, t, 3, self.n_head, hs)
               .permute(2, 0, 3, 1, 4)
               .contiguous())  # [3, B, nh, T, hs]
        if HAS_SDPA:
            y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2],
                                               attn_mask=None, dropout_p=0.0,
                                               is_causal=True)
        else:
            q = qkv[0].view(b * self.n_head, t, hs)
            k = qkv[1].view(b * self.n_head, t, hs)
            v = qkv[2].view(b * self.n_head, t, hs)
            scores = torch.baddbmm(self._causal_mask(t, x), q,
                                   k.transpose(1, 2), beta=1.0,
                                   alpha=1.0 / math.sqrt(hs))
            y = torch.bmm(torch.softmax(scores, -1), v).view(
                b, self.n_head, t, hs)
        y = y.permute(0, 2, 1, 3).reshape(b * t, c)
        return self.c_proj(y).view(b, t, c)


class MLP(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x.reshape(-1, x.shape[-1])), approximate="tanh")
        return self.c_proj(h).view(x.shape)


class Block(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPS)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPS)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2; forward(idx [B,T] int64) -> logits [B, T, vocab_size]."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        config.validate()
        self.config = config
        # Registration order fixes named_parameters() order, which the seeded
        # initialisation walks: keep it identical to the C++ model.
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=LAYER_NORM_EPS)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Gpt2Impl::InitWeights: one pass over named_parameters() drawing
        from a CPU generator seeded with `seed`; biases 0, LayerNorm weights
        1, c_proj weights N(0, 0.02/sqrt(2L)), other weights N(0, 0.02); then
        the padded rows of wte are zeroed."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        proj_std = INIT_STD / math.sqrt(2.0 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif name.startswith("ln_") or ".ln_" in name:
                p.fill_(1.0)
            else:
                std = proj_std if name.endswith("c_proj.weight") else INIT_STD
                if p.device.type == "cpu" and p.is_contiguous():
                    p.normal_(0.0, std, generator=gen)
                else:
                    p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(
                        0.0, std, generator=gen))
        self.wte.weight[self.config.vocab_size:].zero_()

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        assert 1 <= t <= self.config.block_size, f"sequence length {t}"
        return self.wte(idx) + self.wpe.weight[:t]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        vocab_rows = self.wte.weight[:self.config.vocab_size]
        return F.linear(self.ln_f(x).reshape(b * t, c), vocab_rows).view(
            b, t, self.config.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


def cross_entropy_loss(logits: torch.Tensor,
                       targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all B*T positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           targets.reshape(-1))


# ----------------------------------------------------------------------------
# llm.c model files: mirrors worker/engine/model/llmc_checkpoint.{h,cc}.

LLMC_MAGIC = 20240326
LLMC_VERSION_FP32 = 3
LLMC_VERSION_BF16 = 5
LLMC_HEADER_INTS = 256


def llmc_tensors(model: GPT) -> List[torch.Tensor]:
    """The model's parameters in llm.c's file order."""
    per_layer = lambda get: [get(block) for block in model.h]  # noqa: E731
    return ([model.wte.weight, model.wpe.weight] +
            per_layer(lambda b: b.ln_1.weight) +
            per_layer(lambda b: b.ln_1.bias) +
            per_layer(lambda b: b.attn.c_attn.weight) +
            per_layer(lambda b: b.attn.c_attn.bias) +
            per_layer(lambda b: b.attn.c_proj.weight) +
            per_layer(lambda b: b.attn.c_proj.bias) +
            per_layer(lambda b: b.ln_2.weight) +
            per_layer(lambda b: b.ln_2.bias) +
            per_layer(lambda b: b.mlp.c_fc.weight) +
            per_layer(lambda b: b.mlp.c_fc.bias) +
            per_layer(lambda b: b.mlp.c_proj.weight) +
            per_layer(lambda b: b.mlp.c_proj.bias) +
            [model.ln_f.weight, model.ln_f.bias])


def read_llmc_config(path: str) -> GPTConfig:
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    if header.size != LLMC_HEADER_INTS:
        raise ValueError(f"llm.c checkpoint {path}: truncated header")
    if header[0] != LLMC_MAGIC:
        raise ValueError(f"llm.c checkpoint {path}: bad magic {header[0]}")
    if header[1] != LLMC_VERSION_FP32:
        raise ValueError(f"llm.c checkpoint {path}: version {header[1]} is "
                         f"not supported; only {LLMC_VERSION_FP32} (fp32)")
    config = GPTConfig(name="custom", block_size=int(header[2]),
                       vocab_size=int(header[3]), n_layer=int(header[4]),
                       n_head=int(header[5]), n_embd=int(header[6]),
                       padded_vocab_size=int(header[7]))
    for name in PRESETS:
        if GPTConfig.from_preset(name).same_shape(config):
            config = dataclasses.replace(config, name=name)
    expected = 4 * (LLMC_HEADER_INTS + config.num_parameters())
    size = os.path.getsize(path)
    if size != expected:
        raise ValueError(f"llm.c checkpoint {path}: {size} bytes, expected "
                         f"{expected}")
    return config


@torch.no_grad()
def load_llmc(path: str, model: Optional[GPT] = None) -> GPT:
    """Reads an llm.c fp32 GPT-2 model file into `model` (built to the file's
    config when None) and returns it."""
    config = read_llmc_config(path)
    if model is None:
        model = GPT(config)
    elif not model.config.same_shape(config):
        raise ValueError(f"llm.c checkpoint {path} does not match the model")
    data = torch.from_numpy(
        np.fromfile(path, dtype="<f4", offset=4 * LLMC_HEADER_INTS))
    offset = 0
    for p in llmc_tensors(model):
        p.copy_(data[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return model


def save_llmc(model: GPT, path: str,
              tensors: Optional[List[torch.Tensor]] = None) -> None:
    """Writes `model` (or `tensors`, shaped like its parameters in file order,
    e.g. gradients) in llm.c's fp32 layout, via a temporary file."""
    c = model.config
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:8] = [LLMC_MAGIC, LLMC_VERSION_FP32, c.block_size, c.vocab_size,
                  c.n_layer, c.n_head, c.n_embd, c.padded_vocab_size]
    tensors = llmc_tensors(model) if tensors is None else tensors
    temp = f"{path}.tmp.{os.getpid()}"
    with open(temp, "wb") as f:
        f.write(header.tobytes())
        for t in tensors:
            f.write(t.detach().to("cpu", torch.float32).contiguous().numpy()
                    .tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


# ----------------------------------------------------------------------------
# Command line: the parity checks run by tests/worker/engine/model.


def read_tokens(path: str) -> torch.Tensor:
    """One sequence per line, whitespace-separated ids -> [B, T+1] int64."""
    with open(path) as f:
        rows = [[int(tok) for tok in line.split()] for line in f
                if line.strip()]
    if not rows or len({len(r) for r in rows}) != 1 or len(rows[0]) < 2:
        raise ValueError(f"{path}: need lines of equal length >= 2")
    return torch.tensor(rows, dtype=torch.long)


def check_parity(args: argparse.Namespace) -> dict:
    model = load_llmc(args.model_bin)
    tokens = read_tokens(args.tokens)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs)
    loss = cross_entropy_loss(logits, targets)
    loss.backward()
    if args.logits_out:
        logits.detach().numpy().astype("<f4").tofile(args.logits_out)
    if args.grads_out:
        save_llmc(model, args.grads_out,
                  tensors=[p.grad for p in llmc_tensors(model)])
    d = logits.detach().double()
    return {
        "torch_version": torch.__version__,
        "attention": "sdpa" if HAS_SDPA else "masked_softmax",
        "model": model.config.name,
        "batch": int(inputs.shape[0]),
        "seq_len": int(inputs.shape[1]),
        "loss": loss.item(),
        "logits": {
            "shape": list(logits.shape),
            "mean": d.mean().item(),
            "std": d.std().item(),
            "min": d.min().item(),
            "max": d.max().item(),
        },
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check-parity", action="store_true",
                      help="loss and logits of --model-bin on --tokens, JSON")
    mode.add_argument("--init", action="store_true",
                      help="write a freshly initialised --model to --out")
    parser.add_argument("--model-bin", help="llm.c fp32 model file")
    parser.add_argument("--tokens", help="one sequence of T+1 ids per line")
    parser.add_argument("--logits-out", help="write logits as raw fp32")
    parser.add_argument("--grads-out", help="write gradients, llm.c layout")
    parser.add_argument("--model", default="gpt2-tiny", help="model spec")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="output llm.c model file (--init)")
    args = parser.parse_args(argv)

    if args.check_parity:
        if not args.model_bin or not args.tokens:
            parser.error("--check-parity needs --model-bin and --tokens")
        result = check_parity(args)
    else:
        if not args.out:
            parser.error("--init needs --out")
        model = GPT(GPTConfig.parse(args.model), seed=args.seed)
        save_llmc(model, args.out)
        result = {"model": model.config.name, "seed": args.seed,
                  "num_parameters": model.config.num_parameters()}
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
