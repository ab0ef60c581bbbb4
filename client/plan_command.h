// `shardtrain plan`: the tensor bytes each rank will need at its peak under
// each strategy, predicted from the job's shape before anything runs
// (core/plan/memory_plan.h). Local, no daemon needed. E.g.
//   plan --model gpt2-mini --world-size 2 --batch-size 2 --seq-len 64
//   plan --model gpt2 --strategy fsdp --world-size 8 --batch-size 16
//        --seq-len 1024 --device cuda --precision bf16 -o json
#ifndef SHARDTRAIN_CLIENT_PLAN_COMMAND_H_
#define SHARDTRAIN_CLIENT_PLAN_COMMAND_H_

#include "CLI/CLI.hpp"

namespace shardtrain::cli {

// Adds `plan` to `app`; the chosen command stores its ExitCode in *exit_code.
void AddPlanCommand(CLI::App* app, int* exit_code);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_PLAN_COMMAND_H_
