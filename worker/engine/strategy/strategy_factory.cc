#include "worker/engine/strategy/strategy_factory.h"

#include <algorithm>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/run/strategy_kinds.h"
#include "worker/engine/strategy/ddp_strategy.h"
#include "worker/engine/strategy/fsdp_strategy.h"
#include "worker/engine/strategy/pipeline_strategy.h"
#include "worker/engine/strategy/single_device_strategy.h"
#include "worker/engine/strategy/tensor_parallel_strategy.h"

namespace shardtrain {

StrategyOptions StrategyOptionsFor(const TrainConfig& config,
                                   const torch::Device& device, int64_t rank,
                                   int64_t world_size, int64_t ranks_per_node) {
  StrategyOptions options;
  options.device = device;
  options.rank = rank;
  options.world_size = world_size;
  options.ranks_per_node = ranks_per_node;
  options.precision = config.precision;
  options.adamw = {config.beta1, config.beta2, config.eps};
  options.weight_decay = config.weight_decay;
  return options;
}

namespace {

using Factory = std::unique_ptr<Strategy> (*)(const TrainConfig&,
                                              const StrategyOptions&,
                                              Communicator*);

FsdpOptions FsdpOptionsFor(const TrainConfig& config) {
  FsdpOptions fsdp;
  fsdp.reshard_after_forward = config.reshard_after_forward;
  fsdp.prefetch = config.prefetch;
  fsdp.no_sync = config.fsdp_no_sync;
  return fsdp;
}

// One row per StrategyKinds() row (train/strategy_kinds.h), by name.
const std::map<std::string, Factory>& Factories() {
  static const auto* const kFactories = new std::map<std::string, Factory>{
      {"single",
       [](const TrainConfig&, const StrategyOptions& options,
          Communicator*) -> std::unique_ptr<Strategy> {
         return std::make_unique<SingleDeviceStrategy>(options);
       }},
      {"ddp",
       [](const TrainConfig& config, const StrategyOptions& options,
          Communicator* comm) -> std::unique_ptr<Strategy> {
         return std::make_unique<DdpStrategy>(options, comm, config.bucket_mb);
       }},
      {"fsdp",
       [](const TrainConfig& config, const StrategyOptions& options,
          Communicator* comm) -> std::unique_ptr<Strategy> {
         return std::make_unique<FsdpStrategy>(options, comm,
                                               FsdpOptionsFor(config));
       }},
      {"hsdp",
       [](const TrainConfig& config, const StrategyOptions& options,
          Communicator* comm) -> std::unique_ptr<Strategy> {
         FsdpOptions fsdp = FsdpOptionsFor(config);
         fsdp.shard_group_size =
             ResolveShardGroupSize(config.shard_group_size, options.world_size,
                                   options.ranks_per_node);
         return std::make_unique<FsdpStrategy>(options, comm, fsdp);
       }},
  };
  return *kFactories;
}

// Pipeline stages x the data-parallel part config.strategy names (single:
// one replica; ddp, fsdp, hsdp: world / stages ranks per stage that
// replicate it, shard it, or shard it within groups).
absl::StatusOr<std::unique_ptr<Strategy>> CreatePipeline(
    const TrainConfig& config, const StrategyOptions& options,
    Communicator* comm) {
  if (comm == nullptr) {
    return absl::InvalidArgumentError(
        "pipeline_stages: a pipeline needs a communicator");
  }
  PipelineOptions pipeline;
  pipeline.bucket_mb = config.bucket_mb;
  pipeline.stages = config.pipeline_stages;
  if (!config.pipeline_split.empty()) {
    absl::StatusOr<std::vector<int64_t>> split =
        ParsePipelineSplit(config.pipeline_split);
    if (!split.ok()) return split.status();
    pipeline.split = std::move(*split);
  }
  absl::StatusOr<PipelineSchedule> schedule =
      ParsePipelineSchedule(config.pipeline_schedule);
  if (!schedule.ok()) return schedule.status();
  pipeline.schedule = *schedule;
  pipeline.micro_batches = config.micro_batches;
  pipeline.virtual_stages = config.virtual_stages;
  pipeline.seq_len = config.seq_len;
  pipeline.data_parallel = config.strategy;
  pipeline.tensor_parallel = std::max<int64_t>(1, config.tensor_parallel);
  if (FindStrategyKind(config.strategy)->layout ==
      StateLayout::kShardedInGroups) {
    pipeline.shard_group_size = ResolveShardGroupSize(
        config.shard_group_size, config.DataParallelSize(options.world_size),
        options.ranks_per_node);
  }
  return std::unique_ptr<Strategy>(
      std::make_unique<PipelineStrategy>(options, comm, std::move(pipeline)));
}

}  // namespace

bool HasStrategyFactory(const std::string& name) {
  return Factories().count(name) > 0;
}

absl::StatusOr<std::unique_ptr<Strategy>> CreateStrategy(
    const TrainConfig& config, const StrategyOptions& options,
    Communicator* comm) {
  const StrategyKind* kind = FindStrategyKind(config.strategy);
  const auto factory = Factories().find(config.strategy);
  if (kind == nullptr || factory == Factories().end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "strategy: got ", config.strategy, "; allowed: ", StrategyNameList()));
  }
  // The mesh against the world, once, with every refusal's wording.
  if (absl::Status s = config.CheckMeshWorld(options.world_size); !s.ok()) {
    return s;
  }
  if (config.pipeline_stages > 1) return CreatePipeline(config, options, comm);
  if (config.tensor_parallel > 1) {
    if (comm == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor_parallel: ", config.tensor_parallel,
                       " needs a communicator"));
    }
    // HSDP over the replicas: shard groups of G (a group of one
    // replicates, as DDP does).
    const int64_t group =
        kind->layout == StateLayout::kShardedInGroups
            ? ResolveShardGroupSize(config.shard_group_size,
                                    config.DataParallelSize(options.world_size),
                                    options.ranks_per_node)
            : 0;
    const bool sharded = kind->layout == StateLayout::kSharded || group > 1;
    return std::unique_ptr<Strategy>(std::make_unique<TensorParallelStrategy>(
        options, comm, config.tensor_parallel, sharded, config.bucket_mb,
        group));
  }
  if (kind->distributed && comm == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("strategy: ", kind->name, " needs a communicator"));
  }
  return factory->second(config, options, comm);
}

}  // namespace shardtrain
