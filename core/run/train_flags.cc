#include "core/run/train_flags.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/model/model_config.h"
#include "core/run/step_metrics.h"
#include "core/run/strategy_kinds.h"

namespace shardtrain {

void AddTrainFlags(CLI::App& app, TrainConfig& c) {
  app.add_option(
      "--model", c.model,
      absl::StrCat("preset (", absl::StrJoin(ModelConfig::PresetNames(), ", "),
                   "), custom:n_layer=L,n_head=H,n_embd=C[,...] "
                   "(GPT-2) or custom-llama:n_layer=L,n_head=H,"
                   "n_kv_head=K,n_embd=C,intermediate_size=I[,...] "
                   "(docs/models.md)"));
  app.add_option("--data", c.data, "directory with train.bin [and val.bin]");
  app.add_option("--init-from", c.init_from,
                 absl::StrCat("weights to start from: a Hugging Face directory "
                              "(config.json + model.safetensors; ",
                              absl::StrJoin(ModelFamilyNames(), ", "),
                              "), an llm.c model .bin (gpt2) or a checkpoint"));
  app.add_option("--batch-size", c.batch_size,
                 "sequences per rank per micro-step");
  app.add_option("--seq-len", c.seq_len, "tokens per sequence");
  app.add_option("--grad-accum", c.grad_accum,
                 "micro-steps per optimizer step");
  app.add_option("--max-steps", c.max_steps,
                 "optimizer steps (wins over --epochs)");
  app.add_option("--epochs", c.epochs, "passes over train.bin");
  app.add_option("--lr", c.lr, "peak learning rate");
  app.add_option("--min-lr-ratio", c.min_lr_ratio,
                 "final lr as a fraction of --lr");
  app.add_option("--warmup-steps", c.warmup_steps, "linear warmup steps");
  app.add_option("--weight-decay", c.weight_decay, "AdamW decay on matrices");
  app.add_option("--beta1", c.beta1, "AdamW beta1");
  app.add_option("--beta2", c.beta2, "AdamW beta2");
  app.add_option("--eps", c.eps, "AdamW epsilon");
  app.add_option("--grad-clip", c.grad_clip,
                 "max global grad norm (<= 0: off)");
  app.add_option("--strategy", c.strategy,
                 StrategyFlagHelp(/*with_auto=*/true));
  app.add_option("--device", c.device, "cpu | cuda | cuda:N");
  app.add_option("--precision", c.precision, "fp32 | bf16 (CUDA)");
  app.add_option("--seed", c.seed, "seed for init and data order");
  app.add_option("--threads", c.threads,
                 "CPU threads per rank (0: cores / ranks)");
  app.add_option("--peak-flops", c.peak_flops, "MFU denominator in FLOP/s");
  app.add_option("--shuffle", c.shuffle, "shuffle training windows each epoch");
  app.add_option_function<std::string>(
      "--memory-cap",
      [&c](const std::string& value) {
        absl::StatusOr<int64_t> bytes = ParseBytes(value);
        if (!bytes.ok()) {
          throw CLI::ValidationError("--memory-cap",
                                     std::string(bytes.status().message()));
        }
        c.memory_cap = *bytes;
      },
      "cap each rank's tensor memory (e.g. 512MiB): past it the run fails "
      "out of memory, as on a device that size");
  app.add_option("--bucket-mb", c.bucket_mb,
                 "DDP gradient bucket size in MB (also DDP replicas of "
                 "pipeline stages and tensor-parallel slices)");
  app.add_option(
      "--reshard-after-forward", c.reshard_after_forward,
      "FSDP: free gathered parameters after forward (false: ZeRO-2-like)");
  app.add_option("--prefetch", c.prefetch,
                 "FSDP: prefetch the next unit's all-gather");
  app.add_option("--fsdp-no-sync", c.fsdp_no_sync,
                 "FSDP: keep full gradients over accumulation micro-steps and "
                 "reduce-scatter once (less communication, more memory)");
  app.add_option("--shard-group-size", c.shard_group_size,
                 "HSDP: ranks per shard group, dividing the world size (0: "
                 "ranks per node; on one node, half the ranks)");
  app.add_option("--activation-checkpointing", c.activation_checkpointing,
                 "recompute blocks' activations in backward: none | all | "
                 "every-N (every N-th block)");
  app.add_option("--pipeline-stages,--pp", c.pipeline_stages,
                 "pipeline stages: the model's blocks cut into S contiguous "
                 "stages, one rank each per replica; world size = S x T x "
                 "the data-parallel size (--strategy: its data-parallel "
                 "part)");
  app.add_option("--pipeline-split", c.pipeline_split,
                 "blocks before which stages 1, 2, ... start, e.g. 4,8 "
                 "(empty: balanced by compute)");
  app.add_option("--micro-batches", c.micro_batches,
                 "micro-batches each rank's --batch-size is cut into, flowing "
                 "through the pipeline stages; must divide --batch-size");
  app.add_option("--pipeline-schedule", c.pipeline_schedule,
                 "gpipe (all forwards, then all backwards) | 1f1b (one "
                 "forward, one backward: fewer activations held) | zb-h1 "
                 "(1f1b with each backward split into the input's and the "
                 "weights' gradients, the latter run where 1f1b waits)");
  app.add_option("--virtual-stages", c.virtual_stages,
                 "interleaved pipeline: each stage runs V chunks of the model "
                 "(model stages s, s+S, ...), the bubble (S-1)/(V*M+S-1) for "
                 "V times the point-to-point traffic; under 1f1b "
                 "--micro-batches must be a multiple of the stages");
  app.add_option("--tensor-parallel,--tp", c.tensor_parallel,
                 "tensor-parallel ranks: every block's attention heads and "
                 "MLP units split over T ranks (T divides the heads); world "
                 "size = S x T x the data-parallel size (--strategy single, "
                 "ddp or fsdp)");
  app.add_option("--comm-timeout", c.comm_timeout,
                 "seconds before a collective fails");
  app.add_option("--eval-every", c.eval_every,
                 "eval every N steps (and at the end)");
  app.add_option("--eval-steps", c.eval_steps, "batches per eval");
  app.add_option("--checkpoint-every", c.checkpoint_every,
                 "checkpoint every N steps");
  app.add_option("--out", c.out,
                 "output dir: metrics.jsonl, checkpoints, model.bin");
  app.add_flag("--eval-only", c.eval_only,
               "only evaluate --init-from's model on val.bin");
  app.add_flag("--resume", c.resume,
               "continue from the latest checkpoint in --out");
  app.add_option("--log-every", c.log_every, "print a step line every N steps");
}

}  // namespace shardtrain
