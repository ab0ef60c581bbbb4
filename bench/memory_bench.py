"""What memory buys: peak per rank under DDP, FSDP and HSDP, with and without
activation checkpointing, the step-time cost of recomputation, and the
largest batch each fits under a memory cap, predicted and found by running.

Part 1, for each model and world size: shardtrain-train --nproc W under
each strategy with --activation-checkpointing none and all, a few steps at
the given per-rank batch; the largest memory_peak_bytes of any rank and
step, and the median step time after the first steps.

Part 2, for the same runs' configurations: `shardtrain plan --fit` predicts
the largest per-rank batch whose planned peak is within 98% of --cap; then
real runs find the largest batch that trains (two steps): the peak measured
uncapped at the prediction and at half of it gives an estimate (the peak is
linear in the batch between moments), then runs under --memory-cap settle
it: that batch trains, one more sequence fails out of memory.

  /usr/bin/python3 bench/memory_bench.py --data data/brown

Prints Markdown tables (bench/RESULTS.md keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
TRAIN = f"{ROOT}/build/bin/shardtrain-train"
CLI = f"{ROOT}/build/bin/shardtrain"


def run(model: str, strategy: str, world: int, batch: int, seq: int,
        checkpointing: str, steps: int, data: str, cap: str = "") -> dict | None:
    """One training run; None when it failed (e.g. out of memory)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [TRAIN, "--model", model, "--strategy", strategy, "--data", data,
               "--batch-size", str(batch), "--seq-len", str(seq),
               "--max-steps", str(steps), "--eval-every", "1000000",
               "--eval-steps", "1", "--activation-checkpointing", checkpointing,
               "--log-every", "1000000", "--out", out]
        if strategy != "single":
            cmd += ["--nproc", str(world)]
        if strategy == "hsdp":
            cmd += ["--shard-group-size", str(world // 2)]
        if cap:
            cmd += ["--memory-cap", cap]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            if "out of memory" not in r.stderr + r.stdout:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
            return None
        rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")
                if line.startswith("{")]
    rank0 = [r for r in rows if r.get("rank", 0) == 0]
    timed = [r["step_seconds"] for r in rank0[2:]] or [r["step_seconds"] for r in rank0]
    return {"peak": max(r["memory_peak_bytes"] for r in rows),
            "step": statistics.median(timed)}


def predicted_batch(model: str, strategy: str, world: int, seq: int,
                    checkpointing: str, cap: str) -> int:
    cmd = [CLI, "plan", "--fit", "--model", model, "--strategy", strategy,
           "--devices", str(world), "--memory-per-device", cap, "--seq-len", str(seq),
           "-o", "json"]
    if strategy == "hsdp":
        cmd += ["--shard-group-size", str(world // 2)]
    fits = json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                     check=True).stdout)["fits"]
    for row in fits:
        if row["activation_checkpointing"] == checkpointing:
            return row["batch_size"]
    raise RuntimeError(f"no {checkpointing} row in {fits}")


def found_batch(model: str, strategy: str, world: int, seq: int,
                checkpointing: str, cap: str, start: int, data: str) -> int:
    """The largest per-rank batch that trains two steps under --memory-cap.

    The peak grows with the batch piecewise linearly (the largest of a few
    moments, each linear in the batch), so two uncapped runs (at the
    prediction and half of it) give a first estimate; runs under the cap
    then settle it: the answer trains, one more sequence does not.
    """
    cap_bytes = parse_size(cap)

    def trains(batch: int) -> bool:
        # Two steps: the optimizer's state exists from the first update on.
        return batch >= 1 and run(model, strategy, world, batch, seq, checkpointing,
                                  2, data, cap) is not None

    start = max(start, 2)
    hi_run = run(model, strategy, world, start, seq, checkpointing, 2, data)
    lo_run = run(model, strategy, world, start // 2, seq, checkpointing, 2, data)
    slope = (hi_run["peak"] - lo_run["peak"]) / (start - start // 2)
    batch = start + int((cap_bytes - hi_run["peak"]) // slope) if slope > 0 else start
    batch = max(batch, 1)
    if trains(batch):
        while trains(batch + 1):
            batch += 1
        return batch
    while batch > 1:
        batch -= 1
        if trains(batch):
            return batch
    return 0


def parse_size(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "": 1}
    m = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB|)", text)
    if not m:
        raise ValueError(f"size {text!r}: expected e.g. 512MiB")
    return int(m.group(1)) * units[m.group(2)]


def mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--models", default="gpt2-tiny:4:128,gpt2-mini:2:128",
                   help="model:batch:seq, comma-separated (the demo's first)")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--strategies", default="ddp,fsdp,hsdp")
    p.add_argument("--checkpointing", default="none,all")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cap", default="512MiB")
    p.add_argument("--part", choices=("all", "peaks", "fit"), default="all",
                   help="peaks: part 1 only; fit: part 2 only")
    args = p.parse_args()
    # Training only: without val.bin, no evaluation batch (which at the
    # largest batches would ask for more validation text than there is).
    train_only = tempfile.mkdtemp(prefix="memory_bench_")
    os.symlink(os.path.abspath(f"{args.data}/train.bin"), f"{train_only}/train.bin")
    args.data = train_only

    if args.part != "fit":
        peaks(args)
    if args.part != "peaks":
        fit(args)


def peaks(args: argparse.Namespace) -> None:
    print("| model | world | strategy | activation ckpt | batch/rank | peak/rank "
          "| step (median) | recompute cost |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for spec in args.models.split(","):
        model, batch, seq = spec.split(":")
        for world in map(int, args.worlds.split(",")):
            for strategy in args.strategies.split(","):
                if strategy == "hsdp" and world < 4:
                    continue  # two groups of at least two
                plain = None
                for ckpt in args.checkpointing.split(","):
                    r = run(model, strategy, world, int(batch), int(seq), ckpt,
                            args.steps, args.data)
                    cost = "" if plain is None else f"{r['step'] / plain['step']:.2f}x"
                    name = strategy if strategy != "hsdp" else f"hsdp (G={world // 2})"
                    print(f"| {model} | {world} | {name} | {ckpt} | {batch} | "
                          f"{mib(r['peak'])} | {r['step'] * 1e3:.0f} ms | {cost} |",
                          flush=True)
                    plain = plain or r



def fit(args: argparse.Namespace) -> None:
    print()
    print(f"| model | world | strategy | activation ckpt | largest batch in "
          f"{args.cap}: predicted | found by running |")
    print("|---|---:|---|---|---:|---:|")
    for spec in args.models.split(","):
        model, _, seq = spec.split(":")
        for world in map(int, args.worlds.split(",")):
            for strategy in args.strategies.split(","):
                if strategy == "hsdp" and world < 4:
                    continue
                for ckpt in args.checkpointing.split(","):
                    pred = predicted_batch(model, strategy, world, int(seq), ckpt,
                                           args.cap)
                    found = found_batch(model, strategy, world, int(seq), ckpt,
                                        args.cap, pred, args.data)
                    name = strategy if strategy != "hsdp" else f"hsdp (G={world // 2})"
                    print(f"| {model} | {world} | {name} | {ckpt} | {pred} | {found} |",
                          flush=True)


if __name__ == "__main__":
    main()
