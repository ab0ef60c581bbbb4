"""Pipeline benchmark on this CPU: step time against micro-batches, memory
per stage for GPipe and 1F1B, and a pipeline beside single, DDP and FSDP.

The same model, global batch and steps under
  single    shardtrain-train, one process
  ddp/fsdp  --nproc 2, half the batch per rank
  ppS mM    --pp S --nproc S --micro-batches M (schedule 1f1b unless said)
  meshes    four ranks as DDP 4, FSDP 4, PP 2 x DDP 2 and PP 2 x FSDP 2
and prints Markdown tables: the median step time after warm-up, the ideal
bubble (S-1)/(M+S-1), the share of the step each stage spent blocked on
communication (its wait for activations and gradients, which holds the
bubble), and the peak tensor memory of each stage; for the meshes, each
rank's measured bubble share (pipeline_bubble_seconds), point-to-point bytes
per step and model state. --meshes-only runs the last table alone.

--interleaved runs interleaved 1F1B (--virtual-stages V) against plain 1F1B
on a model whose blocks, not its head, hold the compute (8 blocks of C = 256,
a 512-token vocabulary: the Brown Corpus's GPT-2 ids taken modulo 512):
two stages, V = 1, 2, 4 chunks per stage, M = 2, 4, 8 micro-batches; the
step time, the ideal bubble (S-1)/(V*M+S-1), each stage's measured bubble
share and point-to-point traffic, and its peak memory.

--zero-bubble runs zb-h1 (each backward split into the input's and the
weights' gradients) against 1F1B on the same model: two stages, M = 2, 4, 8;
the step time, the bubble on paper of each, each stage's measured bubble
share and its peak memory.

  /usr/bin/python3 bench/pipeline_bench.py --data ~/.cache/shardtrain/data/brown
"""

from __future__ import annotations

import argparse
import array
import json
import os
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
WARMUP = 2


