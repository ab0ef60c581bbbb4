// The strategies, in one table: their names (flags, JobSpec, metrics), how
// reports name them and whether they run over several ranks. Validation,
// `shardtrain compare`, `shardtrain plan` and the report read it; the
// factory (strategy/strategy_factory.cc) builds each one by this name, and a
// test checks the two agree. Torch-free. A new strategy is one file pair in
// strategy/, one row here and one in the factory.
#ifndef SHARDTRAIN_CORE_TRAIN_STRATEGY_KINDS_H_
#define SHARDTRAIN_CORE_TRAIN_STRATEGY_KINDS_H_

#include <cstdint>
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

// HSDP's ranks per shard group when --shard-group-size is 0: the ranks per
// node, so the all-gathers and reduce-scatters stay inside a node and only
// the replicas' all-reduce crosses nodes. When every rank is on one node
// (ranks_per_node >= world_size, or unknown: 0) that would be plain FSDP;
// there the default is the largest divisor of the world size below it
// (half of an even world: two replicas), and 1 for one rank.
int64_t DefaultShardGroupSize(int64_t world_size, int64_t ranks_per_node);
// The shard group size a run uses: `requested` when > 0, else the default.
int64_t ResolveShardGroupSize(int64_t requested, int64_t world_size,
                              int64_t ranks_per_node);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_TRAIN_STRATEGY_KINDS_H_
