"""Our DDP and FSDP beside PyTorch's own, on CPU/Gloo, world size 2.

Run inside the Debian 13 root, so both sides use the same LibTorch 2.6:

  scripts/debian13 build
  scripts/debian13 run python3 bench/torch_peers_bench.py --data DIR

For each model, the same GPT-2 (bench/reference/gpt2_reference.py is ours,
initialised identically from the seed), the same windows in file order
(--shuffle false), batch, AdamW, clipping and lr schedule, world size 2:

  shardtrain ddp                       vs  PyTorch DistributedDataParallel
  shardtrain fsdp                      vs  PyTorch FSDP1 (FULL_SHARD, a unit per block)
  shardtrain fsdp, no reshard in fwd   vs  PyTorch FSDP2 fully_shard(reshard_after_forward=False)

FSDP2 with resharding after forward cannot run backward on CPU in 2.6 (see
train_reference.py), hence the pairing of the third row. Every rank is
started directly by this script with torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), one OpenBLAS thread per rank on 2 cores, the
same glibc allocator settings on both sides (shardtrain-train sets them
itself, GLIBC_TUNABLES gives PyTorch the same), and under the same heap
meter (bench/tools/heap_meter.c, LD_PRELOAD): "peak heap" is the most live
malloc'ed bytes a rank held, counted identically for both programs.

Prints one Markdown table: tokens/s (median step after 3 warm-up steps),
peak heap per rank (the larger rank), and the largest relative difference of
the per-step loss from our DDP's. A Python process holds heap before it
trains (the interpreter, `import torch`); that baseline, measured once under
the same meter, is printed with the table and subtracted in the last
memory column, so the training's own memory is compared too.
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
MIB = 1 << 20
SAME_ALLOCATOR = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_heap_meter(workdir: str) -> str:
    lib = os.path.join(workdir, "heap_meter.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib,
                    os.path.join(ROOT, "bench/tools/heap_meter.c")], check=True)
    return lib


def launch(cmds: list[list[str]], extra_env: dict, meter: str, workdir: str) -> tuple:
    """Starts one process per rank; returns their stdouts and peak heaps."""
    peaks_file = tempfile.mkstemp(prefix="peaks-", suffix=".txt", dir=workdir)[1]
    port = str(free_port())
    procs = []
    for rank, cmd in enumerate(cmds):
        env = {**os.environ, **extra_env, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(len(cmds)), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "USE_LIBUV": "0", "OPENBLAS_NUM_THREADS": "1",
               "LD_PRELOAD": meter, "HEAP_METER_OUT": peaks_file}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    outputs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            sys.exit(f"{' '.join(p.args)} failed ({p.returncode}):\n{err[-3000:]}")
    with open(peaks_file) as f:
        peaks = [int(line.split()[1]) for line in f]
    return [out for out, _ in outputs], max(peaks)


def ours(label: str, strategy: str, flags: list[str], args, meter: str, workdir: str) -> dict:
    out = tempfile.mkdtemp(dir=workdir)
    cmd = [f"{ROOT}/{args.build}/bin/shardtrain-train", "--model", args.model,
           "--data", args.data, "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--max-steps", str(args.steps),
           "--lr", "6e-4", "--warmup-steps", "0", "--weight-decay", "0.1",
           "--grad-clip", "1.0", "--seed", "1337", "--shuffle", "false",
           "--threads", "1", "--eval-every", "0", "--log-every", "1000000",
           "--strategy", strategy, "--out", out, *flags]
    _, peak = launch([cmd] * args.world, {}, meter, workdir)
    with open(f"{out}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rank0 = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])
    step = statistics.median(r["step_seconds"] for r in rank0[WARMUP:])
    return {"name": label, "step_s": step,
            "tokens_per_s": args.world * args.batch_size * args.seq_len / step,
            "peak": peak, "losses": [r["loss"] for r in rank0]}


def theirs(label: str, flags: list[str], args, meter: str, workdir: str) -> dict:
    cmd = ["python3", f"{ROOT}/bench/reference/train_reference.py", "--model", args.model,
           "--data", args.data, "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--max-steps", str(args.steps),
           "--lr", "6e-4", "--warmup-steps", "0", "--weight-decay", "0.1",
           "--grad-clip", "1.0", "--seed", "1337", "--shuffle", "false",
           "--threads", "1", *flags]
    outs, peak = launch([cmd] * args.world, {"GLIBC_TUNABLES": SAME_ALLOCATOR}, meter, workdir)
    result = json.loads(outs[0])
    steps = result["steps"]
    step = statistics.median(s["step_seconds"] for s in steps[WARMUP:])
    return {"name": label, "step_s": step,
            "tokens_per_s": args.world * args.batch_size * args.seq_len / step,
            "peak": peak, "losses": [s["loss"] for s in steps], "torch": result["torch"]}


def import_baseline(meter: str, workdir: str) -> int:
    """Peak heap of a Python process that only imports what the reference does."""
    peaks_file = os.path.join(workdir, "baseline.txt")
    env = {**os.environ, "LD_PRELOAD": meter, "HEAP_METER_OUT": peaks_file,
           "GLIBC_TUNABLES": SAME_ALLOCATOR}
    subprocess.run(["python3", "-c", "import numpy, torch, torch.distributed, "
                    "torch.distributed.fsdp"], check=True, env=env)
    with open(peaks_file) as f:
        return max(int(line.split()[1]) for line in f)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--models", default="gpt2-tiny,gpt2-mini")
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--build", default="build-debian13", help="our build directory")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        meter = build_heap_meter(workdir)
        baseline = import_baseline(meter, workdir)
        print(f"world {args.world}, batch {args.batch_size}/rank, seq {args.seq_len}, "
              f"{args.steps} steps (median after {WARMUP}), {os.cpu_count()} cores, "
              f"CPU/Gloo; a Python process that only imports torch peaks at "
              f"{baseline / MIB:,.1f} MiB of heap\n")
        print("| model | ours | tokens/s | peak heap MiB/rank | PyTorch peer | tokens/s "
              "| peak heap MiB/rank | speed ours/theirs | memory ours/theirs "
              "| ours / (theirs − import heap) | max loss rel. diff vs our DDP "
              "(ours, theirs) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for model in args.models.split(","):
            args.model = model
            pairs = [
                (ours("DDP", "ddp", [], args, meter, workdir),
                 theirs("DDP", [], args, meter, workdir)),
                (ours("FSDP", "fsdp", ["--reshard-after-forward", "true"], args, meter, workdir),
                 theirs("FSDP1 FULL_SHARD", ["--fsdp1"], args, meter, workdir)),
                (ours("FSDP, no fwd reshard", "fsdp", ["--reshard-after-forward", "false"],
                      args, meter, workdir),
                 theirs("FSDP2 fully_shard, no fwd reshard",
                        ["--fsdp2", "--reshard-after-forward", "false"], args, meter, workdir)),
            ]
            reference = pairs[0][0]["losses"]

            def rel(losses: list[float]) -> float:
                return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))

            for a, b in pairs:
                print(f"| {model} | {a['name']} | {a['tokens_per_s']:,.0f} | "
                      f"{a['peak'] / MIB:,.1f} | {b['name']} (torch {b['torch']}) | "
                      f"{b['tokens_per_s']:,.0f} | {b['peak'] / MIB:,.1f} | "
                      f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}× | "
                      f"{a['peak'] / b['peak']:.2f}× | "
                      f"{a['peak'] / (b['peak'] - baseline):.2f}× | {rel(a['losses']):.1e}, "
                      f"{rel(b['losses']):.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
