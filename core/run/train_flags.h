// The trainer's command-line flags, registered on a CLI11 app: shared by
// shardtrain-train and `shardtrain submit`, so both accept the same flags
// with the same meaning. Torch-free.
#ifndef SHARDTRAIN_CORE_RUN_TRAIN_FLAGS_H_
#define SHARDTRAIN_CORE_RUN_TRAIN_FLAGS_H_

#include "CLI/CLI.hpp"
#include "core/run/train_config.h"

namespace shardtrain {

// Binds every TrainConfig field to its flag (`--batch-size` <-> batch_size);
// `c` must outlive parsing.
void AddTrainFlags(CLI::App& app, TrainConfig& c);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_RUN_TRAIN_FLAGS_H_
