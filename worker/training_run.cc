#include "worker/training_run.h"

#include <memory>
#include <string>
#ifdef SHARDTRAIN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "absl/strings/str_cat.h"
#include "common/exit_codes.h"
#include "core/run/strategy_kinds.h"
#include "worker/engine/comm/c10d_communicator.h"
#include "worker/engine/strategy/strategy_factory.h"

namespace shardtrain {

absl::Status RunTrainingRank(const TrainConfig& config, const DistEnv& env,
                             std::ostream* log, const TrainingHooks& hooks) {
  const RankInfo rank_info{env.rank, env.world_size};
  // One GPU per rank: plain "cuda" means this rank's local device. The index
  // is always explicit, so memory stats and NCCL name a real device.
  torch::Device device(config.device == "cuda"
                           ? "cuda:" + std::to_string(env.local_rank)
                           : config.device);
  // Before the CUDA calls below.
  if (absl::Status s = CheckDeviceVisible(device, config.device); !s.ok()) {
    return s;
  }
#ifdef SHARDTRAIN_WITH_CUDA
  // Kernels, the caching allocator and NCCL's streams follow the current
  // device; make it this rank's before anything touches CUDA.
  if (device.is_cuda()) c10::cuda::set_device(device.index());
#endif

  std::unique_ptr<Communicator> comm;
  const StrategyKind* kind = FindStrategyKind(config.strategy);
  // Ranks talk when the strategy is distributed or the model is cut into
  // pipeline stages (single x stages: one replica over several ranks).
  if (kind != nullptr &&
      (kind->distributed || config.ModelParallelSize() > 1)) {
    auto c10d = C10dCommunicator::Create(
        env, std::chrono::seconds(config.comm_timeout), device);
    if (!c10d.ok()) {
      const std::string message =
          absl::StrCat("rank ", env.rank, ": ", c10d.status().message());
      return IsRendezvousPortTaken(c10d.status())
                 ? RendezvousPortTakenError(message)
                 : absl::Status(c10d.status().code(), message);
    }
    comm = std::move(*c10d);
  }
  absl::StatusOr<std::unique_ptr<Strategy>> strategy =
      CreateStrategy(config,
                     StrategyOptionsFor(config, device, env.rank,
                                        env.world_size, env.local_world_size),
                     comm.get());
  if (!strategy.ok()) {
    return absl::InvalidArgumentError(strategy.status().message());
  }
  absl::StatusOr<std::unique_ptr<Trainer>> trainer =
      Trainer::Create(config, rank_info, std::move(*strategy), log);
  if (!trainer.ok()) {
    // A bad config is caught by Validate() before; what fails here is the
    // run itself (data, checkpoint, memory).
    // A malformed file the job names stays a bad configuration.
    if (IsBadInput(trainer.status())) return trainer.status();
    return absl::Status(absl::IsInvalidArgument(trainer.status())
                            ? absl::StatusCode::kInternal
                            : trainer.status().code(),
                        trainer.status().message());
  }
  if (hooks.on_step) (*trainer)->set_step_callback(hooks.on_step);
  if (hooks.stop_requested) {
    (*trainer)->set_stop_request(hooks.stop_requested);
  }
  if (hooks.on_ready) {
    if (absl::Status s = hooks.on_ready(); !s.ok()) return s;
  }
  return (*trainer)->Run();
}

}  // namespace shardtrain
