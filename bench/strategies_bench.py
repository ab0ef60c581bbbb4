"""Strategy benchmark on this CPU: single vs DDP vs FSDP, and PyTorch's DDP.

The same GPT-2 config and global batch (strong scaling) under
  single  shardtrain-train, one process, batch W*B, all cores
  ddp     shardtrain-train --nproc W --strategy ddp,  batch B per rank
  fsdp    shardtrain-train --nproc W --strategy fsdp, batch B per rank
  torch   bench/reference/train_reference.py under PyTorch's own
          DistributedDataParallel (gloo), W processes, batch B per rank
one after the other, then prints a Markdown table: tokens/s, step time
(median after warm-up), peak tensor memory and model-state bytes
(parameters + gradients + optimizer state) per rank, and the share of the
step spent blocked on communication.

  /usr/bin/python3 bench/strategies_bench.py --data ~/.cache/shardtrain/data/brown
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
WARMUP = 3


def blas_core_env() -> dict:
    """OPENBLAS_CORETYPE as shardtrain's binaries pick it (cpu_threads.h), so
    the PyTorch side runs the same BLAS kernels: OpenBLAS falls back to
    generic ones on virtual CPUs with a generic model name."""
    if "OPENBLAS_CORETYPE" in os.environ:
        return {}
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return {"OPENBLAS_CORETYPE": "SkylakeX"}
    if {"avx2", "fma"} <= flags:
        return {"OPENBLAS_CORETYPE": "Haswell"}
    return {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours(strategy: str, world: int, batch: int, common: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [f"{ROOT}/build/bin/shardtrain-train", *common, "--strategy", strategy,
               "--batch-size", str(batch), "--log-every", "1000000", "--out", out]
        if world > 1:
            cmd += ["--nproc", str(world)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(f"{out}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
    by_rank: dict[int, list] = {}
    for r in rows:
        by_rank.setdefault(r["rank"], []).append(r)
    rank0 = sorted(by_rank[0], key=lambda r: r["step"])[WARMUP:]
    step = statistics.median(r["step_seconds"] for r in rank0)
    return {
        "name": f"shardtrain {strategy}", "world": world, "batch": batch,
        "step_s": step, "tokens_per_s": rank0[0]["tokens"] / step,
        "peak_bytes": max(max(r["memory_peak_bytes"] for r in v) for v in by_rank.values()),
        "state_bytes": max(max(r["model_state_bytes"] for r in v) for v in by_rank.values()),
        "comm_share": statistics.median(r["comm_seconds"] / r["step_seconds"] for r in rank0),
    }


def torch_ddp(world: int, batch: int, common: list[str], threads: int) -> dict:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OPENBLAS_NUM_THREADS": str(threads), **blas_core_env()}
        procs.append(subprocess.Popen(
            ["/usr/bin/python3", f"{ROOT}/bench/reference/train_reference.py", *common,
             "--batch-size", str(batch), "--threads", str(threads)],
            stdout=subprocess.PIPE, text=True, env=env))
    outputs = [json.loads(p.communicate()[0]) for p in procs]
    if any(p.returncode != 0 for p in procs):
        sys.exit("PyTorch DDP reference failed")
    steps = outputs[0]["steps"][WARMUP:]
    step = statistics.median(s["step_seconds"] for s in steps)
    return {"name": "PyTorch DDP (gloo)", "world": world, "batch": batch, "step_s": step,
            "tokens_per_s": batch * world * outputs[0]["seq_len"] / step,
            "peak_bytes": None, "state_bytes": None, "comm_share": None}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    cores = os.cpu_count()
    common = ["--model", args.model, "--data", args.data, "--seq-len", str(args.seq_len),
              "--max-steps", str(args.steps)]
    W, B = args.world, args.batch_size
    rows = [
        ours("single", 1, W * B, common + ["--threads", str(cores)]),
        ours("ddp", W, B, common),
        ours("fsdp", W, B, common),
        torch_ddp(W, B, common, max(1, cores // W)),
    ]
    ddp = rows[1]
    print(f"{args.model}, seq {args.seq_len}, global batch {W * B}, world {W}, "
          f"{cores} cores, {args.steps} steps (median after {WARMUP})\n")
    print("| run | world × batch | tokens/s | vs our DDP | step ms | peak tensor MiB/rank "
          "| peak vs DDP | model state MiB/rank | vs DDP | comm share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for r in rows:
        fmt = lambda v, d=0: "n/a" if v is None else f"{v / mib:,.{d}f}"  # noqa: E731
        state_ratio = ("n/a" if r["state_bytes"] is None
                       else f"{r['state_bytes'] / ddp['state_bytes']:.2f}×")
        peak_ratio = ("n/a" if r["peak_bytes"] is None
                      else f"{r['peak_bytes'] / ddp['peak_bytes']:.2f}×")
        comm = "n/a" if r["comm_share"] is None else f"{r['comm_share']:.0%}"
        print(f"| {r['name']} | {r['world']} × {r['batch']} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] / ddp['tokens_per_s']:.2f}× | {r['step_s'] * 1e3:,.0f} | "
              f"{fmt(r['peak_bytes'], 1)} | {peak_ratio} | {fmt(r['state_bytes'], 1)} | "
              f"{state_ratio} | {comm} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
