// Trainer: the training loop, llm.c style.
//
//   next batch -> forward/backward (x grad_accum) -> global grad norm -> clip
//   -> AdamW step at the scheduled lr -> metrics; then eval, checkpoint and
//   logging each in their own `every N` block.
//
// The trainer owns data, schedule, metrics and checkpoints; the Strategy owns
// the model, the gradients' communication and the optimizer state. Same seed
// and global batch => same data order on every strategy and world size.
#ifndef SHARDTRAIN_WORKER_ENGINE_TRAIN_TRAINER_H_
#define SHARDTRAIN_WORKER_ENGINE_TRAIN_TRAINER_H_

#include <torch/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/checkpoint/checkpoint_store.h"
#include "core/data/batch_sampler.h"
#include "core/data/token_file.h"
#include "core/model/model_config.h"
#include "core/run/lr_schedule.h"
#include "core/run/step_metrics.h"
#include "core/run/train_config.h"
#include "worker/engine/strategy/strategy.h"

namespace shardtrain {

// Where this process sits in the job (torchrun's RANK / WORLD_SIZE).
struct RankInfo {
  int64_t rank = 0;
  int64_t world_size = 1;
};

// FailedPrecondition naming `requested` (the --device value) when `device`
// is a CUDA device and this LibTorch sees none (no GPU, no driver, or a CPU
// build): checked before anything touches CUDA, which would throw from
// inside LibTorch.
absl::Status CheckDeviceVisible(const torch::Device& device,
                                const std::string& requested);

class Trainer {
 public:
  using StepCallback = std::function<void(const StepMetrics&)>;

  // Validates the config, opens the data, builds and initialises the model
  // (from the seed or --init-from), hands it to `strategy` and, with --resume,
  // restores the latest checkpoint. Writes nothing to disk.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const TrainConfig& config, const RankInfo& rank_info,
      std::unique_ptr<Strategy> strategy, std::ostream* log);

  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Trains to the last step (or only evaluates with eval_only), writing
  // OUT/metrics.jsonl, checkpoints and OUT/model.bin when `out` is set.
  absl::Status Run();

  // Mean loss over the first eval_steps global batches of val.bin.
  absl::StatusOr<double> Evaluate();

  // Called on every rank after each step with that rank's metrics.
  void set_step_callback(StepCallback callback) {
    step_callback_ = std::move(callback);
  }

  // Asked after every step but the last: when it says yes on any rank
  // (agreed by an all-reduce, so every rank stops at the same step), the
  // run saves a checkpoint there (the next step's) and Run() returns
  // PreemptedError. Used for preemption: the job resumes from it.
  void set_stop_request(std::function<bool()> stop_requested) {
    stop_requested_ = std::move(stop_requested);
  }

  int64_t start_step() const { return start_step_; }
  int64_t total_steps() const { return total_steps_; }
  const std::vector<StepMetrics>& history() const { return history_; }
  Strategy& strategy() { return *strategy_; }

 private:
  Trainer(const TrainConfig& config, const RankInfo& rank_info,
          std::unique_ptr<Strategy> strategy, std::ostream* log);

  absl::Status RunLoop();
  StepMetrics TrainStep(int64_t step);
  // Inputs and targets [batch, seq_len] for windows of seq_len + 1 tokens.
  std::pair<torch::Tensor, torch::Tensor> LoadBatch(
      const TokenFile& tokens, const std::vector<int64_t>& starts) const;
  absl::Status SaveCheckpoint(int64_t next_step);
  // A resume at another world size keeps the newest checkpoint's global
  // batch (sequences per step): the per-rank batch and accumulation in
  // config_ are split anew, so the run continues the same training.
  absl::Status KeepCheckpointGlobalBatch();
  absl::Status Resume();
  // Loads one checkpoint into this rank (strategy state, RNG); its step.
  absl::StatusOr<int64_t> LoadCheckpointFrom(const std::string& dir);
  void Log(const std::string& line);
  // The end of the run: steps, time, throughput, final losses, outputs.
  void LogSummary(double seconds, double val_loss);

  TrainConfig config_;
  RankInfo rank_info_;
  std::unique_ptr<Strategy> strategy_;
  std::ostream* log_;
  torch::Device device_{torch::kCPU};
  ModelConfig model_config_;
  std::optional<TokenFile> train_tokens_;
  std::optional<TokenFile> val_tokens_;
  std::optional<BatchSampler> sampler_;
  std::optional<LrSchedule> schedule_;
  std::optional<CheckpointStore> checkpoints_;
  double flops_per_token_ = 0;
  double peak_flops_ = 0;
  int64_t start_step_ = 0;
  int64_t total_steps_ = 0;
  int metrics_fd_ = -1;
  StepCallback step_callback_;
  std::function<bool()> stop_requested_;
  std::vector<StepMetrics> history_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_TRAIN_TRAINER_H_
