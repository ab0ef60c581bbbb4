"""shardtrain-train on one device, LibTorch 1.13 (Debian 12) vs 2.6 (Debian 13).

The same sources built twice: build/ against Debian 12's LibTorch 1.13 and
build-debian13/ against Debian 13's LibTorch 2.6 (scripts/debian13 build),
run one after the other on the same data, model, batch and seed, with the
same thread policy (shardtrain-train's own). Prints a Markdown table:
tokens/s and step time (median after 3 warm-up steps), peak tensor memory
and the final loss of each.

  python3 bench/torch_versions_bench.py --data data/brown

(from the repository root on the Debian 12 host; the 2.6 run goes through
scripts/debian13 run, so the data directory must lie inside the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
WARMUP = 3


def run(label: str, prefix: list[str], binary: str, args, model: str, batch: int,
        seq: int) -> dict:
    out = tempfile.mkdtemp(dir=os.path.join(ROOT, "runs"))
    try:
        cmd = [*prefix, binary, "--model", model, "--data", args.data, "--batch-size",
               str(batch), "--seq-len", str(seq), "--max-steps", str(args.steps),
               "--seed", "1337", "--eval-every", "0", "--log-every", "1000000",
               "--out", out]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    steps = sorted(rows, key=lambda r: r["step"])
    step = statistics.median(r["step_seconds"] for r in steps[WARMUP:])
    return {"label": label, "step_s": step, "tokens_per_s": batch * seq / step,
            "peak": max(r["memory_peak_bytes"] for r in steps),
            "loss": steps[-1]["loss"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="inside the repository")
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    os.makedirs(os.path.join(ROOT, "runs"), exist_ok=True)
    print("| model | batch × seq | LibTorch | tokens/s | step ms | peak tensor MiB "
          "| final loss | 2.6 vs 1.13 |")
    print("|---|---|---|---|---|---|---|---|")
    for model, batch, seq in [("gpt2-tiny", 8, 128), ("gpt2-mini", 8, 256)]:
        old = run("1.13 (Debian 12)", [], os.path.join(ROOT, "build/bin/shardtrain-train"),
                  args, model, batch, seq)
        new = run("2.6 (Debian 13)", [os.path.join(ROOT, "scripts/debian13"), "run"],
                  os.path.join(ROOT, "build-debian13/bin/shardtrain-train"),
                  args, model, batch, seq)
        for r in (old, new):
            ratio = f"{new['tokens_per_s'] / old['tokens_per_s']:.2f}×" if r is new else ""
            print(f"| {model} | {batch} × {seq} | {r['label']} | {r['tokens_per_s']:,.0f} | "
                  f"{r['step_s'] * 1e3:,.0f} | {r['peak'] / (1 << 20):,.0f} | "
                  f"{r['loss']:.4f} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
