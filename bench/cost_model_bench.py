"""The step-time model against measurement on this host.

For each case (a model, a number of ranks, a global batch and a sequence
length), `shardtrain plan --fit --global-batch G` lists every mesh of the
ranks (data-parallel strategies, pipeline stages, tensor parallelism) with
its predicted step time, from the rates `shardtrain-train --calibrate`
measured once; each mesh without activation checkpointing is then trained
for a few steps with exactly the batch, accumulation and micro-batches the
plan chose, and its median step time after warm-up measured. Prints, per
case, a Markdown table (predicted, measured, error, both ranks) and whether
the measured fastest mesh is in the prediction's top 2; then the tally.

  /usr/bin/python3 bench/cost_model_bench.py --data DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
BIN = f"{ROOT}/build/bin"
WARMUP = 2

# (model, ranks, global batch, sequence length)
CASES = [
    ("gpt2-tiny", 2, 8, 128),
    ("gpt2-tiny", 2, 32, 128),
    ("gpt2-tiny", 2, 16, 256),
    ("gpt2-tiny", 4, 16, 128),
    ("gpt2-tiny", 4, 32, 64),
    ("gpt2-mini", 2, 8, 128),
    ("gpt2-mini", 2, 16, 128),
    ("gpt2-mini", 2, 8, 256),
    ("gpt2-mini", 4, 16, 128),
    ("gpt2-mini", 4, 32, 64),
]


def predict(model: str, ranks: int, batch: int, seq: int) -> list[dict]:
    out = subprocess.run(
        [f"{BIN}/shardtrain", "plan", "--fit", "--model", model, "--devices", str(ranks),
         "--memory-per-device", "64GiB", "--global-batch", str(batch), "--seq-len", str(seq),
         "-o", "json"], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)["fits"]
    return [r for r in rows if r["batch_size"] > 0 and r["activation_checkpointing"] == "none"
            and r["world_size"] == ranks]


def measure(row: dict, model: str, seq: int, data: str, steps: int) -> float:
    args = ["--model", model, "--seq-len", str(seq), "--data", data,
            "--max-steps", str(steps), "--log-every", "1000000", "--eval-every", "0",
            "--eval-steps", "1", "--strategy", row["strategy"],
            "--batch-size", str(row["batch_size"]), "--grad-accum", str(row["grad_accum"]),
            "--nproc", str(row["world_size"])]
    if row.get("pipeline_stages", 1) > 1:
        args += ["--pp", str(row["pipeline_stages"]), "--micro-batches", str(row["micro_batches"])]
    if row.get("tensor_parallel", 1) > 1:
        args += ["--tp", str(row["tensor_parallel"])]
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([f"{BIN}/shardtrain-train", *args, "--out", out], check=True,
                       stdout=subprocess.DEVNULL)
        with open(f"{out}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
    mine = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])[WARMUP:]
    return statistics.median(r["step_seconds"] for r in mine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cases", type=int, nargs="*", help="1-based case numbers (default: all)")
    args = parser.parse_args()
    hits = 0
    done = 0
    errors = []
    for number, (model, ranks, batch, seq) in enumerate(CASES, 1):
        if args.cases and number not in args.cases:
            continue
        rows = predict(model, ranks, batch, seq)
        for r in rows:
            r["name"] = r.get("mesh", f"{r['strategy']}{ranks}")
            r["measured"] = measure(r, model, seq, args.data, args.steps)
        by_prediction = sorted(rows, key=lambda r: r["predicted_step_seconds"])
        by_measure = sorted(rows, key=lambda r: r["measured"])
        fastest = by_measure[0]["name"]
        top2 = [r["name"] for r in by_prediction[:2]]
        hit = fastest in top2
        hits += hit
        done += 1
        print(f"\n{number}. {model}, {ranks} ranks, global batch {batch} x {seq}: measured "
              f"fastest {fastest}, predicted top 2 {', '.join(top2)}: "
              f"{'in' if hit else 'NOT in'} the top 2\n")
        print("| mesh | batch x accum | predicted step (s) | measured step (s) | error | "
              "predicted rank | measured rank |\n| --- | --- | --- | --- | --- | --- | --- |")
        for r in by_prediction:
            err = r["predicted_step_seconds"] / r["measured"] - 1
            errors.append(abs(err))
            print(f"| {r['name']} | {r['batch_size']} x {r['grad_accum']} | "
                  f"{r['predicted_step_seconds']:.3f} | {r['measured']:.3f} | {err:+.0%} | "
                  f"{by_prediction.index(r) + 1} | {by_measure.index(r) + 1} |", flush=True)
    print(f"\nmeasured fastest in the predicted top 2: {hits} of {done} cases; "
          f"median |error| {statistics.median(errors):.0%}, largest {max(errors):.0%}")


if __name__ == "__main__":
    main()
