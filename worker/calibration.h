// `shardtrain-train --calibrate`: measures what the step-time model
// (core/plan/step_time_plan.h) needs of this host, once, and caches it
// (HostRatesCachePath): the training FLOP/s of one compute thread on the
// model asked for (forward and backward of whole steps, the best of a few),
// AdamW's seconds per parameter, and the latency and bandwidth of an
// all-reduce between this host's ranks (over Gloo on CPU, NCCL on GPUs);
// run over several hosts (--nnodes, or srun), also of an all-reduce
// between them (one rank each): the inter-node link.
#ifndef SHARDTRAIN_WORKER_CALIBRATION_H_
#define SHARDTRAIN_WORKER_CALIBRATION_H_

#include <ostream>

#include "absl/status/status.h"
#include "common/dist_env.h"
#include "core/run/train_config.h"

namespace shardtrain {

// One rank's part: every rank measures the all-reduce (over several hosts:
// host 0's ranks among them, each host's first rank between the hosts);
// rank 0 also measures compute and AdamW (alone, the others waiting) and
// saves the rates, keeping a link this run could not measure as cached,
// printing them to `log`. Needs two ranks or more (WORLD_SIZE).
absl::Status RunCalibrationRank(const TrainConfig& config, const DistEnv& env,
                                std::ostream* log);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_CALIBRATION_H_
