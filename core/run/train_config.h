// TrainConfig: everything one training run needs, as plain data.
//
// Torch-free, so the CLI and the coordinator validate job specs with the same
// rules as shardtrain-train. Field names follow the command-line flags
// (`--batch-size` <-> batch_size); the YAML keys are the flag names too.
#ifndef SHARDTRAIN_CORE_RUN_TRAIN_CONFIG_H_
#define SHARDTRAIN_CORE_RUN_TRAIN_CONFIG_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardtrain {

struct ModelConfig;

struct TrainConfig {
  // Model and data.
  std::string model = "gpt2-tiny";  // preset or custom:... (see model_config.h)
  std::string data;                 // dir with train.bin [+ val.bin]
  std::string init_from;  // llm.c .bin, Hugging Face dir or checkpoint

  // Batch and length of training.
  int64_t batch_size = 8;  // sequences per rank per micro-step
  int64_t seq_len = 128;
  int64_t grad_accum = 1;
  int64_t max_steps = 0;  // > 0 wins over epochs
  int64_t epochs = 1;

  // Optimizer: AdamW, weight decay on matrices only; warmup + cosine decay.
  double lr = 6e-4;
  double min_lr_ratio = 0.1;  // final lr = lr * min_lr_ratio
  int64_t warmup_steps = 0;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // <= 0 disables clipping

  // Execution.
  std::string strategy = "single";  // a StrategyKinds() row (strategy_kinds.h)
  std::string device = "cpu";       // cpu | cuda | cuda:N
  std::string precision = "fp32";   // fp32 | bf16
  uint64_t seed = 1337;
  int64_t threads = 0;    // intra-op CPU threads; 0 = cores / world size
  double peak_flops = 0;  // MFU denominator; 0 = table (GPU) or measured
  bool shuffle = true;    // shuffle training windows each epoch
  // Per-rank cap on tensor memory in bytes (0: none); past it the run fails
  // out of memory, as on a device that size (MemoryTracker::SetLimit).
  int64_t memory_cap = 0;

  // Distributed strategies.
  double bucket_mb = 25;              // DDP gradient bucket size
  bool reshard_after_forward = true;  // FSDP: free full params after forward
  bool prefetch = true;               // FSDP: gather the next unit early
  bool fsdp_no_sync = false;   // FSDP: no reduce-scatter on accumulation steps
  int64_t comm_timeout = 300;  // seconds before a collective fails
  // HSDP: ranks per shard group (0: DefaultShardGroupSize).
  int64_t shard_group_size = 0;
  // Recompute blocks' activations in backward: none | all | every-N.
  std::string activation_checkpointing = "none";

  // Pipeline parallelism: the model's blocks cut into `pipeline_stages`
  // contiguous stages (pipeline_plan.h). The world size is pipeline_stages x
  // the data-parallel size; `strategy` names the data-parallel part (single
  // or ddp).
  int64_t pipeline_stages = 1;
  std::string
      pipeline_split;  // "4,8": where stages 1, 2, ... start; "": balanced
  // Each rank's batch_size sequences cut into this many micro-batches that
  // flow through the stages.
  int64_t micro_batches = 1;
  std::string pipeline_schedule = "1f1b";  // gpipe | 1f1b | zb-h1
  // Interleaved schedules: each stage runs this many chunks of the model
  // (model stages s, s + S, ...), cutting the bubble to (S-1)/(V·M+S-1) for
  // V times the point-to-point traffic (pipeline_plan.h). 1: none.
  int64_t virtual_stages = 1;

  // Tensor parallelism: every block's attention heads and MLP units split
  // over this many ranks of each data-parallel replica (Megatron-LM's
  // split); it must divide n_head. The world size is tensor_parallel x the
  // data-parallel size; `strategy` names the data-parallel part (single or
  // ddp). Not combined with pipeline stages yet.
  int64_t tensor_parallel = 1;

  // Eval, checkpoints, output.
  int64_t eval_every = 0;  // 0 = only at the end when val.bin exists
  int64_t eval_steps = 20;
  int64_t checkpoint_every = 0;  // 0 = no periodic checkpoints
  std::string out;               // output dir: metrics.jsonl, model.bin, ...
  bool eval_only = false;
  bool resume = false;  // continue from the latest checkpoint in out
  int64_t log_every = 1;

