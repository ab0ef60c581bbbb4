// The one place that maps a TrainConfig's strategy name to a Strategy.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_STRATEGY_FACTORY_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_STRATEGY_FACTORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "core/run/train_config.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/strategy/strategy.h"

namespace shardtrain {

// StrategyOptions from the config for this rank; `ranks_per_node` as
// StrategyOptions::ranks_per_node.
StrategyOptions StrategyOptionsFor(const TrainConfig& config,
                                   const torch::Device& device, int64_t rank,
                                   int64_t world_size,
                                   int64_t ranks_per_node = 0);

// The strategy config.strategy names (a StrategyKinds() row). `comm` may be
// null only for a strategy that is not distributed; it must outlive the
// strategy.
absl::StatusOr<std::unique_ptr<Strategy>> CreateStrategy(
    const TrainConfig& config, const StrategyOptions& options,
    Communicator* comm);

// Whether CreateStrategy can build `name` (tests check every StrategyKinds()
// row has a factory).
bool HasStrategyFactory(const std::string& name);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_STRATEGY_FACTORY_H_
