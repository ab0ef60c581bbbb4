"""Single-device benchmark: shardtrain-train vs the PyTorch Python reference.

Runs the same GPT-2 config, batch and data through `build/bin/shardtrain-train`
and `bench/reference/train_reference.py` (Debian's python3-torch, which shares
our LibTorch's kernels), one after the other, and prints a Markdown table:
tokens/s, step time (median of the steps after warm-up), peak memory and MFU
against the measured fp32 GEMM rate.

  /usr/bin/python3 bench/single_device_bench.py --data ~/.cache/shardtrain/data/brown
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [  # model, batch, seq_len
    ("gpt2-tiny", 8, 128),
    ("gpt2-mini", 8, 256),
]
WARMUP = 3


def run(cmd: list[str], env: dict | None = None) -> tuple[str, int]:
    """Runs cmd; returns (stdout, max RSS in bytes of that process)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return out, usage.ru_maxrss * 1024


def median_step(seconds: list[float]) -> float:
    return statistics.median(seconds[WARMUP:])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()

    rows = []
    for model, batch, seq_len in CONFIGS:
        common = ["--model", model, "--data", args.data, "--batch-size", str(batch),
                  "--seq-len", str(seq_len), "--max-steps", str(args.steps),
                  "--threads", str(args.threads)]
        with tempfile.TemporaryDirectory() as out:
            _, ours_rss = run([f"{ROOT}/build/bin/shardtrain-train", *common,
                               "--log-every", "1000000", "--out", out])
            with open(f"{out}/metrics.jsonl") as f:
                ours = [json.loads(line) for line in f]
        ref_out, ref_rss = run(["/usr/bin/python3",
                                f"{ROOT}/bench/reference/train_reference.py", *common],
                               env={"OPENBLAS_NUM_THREADS": str(args.threads)})
        ref = json.loads(ref_out)
        tokens = batch * seq_len
        gemm = ref["gemm_flops"]
        fpt = ref["flops_per_token"]
        ours_t = median_step([m["step_seconds"] for m in ours])
        ref_t = median_step([s["step_seconds"] for s in ref["steps"]])
        rows.append({
            "model": model, "batch": batch, "seq_len": seq_len,
            "ours_tok_s": tokens / ours_t, "ref_tok_s": tokens / ref_t,
            "ours_ms": ours_t * 1e3, "ref_ms": ref_t * 1e3,
            "ours_peak_tensor": max(m["memory_peak_bytes"] for m in ours),
            "ours_rss": ours_rss, "ref_rss": ref_rss,
            "ours_mfu": fpt * tokens / ours_t / gemm,
            "ref_mfu": fpt * tokens / ref_t / gemm,
            "gemm": gemm,
        })

    print(f"threads {args.threads}, {args.steps} steps, median of steps "
          f"{WARMUP + 1}..{args.steps}; MFU against the measured fp32 GEMM rate\n")
    print("| model | batch × seq | tokens/s ours | tokens/s PyTorch | ratio | "
          "step ms ours | step ms PyTorch | peak tensor bytes ours | max RSS ours | "
          "max RSS PyTorch | MFU ours | MFU PyTorch | GEMM GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for r in rows:
        print(f"| {r['model']} | {r['batch']} × {r['seq_len']} | {r['ours_tok_s']:,.0f} | "
              f"{r['ref_tok_s']:,.0f} | {r['ours_tok_s'] / r['ref_tok_s']:.2f}× | "
              f"{r['ours_ms']:.0f} | {r['ref_ms']:.0f} | "
              f"{r['ours_peak_tensor'] / mib:.0f} MiB | {r['ours_rss'] / mib:.0f} MiB | "
              f"{r['ref_rss'] / mib:.0f} MiB | {r['ours_mfu']:.1%} | {r['ref_mfu']:.1%} | "
              f"{r['gemm'] / 1e9:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