  // Checks every field against the allowed values; the message names the
  // field, the value and what is allowed. Does not touch the filesystem.
  absl::Status Validate() const;
  // Validate's pipeline part, for `model_config` (the parsed `model`):
  // pipeline_stages, micro_batches, pipeline_schedule, virtual_stages,
  // pipeline_split and
  // the stage partition of the model.
  absl::Status ValidatePipeline(const ModelConfig& model_config) const;
  // Validate's tensor-parallel part: tensor_parallel in range, dividing the
  // model's heads, with a strategy it composes with.
  absl::Status ValidateTensorParallel(const ModelConfig& model_config) const;

  // Checks that `world_size` ranks can run this config's model-parallel
  // ranks (pipeline stages x tensor-parallel ranks, a data-parallel
  // replica's): a multiple of them, exactly them for a strategy that is not
  // distributed, and HSDP shard groups (shard_group_size, when given) that
  // divide a stage's ranks; without stages or tensor parallelism, one rank
  // for a strategy that is not distributed. InvalidArgument naming `field`
  // ("world_size") and the numbers.
  absl::Status CheckMeshWorld(int64_t world_size,
                              absl::string_view field = "world_size") const;

  // NotFound naming `data` when it is set and not a directory (the one
  // filesystem check before training: the launcher makes it once for all
  // ranks, each rank again before it opens the token files).
  absl::Status CheckDataDirectory() const;

  // The ranks of one data-parallel replica: pipeline_stages x
  // tensor_parallel.
  int64_t ModelParallelSize() const {
    return std::max<int64_t>(1, pipeline_stages) *
           std::max<int64_t>(1, tensor_parallel);
  }
  // The data-parallel size at `world_size` ranks: world_size /
  // ModelParallelSize().
  int64_t DataParallelSize(int64_t world_size) const {
    return world_size / ModelParallelSize();
  }

  // The CPU compute threads of one rank of `world_size` on this machine:
  // `threads`, or the machine's cores shared evenly (at least 1).
  int64_t ThreadsPerRank(int64_t world_size) const;
};

// Overwrites the fields named in a YAML mapping (keys as the flags:
// `batch-size` or `batch_size`). Unknown keys and wrong types are errors.
// How `global` sequences per optimizer step are shared by `world` ranks:
// each rank's share split into micro-batches of `batch` accumulated `accum`
// times. The micro-batch is `preferred_batch` when it divides the share (so
// memory per rank stays as it was), else the largest that does.
// FailedPrecondition when `world` ranks cannot share `global` equally.
struct BatchSplit {
  int64_t batch = 1;
  int64_t accum = 1;
};
absl::StatusOr<BatchSplit> SplitGlobalBatch(int64_t global, int64_t world,
                                            int64_t preferred_batch);

// What --activation-checkpointing means: 0 for "none", 1 for "all", N for
// "every-N": every N-th block is recomputed (0-based blocks N-1, 2N-1, ...;
// Gpt2Impl::IsRecomputed), L / N of L blocks. InvalidArgument naming the
// value otherwise.
absl::StatusOr<int64_t> ActivationCheckpointEvery(absl::string_view value);

absl::Status ApplyYamlTrainConfig(const std::string& yaml_text,
                                  TrainConfig* config);
// The keys ApplyYamlTrainConfig takes (snake_case), sorted.
std::vector<std::string> YamlTrainConfigKeys();
absl::Status LoadYamlTrainConfigFile(const std::string& path,
                                     TrainConfig* config);

// A run's mesh in the notation `compare --strategies` takes and `plan`
// prints, the one name every view gives a run: "single", "ddp4", "fsdp2",
// "hsdp4", "tp2", "ddp2xtp2", "pp2", "pp2xfsdp2", "pp2xfsdp2xtp2" (the
// pipeline stages first, the data-parallel strategy over its replicas, the
// tensor-parallel ranks last).
std::string MeshName(const TrainConfig& config, int64_t world_size);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_RUN_TRAIN_CONFIG_H_
