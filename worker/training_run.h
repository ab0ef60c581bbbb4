// RunTrainingRank: one rank's whole run (device, process group, strategy,
// trainer, loop). shardtrain-train and shardtrain-worker both call it; they
// differ only in where the TrainConfig comes from and who hears the steps.
#ifndef SHARDTRAIN_WORKER_TRAINING_RUN_H_
#define SHARDTRAIN_WORKER_TRAINING_RUN_H_

#include <functional>
#include <ostream>

#include "absl/status/status.h"
#include "common/dist_env.h"
#include "core/run/train_config.h"
#include "worker/engine/train/trainer.h"

namespace shardtrain {

struct TrainingHooks {
  // After the process group formed and the trainer was built (and resumed),
  // before the first step. An error stops the run.
  std::function<absl::Status()> on_ready;
  // Every step, on this rank, with this rank's metrics.
  Trainer::StepCallback on_step;
  // Asked at each step boundary; once any rank says yes, every rank saves
  // a checkpoint there and the run ends with PreemptedError.
  std::function<bool()> stop_requested;
};

// InvalidArgument: the config cannot run (exit code 2 for a command line);
// anything else is a failure of the run. Messages name the rank when the
// process group is involved.
absl::Status RunTrainingRank(const TrainConfig& config, const DistEnv& env,
                             std::ostream* log, const TrainingHooks& hooks);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_TRAINING_RUN_H_
