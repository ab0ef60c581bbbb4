"""A learning-rate sweep with the Python client: one job per learning rate,
all submitted at once (the daemon queues what does not fit), then the final
loss of each and the best.

  python3 docs/examples/lr_sweep.py --data brown --lrs 1e-4,3e-4,1e-3,3e-3

Connects as the CLI does ($SHARDTRAIN_ADDRESS, else the local daemon).
"""

import argparse

import shardtrain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="brown")
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--lrs", default="1e-4,3e-4,1e-3,3e-3")
    p.add_argument("--max-steps", type=int, default=50)
    args = p.parse_args()

    client = shardtrain.Client()
    jobs = {}
    for lr in (float(x) for x in args.lrs.split(",")):
        job = client.submit(model=args.model, data=args.data, lr=lr, max_steps=args.max_steps,
                            batch_size=2, seq_len=32, eval_every=0, warmup_steps=0,
                            name=f"lr-{lr:.0e}", labels={"sweep": "lr"})
        jobs[lr] = job.id

    final = {}
    for lr, job_id in jobs.items():
        job = client.wait(job_id)
        if job.state != "SUCCEEDED":
            print(f"lr {lr:.0e}: {job.state} {job.failure}")
            continue
        final[lr] = job.last_step["loss"]
        print(f"lr {lr:.0e}: final loss {final[lr]:.4f} ({job_id})")
    if final:
        best = min(final, key=final.get)
        print(f"best: lr {best:.0e}, final loss {final[best]:.4f}")


if __name__ == "__main__":
    main()
