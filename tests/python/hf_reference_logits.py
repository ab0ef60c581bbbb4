"""Runs the PyTorch reference GPT-2 (bench/reference/gpt2_reference.py) on a
Hugging Face GPT-2 directory that shardtrain exported, reading it without
shardtrain's code or the safetensors package (bench/reference/
safetensors_reader.py is written from the format's specification),
the names and the Conv1D transposition from transformers' GPT-2.

  /usr/bin/python3 tests/python/hf_reference_logits.py --hf DIR \\
      --tokens tokens.txt --logits-out logits.f32

tokens.txt: one sequence per line (T + 1 ids; the first T are the input).
Writes the logits as raw little-endian float32 [B, T, vocab_size] and prints
what it read as JSON. Exits 1 with a message when the file breaks the format.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench", "reference"))
import gpt2_reference as ref  # noqa: E402
from safetensors_reader import read_safetensors  # noqa: E402

CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
          ".mlp.c_proj.weight")


def load_reference(hf_dir: str) -> Tuple[ref.GPT, dict]:
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    assert hf["model_type"] == "gpt2" and "GPT2LMHeadModel" in hf["architectures"]
    assert hf["activation_function"] == "gelu_new" and hf["tie_word_embeddings"]
    tensors, metadata = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
    vocab = hf["vocab_size"]
    padded = int(metadata.get("shardtrain.padded_vocab_size",
                              ref._round_up(vocab, ref.VOCAB_PAD_MULTIPLE)))
    config = ref.GPTConfig("custom", hf["n_positions"], vocab, padded,
                           hf["n_layer"], hf["n_head"], hf["n_embd"])
    model = ref.GPT(config)
    state = model.state_dict()
    seen = set()
    for name, array in tensors.items():
        ours = name[len("transformer."):] if name.startswith("transformer.") else name
        value = torch.from_numpy(array.copy())
        if ours.endswith(CONV1D):
            value = value.t().contiguous()  # Conv1D [in, out] -> Linear [out, in]
        if ours == "wte.weight":
            rows = torch.zeros(padded, value.shape[1])
            rows[:vocab] = value
            value = rows
        if state[ours].shape != value.shape:
            raise ValueError(f"{name}: {tuple(value.shape)}, the reference "
                             f"holds {tuple(state[ours].shape)}")
        state[ours] = value
        seen.add(ours)
    missing = set(state) - seen
    if missing:
        raise ValueError(f"model.safetensors lacks {sorted(missing)}")
    model.load_state_dict(state)
    return model, {"tensors": len(tensors), "metadata": metadata,
                   "n_layer": config.n_layer, "vocab_size": vocab}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--logits-out", required=True)
    args = p.parse_args()
    try:
        model, info = load_reference(args.hf)
    except (ValueError, KeyError) as e:
        print(f"hf_reference_logits: {e}", file=sys.stderr)
        return 1
    tokens = ref.read_tokens(args.tokens)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    logits.numpy().astype("<f4").tofile(args.logits_out)
    info["torch_version"] = torch.__version__
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
