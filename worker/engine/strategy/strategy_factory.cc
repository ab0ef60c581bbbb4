#include "worker/engine/strategy/strategy_factory.h"

#include "absl/strings/str_cat.h"
#include "worker/engine/strategy/ddp_strategy.h"
#include "worker/engine/strategy/fsdp_strategy.h"
#include "worker/engine/strategy/single_device_strategy.h"

namespace shardtrain {

StrategyOptions StrategyOptionsFor(const TrainConfig& config,
                                   const torch::Device& device, int64_t rank,
                                   int64_t world_size) {
  StrategyOptions options;
  options.device = device;
  options.rank = rank;
  options.world_size = world_size;
  options.precision = config.precision;
  options.adamw = {config.beta1, config.beta2, config.eps};
  options.weight_decay = config.weight_decay;
  return options;
}

absl::StatusOr<std::unique_ptr<Strategy>> CreateStrategy(
    const TrainConfig& config, const StrategyOptions& options,
    Communicator* comm) {
  if (config.strategy == "single") {
    if (options.world_size != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "strategy: single trains on one device, but the world size is ",
          options.world_size, "; use ddp or fsdp"));
    }
    return std::make_unique<SingleDeviceStrategy>(options);
  }
  if (comm == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("strategy: ", config.strategy, " needs a communicator"));
  }
  if (config.strategy == "ddp") {
    return std::make_unique<DdpStrategy>(options, comm, config.bucket_mb);
  }
  if (config.strategy == "fsdp") {
    FsdpOptions fsdp;
    fsdp.reshard_after_forward = config.reshard_after_forward;
    fsdp.prefetch = config.prefetch;
    fsdp.no_sync = config.fsdp_no_sync;
    return std::make_unique<FsdpStrategy>(options, comm, fsdp);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "strategy: got ", config.strategy, "; allowed: single, ddp, fsdp"));
}

}  // namespace shardtrain
