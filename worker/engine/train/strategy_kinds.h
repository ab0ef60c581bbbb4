// The strategies, in one table: their names (flags, JobSpec, metrics), how
// reports name them and whether they run over several ranks. Validation,
// `shardtrain compare`, `shardtrain plan` and the report read it; the
// factory (strategy/strategy_factory.cc) builds each one by this name, and a
// test checks the two agree. Torch-free. A new strategy is one file pair in
// strategy/, one row here and one in the factory.
#ifndef SHARDTRAIN_WORKER_ENGINE_TRAIN_STRATEGY_KINDS_H_
#define SHARDTRAIN_WORKER_ENGINE_TRAIN_STRATEGY_KINDS_H_

#include <string>
#include <string_view>
#include <vector>

namespace shardtrain {

struct StrategyKind {
  const char* name;          // "fsdp"
  const char* display_name;  // "FSDP"
  // Runs over a communicator, one rank per device; otherwise one process on
  // one device (world size 1).
  bool distributed;
};

// Every strategy, in the order studies and reports list them.
const std::vector<StrategyKind>& StrategyKinds();
// The row named `name`, or nullptr.
const StrategyKind* FindStrategyKind(std::string_view name);
// "single, ddp, fsdp", for messages.
std::string StrategyNameList();
// Every name, for flag checks.
std::vector<std::string> StrategyNames();

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_TRAIN_STRATEGY_KINDS_H_