def run(args: list[str], common: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [f"{ROOT}/build/bin/shardtrain-train", *common, *args,
               "--log-every", "1000000", "--out", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(f"{out}/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
    by_rank: dict[int, list] = {}
    for r in rows:
        by_rank.setdefault(r["rank"], []).append(r)
    steps = {rank: sorted(v, key=lambda r: r["step"])[WARMUP:] for rank, v in by_rank.items()}
    return {
        "step_s": statistics.median(r["step_seconds"] for r in steps[0]),
        "comm_share": [statistics.median(r["comm_seconds"] / r["step_seconds"] for r in steps[k])
                       for k in sorted(steps)],
        "peak_mib": [max(r["memory_peak_bytes"] for r in by_rank[k]) / 2**20 for k in sorted(by_rank)],
        "bubble_share": [statistics.median(r.get("pipeline_bubble_seconds", 0) / r["step_seconds"]
                                           for r in steps[k]) for k in sorted(steps)],
        "p2p_mib": [statistics.median(r.get("p2p_bytes", 0) for r in steps[k]) / 2**20
                    for k in sorted(steps)],
        "state_mib": [by_rank[k][-1]["model_state_bytes"] / 2**20 for k in sorted(by_rank)],
    }


def meshes(b: int, common: list[str]) -> None:
    """Four ranks as data parallelism alone and as 2 stages x 2."""
    print("\n| mesh (4 ranks) | step (s) | bubble share per rank | p2p MiB/step per rank | "
          "model state per rank (MiB) | peak per rank (MiB) |\n| --- | --- | --- | --- | --- | --- |")
    for name, extra in (("ddp 4", ["--strategy", "ddp"]),
                        ("fsdp 4", ["--strategy", "fsdp"]),
                        ("pp 2 x ddp 2", ["--strategy", "ddp", "--pp", "2", "--micro-batches", "4"]),
                        ("pp 2 x fsdp 2", ["--strategy", "fsdp", "--pp", "2", "--micro-batches", "4"])):
        pp = "--pp" in extra
        r = run([*extra, "--nproc", "4", "--batch-size", str(b // (2 if pp else 4))], common)
        print(f"| {name} | {r['step_s']:.3f} | "
              f"{' / '.join(f'{c:.2f}' for c in r['bubble_share']) if pp else '-'} | "
              f"{' / '.join(f'{c:.1f}' for c in r['p2p_mib']) if pp else '-'} | "
              f"{' / '.join(f'{p:.1f}' for p in r['state_mib'])} | "
              f"{' / '.join(f'{p:.1f}' for p in r['peak_mib'])} |", flush=True)


def modulo_vocabulary(src: str, dst: str, vocab: int) -> None:
    """Copies a prepared dataset with every token id taken modulo `vocab`
    (llm.c's 16-bit token files: a 256-int32 header, then the ids)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".bin"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
            continue
        with open(os.path.join(src, name), "rb") as f:
            header = f.read(256 * 4)
            ids = array.array("H")
            ids.frombytes(f.read())
        with open(os.path.join(dst, name), "wb") as f:
            f.write(header)
            f.write(array.array("H", (i % vocab for i in ids)).tobytes())


BLOCKS_MODEL = "custom:n_layer=8,n_head=8,n_embd=256,block_size=128,vocab_size=512"


def blocks_common(args: argparse.Namespace, data: str) -> list[str]:
    return ["--data", data, "--model", BLOCKS_MODEL, "--seq-len", "128",
            "--max-steps", str(args.steps), "--threads", "1", "--eval-every", "0",
            "--eval-steps", "1"]


def zero_bubble(args: argparse.Namespace) -> None:
    """Two stages, 1F1B against zb-h1."""
    with tempfile.TemporaryDirectory() as tmp:
        modulo_vocabulary(args.data, f"{tmp}/data", 512)
        common = blocks_common(args, f"{tmp}/data")
        print(f"{BLOCKS_MODEL}, seq 128, batch {args.batch}, 2 stages, 1 thread per rank, "
              f"median of steps {WARMUP + 1}-{args.steps}\n")
        print("| M | schedule | step (s) | bubble on paper | bubble share per stage | "
              "peak per stage (MiB) |\n| --- | --- | --- | --- | --- | --- |")
        for m in (2, 4, 8):
            for schedule in ("1f1b", "zb-h1"):
                r = run(["--strategy", "single", "--pp", "2", "--nproc", "2",
                         "--batch-size", str(args.batch), "--micro-batches", str(m),
                         "--pipeline-schedule", schedule], common)
                # Equal F, B and W: 1F1B idles 3 units per stage beside 3M of
                # work; zb-h1's order 1 (M even) or 2 (M odd).
                paper = 1 / (m + 1) if schedule == "1f1b" else (1 + m % 2) / (3 * m + 1 + m % 2)
                print(f"| {m} | {schedule} | {r['step_s']:.3f} | {paper:.3f} | "
                      f"{' / '.join(f'{c:.2f}' for c in r['bubble_share'])} | "
                      f"{' / '.join(f'{p:.1f}' for p in r['peak_mib'])} |", flush=True)


def interleaved(args: argparse.Namespace) -> None:
    """Two stages, 1F1B, with 1, 2 and 4 chunks per stage."""
    with tempfile.TemporaryDirectory() as tmp:
        modulo_vocabulary(args.data, f"{tmp}/data", 512)
        model = BLOCKS_MODEL
        common = blocks_common(args, f"{tmp}/data")
        print(f"{model}, seq 128, batch {args.batch}, 2 stages (1F1B), 1 thread per rank, "
              f"median of steps {WARMUP + 1}-{args.steps}\n")
        print("| M | chunks V | step (s) | ideal bubble (S-1)/(V*M+S-1) | "
              "bubble share per stage | p2p MiB/step per stage | peak per stage (MiB) |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
        for m in (2, 4, 8):
            for v in (1, 2, 4):
                r = run(["--strategy", "single", "--pp", "2", "--nproc", "2",
                         "--batch-size", str(args.batch), "--micro-batches", str(m),
                         "--virtual-stages", str(v)], common)
                ideal = 1 / (v * m + 1)
                print(f"| {m} | {v} | {r['step_s']:.3f} | {ideal:.3f} | "
                      f"{' / '.join(f'{c:.2f}' for c in r['bubble_share'])} | "
                      f"{' / '.join(f'{c:.2f}' for c in r['p2p_mib'])} | "
                      f"{' / '.join(f'{p:.1f}' for p in r['peak_mib'])} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="gpt2-mini")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--meshes-only", action="store_true",
                        help="only the four-rank meshes (PP x DDP, PP x FSDP)")
    parser.add_argument("--interleaved", action="store_true",
                        help="only interleaved 1F1B against 1F1B (--virtual-stages)")
    parser.add_argument("--zero-bubble", action="store_true",
                        help="only zb-h1 against 1F1B (--pipeline-schedule zb-h1)")
    args = parser.parse_args()
    if args.interleaved:
        interleaved(args)
        return
    if args.zero_bubble:
        zero_bubble(args)
        return
    common = ["--data", args.data, "--model", args.model, "--seq-len", str(args.seq_len),
              "--max-steps", str(args.steps), "--threads", "1", "--eval-every", "0",
              "--eval-steps", "1"]
    b = args.batch

    print(f"{args.model}, seq {args.seq_len}, global batch {b}, 1 thread per rank, "
          f"median of steps {WARMUP + 1}-{args.steps}\n")
    if args.meshes_only:
        meshes(b, common)
        return
    base = {
        "single": run(["--strategy", "single", "--batch-size", str(b)], common),
        "ddp 2": run(["--strategy", "ddp", "--nproc", "2", "--batch-size", str(b // 2)], common),
        "fsdp 2": run(["--strategy", "fsdp", "--nproc", "2", "--batch-size", str(b // 2)], common),
    }
    print("| run | ranks | step (s) | peak per rank (MiB) |\n| --- | --- | --- | --- |")
    for name, r in base.items():
        print(f"| {name} | {len(r['peak_mib'])} | {r['step_s']:.3f} | "
              f"{' / '.join(f'{p:.1f}' for p in r['peak_mib'])} |")

    print("\n| stages | M | step (s) | ideal bubble (S-1)/(M+S-1) | blocked share per stage | "
          "peak per stage (MiB) |\n| --- | --- | --- | --- | --- | --- |")
    for stages in (2, 4):
        for m in (1, 2, 4, 8, 16):
            r = run(["--strategy", "single", "--pp", str(stages), "--nproc", str(stages),
                     "--batch-size", str(b), "--micro-batches", str(m)], common)
            ideal = (stages - 1) / (m + stages - 1)
            print(f"| {stages} | {m} | {r['step_s']:.3f} | {ideal:.2f} | "
                  f"{' / '.join(f'{c:.2f}' for c in r['comm_share'])} | "
                  f"{' / '.join(f'{p:.1f}' for p in r['peak_mib'])} |", flush=True)

    print("\n| schedule | stages | M | step (s) | peak per stage (MiB) |\n| --- | --- | --- | --- | --- |")
    for schedule in ("gpipe", "1f1b"):
        for stages in (2, 4):
            r = run(["--strategy", "single", "--pp", str(stages), "--nproc", str(stages),
                     "--batch-size", str(b), "--micro-batches", "8",
                     "--pipeline-schedule", schedule], common)
            print(f"| {schedule} | {stages} | 8 | {r['step_s']:.3f} | "
                  f"{' / '.join(f'{p:.1f}' for p in r['peak_mib'])} |", flush=True)
    meshes(b, common)


if __name__ == "__main__":
    main()
