// JobSpec (proto) <-> TrainConfig (engine): the one conversion between the
// control plane's job description and the engine's config. Validation stays
// in TrainConfig::Validate(), so the coordinator and shardtrain-train accept
// exactly the same jobs. Torch-free.
#ifndef SHARDTRAIN_PROTO_JOB_CONFIG_H_
#define SHARDTRAIN_PROTO_JOB_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "core/run/step_metrics.h"
#include "core/run/train_config.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

// The TrainConfig a job's ranks run: spec fields that are set override
// TrainConfig's defaults; `out_dir` is where the coordinator keeps the job's
// outputs (state-dir/jobs/<id>). Validates the result (and the fields
// TrainConfig does not hold: world size, restarts); errors name the field.
absl::StatusOr<TrainConfig> TrainConfigFromJobSpec(const v1::JobSpec& spec,
                                                   const std::string& out_dir);

// A JobSpec that converts back to `config` (every trainer field set).
v1::JobSpec JobSpecFromTrainConfig(const TrainConfig& config, int world_size);

// The job's mesh (MeshName) at `world_size` ranks (the running attempt's;
// 0: the spec's): "pp2xfsdp2xtp2". A job of strategy auto shows the mesh
// chosen for it once there is one ("auto: tp4"), else "auto".
std::string JobMeshName(const v1::JobSpec& spec, int64_t world_size = 0);
// The mesh `job`'s latest attempt trains: the one recorded when it was
// launched (an elastic job re-meshed at another world size trains the mesh
// the coordinator chose), else JobMeshName at its world size.
std::string JobMesh(const v1::Job& job);

// The engine's per-step metrics as the control plane carries them, and back.
// val_loss < 0 in the engine means "no eval this step": unset in the proto.
v1::StepMetrics StepMetricsToProto(const StepMetrics& m);
StepMetrics StepMetricsFromProto(const v1::StepMetrics& m);

}  // namespace shardtrain

#endif  // SHARDTRAIN_PROTO_JOB_CONFIG_H_
