// `shardtrain checkpoint inspect DIR` and `shardtrain checkpoint export DIR
// --to model.bin`: any checkpoint, whatever strategy and world size wrote
// it, read on this host without ranks or a daemon
// (core/checkpoint/checkpoint_format.h). DIR is a checkpoint, a run's
// --out, or its checkpoints/ folder (then the newest complete checkpoint).
#ifndef SHARDTRAIN_CLIENT_CHECKPOINT_COMMANDS_H_
#define SHARDTRAIN_CLIENT_CHECKPOINT_COMMANDS_H_

#include "CLI/CLI.hpp"

namespace shardtrain::cli {

// Adds `checkpoint` to `app`; the chosen command stores its ExitCode in
// *exit_code.
void AddCheckpointCommands(CLI::App* app, int* exit_code);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_CHECKPOINT_COMMANDS_H_
