"""PyTorch reference training loop for the benchmarks.

nanoGPT-style: the model of gpt2_reference.py, AdamW (torch.optim, decay on
matrices only), global-norm clipping, linear warmup + cosine decay, batches of
windows of seq_len + 1 tokens from an llm.c token file — the same work per
step as `shardtrain-train --strategy single`. With WORLD_SIZE > 1 (and RANK,
MASTER_ADDR, MASTER_PORT set by hand: torchrun crashes on Debian's Python
3.11) it trains with PyTorch's own DistributedDataParallel over gloo, each
rank on its slice of the global batch, like `--strategy ddp`. With --fsdp2
(PyTorch >= 2.6) every block and then the root are wrapped with
`torch.distributed.fsdp.fully_shard`, over NCCL on CUDA (world size 1 unless
WORLD_SIZE says otherwise; bf16 parameters and fp32 reductions under
--precision bf16) or Gloo on CPU, the peer of `--strategy fsdp`; --fsdp1 uses
PyTorch's classic FullyShardedDataParallel (FULL_SHARD, each block a unit).
Prints one JSON object (per rank) with the per-step times and losses (the
mean over ranks, as shardtrain logs it). On CPU run it with Debian's
/usr/bin/python3 (python3-torch).

FSDP2 on CPU in PyTorch 2.6: its CPU stream lacks record_event/wait_event
(AttributeError in foreach_all_gather); on one CPU stream every op is
already ordered, so --fsdp2 on CPU gives the stream those two as no-ops
(cpu_stream_events). Even so, 2.6 cannot re-gather parameters for backward
on CPU ("modified by an inplace operation" in backward), so on CPU --fsdp2
needs --reshard-after-forward false (parameters stay gathered from forward
to backward, as `shardtrain-train --reshard-after-forward false`).

  /usr/bin/python3 bench/reference/train_reference.py --model gpt2-tiny \\
      --data DIR --batch-size 8 --seq-len 128 --max-steps 30 --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_reference import GPT, GPTConfig, cross_entropy_loss  # noqa: E402

TOKEN_MAGIC = 20240520
HEADER_BYTES = 256 * 4


def open_tokens(path: str) -> np.ndarray:
    header = np.fromfile(path, dtype=np.int32, count=256)
    if header[0] != TOKEN_MAGIC or header[1] != 1:
        raise ValueError(f"{path}: not an llm.c token file")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES,
                     shape=(int(header[2]),))


def gemm_flops() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
    return 2 * 1024 ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_stream_events() -> None:
    """Event methods FSDP2 calls on streams, for PyTorch 2.6's CPU stream,
    which has none: ops on one CPU stream run in order, so there is never
    anything to wait for."""
    stream = torch.cpu.Stream
    if hasattr(stream, "record_event"):
        return

    class Done:
        def synchronize(self) -> None:
            pass

        def wait(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return True

    stream.record_event = lambda self, event=None: Done()
    stream.wait_event = lambda self, event: None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16 (autocast, CUDA)")
    p.add_argument("--fsdp2", action="store_true",
                   help="shard with PyTorch FSDP2 (fully_shard): NCCL on CUDA, Gloo on CPU")
    p.add_argument("--fsdp1", action="store_true",
                   help="shard with PyTorch's FullyShardedDataParallel (FULL_SHARD)")
    p.add_argument("--reshard-after-forward", default="true", choices=["true", "false"],
                   help="FSDP2: free gathered parameters after forward")
    p.add_argument("--shuffle", default="true", choices=["true", "false"],
                   help="false: windows in file order (as shardtrain-train --shuffle false)")
    args = p.parse_args()
    device = torch.device(args.device)

    # The same thread policy as shardtrain's SetCpuComputeThreads: OpenBLAS
    # (OPENBLAS_NUM_THREADS, set by the bench driver before start) gets the
    # cores, ATen's OpenMP pool one thread, so the pools don't spin against
    # each other.
    torch.set_num_threads(1 if os.environ.get("OPENBLAS_NUM_THREADS") else args.threads)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = GPTConfig.parse(args.model)
    model = GPT(config, seed=args.seed).to(device)
    unwrapped = model
    ddp = None
    backend = "nccl" if device.type == "cuda" else "gloo"
    reshard = args.reshard_after_forward == "true"
    if args.fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            cpu_stream_events()
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if args.precision == "bf16" else None,
            reduce_dtype=torch.float32)
        for block in model.h:
            fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    elif args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
        block_type = type(model.h[0])
        model = FullyShardedDataParallel(
            model, sharding_strategy=ShardingStrategy.FULL_SHARD,
            auto_wrap_policy=ModuleWrapPolicy({block_type}), device_id=device,
            use_orig_params=True)
    elif world > 1:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    # Weight decay on matrices, named before wrapping: FSDP1 leaves each rank
    # flat, shape-less views of the parameters it does not hold.
    decay_names = {n for n, q in unwrapped.named_parameters() if q.dim() >= 2}
    clean = lambda n: n.replace("_fsdp_wrapped_module.", "")  # noqa: E731
    decay = [q for n, q in model.named_parameters() if clean(n) in decay_names]
    no_decay = [q for n, q in model.named_parameters() if clean(n) not in decay_names]
    # One parameter at a time on CPU, as shardtrain's AdamW there; on CUDA
    # PyTorch's default (multi-tensor), what a PyTorch user gets.
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
        foreach=None if device.type == "cuda" else False)

    tokens = open_tokens(os.path.join(args.data, "train.bin"))
    T, B = args.seq_len, args.batch_size
    windows = (len(tokens) - 1) // T
    global_batch = B * world
    order = (np.random.default_rng(args.seed).permutation(windows)
             if args.shuffle == "true" else np.arange(windows))

    def lr_at(step: int) -> float:
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        decay_steps = args.max_steps - args.warmup_steps
        if decay_steps <= 1:
            return args.lr
        ratio = min(1.0, (step - args.warmup_steps) / (decay_steps - 1))
        return 0.1 * args.lr + 0.5 * (1 + math.cos(math.pi * ratio)) * 0.9 * args.lr

    steps = []
    for step in range(args.max_steps):
        start = time.perf_counter()
        first = (step * global_batch) % (windows - global_batch) + rank * B
        rows = [tokens[w * T: w * T + T + 1].astype(np.int64)
                for w in order[first:first + B]]
        batch = torch.from_numpy(np.stack(rows)).to(device)
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                            enabled=args.precision == "bf16"):
            logits = (ddp or model)(x)
        loss = cross_entropy_loss(logits.float(), y)
        loss.backward()
        if args.fsdp1:
            norm = model.clip_grad_norm_(args.grad_clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if world > 1:
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
            loss /= world
        loss_value = loss.item()
        steps.append({"step": step + 1, "loss": loss_value,
                      "grad_norm": float(norm),
                      "step_seconds": time.perf_counter() - start})

    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print(json.dumps({
        "peak_memory_bytes": peak,
        "model": args.model, "batch_size": B, "seq_len": T, "rank": rank,
        "world_size": world,
        "threads": args.threads, "torch": torch.__version__,
        "flops_per_token": config.flops_per_token(T),
        "gemm_flops": gemm_flops(), "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
